"""Ships the start-up hook: ``lightning_roundpipe.pth`` at the root of site-packages.

Lightning has no entry point for strategies, so ``Trainer(strategy="roundpipe")`` with no import of this
package works only if something registers the name at start-up. The ``.pth`` file imports the package
(which imports neither torch nor Lightning) and registers the strategies once ``lightning.pytorch`` is
imported. Set ``LIGHTNING_ROUNDPIPE_NO_AUTOLOAD=1`` to skip it. Everything else is in pyproject.toml.

Both kinds of install get the hook:

* a wheel (``pip install .``): ``build_py`` copies it into the build folder, whose contents become the
  wheel's root, which pip unpacks into site-packages;
* an editable install (``pip install -e .``, what ``make`` runs): setuptools' ``editable_wheel`` runs
  ``build_py`` too, but packs nothing from the build folder (the code stays in the checkout). It packs
  the folder that the ``install`` command installs into, so in editable mode the hook goes there, next
  to setuptools' own ``__editable__`` ``.pth``. Python runs ``.pth`` files in name order, so that one,
  which makes the checkout importable, runs before the hook imports the package.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK = "lightning_roundpipe.pth"


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            # editable_wheel points `install`'s install_lib at the unpacked editable wheel
            target = self.get_finalized_command("install").install_lib
        else:
            target = self.build_lib
        self.mkpath(target)
        shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), HOOK), os.path.join(target, HOOK))


setup(cmdclass={"build_py": BuildWithStartupHook})

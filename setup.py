"""Ships the start-up hook: ``lightning_roundpipe.pth`` at the root of site-packages.

Lightning has no entry point for strategies, so ``Trainer(strategy="roundpipe")`` with no import of this
package works only if something registers the name at start-up. The ``.pth`` file imports the package
(which imports neither torch nor Lightning) and registers the strategies once ``lightning.pytorch`` is
imported. Set ``LIGHTNING_ROUNDPIPE_NO_AUTOLOAD=1`` to skip it. Everything else is in pyproject.toml.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK = "lightning_roundpipe.pth"


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), HOOK), os.path.join(self.build_lib, HOOK))


setup(cmdclass={"build_py": BuildWithStartupHook})

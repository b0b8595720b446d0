"""Register the strategies with Lightning as soon as ``lightning.pytorch`` is imported.

Lightning has no entry-point group for strategies, so ``Trainer(strategy="roundpipe")`` can only find
the name if something registered it first. ``import lightning_roundpipe`` calls :func:`install`, and so
does the start-up ``.pth`` file a regular install ships: if Lightning is already imported the
strategies are registered at once, otherwise a one-shot import hook registers them right after
``lightning.pytorch`` has finished importing. Neither path imports torch or Lightning itself, and a
failure here never breaks ``import lightning``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

_TARGET = "lightning.pytorch"


def install() -> None:
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def _register() -> None:
    strategy = sys.modules.get("lightning_roundpipe.strategy")
    if strategy is not None and not hasattr(strategy, "register"):
        return  # it is importing Lightning right now, and registers itself when it has finished
    try:
        from lightning_roundpipe.strategy import register

        register()
    except Exception as error:  # noqa: BLE001 - never break the user's import of lightning
        warnings.warn(f"lightning_roundpipe could not register its strategies with Lightning: {error}", stacklevel=2)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` with the other finders and registers once its module has run."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the search below from finding this finder
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            _register()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

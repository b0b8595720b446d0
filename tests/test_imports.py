"""Imports point one way (DESIGN.md §3): pure modules import no torch and nothing impure."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "lightning_roundpipe"
PURE = {"partition", "schedule", "simulate"}
FRAMEWORK_MODULES = {"strategy", "precision"}  # the only top-level modules allowed to import lightning or hydra
FRAMEWORK_PACKAGES = {"app"}  # the Hydra application: the entry point, so it may import them too
FRAMEWORKS = {"lightning", "pytorch_lightning", "hydra", "omegaconf"}


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level and not node.module:  # from . import a, b
                names.update(f"lightning_roundpipe.{alias.name}" for alias in node.names)
            else:
                names.add(f"lightning_roundpipe.{node.module}" if node.level else node.module or "")
    return names


def test_pure_modules_import_only_the_standard_library_and_each_other():
    for name in PURE:
        for imported in _imports(PACKAGE / f"{name}.py"):
            root = imported.split(".")[0]
            if root == "lightning_roundpipe":
                assert imported.split(".")[-1] in PURE, f"{name}.py imports {imported}"
            else:
                assert root in sys.stdlib_module_names, f"{name}.py imports {imported}"


def _library_modules() -> list[pathlib.Path]:
    """Every module of the package except the framework adapter and the app subpackage."""
    modules = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] in FRAMEWORK_PACKAGES or (len(parts) == 1 and path.stem in FRAMEWORK_MODULES):
            continue
        modules.append(path)
    return modules


def test_only_the_lightning_adapter_and_the_app_import_lightning_or_hydra():
    checked = _library_modules()
    assert PACKAGE / "runtime.py" in checked and not any(p.parent.name in FRAMEWORK_PACKAGES for p in checked)
    for path in checked:
        for imported in _imports(path):
            assert imported.split(".")[0] not in FRAMEWORKS, f"{path.relative_to(PACKAGE)} imports {imported}"


def test_the_library_does_not_import_the_app():
    for path in _library_modules() + [PACKAGE / f"{name}.py" for name in FRAMEWORK_MODULES]:
        if path.exists():
            assert not any(".app" in name for name in _imports(path)), f"{path.name} imports the app"


def test_importing_the_package_starts_nothing_and_imports_no_torch():
    code = ("import sys, threading, lightning_roundpipe; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert threading.active_count() == 1, 'a thread was started'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hugging_face_libraries_are_imported_only_when_a_model_of_theirs_is_used():
    code = ("import sys, torch, lightning_roundpipe.causal_lm as c; "
            "assert c.find_causal_lm(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None; "
            "loaded = [m for m in ('transformers', 'peft') if m in sys.modules]; "
            "assert not loaded, f'imported {loaded}'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_importing_the_strategy_module_first_registers_the_names():
    code = ("import warnings; warnings.simplefilter('error'); "
            "from lightning_roundpipe.strategy import RoundPipeStrategy; "
            "from lightning.pytorch.strategies import StrategyRegistry; "
            "assert {'roundpipe', 'roundpipe_async'} <= set(StrategyRegistry), 'not registered'")
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True)

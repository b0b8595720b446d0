"""Imports point one way (DESIGN.md §3), now checked per subpackage.

    app  ->  top level (the Lightning adapter)  ->  hf  ->  engine  ->  observe  ->  planning

Each layer may import the layers to its right, never one to its left. ``planning`` imports only the
standard library; only the top level and ``app`` import Lightning or Hydra.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "lightning_roundpipe"
LAYERS = ["app", "", "hf", "engine", "observe", "planning"]  # "" is the top level
FRAMEWORKS = {"lightning", "pytorch_lightning", "hydra", "omegaconf"}


def _layer(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else ""


def _module_layer(module: str) -> str | None:
    """The layer of an imported ``lightning_roundpipe`` module, or None for anything else."""
    parts = module.split(".")
    if parts[0] != "lightning_roundpipe":
        return None
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return ""


def _imports(path: pathlib.Path) -> set[str]:
    package = ".".join(("lightning_roundpipe", *path.relative_to(PACKAGE).parts[:-1]))
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            if node.level and not node.module:  # from . import a, b
                names.update(f"{base}.{alias.name}" for alias in node.names)
            elif node.level:
                names.add(f"{base}.{node.module}")
            else:
                names.add(node.module or "")
    return names


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_in_a_known_layer():
    assert {_layer(path) for path in MODULES} == set(LAYERS)


def _wrong_way(imports: set[str], layer: str) -> list[str]:
    """The imports of a module in ``layer`` that point to a higher layer."""
    here = LAYERS.index(layer)
    return sorted(name for name in imports
                  if (target := _module_layer(name)) is not None and LAYERS.index(target) < here)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_to_lower_layers_only(path):
    assert _wrong_way(_imports(path), _layer(path)) == [], f"{path.relative_to(PACKAGE)} imports a higher layer"


def test_the_layer_check_can_fail():
    engine_imports = _imports(PACKAGE / "engine" / "engine.py")
    assert "lightning_roundpipe.planning.partition" in engine_imports  # relative and absolute forms resolve
    assert _wrong_way(engine_imports | {"lightning_roundpipe.strategy"}, "engine") == ["lightning_roundpipe.strategy"]
    assert _wrong_way({"lightning_roundpipe.engine.stage"}, "planning") == ["lightning_roundpipe.engine.stage"]


@pytest.mark.parametrize("path", sorted((PACKAGE / "planning").rglob("*.py")), ids=lambda p: p.name)
def test_planning_imports_only_the_standard_library(path):
    for imported in _imports(path):
        root = imported.split(".")[0]
        assert root == "lightning_roundpipe" or root in sys.stdlib_module_names, f"{path.name} imports {imported}"


@pytest.mark.parametrize("path", [p for p in MODULES if _layer(p) not in ("", "app")],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_below_the_adapter_nothing_imports_lightning_or_hydra(path):
    for imported in _imports(path):
        assert imported.split(".")[0] not in FRAMEWORKS, f"{path.relative_to(PACKAGE)} imports {imported}"


def test_importing_the_package_starts_nothing_and_imports_no_torch():
    code = ("import sys, threading, lightning_roundpipe; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'lightning' not in sys.modules, 'lightning imported'; "
            "assert threading.active_count() == 1, 'a thread was started'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_planning_command_line_imports_no_torch():
    code = ("import sys; from lightning_roundpipe.planning.cli import main; "
            "main(['--layers', '4', '--devices', '2']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_hugging_face_libraries_are_imported_only_when_a_model_of_theirs_is_used():
    code = ("import sys, torch, lightning_roundpipe.hf.causal_lm as c; "
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


def test_the_engine_exceptions_live_in_errors_and_keep_their_old_import_paths():
    import lightning_roundpipe
    from lightning_roundpipe.engine import call, dataparallel, device, engine, errors

    assert lightning_roundpipe.PipelineError is errors.PipelineError
    assert call.PipelineError is engine.PipelineError is errors.PipelineError
    assert device.EngineAborted is errors.EngineAborted and device.OutOfDeviceMemory is errors.OutOfDeviceMemory
    assert dataparallel.DataParallelError is errors.DataParallelError
    assert all(issubclass(getattr(errors, name), RuntimeError) for name in errors.__all__)

"""The package as users install it: the start-up hook, and the app working from any folder.

``Trainer(strategy="roundpipe")`` with no import of this package relies on ``lightning_roundpipe.pth`` in
site-packages. The probes unpack a built wheel (regular or editable) into a scratch site directory and
start an interpreter with ``-S``, so that only that directory's ``.pth`` files run (``site.addsitedir``),
not those of the environment running the tests, which has the hook already; the dependencies come from
the test environment's site-packages as a plain path.

The app tests install the wheel into a fresh virtual environment (no pip in it, nothing downloaded: the
dependencies again come from the test environment) and run it from a folder outside the clone.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONF = ROOT / "lightning_roundpipe" / "app" / "conf"
GROUPS = ("model", "model/lora", "data", "trainer", "strategy", "logger", "callbacks", "experiment")
DEPENDENCIES = sysconfig.get_paths()["purelib"]  # torch, Lightning, Hydra: those of the test environment
PROBE = (
    "import site, sys; site.addsitedir({site!r}); sys.path.append({deps!r}); "
    "import lightning.pytorch as pl; "
    "trainer = pl.Trainer(strategy='roundpipe_async', accelerator='cpu', devices=2, logger=False); "
    "print(type(trainer.strategy).__name__, trainer.strategy.engine_options.async_step)"
)


def _unpacked(wheel: pathlib.Path, site: pathlib.Path) -> pathlib.Path:
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    wheels = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True)
    (built,) = wheels.glob("lightning_roundpipe-*.whl")
    return built


@pytest.fixture(scope="module")
def site_dir(wheel: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return _unpacked(wheel, tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def editable_site_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """What ``pip install -e .`` (and so ``make``) installs: the PEP 660 editable wheel, unpacked."""
    wheels = tmp_path_factory.mktemp("editable_wheel")
    build = f"from setuptools import build_meta; print(build_meta.build_editable({str(wheels)!r}))"
    subprocess.run([sys.executable, "-c", build], check=True, capture_output=True, cwd=ROOT)
    (built,) = wheels.glob("lightning_roundpipe-*editable*.whl")
    return _unpacked(built, tmp_path_factory.mktemp("editable_site"))


def _probe(site: pathlib.Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-S", "-c", PROBE.format(site=str(site), deps=DEPENDENCIES)],
                          capture_output=True, text=True, env=env, cwd=site)


def test_the_wheel_registers_the_strategy_at_start_up(site_dir):
    assert (site_dir / "lightning_roundpipe.pth").is_file()
    result = _probe(site_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["RoundPipeStrategy", "True"]


def test_without_the_hook_lightning_does_not_know_the_name(site_dir):
    result = _probe(site_dir, env={**os.environ, "LIGHTNING_ROUNDPIPE_NO_AUTOLOAD": "1"})
    assert result.returncode != 0 and "invalid strategy name" in result.stderr.lower()


def test_the_editable_install_registers_the_strategy_at_start_up(editable_site_dir):
    # the package stays in the checkout: the editable wheel holds setuptools' finder, and the hook beside it
    assert not (editable_site_dir / "lightning_roundpipe").exists()
    assert (editable_site_dir / "lightning_roundpipe.pth").is_file()
    result = _probe(editable_site_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["RoundPipeStrategy", "True"]


def test_the_wheel_ships_every_config_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {path.relative_to(ROOT).as_posix() for path in CONF.rglob("*.yaml")}
    assert "lightning_roundpipe/app/conf/model/lora/default.yaml" in configs  # nested folders count too
    assert configs <= names, sorted(configs - names)
    assert {"lightning_roundpipe/app/conf/__init__.py",  # Hydra's pkg:// search path needs a package
            "lightning_roundpipe/app/__main__.py",
            "lightning_roundpipe/observe/paper_profiles.json",
            "lightning_roundpipe/py.typed"} <= names


# ---------------------------------------------------------------------------- installed into a fresh venv
@pytest.fixture(scope="module")
def fresh_venv(wheel: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    # the test environment's pip installs into the new one (pip >= 22.3), with its console script
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # after the venv's own site-packages on sys.path: the installed package wins over the checkout's
    (pathlib.Path(purelib) / "_test_dependencies.pth").write_text(DEPENDENCIES + "\n")
    return venv


def _in_venv(venv: pathlib.Path, *command: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([str(venv / "bin" / command[0]), *command[1:]], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def test_the_installed_package_is_the_one_imported(fresh_venv, tmp_path):
    result = _in_venv(fresh_venv, "python", "-c", "import lightning_roundpipe; print(lightning_roundpipe.__file__)",
                      cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert pathlib.Path(result.stdout.strip()).is_relative_to(fresh_venv)


def test_the_console_script_trains_from_a_folder_outside_the_clone(fresh_venv, tmp_path):
    result = _in_venv(fresh_venv, "roundpipe-train", "experiment=quick", "trainer.max_steps=2", "sample_tokens=0",
                      "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "data.limit_bytes=200000",
                      cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "summary" in result.stdout
    (run_dir,) = (tmp_path / "outputs").glob("*/*")  # Hydra's run folder, under the current folder
    assert (run_dir / "logs" / "metrics.csv").is_file() and (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert f"outputs         {run_dir}" in result.stdout


def test_the_module_lists_the_shipped_options(fresh_venv, tmp_path):
    """``python -m lightning_roundpipe.app --help``: every group offers its yaml files, and no schema."""
    result = _in_venv(fresh_venv, "python", "-m", "lightning_roundpipe.app", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    offered = dict(line.split(": ", 1) for line in result.stdout.splitlines()
                   if ": " in line and line.split(": ", 1)[0] in GROUPS)
    for group, options in offered.items():
        assert options.split(", ") == sorted(path.stem for path in (CONF / group).glob("*.yaml")), group
    assert sorted(offered) == sorted(GROUPS)

"""``Trainer(strategy="roundpipe")`` with no import, after a regular (wheel) install.

The test builds the wheel, unpacks it into a scratch site directory and starts a fresh interpreter that
processes that directory's ``.pth`` files as site-packages would (``site.addsitedir``), then asks
Lightning for the strategy by name without importing this package.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROBE = (
    "import site, sys; {addsite}"
    "import lightning.pytorch as pl; "
    "trainer = pl.Trainer(strategy='roundpipe_async', accelerator='cpu', devices=2, logger=False); "
    "print(type(trainer.strategy).__name__, trainer.strategy.engine_options.async_step)"
)


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    wheels = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True)
    site = tmp_path_factory.mktemp("site")
    (wheel,) = wheels.glob("lightning_roundpipe-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def _probe(site: pathlib.Path | None, env: dict | None = None) -> subprocess.CompletedProcess:
    addsite = f"site.addsitedir({str(site)!r}); " if site is not None else ""
    return subprocess.run([sys.executable, "-c", PROBE.format(addsite=addsite)], capture_output=True, text=True,
                          env=env, cwd=site or ROOT.parent)


def test_the_wheel_registers_the_strategy_at_start_up(site_dir):
    assert (site_dir / "lightning_roundpipe.pth").is_file()
    result = _probe(site_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["RoundPipeStrategy", "True"]


def test_without_the_hook_lightning_does_not_know_the_name(site_dir):
    import os

    result = _probe(site_dir, env={**os.environ, "LIGHTNING_ROUNDPIPE_NO_AUTOLOAD": "1"})
    assert result.returncode != 0 and "invalid strategy name" in result.stderr.lower()

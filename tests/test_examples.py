"""The example scripts run from a clean checkout and show what their README line says."""

from __future__ import annotations

import math
import pathlib
import re
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_a_plain_lightning_module_trains_unchanged_with_roundpipe():
    output = _run("plain_lightning.py")
    losses = [float(x) for x in re.findall(r"final loss, .*:\s+([0-9.]+)", output)]
    assert len(losses) == 2 and math.isclose(losses[0], losses[1], rel_tol=1e-4)


def test_the_fused_loss_example_learns():
    output = _run("fused_loss.py")
    loss, uniform = (float(x) for x in re.search(r"final train loss ([0-9.]+) .* is ([0-9.]+)", output).groups())
    assert loss < 0.75 * uniform


def test_the_gpu_check_runs_end_to_end_in_smoke_mode(tmp_path):
    """``benchmarks/gpu.py --smoke`` runs every section on CPU, so the GPU check is debugged before a GPU."""
    out = tmp_path / "gpu.json"
    result = subprocess.run([sys.executable, str(EXAMPLES.parent / "benchmarks" / "gpu.py"), "--smoke", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    sections = json.loads(out.read_text())
    assert sections["smoke"] is True
    for name in ("ceilings", "fits", "big_sync", "big_async", "published"):
        assert "result" in sections[name], (name, sections[name])
    assert sections["fits"]["result"]["roundpipe_tokens_per_s"] > 0
    assert sections["big_async"]["result"]["tokens_per_s"] > 0

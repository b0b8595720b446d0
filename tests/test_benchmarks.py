"""Every script in ``benchmarks/`` runs in its ``--smoke`` mode in the suite, so a change that breaks a benchmark
breaks a test; ``pytest -m smoke`` (or ``-k smoke``) runs them all.

Each runs once, where it is checked best (:data:`SMOKE_RUNS`):

* a benchmark the READMEs name: ``tests/test_readme_commands.py`` runs the README's command with ``--smoke`` (its
  ``Benchmark`` entries: the printed headers and verdicts, and the ``--json`` keys of those that write one);
* ``gpu.py``: ``tests/test_examples.py`` runs every section on CPU;
* the others: here.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Sequence

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
README_ENTRY = "a Benchmark entry of tests/test_readme_commands.py"

SMOKE_RUNS = {
    "bubble.py": README_ENTRY,
    "bubble_paper.py": README_ENTRY,
    "host_optimizer.py": README_ENTRY,
    "host_memory.py": README_ENTRY,
    "low_bit.py": README_ENTRY,
    "memory.py": README_ENTRY,
    "overhead.py": README_ENTRY,
    "small_models.py": README_ENTRY,
    "soak.py": README_ENTRY,
    "sync_async.py": README_ENTRY,
    "gpu.py": "tests/test_examples.py::test_the_gpu_check_runs_every_section_in_smoke_mode",
    "scaleout.py": "tests/test_benchmarks.py::test_scaleout_smoke_prints_its_three_sections",
    "device_wait.py": "tests/test_benchmarks.py::test_device_wait_smoke_prints_its_table_and_compares_a_run_before",
}
"""Benchmark script -> the smoke test that runs it."""


def missing_lines(output: str, patterns: Sequence[str]) -> list[str]:
    """The ``patterns`` (regular expressions) that no line of ``output`` matches: what a smoke run failed to
    print."""
    lines = output.splitlines()
    return [pattern for pattern in patterns if not any(re.search(pattern, line) for line in lines)]


def _smoke_test_source(where: str) -> str | None:
    """The source of the test function ``file::name`` if it is marked ``smoke``, else None."""
    path, name = where.split("::")
    module = ast.parse((REPO / path).read_text())
    for node in module.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            marks = [ast.unparse(decorator) for decorator in node.decorator_list]
            return ast.unparse(node) if "pytest.mark.smoke" in marks else None
    return None


def test_every_benchmark_runs_in_smoke_mode_in_a_smoke_test():
    scripts = sorted(path.name for path in BENCHMARKS.glob("*.py") if path.name != "common.py")
    assert scripts == sorted(SMOKE_RUNS), "a benchmark script with no smoke run (add it to SMOKE_RUNS), or one gone"
    readme_entries = (REPO / "tests" / "test_readme_commands.py").read_text()
    for script, where in SMOKE_RUNS.items():
        assert "--smoke" in (BENCHMARKS / script).read_text(), f"{script} has no --smoke mode"
        if where == README_ENTRY:
            assert re.search(rf'"python benchmarks/{re.escape(script)}[^"]*": Benchmark\(', readme_entries), script
        else:
            source = _smoke_test_source(where)
            assert source is not None, f"{where} is gone or not marked smoke"
            # ast.unparse writes string constants with repr()
            assert repr(script) in source and repr("--smoke") in source, f"{where} does not run {script} --smoke"


@pytest.mark.smoke
def test_scaleout_smoke_prints_its_three_sections(tmp_path):
    """The measured all-reduce, the projection to K nodes and the 2-process engine run, each with its table."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "scaleout.py"), "--smoke"], capture_output=True,
                            text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    expected = [
        r"^1\. gloo all_reduce \(SUM\) on this machine: 2 processes",
        r"^float32 +1 +262,144 \| +\d+\.\d\d +\d+\.\d\d +\d+\.\d+ \| +\d+\.\d+ +\d+\.\d+$",
        r"^2\. Projection: K nodes, one 8-GPU RoundPipe ring each",
        r"^Llama3-8B +fp32 +100 Gb/s \| +\d+\.\d\d +\d+\.\d\d +\d\.\d\d +\d+\.\d +\d+\.\dk \|",
        r"^3\. The gradient reduction behind the backward: 2 processes",
        r"^fp32 sharded +\d+\.\d +\d+\.\d\d \| +\d+\.\d +\d+% +\d+\.\d +\d\.\d \| +\d+\.\d +4\.00$",
        r"^Caveat: ",
    ]
    absent = missing_lines(result.stdout, expected)
    assert not absent, f"scaleout.py --smoke did not print lines matching {absent}:\n{result.stdout[-3000:]}"


FIRST_RUN_STEPS = ("environment", "pinning", "gpu_tests", "sanitizer", "transport", "waits", "throughput")


def _first_run_timeouts(script: str) -> dict[str, int]:
    """Each step's timeout as the script's header table states it."""
    return {name: int(seconds) for name, seconds in re.findall(r"^#   (\w+) +(\d+) ", script, flags=re.MULTILINE)}


def test_the_first_gpu_run_states_its_timeouts_and_uses_them():
    """At most 460 s of timeouts in all (8 minutes on the device with its start), and the steps use the stated ones."""
    script = (BENCHMARKS / "gpu_first_run.sh").read_text()
    timeouts = _first_run_timeouts(script)
    assert set(timeouts) == {*FIRST_RUN_STEPS, "summary"}
    assert sum(timeouts.values()) <= 460
    used = dict(re.findall(r"^(?:gpu_py|python_step) (\w+) (\d+)", script, flags=re.MULTILINE))
    used["gpu_tests"] = re.search(r"^timeout (\d+) \"\$PY\" -m pytest", script, flags=re.MULTILINE).group(1)
    used["summary"] = re.search(r"^timeout (\d+) \"\$PY\" - <<", script, flags=re.MULTILINE).group(1)
    assert {name: int(seconds) for name, seconds in used.items()} == {k: v for k, v in timeouts.items()
                                                                      if k != "throughput"}
    # the throughput step: its own timeout, plus what the earlier steps left, within the 460 s
    assert f"limit=$(( left < {timeouts['throughput']} ? {timeouts['throughput']} : left ))" in script
    assert f"left=$(( {460 - timeouts['summary']} - ($(date +%s) - START) ))" in script


@pytest.mark.smoke
def test_the_first_gpu_run_dry_run_reports_every_step(tmp_path):
    """``bash benchmarks/gpu_first_run.sh --dry-run`` runs every step on CPU: what needs CUDA says it skipped, the
    rest runs (the sanitizer's CPU checker over the engine's threads, the bf16 transport check on CPU stand-ins,
    gpu.py in --smoke), and each step leaves its JSON."""
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(BENCHMARKS / "gpu_first_run.sh"), "--dry-run"], capture_output=True, text=True,
                            timeout=400, cwd=tmp_path, env={**os.environ, "OUT": str(out), "PY": sys.executable})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "first_run.json").read_text())
    assert summary["dry_run"] is True
    assert tuple(summary["steps"]) == FIRST_RUN_STEPS
    for name, entry in summary["steps"].items():
        assert entry["rc"] == 0 and entry["status"] in ("ok", "skipped") and not entry["errors"], (name, entry)
        assert json.loads((out / f"{name}.json").read_text())["rc"] == 0
    steps = summary["steps"]
    assert steps["pinning"]["status"] == steps["waits"]["status"] == steps["gpu_tests"]["status"] == "skipped"
    assert steps["gpu_tests"]["counts"]["skipped"] >= 1
    assert steps["sanitizer"]["result"]["races_reported"] == 0
    assert steps["sanitizer"]["result"]["ops_checked_by_thread"]["compute"] > 0
    for mode in ("sync", "async"):
        transport = steps["transport"]["result"][mode]
        assert transport["bitwise"] and transport["uploaded_ratio"] < 1.0, transport
    sections = steps["throughput"]["sections"]
    assert set(sections) == {"fits_sync", "fits_async", "big_async", "big_sync"}
    assert all(section["tokens_per_s"] > 0 and section["numerics"] for section in sections.values()), sections


@pytest.mark.smoke
def test_device_wait_smoke_prints_its_table_and_compares_a_run_before(tmp_path):
    """The wait between backward jobs of one run, written with --json, then compared with a second run (--before)."""
    script = str(BENCHMARKS / "device_wait.py")
    first = subprocess.run([sys.executable, script, "--smoke", "--label", "before", "--json", "before.json"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    result = subprocess.run([sys.executable, script, "--smoke", "--label", "after", "--before", "before.json"],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    expected = [
        r"^Device wait between consecutive backward jobs: width 128, 4 layers",
        r"^run +pairs +wait median ms +wait mean ms +backward job ms$",
        r"^before +\d+ +\d+\.\d\d +\d+\.\d\d +\d+\.\d\d$",
        r"^after +\d+ +\d+\.\d\d +\d+\.\d\d +\d+\.\d\d$",
        r"^wait before/after: \d+\.\d\dx \(median\), \d+\.\d\dx \(mean\)$",
    ]
    absent = missing_lines(result.stdout, expected)
    assert not absent, f"device_wait.py --smoke did not print lines matching {absent}:\n{result.stdout[-3000:]}"

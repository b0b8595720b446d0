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
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
README_ENTRY = "a Benchmark entry of tests/test_readme_commands.py"

SMOKE_RUNS = {
    "bubble.py": README_ENTRY,
    "bubble_paper.py": README_ENTRY,
    "host_optimizer.py": README_ENTRY,
    "memory.py": README_ENTRY,
    "overhead.py": README_ENTRY,
    "small_models.py": README_ENTRY,
    "soak.py": README_ENTRY,
    "sync_async.py": README_ENTRY,
    "gpu.py": "tests/test_examples.py::test_the_gpu_check_runs_every_section_in_smoke_mode",
    "scaleout.py": "tests/test_benchmarks.py::test_scaleout_smoke_prints_its_three_sections",
}
"""Benchmark script -> the smoke test that runs it."""


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
    lines = result.stdout.splitlines()
    absent = [pattern for pattern in expected if not any(re.search(pattern, line) for line in lines)]
    assert not absent, f"scaleout.py --smoke did not print lines matching {absent}:\n{result.stdout[-3000:]}"

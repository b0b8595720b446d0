"""Every shell command the READMEs document runs in the suite, so a documented command cannot break silently.

The commands are read from the READMEs' ```bash blocks, the `run` column of examples/README.md, and the prose:
an inline code span is a command when its first word is a command (:data:`COMMAND_WORDS`) and at least one
argument follows; a bare tool name (`pytest`, `make`, `roundpipe-train`) names the tool and is not run. Optional
arguments are written in brackets (`[--quick]`). :data:`COMMANDS` says, for each command, how the suite checks it:

* :class:`Run`: run as written, with :data:`SMOKE` overrides appended (a few steps, a small data window; a
  later override wins in Hydra), and stand-ins for what cannot exist here (a corpus path, a checkpoint of an
  earlier run). ``roundpipe-train``, ``python -m lightning_roundpipe.app`` and ``python examples/train.py``
  are one entry point (checked below); it runs in-process from its overrides (Hydra's compose and the app's
  ``run``, as ``main`` calls it): a fresh interpreter per command would cost most of the time budget.
  tests/test_app.py starts the real command line (multirun, two processes, errors).
* :class:`Script`: a script or module's ``main(argv)``, in-process, with smoke-sized arguments added.
* :class:`Benchmark`: a benchmark script, run in a fresh interpreter with ``--smoke`` (its own tiny sizes, the
  same code path): its output must have the lines that make its point (table headers, verdicts).
* :class:`Compose`: needs GPUs or several machines: the app's argv (after the launcher) composes, passes the
  schema and builds its strategy, without training.
* :class:`Covered`: a test elsewhere in the suite runs it already (that test must exist and name what it runs).
* :class:`Recipe`, :class:`TheSuite`: ``make`` targets: the recipe is checked, and what it runs is run
  (``make test`` is the suite itself: it is checked to be what CI runs and the README's test command).
* :class:`NotRun`: a documented reason.

A command missing from the table fails :func:`test_every_documented_command_has_an_entry`.
"""

from __future__ import annotations

import ast
import datetime
import importlib.util
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("hydra", reason="the Hydra app needs hydra-core")

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.utils import instantiate  # noqa: E402

from lightning_roundpipe.app.schema import validate  # noqa: E402
from lightning_roundpipe.app.train import CONFIG_DIR, Summary, run  # noqa: E402
from tests.test_benchmarks import missing_lines  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
READMES = (REPO / "README.md", REPO / "examples" / "README.md")

SMOKE = ("trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
         "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "sample_tokens=4",
         "data.limit_bytes=200000", "data.val_windows=4")
"""Appended to every run: two steps, one validation batch, a 200 kB data window. Nothing that changes what a
step holds on a device (batch size, context, microbatches, model), so a memory budget is tested as written."""

APP = ("roundpipe-train", "python -m lightning_roundpipe.app", "python examples/train.py")
"""The app's command lines (one entry point, see test_the_app_commands_are_one_entry_point)."""

COMMAND_WORDS = ("python", "roundpipe-train", "make", "pytest", "bash", "torchrun", "srun")
"""First words of a command in the prose (besides a program in ``.venv/bin/``)."""


# ---------------------------------------------------------------------------- how each command is checked
@dataclass(frozen=True)
class Run:
    """Run the app command with :data:`SMOKE` and ``extra`` overrides; ``stand_ins``: README text -> name of a
    stand-in (see :class:`_Workspace`); ``expect``: a further check of the run, by name."""

    extra: tuple[str, ...] = ()
    stand_ins: dict[str, str] = field(default_factory=dict)
    expect: str | None = None


@dataclass(frozen=True)
class Script:
    """A script (path) or module (``-m``) whose ``main(argv)`` runs in-process, with ``extra`` arguments."""

    extra: tuple[str, ...] = ()
    stand_ins: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Benchmark:
    """``sys.executable benchmarks/X.py --smoke`` plus the documented arguments but ``sized`` (documented arguments
    that only set sizes or durations, each as written, e.g. ``"--width 1448"``: ``--smoke`` sets its own); its output
    must match each of ``expect`` (regular expressions, searched line by line). ``grows``: the exit status may be
    1, the benchmark's own verdict that something grew (a smoke run is too short for that verdict to mean anything;
    the verdict line must still be printed). ``json``: the run also writes ``--json FILE``, whose object must hold
    these keys (what a reader of the results looks up)."""

    expect: tuple[str, ...]
    sized: tuple[str, ...] = ()
    grows: bool = False
    json: tuple[str, ...] = ()


@dataclass(frozen=True)
class Compose:
    """An app command for GPUs or several machines: after ``launcher`` (``torchrun`` with its flags, checked by
    torchrun's own parser; ``srun``), its overrides compose and validate; ``stand_ins``: README text -> value."""

    why: str
    launcher: str | None = None
    stand_ins: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Covered:
    """Run by ``test`` (``file::function``), whose source names each of ``names`` (the script, the overrides)."""

    test: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class Recipe:
    """A ``make`` target whose recipe is ``.venv/bin/`` + ``command``, itself an entry of the table."""

    command: str


@dataclass(frozen=True)
class TheSuite:
    """``make test``: ruff, mypy, then the whole suite; what .ci/run runs and what the README names."""


@dataclass(frozen=True)
class NotRun:
    why: str


Check = Run | Script | Benchmark | Compose | Covered | Recipe | TheSuite | NotRun

_GPU_SMOKE = "tests/test_examples.py::test_the_gpu_check_runs_every_section_in_smoke_mode"
_FITS = ("Llama-3.1-8B on GPUs with 22-120 GB of host memory (tests/test_disk_tier.py and tests/test_frozen_weights.py "
         "run the disk tier and the frozen weights on CPU)")
_GPU = "needs a CUDA GPU (up to 9 minutes); `python benchmarks/gpu.py --smoke` runs every section on CPU"
COMMANDS: dict[str, Check] = {
    # README: status
    "python benchmarks/gpu.py": NotRun(_GPU),
    "pytest -m gpu": Covered(_GPU_SMOKE, ('sections["pytest"]',)),
    # README: fresh machine
    "make train": Recipe("python examples/train.py"),
    "make test": TheSuite(),
    # README: configuring runs with Hydra
    "python -m lightning_roundpipe.app": Run(),
    "roundpipe-train --help": Covered("tests/test_startup_hook.py::test_the_module_lists_the_shipped_options",
                                      ('"lightning_roundpipe.app", "--help"',)),
    "roundpipe-train --config-dir my_conf model=wide": Covered(
        "tests/test_app.py::test_a_folder_of_your_own_adds_a_model_option",
        ('"--config-dir"', "my_conf", "gpt_small", "width: 96")),
    "python -m lightning_roundpipe.planning --layers 10 --devices 2 --microbatches 3 --stages 2": Script(),
    "roundpipe-train experiment=quick": Run(),
    "roundpipe-train strategy.num_stages=6 strategy.recompute=layer strategy.device_memory_limit=2MiB "
    "strategy.num_microbatches=6": Run(extra=("trainer.max_steps=3",), expect="within 2 MiB"),
    "roundpipe-train strategy=single_device": Run(),
    "roundpipe-train -m strategy.num_microbatches=2,4 strategy.num_stages=auto,6 experiment=quick": Covered(
        "tests/test_app.py::test_multirun_runs_one_job_per_combination",
        ('"-m"', "strategy.num_microbatches=2,4", "strategy.num_stages=auto,6", "experiment=quick")),
    "roundpipe-train model=llama_tiny": Covered(
        "tests/test_app.py::test_a_hugging_face_model_trains_under_roundpipe", ("model=llama_tiny",)),
    "roundpipe-train model=qwen3_tiny +model/lora=default model.lora.r=4": Run(),
    "roundpipe-train model.optimizer=adamw8bit": Run(),
    "roundpipe-train model=llama_tiny +model/lora=qlora": Run(),
    "roundpipe-train trainer.precision=bf16-true strategy.stochastic_rounding=true": Run(),
    "roundpipe-train data=text_path data.path=/data/corpus.txt": Run(stand_ins={"/data/corpus.txt": "corpus"}),
    "roundpipe-train trainer.max_steps=3600 ckpt_path=outputs/<date>/<time>/checkpoints/last.ckpt": Run(
        extra=("trainer.max_steps=4",), stand_ins={"outputs/<date>/<time>": "quick_run_folder"}, expect="resumed"),
    # README: data parallel over rings, several machines
    "roundpipe-train trainer.devices=4 strategy.rings_per_node=2": Covered(
        "tests/test_app.py::test_two_processes_from_the_command_line_share_one_run_and_one_summary",
        ('"trainer.devices=4"', '"strategy.rings_per_node=2"')),
    "roundpipe-train trainer=gpu trainer.devices=4 strategy.rings_per_node=2": Compose(
        "needs 4 GPUs; tests/test_app.py::test_two_processes_from_the_command_line_share_one_run_and_one_summary "
        "runs the same on CPU devices (trainer.devices=4 strategy.rings_per_node=2)"),
    "torchrun --nnodes K --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint host0:29500 -m "
    "lightning_roundpipe.app trainer=gpu trainer.devices=8 trainer.num_nodes=K": Compose(
        "needs K machines with 8 GPUs each", launcher="torchrun", stand_ins={"K": "2"}),
    "srun roundpipe-train trainer=gpu trainer.devices=8 trainer.num_nodes=K": Compose(
        "needs a SLURM allocation of K machines with 8 GPUs each", launcher="srun", stand_ins={"K": "2"}),
    # README: what fits in host memory (the disk tier, frozen weights)
    "roundpipe-train model=llama_8b model.dtype=float32 trainer=gpu": Compose(_FITS),
    "roundpipe-train model=llama_8b model.dtype=float32 trainer=gpu strategy.offload=optimizer "
    "strategy.offload_dir=/nvme/run1": Compose(_FITS),
    "roundpipe-train model=llama_8b model.dtype=float32 trainer=gpu strategy.offload=optimizer+masters "
    "strategy.offload_dir=/nvme/run1": Compose(_FITS),
    "roundpipe-train model=llama_8b model.dtype=float32 trainer=gpu +model/lora=default "
    "strategy.frozen_weights=round": Compose(_FITS),
    "roundpipe-train model=llama_8b model.dtype=bfloat16 trainer=gpu +model/lora=default": Compose(_FITS),
    "roundpipe-train model=llama_8b model.dtype=float32 trainer=gpu model.optimizer=adamw8bit": Compose(_FITS),
    "roundpipe-train model=llama_8b model.dtype=float32 trainer=gpu model.optimizer=adamw8bit "
    "strategy.offload=optimizer+masters strategy.offload_dir=/nvme/run1": Compose(_FITS),
    "roundpipe-train model=llama_8b model.dtype=bfloat16 trainer=gpu +model/lora=qlora": Compose(_FITS),
    "roundpipe-train model=llama_8b model.dtype=bfloat16 trainer=gpu trainer.precision=bf16-true "
    "strategy.stochastic_rounding=true model.optimizer=adamw8bit": Compose(_FITS),
    # README: timelines and schedule pictures
    "roundpipe-train strategy.timeline=true experiment=quick": Run(expect="timeline"),
    "python -m lightning_roundpipe.observe.gantt schedule --paper Llama3-8B --png schedule.png": Script(),
    "python -m lightning_roundpipe.observe.gantt schedule --layers 12 --devices 4 --microbatches 5 --png "
    "schedule.png": Script(),
    "python -m lightning_roundpipe.observe.gantt trace outputs/.../timeline.json --png timeline.png": Script(
        stand_ins={"outputs/.../timeline.json": "timeline_json"}),
    # README: benchmarks
    "python benchmarks/bubble.py [--plot bubble.png]": Benchmark(
        (r"^1\. Bubble %, 8 devices, 16 microbatches", r"^Qwen3-1\.7B .* (at/below|ABOVE) \|",
         r"^2\. Llama3-8B: our sync / async-steady bubble %", r"^3\. Host optimizer step, assumed",
         r"^3\. Host optimizer step, AdamW measured here", r"^picture: bubble\.png$")),
    "python benchmarks/bubble_paper.py": Benchmark(
        (r"^Reproduction of the paper's simulator", r"^Qwen3-1\.7B +RoundPipe-sync +\d+\.\d +\d+\.\d\d ",
         r"^Planner and runtime, bubble %", r"^ +Llama3-8B +paper ")),
    "python benchmarks/host_optimizer.py [--rounds 3]": Benchmark(
        (r"^1\. ns per parameter", r"^AdamW +fused=True +\d", r"^2\. fused=True against the default path",
         r"^SGD +\d+ +\d\.\d\de[+-]\d\d +\d+\.\d{4}%$"), sized=("--rounds 3",)),
    "python benchmarks/sync_async.py [--quick]": Benchmark(
        (r"^\| configuration \| variant \| ms/step \|", r"^\| clip 1\.0 \| async, streaming_step off \|",
         r"^Verdict, no clipping: sync/async \d\.\d\d \(target >= 0\.95\) (MET|NOT MET)$",
         r"^With clipping: sync/async \d"), sized=("--quick",),
        json=("config", "streaming_step", "strategy_streaming_step", "sizing", "calibration", "summary", "clip_bound",
              "rounds", "seconds")),
    "python benchmarks/overhead.py [--quick]": Benchmark(
        (r"^variant +ms/step +tokens/s", r"^\(c\) roundpipe, 1 device", r"^\(d\) roundpipe, no recompute",
         r"^\(c\) CPU ms/step by thread .*: .*dev0-compute \d", r"^Verdict: \(c\)/\(b\) = \d",
         r"^Verdict: \(d\)/\(a\) = \d"),
        sized=("--quick",), json=("config", "summary", "rounds", "seconds")),
    "python benchmarks/overhead.py --profile d": Benchmark(  # the engine's threads are profiled too
        (r"^\(d\) roundpipe, no recompute, 2 measured steps under cProfile", r"^all threads, CPU ms/step: \d",
         r"^\| `engine/stage\.py:fused_microbatch` \| \d+\.\d\d \| 1\.0 \|$")),
    "python benchmarks/small_models.py [--quick]": Benchmark(
        (r"^\| model \| default strategy ms/step \| roundpipe ms/step", r"^\| cli-app \| \d", r"^\| vit-tiny \| \d",
         r"^cli-app, roundpipe: CPU ms/step by thread .*: .*dev0-compute \d",
         r"^Verdict: roundpipe / default at most \d"), sized=("--quick",), json=("config", "summary", "runs")),
    "python benchmarks/memory.py [--quick] [--transport off]": Benchmark(
        (r"^Device memory \(engine accounting", r"^Host bytes per parameter", r"^total +\d+\.\d\d +\d+\.\d\d$",
         r"^uploaded B/param/step", r"^Verdict: device peaks within the limit; host: sync \d"),
        sized=("--quick",), json=("config", "parameters", "parameter_bytes", "limit", "results")),
    "python benchmarks/host_memory.py [--quick]": Benchmark(
        (r"^\| configuration \| setup \| first step \| steady \| setup/steady \| disk read MB/step",
         r"^\| state \+ masters on disk \| \d+\.\d\d \|", r"^\| LoRA, bf16 base frozen \| \d+\.\d\d \|",
         r"^\| microbatches \| in memory ms/step \| state on disk ms/step \(ratio\)",
         r"^state on disk: within 1\.05x of in memory ", r"^\| LoRA, bf16 base frozen \| -?\d+\.\d\d \| -?\d+\.\d\d \| ",
         r"^Verdict: state \+ masters on disk -?\d+\.\d\d B/param at the margin.*the frozen weights \d+\.\d\d B per frozen",
         r"^\| QLoRA, NF4 base \| \d+\.\d\d \|", r"^\| bf16 masters \(stochastic rounding\) \+ 8-bit state \| \d+\.\d\d \|",
         r"QLoRA, NF4 base: the frozen weights \d+\.\d\d B per frozen parameter"),
        sized=("--quick",), json=("config", "results", "timing", "verdicts", "seconds")),
    "python benchmarks/low_bit.py [--steps 1500]": Benchmark(
        (r"^kernel +ns/param +first step s +state B/param +update error", r"^torch AdamW fused +\d",
         r"^bitsandbytes AdamW8bit +\d+\.\d\d +\d", r"^option +seed +val loss +step ms +state B/p +host B/p",
         r"^adamw8bit +0 +\d", r"^adamw: final validation loss \d\.\d{4} \(seed-to-seed spread",
         r"^adamw8bit: final validation loss \d\.\d{4}: (within|OUTSIDE) the adamw spread",
         r"^bf16\+sr: final validation loss \d\.\d{4}: (within|OUTSIDE) the adamw spread",
         r"^qlora\+adamw8bit: final validation loss \d\.\d{4}: (within|OUTSIDE) the adamw spread.*uploaded bytes"),
        sized=("--steps 1500",)),
    "python benchmarks/soak.py [--steps 2000]": Benchmark(
        (r"^ +step +seconds +rss MiB +fds +threads", r"^ +8 ", r"^verdict: .*(no thread left after teardown|GREW)"),
        sized=("--steps 2000",), grows=True, json=("samples", "problems")),
    # README: the GPU check
    "python benchmarks/gpu.py --out $OUT/gpu_results.json": NotRun(_GPU),
    "python benchmarks/gpu.py --smoke": Covered(_GPU_SMOKE, ('"--smoke"', '"gpu.py"')),
    "python -m pytest -q -m gpu tests/test_gpu.py": Covered(_GPU_SMOKE, ('sections["pytest"]',)),
    "python -m pytest -m gpu tests/test_gpu.py": Covered(_GPU_SMOKE, ('sections["pytest"]',)),
    "bash benchmarks/gpu_first_run.sh": NotRun("needs a CUDA GPU (8 minutes); its --dry-run runs every step on CPU"),
    "bash benchmarks/gpu_first_run.sh --dry-run": Covered(
        "tests/test_benchmarks.py::test_the_first_gpu_run_dry_run_reports_every_step",
        ('"gpu_first_run.sh"', '"--dry-run"')),
    "python benchmarks/gpu.py --only published": NotRun(_GPU),
    # examples/README.md
    "python examples/train.py": Run(),
    "python examples/plain_lightning.py": Covered(
        "tests/test_examples.py::test_a_plain_lightning_module_trains_unchanged_with_roundpipe",
        ('"plain_lightning.py"',)),
    "python examples/fused_loss.py": Covered("tests/test_examples.py::test_the_fused_loss_example_learns",
                                             ('"fused_loss.py"',)),
    "python examples/engine_demo.py": Script(extra=("--steps", "2")),
}


# ---------------------------------------------------------------------------- reading the READMEs
def _strip_comment(line: str) -> str:
    """The line without a shell comment (a `#` at the start or after a blank)."""
    match = re.search(r"(^|\s)#", line)
    return line[:match.start()] if match else line


def _bash_blocks(text: str) -> list[str]:
    """The commands of the ```bash blocks: continuation lines joined, comments and blank lines dropped."""
    commands = []
    for block in re.findall(r"^```(?:bash|sh|shell|console)\n(.*?)^```", text, flags=re.M | re.S):
        joined = re.sub(r"\\\n", " ", block)
        commands += [" ".join(_strip_comment(line).split()) for line in joined.splitlines()]
    return [command for command in commands if command]


def _table_commands(text: str) -> list[str]:
    """The commands of a Markdown table's `run` column (examples/README.md)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    if not lines:
        return []
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    if "run" not in header:
        return []
    column = header.index("run")
    commands = []
    for line in lines[2:]:
        cell = line.strip("|").split("|")[column]
        commands += [" ".join(code.split()) for code in re.findall(r"`([^`]+)`", cell)]
    return commands


def _inline_commands(text: str) -> list[str]:
    """The commands of the prose: code spans outside fenced blocks whose first word is a command (one of
    :data:`COMMAND_WORDS` or a program in ``.venv/bin/``) followed by at least one argument."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    commands = []
    for span in re.findall(r"`([^`\n]+)`", prose):
        words = span.split()
        if len(words) > 1 and (words[0] in COMMAND_WORDS or words[0].startswith(".venv/bin/")):
            commands.append(" ".join(words))
    return commands


def _arguments(command: str) -> list[str]:
    """``command``'s words, optional ones (``[--quick]``) included, brackets dropped."""
    return shlex.split(re.sub(r"\[([^\]]*)\]", r"\1", command))


def documented_commands() -> dict[str, str]:
    """Every documented command -> the README it is in (the first, if several)."""
    found: dict[str, str] = {}
    for readme in READMES:
        text = readme.read_text()
        for command in [*_bash_blocks(text), *_table_commands(text), *_inline_commands(text)]:
            found.setdefault(command, readme.relative_to(REPO).as_posix())
    return found


def test_the_readers_find_commands_as_a_reader_would():
    text = ("x\n```bash\nrun a   # note\n# only a comment\n\nrun b \\\n    --flag c=$OUT/d  # e\n```\n"
            "```python\nnot_a_command()\n```\n")
    assert _bash_blocks(text) == ["run a", "run b --flag c=$OUT/d"]
    table = "| script | run |\n| --- | --- |\n| `a.py` | `python a.py --x` (see `b`) |\n"
    assert _table_commands(table) == ["python a.py --x", "b"]
    prose = ("Run `python  a.py [--quick]` or `.venv/bin/tool x`, not `pytest`, `make` or `python` alone,\n"
             "nor `foo --bar` or `--smoke`:\n```bash\npython fenced.py `python in_a_block.py`\n```\n`bash b.sh`\n")
    assert _inline_commands(prose) == ["python a.py [--quick]", ".venv/bin/tool x", "bash b.sh"]
    assert _arguments("python b.py [--plot p.png] --layers 8 [--quick]") == [
        "python", "b.py", "--plot", "p.png", "--layers", "8", "--quick"]


def test_every_documented_command_has_an_entry():
    """A new command must say how it is tested; an entry whose command left the READMEs must go."""
    documented = documented_commands()
    missing = [f"{command!r} ({readme})" for command, readme in documented.items() if command not in COMMANDS]
    assert not missing, ("README commands with no entry in COMMANDS (tests/test_readme_commands.py): run them, "
                         "or map them to a stand-in or a reason: " + "; ".join(missing))
    stale = sorted(set(COMMANDS) - set(documented))
    assert not stale, f"entries of COMMANDS that no README documents any longer: {stale}"


def test_every_benchmark_command_runs_in_smoke_mode():
    """A benchmark the READMEs name runs here with --smoke; gpu.py needs CUDA, and its --smoke runs elsewhere."""
    for command in documented_commands():
        if not command.startswith("python benchmarks/"):
            continue
        check = COMMANDS.get(command)
        gpu = command.startswith("python benchmarks/gpu.py") and (
            isinstance(check, Covered) and check.test == _GPU_SMOKE or isinstance(check, NotRun) and "--smoke" in check.why)
        assert isinstance(check, Benchmark) or gpu, f"{command!r} should be a Benchmark entry (run with --smoke)"


def test_the_app_commands_are_one_entry_point():
    """roundpipe-train, `python -m lightning_roundpipe.app` and examples/train.py all call app.train.main, the
    function that composes the config and calls the `run` the Run entries call."""
    assert 'roundpipe-train = "lightning_roundpipe.app.train:main"' in (REPO / "pyproject.toml").read_text()
    for script in (REPO / "lightning_roundpipe" / "app" / "__main__.py", REPO / "examples" / "train.py"):
        assert "from lightning_roundpipe.app.train import main" in script.read_text(), script
    main = ast.parse((REPO / "lightning_roundpipe" / "app" / "train.py").read_text())
    body = next(node for node in main.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    assert "run(cfg).val_loss" in ast.unparse(body)


# ---------------------------------------------------------------------------- running them
def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _app_overrides(command: str) -> list[str]:
    for prefix in APP:
        if command == prefix or command.startswith(prefix + " "):
            return shlex.split(command[len(prefix):])
    raise AssertionError(f"{command!r} is not an app command ({', '.join(APP)})")


def _substitute(command: str, replacements: dict[str, str]) -> str:
    """``command`` with each README text (a whole word) replaced by its stand-in."""
    for text, value in replacements.items():
        command, count = re.subn(rf"(?<![\w.]){re.escape(text)}(?![\w.])", lambda _, value=value: value, command)
        assert count, (text, command)
    return command


class _Workspace:
    """One folder for the module's runs (the current folder while they run, as Hydra's run folders are under
    it), the runs done so far by command, and the stand-ins, made on first use."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.folder = folder
        self.runs: dict[tuple[str, ...], tuple[Summary, pathlib.Path]] = {}

    def run_app(self, command: str) -> tuple[Summary, pathlib.Path]:
        """Run ``command`` (a table key) with its stand-ins and extra overrides, once for all the commands that
        are the same overrides (``python examples/train.py`` and ``python -m lightning_roundpipe.app``)."""
        check = COMMANDS[command]
        assert isinstance(check, Run), command
        overrides = (*_app_overrides(_substitute(command, self.stand_ins(check.stand_ins))), *SMOKE, *check.extra)
        if overrides not in self.runs:
            now = datetime.datetime.now()  # Hydra's layout: outputs/<date>/<time>
            output = self.folder / "outputs" / now.strftime("%Y-%m-%d") / f"{now:%H-%M-%S}-{len(self.runs)}"
            self.runs[overrides] = run(_compose(list(overrides)), output), output
        return self.runs[overrides]

    def stand_ins(self, names: dict[str, str]) -> dict[str, str]:
        """README text -> stand-in, from README text -> stand-in name."""
        return {text: self.stand_in(name) for text, name in names.items()}

    def stand_in(self, name: str) -> str:
        if name == "corpus":
            corpus = self.folder / "corpus.txt"
            corpus.write_text("def roundpipe(ring):\n    return sorted(ring)\n" * 3000)
            return str(corpus)
        if name == "quick_run_folder":  # the checkpoint of the README's short run, relative as documented
            _, output = self.run_app("roundpipe-train experiment=quick")
            return output.relative_to(self.folder).as_posix()
        if name == "timeline_json":
            summary, _ = self.run_app("roundpipe-train strategy.timeline=true experiment=quick")
            (json,) = [path for path in summary.timeline_files if path.endswith(".json")]
            return json
        raise KeyError(name)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> _Workspace:
    return _Workspace(tmp_path_factory.mktemp("readme"))


def _function_source(test: str) -> str:
    path, name = test.split("::")
    text = (REPO / path).read_text()
    found = [node for node in ast.parse(text).body if isinstance(node, ast.FunctionDef) and node.name == name]
    assert found, f"{test} does not exist: COMMANDS names a test that no longer runs the command"
    return ast.get_source_segment(text, found[0]) or ""


def _load_script(path: pathlib.Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"readme_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_run(command: str, check: Run, workspace: _Workspace) -> None:
    summary, output = workspace.run_app(command)
    assert summary.tokens_per_second > 0 and summary.val_loss is not None and math.isfinite(summary.val_loss)
    if check.expect == "within 2 MiB":  # the budget held for real, not through an unlimited fallback
        assert summary.peak_device_bytes and max(summary.peak_device_bytes) <= 2 * 2**20, summary.peak_device_bytes
    elif check.expect == "timeline":  # "timeline.json + timeline.png in the run folder"
        names = sorted(pathlib.Path(path).relative_to(output).as_posix() for path in summary.timeline_files)
        assert names == ["timeline.json", "timeline.png"], summary.timeline_files
    elif check.expect == "resumed":  # from the earlier run's last step (2), two more
        import torch

        state = torch.load(output / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
        assert state["global_step"] == 4


def _check_script(command: str, check: Script, workspace: _Workspace, monkeypatch) -> None:
    argv = shlex.split(_substitute(command, workspace.stand_ins(check.stand_ins)))
    assert argv[0] == "python", command
    if argv[1] == "-m":  # a package runs its __main__, which calls the main of a module beside it
        module = importlib.import_module(argv[2])
        main = module.main if hasattr(module, "main") else _package_main(argv[2])
        arguments = argv[3:]
    else:
        main = _load_script(REPO / argv[1]).main
        arguments = argv[2:]
    monkeypatch.chdir(workspace.folder)
    import torch

    threads = torch.get_num_threads()
    try:
        assert main([*arguments, *check.extra]) in (None, 0)
    finally:
        torch.set_num_threads(threads)  # engine_demo.py sets one thread, process-wide
    for picture in [arguments[i + 1] for i, argument in enumerate(arguments) if argument == "--png"]:
        assert (workspace.folder / picture).stat().st_size > 0, picture


def _package_main(package: str) -> Any:
    """The ``main`` that ``package/__main__.py`` calls (imported there with ``from ... import main``)."""
    source = pathlib.Path(importlib.util.find_spec(package).origin).with_name("__main__.py").read_text()
    imported = re.search(r"^from ([\w.]+) import main$", source, flags=re.M)
    assert imported and re.search(r"^sys\.exit\(main\(\)\)$", source, flags=re.M), source
    return importlib.import_module(imported[1]).main


def _check_benchmark(command: str, check: Benchmark, tmp_path: pathlib.Path) -> None:
    words = _arguments(command)
    assert words[0] == "python" and words[1].startswith("benchmarks/"), command
    script = REPO / words[1]
    source = script.read_text()
    assert "add_smoke(parser" in source, f"{words[1]} has no --smoke (benchmarks/common.py: add_smoke)"
    arguments = words[2:]
    for sized in check.sized:  # left to --smoke, but still an option of the script
        assert f'"{sized.split()[0]}"' in source, f"{words[1]} has no option {sized.split()[0]}"
        at = next((i for i in range(len(arguments)) if arguments[i:i + len(sized.split())] == sized.split()), None)
        assert at is not None, (sized, command)
        del arguments[at:at + len(sized.split())]
    if check.json:
        assert '"--json"' in source, f"{words[1]} has no option --json"
        arguments += ["--json", "results.json"]
    result = subprocess.run([sys.executable, str(script), *arguments, "--smoke"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=300)
    assert result.returncode in ((0, 1) if check.grows else (0,)), result.stderr[-3000:]
    absent = missing_lines(result.stdout, check.expect)
    assert not absent, f"{command} --smoke did not print lines matching {absent}:\n{result.stdout[-3000:]}"
    for picture in [arguments[i + 1] for i, argument in enumerate(arguments) if argument == "--plot"]:
        assert (tmp_path / picture).stat().st_size > 0, picture
    if check.json:
        written = json.loads((tmp_path / "results.json").read_text())
        absent = [key for key in check.json if key not in written]
        assert not absent, f"{command} --smoke --json wrote no {absent}: {sorted(written)}"


def _check_compose(command: str, check: Compose) -> None:
    argv = shlex.split(_substitute(command, check.stand_ins))
    if check.launcher == "torchrun":
        from torch.distributed.run import get_args_parser

        launched = get_args_parser().parse_args(argv[1:])  # torchrun's own flags, as torchrun reads them
        assert (launched.module, launched.training_script) == (True, "lightning_roundpipe.app"), launched
        overrides = list(launched.training_script_args)
    else:
        if check.launcher == "srun":
            assert argv[0] == "srun", command
            argv = argv[1:]
        overrides = _app_overrides(" ".join(argv))
    cfg = _compose(overrides)
    validate(cfg)
    instantiate(cfg.strategy)
    assert cfg.trainer.accelerator == "cuda"


def _check_covered(check: Covered) -> None:
    source = _function_source(check.test)
    absent = [name for name in check.names if name not in source]
    assert not absent, f"{check.test} no longer names {absent}: it may not run the command any more"


def _make_dry_run(target: str) -> subprocess.CompletedProcess[str]:
    """What ``make -n target`` prints, as from a shell: the suite itself may run under ``make test`` (CI), whose
    variables would make this make a sub-make (printing "Entering directory", taking its flags)."""
    environment = {name: value for name, value in os.environ.items()
                   if name not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    return subprocess.run(["make", "--no-print-directory", "-n", target], capture_output=True, text=True, cwd=REPO,
                          timeout=60, env=environment)


def _check_recipe(command: str, check: Recipe) -> None:
    target = command.split()[1]
    recipe = _make_dry_run(target)
    assert recipe.returncode == 0, recipe.stderr
    # the last line: before it, the venv's creation where .venv is missing
    assert recipe.stdout.splitlines()[-1] == f".venv/bin/{check.command}", recipe.stdout
    assert check.command in COMMANDS and isinstance(COMMANDS[check.command], Run | Script | Covered)


def _check_the_suite() -> None:
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == "make test", ci
    recipe = _make_dry_run("test")
    assert recipe.returncode == 0, recipe.stderr
    *_, ruff, mypy, pytest = recipe.stdout.splitlines()
    assert [ruff, mypy] == [".venv/bin/ruff check .", ".venv/bin/mypy"], recipe.stdout
    assert pytest.startswith(".venv/bin/python -m pytest -q"), recipe.stdout
    # every test: nothing deselected (workers and reporting options only)
    options = pytest.removeprefix(".venv/bin/python -m pytest").split()
    assert not {"-m", "-k", "--deselect", "--ignore", "--lf", "-x"} & set(options), pytest
    tests_section = (REPO / "README.md").read_text().split("\n## Tests\n", 1)[1]
    assert tests_section.lstrip().startswith("`make test` runs"), tests_section[:200]


# expected of the resumed run: it checkpoints into its own folder, and resumes mid-epoch
@pytest.mark.filterwarnings("ignore:The dirpath has changed", "ignore:.*your dataloader is not resumable",
                            "ignore:a batch of 4 samples is smaller than `num_microbatches=6`")  # SMOKE's 4 val windows
@pytest.mark.parametrize("command", [  # a benchmark's run is its --smoke mode: `pytest -m smoke` runs them all
    pytest.param(command, marks=[pytest.mark.smoke] if isinstance(check, Benchmark) else []) for command, check in
    COMMANDS.items()], ids=lambda command: re.sub(r"\W+", "_", command)[:60])
def test_the_documented_command_runs(command, workspace, monkeypatch, tmp_path):
    check = COMMANDS[command]
    if isinstance(check, Benchmark):
        _check_benchmark(command, check, tmp_path)
    elif isinstance(check, Run):
        monkeypatch.chdir(workspace.folder)  # relative paths (a checkpoint of an earlier run) as documented
        _check_run(command, check, workspace)
    elif isinstance(check, Script):
        _check_script(command, check, workspace, monkeypatch)
    elif isinstance(check, Compose):
        _check_compose(command, check)
    elif isinstance(check, Covered):
        _check_covered(check)
    elif isinstance(check, Recipe):
        _check_recipe(command, check)
    elif isinstance(check, TheSuite):
        _check_the_suite()
    else:
        assert check.why, command

"""Low-bit host state against float32 AdamW: final validation loss, its seed-to-seed spread, host bytes, step time.

Run: ``python benchmarks/low_bit.py`` (about 60 minutes on 2 cores: 15 runs of 1,500 steps, 12 LoRA runs of 300;
``--steps``, ``--lora-steps``, ``--seeds`` to change; ``--smoke``: seconds). Not a test: it prints a table and a verdict per option and always
exits 0.

Setup: the main job's embedded default (``roundpipe-train``: the byte-level GPT of ``model=gpt_small``, 0.3M
parameters, on the Python standard library's sources, RoundPipe on 2 CPU devices), ``--steps`` optimizer steps,
validated every ``--steps / 3`` steps on ``--val-windows`` windows, for each option and seed:

* ``adamw``: torch's AdamW, float32 moments (today's default; its runs give the seed-to-seed spread);
* ``adamw8bit``: bitsandbytes' AdamW8bit (``model.optimizer=adamw8bit``), both moments blockwise in 8 bits;
* ``bf16``: every weight in bfloat16 (``trainer.precision=bf16-true``), stepped as plain training steps it (in
  bfloat16, rounded to nearest; AdamW's moments bfloat16 too): what Lightning's ``bf16-true`` does;
* ``bf16+sr``: the same with ``strategy.stochastic_rounding=true``: the weights stepped in float32 (float32
  moments) and rounded back stochastically, the bf16 master weights of issue 27;
* ``bf16+sr+adamw8bit``: both low-bit options, bf16 masters and 8-bit moments.

Then the same for a tiny Hugging Face Llama's LoRA adapters (``model=llama_tiny +model/lora=default``, width 128,
rank 32: each adapter matrix has 4096 elements, bitsandbytes' threshold for 8-bit moments), ``--lora-steps`` steps,
with ``adamw``, ``adamw8bit`` and two more options: ``qlora``, the frozen base's projections in NF4
(``model.lora.base=nf4``, what ``+model/lora=qlora`` sets), and ``qlora+adamw8bit``, both. An NF4 weight counts as
one parameter in the bytes per parameter.

Per run: the last validation loss; the median step time (one training batch's start to its end: the step, not the
validation); the optimizer state's bytes per trained parameter (its tensors, each shared one once) and the host's
training state per parameter (the masters, that state and the upload copies the pre-flight plan counts; gradients
are in flight only, so not counted); the bytes uploaded to the devices per step (the engine's figure, median).

First, the 8-bit AdamW kernels a library provides on CPU, against torch's AdamW (default and fused): nanoseconds
per parameter of a step (the best of ``--kernel-steps``, on ``--kernel-params`` parameters in 4 tensors, at this
process's thread count), state bytes per parameter, and the update's error: after ``--kernel-steps`` steps of the
same gradients from the same start, the distance of the weights from torch's float32 AdamW's over the distance
torch's moved them (float32 AdamW against itself fused shows the floor). bitsandbytes is the project's choice
(``low-bit`` extra); torchao's ``AdamW8bit`` is measured when it is installed (``pip install --no-deps
torchao``): its step compiles itself with ``torch.compile`` at the first step of each shape, timed apart.

Verdict per option: whether the mean of its final validation losses lies within the float32 runs' range (their
seed-to-seed spread), or by how much it is outside; and its step time and state bytes against float32's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import math
import pathlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from hydra import compose, initialize_config_dir

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import add_smoke, quiet, sized  # noqa: E402 - the benchmarks' shared helpers, beside this file

from lightning_roundpipe.app.train import CONFIG_DIR, run  # noqa: E402
from lightning_roundpipe.nf4 import weight_count  # noqa: E402

BF16 = ["trainer.precision=bf16-true"]
SR = [*BF16, "strategy.stochastic_rounding=true"]
OPTIONS = {"adamw": ["model.optimizer=adamw"], "adamw8bit": ["model.optimizer=adamw8bit"], "bf16": BF16,
           "bf16+sr": SR, "bf16+sr+adamw8bit": [*SR, "model.optimizer=adamw8bit"]}
"""Each option's overrides of the main job's config; ``adamw`` is the reference."""
QLORA_OPTIONS = {"qlora": ["model.lora.base=nf4"], "qlora+adamw8bit": ["model.lora.base=nf4", "model.optimizer=adamw8bit"]}
"""The options of the LoRA runs only: the frozen base in NF4 (``+model/lora=qlora``), alone and with 8-bit moments."""
LORA_OPTIONS = ("adamw", "adamw8bit", *QLORA_OPTIONS)
"""What the LoRA runs compare (the bf16 options are for full training: the embedded default model)."""

LORA = ["model=llama_tiny", "+model/lora=default", "model.hidden_size=128", "model.intermediate_size=256",
        "model.lora.r=32", "model.lr=1e-3"]
"""The tiny Llama's LoRA: wide enough (128) and of rank 32 so that each adapter matrix has 4096 elements,
bitsandbytes' threshold for 8-bit moments (rank 8 on width 64 would keep them all in float32)."""


@dataclass
class RunFigures:
    option: str
    seed: int
    val_loss: float
    step_seconds: float
    state_bytes_per_param: float
    host_bytes_per_param: float
    uploaded_per_step: float


class Measure(pl.Callback):
    """Step times, uploaded bytes per step, and at the end of training the bytes of the host's training state."""

    def __init__(self) -> None:
        self.step_seconds: list[float] = []
        self.uploaded: list[float] = []
        self.state_bytes = self.param_bytes = self.copy_bytes = self.params = self.trained = 0
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.step_seconds.append(time.perf_counter() - self._start)
        uploaded = trainer.callback_metrics.get("roundpipe/uploaded_bytes")  # logged every step (see main)
        if uploaded is not None:
            self.uploaded.append(float(uploaded))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = {id(param): param for param in pl_module.parameters()}.values()
        self.params = weight_count(pl_module)  # an NF4 weight counts as one parameter, not as its bytes
        self.trained = sum(param.numel() for param in params if param.requires_grad)
        self.param_bytes = sum(param.nbytes for param in params)
        self.state_bytes = held_state_bytes(trainer.optimizers[0])
        plan = getattr(trainer.strategy, "memory_plan", None)
        self.copy_bytes = plan.upload_copy_bytes if plan is not None else 0


def train(model: list[str], steps: int, option: str, seed: int, args: argparse.Namespace,
          root: pathlib.Path) -> RunFigures:
    overrides = [*model, *{**OPTIONS, **QLORA_OPTIONS}[option], f"seed={seed}", f"trainer.max_steps={steps}",
                 f"trainer.val_check_interval={max(1, steps // 3)}", f"data.val_windows={args.val_windows}",
                 f"data.limit_bytes={args.limit_bytes}", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
                 "sample_tokens=0", "~logger", "~callbacks"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    measure = Measure()
    with contextlib.redirect_stdout(io.StringIO()):  # the job's own summary: the table below says what counts
        summary = run(cfg, output_dir=root / f"{len(model)}-{option}-{seed}", extra_callbacks=[measure])
    assert summary.val_loss is not None
    steady = measure.step_seconds[1:] or measure.step_seconds  # the first step makes the state
    return RunFigures(option, seed, summary.val_loss, statistics.median(steady),
                      measure.state_bytes / max(measure.trained, 1),
                      (measure.param_bytes + measure.state_bytes + measure.copy_bytes) / max(measure.params, 1),
                      statistics.median(measure.uploaded) if measure.uploaded else float("nan"))


def _eight_bit_kernels() -> dict[str, Any]:
    """The 8-bit AdamW classes importable here, by library."""
    kernels: dict[str, Any] = {}
    try:
        import bitsandbytes

        kernels["bitsandbytes AdamW8bit"] = bitsandbytes.optim.AdamW8bit
    except ImportError:
        print("bitsandbytes is not installed: pip install 'lightning_roundpipe[low-bit]'")
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        print("torchao is not installed: pip install --no-deps torchao (to compare it)")
    else:
        kernels["torchao AdamW8bit"] = AdamW8bit
    return kernels


def _inner_tensors(value: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``value``: itself, or a tensor subclass's (torchao's ``OptimState8bit``: its bytes,
    scales and map), whose own ``nbytes`` is that of the float32 tensor it stands for."""
    if type(value) is torch.Tensor or not hasattr(value, "__tensor_flatten__"):
        return [value]
    names, _ = value.__tensor_flatten__()
    return [plain for name in names for plain in _inner_tensors(getattr(value, name))]


def held_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes ``optimizer``'s state holds, each tensor once (bitsandbytes' maps are one tensor for every
    parameter), a tensor subclass by the plain tensors inside it."""
    held: dict[int, torch.Tensor] = {}
    for entry in optimizer.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor):
                held.update((id(inner), inner) for inner in _inner_tensors(value))
    return sum(tensor.nbytes for tensor in held.values())


def compare_kernels(args: argparse.Namespace) -> None:
    """The table of the module docstring's first paragraph."""
    generator = torch.Generator().manual_seed(0)
    rows = args.kernel_params // 4 // 1024
    start = [torch.randn(rows, 1024, generator=generator) for _ in range(4)]
    grads = [[torch.randn(rows, 1024, generator=generator) * 1e-2 for _ in start] for _ in range(args.kernel_steps)]

    def train(make: Any) -> tuple[list[torch.Tensor], float, float, int]:
        params = [torch.nn.Parameter(value.clone()) for value in start]
        optimizer = make(params)
        best, first = float("inf"), 0.0
        for step, step_grads in enumerate(grads):
            for param, grad in zip(params, step_grads, strict=True):
                param.grad = grad
            began = time.perf_counter()
            optimizer.step()
            took = time.perf_counter() - began
            if step == 0:
                first = took
            else:
                best = min(best, took)
        state = held_state_bytes(optimizer)
        return [param.detach() for param in params], best, first, state

    count = sum(value.numel() for value in start)
    reference, *_ = train(functools.partial(torch.optim.AdamW, lr=1e-3))
    moved = math.sqrt(sum(float((r - s).square().sum()) for r, s in zip(reference, start, strict=True)))
    makers: dict[str, Any] = {"torch AdamW": functools.partial(torch.optim.AdamW, lr=1e-3),
                              "torch AdamW fused": functools.partial(torch.optim.AdamW, lr=1e-3, fused=True)}
    makers.update({name: functools.partial(cls, lr=1e-3) for name, cls in _eight_bit_kernels().items()})
    print(f"\n8-bit AdamW on CPU: {count:,} parameters in 4 tensors, {args.kernel_steps} steps, "
          f"{torch.get_num_threads()} threads")
    print(f"{'kernel':<24}{'ns/param':>10}{'first step s':>14}{'state B/param':>15}{'update error':>14}")
    for name, make in makers.items():
        weights, best, first, state = train(make)
        error = math.sqrt(sum(float((w - r).square().sum()) for w, r in zip(weights, reference, strict=True)))
        print(f"{name:<24}{best / count * 1e9:>10.2f}{first:>14.2f}{state / count:>15.2f}{error / moved:>14.2e}")


def compare_options(title: str, model: list[str], steps: int, options: list[str], args: argparse.Namespace,
                    root: pathlib.Path) -> None:
    """Train ``model`` (overrides of the main job's config) with each option and seed; print the table and the
    verdicts."""
    print(f"\n{title}: {steps} steps, {args.seeds} seeds per option")
    results: dict[str, list[RunFigures]] = {}
    for seed in range(args.seeds):
        for option in options:
            figures = train(model, steps, option, seed, args, root)
            results.setdefault(option, []).append(figures)
            print(f"  {option} seed {seed}: validation loss {figures.val_loss:.4f}", flush=True)
    print(f"{'option':<18}{'seed':>5}{'val loss':>10}{'step ms':>9}{'state B/p':>11}{'host B/p':>10}"
          f"{'uploaded/step':>15}")
    for option in options:
        for f in results[option]:
            print(f"{f.option:<18}{f.seed:>5}{f.val_loss:>10.4f}{f.step_seconds * 1e3:>9.1f}"
                  f"{f.state_bytes_per_param:>11.2f}{f.host_bytes_per_param:>10.2f}{f.uploaded_per_step:>15,.0f}")
    reference = [f.val_loss for f in results["adamw"]]
    low, high = min(reference), max(reference)
    print(f"adamw: final validation loss {statistics.mean(reference):.4f} (seed-to-seed spread {low:.4f} .. "
          f"{high:.4f}, {high - low:.4f} wide)")
    reference_step = statistics.median(f.step_seconds for f in results["adamw"])
    reference_state = statistics.mean(f.state_bytes_per_param for f in results["adamw"])
    reference_host = statistics.mean(f.host_bytes_per_param for f in results["adamw"])
    reference_uploaded = statistics.median(f.uploaded_per_step for f in results["adamw"])
    for option in options:
        if option == "adamw":
            continue
        mean = statistics.mean(f.val_loss for f in results[option])
        outside = mean - high if mean > high else mean - low if mean < low else 0.0
        verdict = "within the adamw spread" if outside == 0.0 else f"OUTSIDE the adamw spread by {outside:+.4f}"
        step = statistics.median(f.step_seconds for f in results[option]) / reference_step
        state = statistics.mean(f.state_bytes_per_param for f in results[option]) / reference_state
        host = statistics.mean(f.host_bytes_per_param for f in results[option]) / reference_host
        uploaded = statistics.median(f.uploaded_per_step for f in results[option]) / reference_uploaded
        print(f"{option}: final validation loss {mean:.4f}: {verdict}; step time {step:.2f}x adamw's, optimizer "
              f"state {state:.2f}x, host bytes {host:.2f}x, uploaded bytes {uploaded:.2f}x")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 1500)")
    parser.add_argument("--lora-steps", type=int, default=None, help="steps of the LoRA runs (default 300; 0: none)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per option (default 3)")
    parser.add_argument("--val-windows", type=int, default=None, help="validation windows (default 192)")
    parser.add_argument("--limit-bytes", type=int, default=None, help="bytes of sources read (default 4000000)")
    every = [*OPTIONS, *QLORA_OPTIONS]
    parser.add_argument("--options", default=",".join(every), help=f"comma-separated, of {', '.join(every)} "
                        "(the qlora ones for the LoRA runs only)")
    parser.add_argument("--kernel-params", type=int, default=None, help="parameters of the kernel table (4M)")
    parser.add_argument("--kernel-steps", type=int, default=None, help="steps of the kernel table (20)")
    parser.add_argument("--kernels-only", action="store_true", help="the kernel table alone")
    add_smoke(parser, "4 steps, 2 seeds, 4 validation windows, kernels on 64K parameters")
    args = parser.parse_args()
    args.steps = sized(args.steps, args, full=1500, smoke=4)
    args.lora_steps = sized(args.lora_steps, args, full=300, smoke=2)
    args.seeds = sized(args.seeds, args, full=3, smoke=2)
    args.val_windows = sized(args.val_windows, args, full=192, smoke=4)
    args.limit_bytes = sized(args.limit_bytes, args, full=4_000_000, smoke=300_000)
    args.kernel_params = sized(args.kernel_params, args, full=4 * 2**20, smoke=2**16)
    args.kernel_steps = sized(args.kernel_steps, args, full=20, smoke=3)
    return args


def main() -> int:
    args = parse()
    quiet()
    chosen = [option for option in args.options.split(",") if option]
    unknown = sorted(set(chosen) - set(OPTIONS) - set(QLORA_OPTIONS))
    if unknown or "adamw" not in chosen:
        print(f"--options: {', '.join(unknown) or 'adamw (the reference) is missing'}; choose from "
              f"{', '.join([*OPTIONS, *QLORA_OPTIONS])}, adamw included")
        return 0
    options = [option for option in chosen if option in OPTIONS]
    lora_options = [option for option in chosen if option in LORA_OPTIONS]
    print(f"low-bit host state, torch {torch.__version__}")
    compare_kernels(args)
    if args.kernels_only:
        return 0
    with tempfile.TemporaryDirectory(dir=".") as root:
        runs = (("the embedded default model (gpt_small)", [], args.steps, options),
                ("a tiny Llama's LoRA adapters", LORA, args.lora_steps, lora_options))
        for title, model, steps, chosen in runs:
            if steps:
                compare_options(title, model, steps, chosen, args, pathlib.Path(root))
    return 0


if __name__ == "__main__":
    sys.exit(main())

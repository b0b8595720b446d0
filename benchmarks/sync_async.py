"""Sync against async step speed when the host optimizer step is a large share of the iteration.

Run: ``python benchmarks/sync_async.py [--quick] [--json PATH]`` (default about 2-3 minutes on 2 cores,
``--quick`` about 1 minute, ``--smoke`` seconds: width 256, one round of 2 measured steps, a short
calibration, as ``--quick`` no synchronize() diagnostic). Not a test: it prints a table and verdicts and always exits 0.

What is compared, in one interleaved run (rounds of sync, async, ..., each a fresh ``Trainer.fit`` from the
same initial weights and the same batches, AdamW, fp32, no logger, checkpointing or progress bar), in two
configurations: without clipping, and with ``Trainer(gradient_clip_val=1.0)``:

* ``sync``: ``RoundPipeStrategy(async_step=False)``, the exact step (``streaming_step`` at its default, where
  ``EngineOptions`` has that option).
* ``async``: ``async_step=True``, one step stale: the host step overlaps the next iteration.
* ``sync, streaming_step off``: only where ``EngineOptions`` has ``streaming_step``: sync with ``"off"`` (the
  whole step between two iterations). Passed as a strategy keyword where the strategy takes it, else set in
  the strategy's ``engine_options`` before ``fit``. ``async, streaming_step off``: the same for async (what
  async was before streaming).
* ``sync, timer callback`` and ``async, timer callback`` (without clipping only): ``sync`` and ``async`` with a
  plain user callback that overrides ``on_train_batch_end`` (a timer: it reads no gradient and declares nothing
  to RoundPipe). Such a hook runs after the step, where Lightning's default strategy shows the step's gradients
  in ``param.grad``: sync shows them once its step is done, without a wait; async has no such point and waits
  for each backward (the strategy's docstring says why). Verdict: sync/async with the callback, each against
  the same variant without it, and sync with the callback against async without it.
* ``sync, no synchronize()`` (not with ``--quick``): a diagnostic, the strategy less its wait for every sync step
  (a subclass whose ``optimizer_step`` queues the step and returns). The engine keeps sync exact without it
  (uploads wait for the step); the strategy waits so that user code sees current weights: right after the step
  where a hook of the user's may run before the next batch or the step keeps its gradients (here: with
  clipping), else when the next batch arrives (here: without clipping; the step timer's hook runs after that).
  Its difference to ``sync`` is what that wait costs.

Emulated devices. On a GPU the devices do not use host cores, so the host step competes only with the
runtime's own threads. CPU stand-in devices compute on host cores, so here a device's compute is mostly a
*wait*: the trunk is ``--layers`` blocks ``x + tanh(Linear(width, width)(x))``, each followed by
:class:`Wait`, an autograd function that sleeps ``forward_ms`` in forward and ``--backward-factor`` times
that in backward (``time.sleep`` releases the GIL, as a device kernel leaves the host free). A backward
stage recomputes its forward, so it sleeps both, as a GPU would run both. The real arithmetic is small: a
microbatch is ``--rows`` samples, so each Linear is a (rows x width) @ (width x width) matmul, and its
weight gradient (a sum of rows outer products) is nonzero in every element: AdamW does real work on every
parameter, and the wide layers (``width^2`` parameters each) make the host step large. The plan is fixed
(``--layers-per-stage`` layers per stage, the deepest stage fused, backward stages on the forward stages'
boundaries) on ``--devices`` CPU devices with ``--microbatches`` microbatches; ``torch.set_num_threads``
is ``--threads`` (process-wide: the optimizer thread steps with that many); ``--host-optimizer`` is the
strategy's option (default ``"exact"``: AdamW's per-tensor loop of torch calls). What is not emulated: the
stand-in devices' weight uploads and gradient downloads are real copies by host cores (on a GPU, copy
engines), and the runtime's threads take the GIL around every operation, so the host step shares the two
cores with them; they make the real iteration longer than its sleeps, and a host step that overlaps device
work (async, or a streamed sync step) slower than one that runs alone: AdamW's per-tensor loop makes a dozen
torch calls per tensor, and each must take the GIL back from the runtime's threads (compare ``host step`` of
``sync, streaming_step off`` with the others).

Sizing. ``forward_ms`` is chosen so that the host step S is ``--host-share`` of the compute span of one
iteration (from forward stage 0's first microbatch to the last backward's end, nothing else running): S is
measured first (``measure_step``, AdamW's default CPU path on scratch parameters of the model's size), the
project's schedule simulator (``planning.simulate.simulate_roundpipe``) gives the span of the sleeps, then a
calibration run of the engine alone (sync, streaming off, timeline on) measures the real span and S, and
the sleeps are resized once for the overhead it found (a fixed cost per iteration is assumed). The header
prints the result; ``--forward-ms`` fixes the sleep instead.

Timing, as in ``overhead.py``: per step, from one ``on_train_batch_start`` to the next (a callback); the first
``--warmup`` steps of every run are dropped; each run's median step gives samples/s. ``host step`` is the
engine's ``optimizer_seconds`` per step and ``exposed`` its ``optimizer_exposed_seconds`` (device time spent
waiting for a step's weights, per device), both from ``engine.pipeline_metrics()``, read by the callback at
each step (the strategy's own metrics logging is off); medians per run, then over the rounds. ``exposed``
is about 0 for ``sync``: there the strategy waits on the main thread for the step before the next batch is
dispatched, so the devices never wait for weights; the wait is in ``ms/step``. Ratios
(``vs async``) are medians of the per-round ratios (each between runs of the same round), with their
min..max, against the faster async variant of the configuration (``async`` or ``async, streaming_step off``,
the one with more samples/s over the rounds): sync is held to async at its best.

Targets. Without clipping: sync/async >= 0.95, with and without the timer callback. With clipping, sync must
have every gradient before it can clip and step any parameter, so part of the step is exposed whatever the
runtime does: the figure is shown against this bound.

The bound with clipping. Let the step's groups be the plan's backward stages and the fused stage (their
layers), stepped in forward order once every gradient is there (``t = 0``): group ``g`` is done at ``c_g``,
S times the share of parameters in groups ``0..g`` (AdamW's cost is per parameter). The next iteration's
forward stage ``i`` (the fused stage last) cannot start before the group holding its layers is stepped, nor
earlier than ``o_i`` after forward stage 0 starts, where ``o_i`` is its start in an iteration that nothing
delays (median over the calibration run's iterations, from its timeline). So the device time exposed after
the last gradient is at least

    exposed_bound = max_i (c_i - o_i) = max(c_0, c_1 - o_1, ..., S - o_fused)

the first group's step, or, where the whole step S outlasts the next iteration's forward stages, what it
exceeds them by (the larger; this is the additive ``c_0 + max(0, S - forward span)`` less the overlap of the
first group's step with that span). Two bounds follow:

    sync/async <= T_async / (T_async + exposed_bound)           (the bound printed first)
    sync/async <= T_async / (span + exposed_bound)              (the strict one)

The first takes the sync period to be at least the async period plus the exposed time: it holds when async
hides its whole step, so that its period is the iteration's alone (its ``exposed`` column near 0). The
second holds whatever async does: from one iteration's last gradient to the next's is at least its
compute span (measured in the calibration run, nothing else running) plus the exposed time, because the
fused stage starts no earlier than ``max(c_0 + o_fused, S)`` after the last gradient and the rest of the
iteration follows it. Where async overlaps consecutive iterations its period is below the span, and the
strict bound is the tighter; where async itself waits for its steps (a step slower than an iteration) it
can exceed 1, and the first bound is then no bound. S is the least contended sync variant's host step (the
smallest of their medians with clipping), T_async the faster async variant's period with clipping. Uploads of the
stepped weights, clipping itself and hand-offs only add to the exposed time. A streaming sync step cannot
beat these with clipping; without clipping only the shallowest group's step (``c_0`` at the least) must
follow the last gradient, so that sync/async <= T_async/(T_async + c_0) whatever the schedule (printed with the
verdict). That is why the default is 8 layers of width 1448 (16.8M parameters, the shallowest 1/8 of them): with
4 layers of width 2048 (the same parameters, the default until the bound was printed) a quarter of the step
follows the last gradient, and the bound, about 0.93, lies below the target of 0.95.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import add_smoke, quiet, sized  # noqa: E402
from overhead import StepTimer, plan_shape  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_roundpipe.precision as rp_precision  # noqa: E402
from lightning_roundpipe import RoundPipeStrategy, pipeline_loss  # noqa: E402
from lightning_roundpipe.engine.engine import RoundPipeEngine  # noqa: E402
from lightning_roundpipe.engine.options import EngineOptions  # noqa: E402
from lightning_roundpipe.engine.step.kernels import measure_step  # noqa: E402
from lightning_roundpipe.observe.trace import COMPUTE_KINDS  # noqa: E402
from lightning_roundpipe.planning.partition import LayerCost, Plan  # noqa: E402
from lightning_roundpipe.planning.simulate import simulate_roundpipe  # noqa: E402

TARGET = 0.95  # sync / async without clipping
STREAMING = "streaming_step" in {field.name for field in dataclasses.fields(EngineOptions)}
STRATEGY_STREAMING = "streaming_step" in inspect.signature(RoundPipeStrategy).parameters
NAMES = {"sync": "sync", "async": "async", "sync_off": "sync, streaming_step off",
         "async_off": "async, streaming_step off", "sync_nosync": "sync, no synchronize()",
         "sync_timer": "sync, timer callback", "async_timer": "async, timer callback"}
TIMED = ("sync_timer", "async_timer")  # variants with a user callback on on_train_batch_end; no clipping only
CONFIGS = ("no clip", "clip 1.0")
MIN_FORWARD_MS = 0.25


class Wait(torch.autograd.Function):
    """Identity that sleeps: ``seconds`` in forward, ``backward_factor * seconds`` in backward (an emulated
    device kernel; ``time.sleep`` releases the GIL)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float, backward_factor: float) -> torch.Tensor:
        ctx.backward_seconds = seconds * backward_factor
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_seconds)
        return grad, None, None


class EmulatedLayer(nn.Module):
    """``x + tanh(Linear(x))``, then :class:`Wait`: a wide layer whose device time is mostly a wait."""

    def __init__(self, width: int, forward_seconds: float, backward_factor: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.forward_seconds, self.backward_factor = forward_seconds, backward_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Wait.apply(x + torch.tanh(self.linear(x)), self.forward_seconds, self.backward_factor)


def make_trunk(args: argparse.Namespace) -> nn.Sequential:
    torch.manual_seed(1234)  # the same initial weights for every variant and round
    return nn.Sequential(*[EmulatedLayer(args.width, args.forward_ms / 1e3, args.backward_factor)
                           for _ in range(args.layers)])


def make_plan(layers: int, per_stage: int) -> Plan:
    """Stages of ``per_stage`` layers; the deepest is fused; backward stages on the forward stages' boundaries."""
    bounds = [*range(0, layers, per_stage), layers]
    stages = [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    return Plan(forward=tuple(stages[:-1]), fused=stages[-1], backward=tuple(reversed(stages[:-1])))


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)


def make_batches(args: argparse.Namespace, count: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    samples = args.microbatches * args.rows
    x = torch.randn(count * samples, args.width, generator=generator)
    y = torch.randn(count * samples, args.width, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=samples, shuffle=False)


class EmulatedModel(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.net = make_trunk(args)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return pipeline_loss(self.net, x, y, F.mse_loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters())


class WithoutSynchronize(RoundPipeStrategy):
    """Diagnostic only: the strategy's ``optimizer_step`` less its wait for a sync step (safe here: nothing reads or
    writes the weights between steps, nor in ``training_step``)."""

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        module = model or self.lightning_module
        assert self.engine is not None and module is not None
        result = closure()
        rp_precision.queue_step(self.precision_plugin, self.engine, optimizer, module, result)
        return result


class UserTimer(pl.Callback):
    """A callback as users write one: it times each batch in ``on_train_batch_end``, reads no gradient, and says
    nothing to RoundPipe (no ``roundpipe_reads_gradients``)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.ends.append(time.perf_counter())


class Timer(StepTimer):
    """``overhead.StepTimer``, plus the engine's host-step figures of each step."""

    def __init__(self, warmup: int) -> None:
        super().__init__(warmup)
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None and not engine.closed:
            self.metrics.append(engine.pipeline_metrics())  # the figures since the previous batch's start

    def median(self, name: str) -> float:
        values = [m[name] for m in self.metrics[self.warmup + 1:]]
        return statistics.median(values) if values else float("nan")


def run_once(variant: str, clip: bool, args: argparse.Namespace) -> dict[str, Any]:
    steps = args.warmup + args.steps + 1  # + 1: the last measured step ends at the next step's start
    options: dict[str, Any] = dict(num_microbatches=args.microbatches, num_stages=args.plan,
                                   async_step=variant.startswith("async"), host_optimizer=args.host_optimizer,
                                   log_pipeline_metrics=False, preflight="off")
    streaming_off = variant.endswith("_off")
    if streaming_off and STRATEGY_STREAMING:
        options["streaming_step"] = "off"
    strategy = (WithoutSynchronize if variant == "sync_nosync" else RoundPipeStrategy)(**options)
    if streaming_off and not STRATEGY_STREAMING:  # the engine has the option, the strategy not yet
        strategy.engine_options = dataclasses.replace(strategy.engine_options, streaming_step="off")
    timer = Timer(args.warmup)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[timer, UserTimer()] if variant in TIMED else [timer],
                         gradient_clip_val=1.0 if clip else None)
    trainer.fit(EmulatedModel(args), make_batches(args, steps))
    times = timer.step_seconds()
    median = statistics.median(times)
    return {"variant": variant, "median_step_s": median, "samples_per_s": args.microbatches * args.rows / median,
            "host_step_s": timer.median("optimizer_seconds"), "exposed_s": timer.median("optimizer_exposed_seconds"),
            "steps": len(times)}


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """The engine alone, sync, no clipping, streaming off, timeline on. Per iteration (after warm-up): the
    compute span (forward stage 0's first compute start to the iteration's last compute end), each forward
    stage's and the fused stage's first compute start after forward stage 0's (``o_i``), the host step (the
    sum of its timeline events) and the step period."""
    trunk = make_trunk(args)
    optimizer = make_optimizer(trunk.parameters())
    plan: Plan = args.plan
    extra: dict[str, Any] = {"streaming_step": "off"} if STREAMING else {}
    options = EngineOptions(num_microbatches=args.microbatches, num_stages=plan, record_timeline=True,
                            host_optimizer=args.host_optimizer, **extra)
    starts = []
    with RoundPipeEngine(trunk, devices=args.devices, options=options) as engine:
        for x, y in make_batches(args, args.calibration_steps):
            starts.append(time.perf_counter())
            engine.forward_backward(x, y, F.mse_loss)
            engine.step(optimizer)
        engine.synchronize()
        events = engine.events()
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    steps: dict[int, float] = {}
    for event in events:
        if event.kind in COMPUTE_KINDS:
            first[event.job] = min(first.get(event.job, event.start), event.start)
            last[event.job] = max(last.get(event.job, event.end), event.end)
        elif event.kind == "optimizer":
            match = re.match(r"step (\d+)", event.label)  # a streamed step has one event per group
            if match:
                number = int(match.group(1))
                steps[number] = steps.get(number, 0.0) + event.end - event.start
    jobs, starters = plan.num_stages, len(plan.forward) + 1
    offsets, spans = [], []
    for iteration in range(args.calibration_warmup, args.calibration_steps):
        base = iteration * jobs
        if all(base + j in first for j in range(jobs)):
            offsets.append([first[base + j] - first[base] for j in range(starters)])
            spans.append(max(last[base + j] for j in range(jobs)) - first[base])
    warm = args.calibration_warmup
    host = [seconds for number, seconds in steps.items() if number > warm] or list(steps.values())
    return {"forward_ms": args.forward_ms,
            "offsets_s": [statistics.median(column) for column in zip(*offsets, strict=True)],
            "span_s": statistics.median(spans), "host_step_s": statistics.median(host),
            "period_s": statistics.median(b - a for a, b in zip(starts[warm:], starts[warm + 1:], strict=False))}


def simulated_span(args: argparse.Namespace) -> float:
    """The compute span of one iteration of the sleeps alone, in ms per ms of forward sleep."""
    unit = [LayerCost(forward=1.0, backward=args.backward_factor)] * args.layers
    return simulate_roundpipe(args.plan, unit, args.devices, args.microbatches, iterations=1, mode="sync").makespan


def size(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Choose ``forward_ms`` (see the module docstring); returns the sizing figures and the last calibration."""
    args.forward_ms = 1.0
    trunk = make_trunk(args)
    params = sum(p.numel() for p in trunk.parameters())
    figure = measure_step(make_optimizer(trunk.parameters()), args.host_optimizer, max_elements=params)
    measured = figure.step_seconds or 0.0
    per_ms = simulated_span(args)  # ms of span per ms of forward sleep
    sizing: dict[str, Any] = {"params": params, "kernel": figure.kernel, "measured_step_s": measured,
                              "ns_per_param": 1e9 * measured / params}
    if args.forward_ms_fixed is not None:
        args.forward_ms = args.forward_ms_fixed
        return sizing, calibrate(args)
    args.forward_ms = max(MIN_FORWARD_MS, 1e3 * measured / (args.host_share * per_ms))
    first = calibrate(args)
    overhead = first["span_s"] - per_ms * args.forward_ms / 1e3  # what the span has beyond its sleeps
    wanted = first["host_step_s"] / args.host_share - overhead
    sizing["first_calibration"] = first
    sizing["overhead_s"] = overhead
    resized = max(MIN_FORWARD_MS, 1e3 * wanted / per_ms)
    if abs(resized - args.forward_ms) <= 0.15 * args.forward_ms:
        return sizing, first
    args.forward_ms = resized
    return sizing, calibrate(args)


def clip_bound(group_params: list[int], offsets: list[float], host_step: float, async_period: float,
               span: float) -> dict[str, float]:
    """The bound of the module docstring: groups in forward order (backward stages shallow to deep, then the
    fused stage); forward stage ``i`` and then the fused stage wait for group ``i``."""
    total, cumulative, done = sum(group_params), 0, []
    for params in group_params:
        cumulative += params
        done.append(host_step * cumulative / total)
    exposed = max([0.0, *(c - o for c, o in zip(done, offsets, strict=False))])
    return {"host_step_s": host_step, "first_group_s": done[0], "forward_span_s": offsets[-1],
            "exposed_bound_s": exposed, "async_period_s": async_period, "span_s": span,
            "ratio_bound": async_period / (async_period + exposed), "strict_ratio_bound": async_period / (span + exposed)}


def no_clip_bound(group_params: list[int], no_clip: dict, reference: str, variants: tuple[str, ...]) -> dict[str, float]:
    """Without clipping only the shallowest group's step must follow the last gradient (the module docstring): its
    share of the least contended sync variant's host step, and the bound it puts on sync/async against the async
    reference's period. Printed beside the verdict: where it is near the target, no schedule meets the target."""
    share = group_params[0] / sum(group_params)
    first_ms = share * min(no_clip[v]["host_step_ms"] for v in variants if v.startswith("sync"))
    period = no_clip[reference]["median_ms_per_step"]
    bound = period / (period + first_ms)
    print(f"  its bound: the shallowest group's step ({first_ms:.1f} ms, {share:.0%} of the parameters) follows the "
          f"last gradient, so sync/async <= T_async/(T_async + that) = {bound:.3f}")
    return {"first_group_ms": first_ms, "async_period_ms": period, "ratio_bound": bound}


def group_parameters(trunk: nn.Sequential, plan: Plan) -> list[int]:
    return [sum(p.numel() for index in group for p in trunk[index].parameters())
            for group in (*reversed(plan.backward), plan.fused)]


def reference(rounds: list[dict[str, dict[str, Any]]], variants: tuple[str, ...]) -> str:
    """The async variant with the most samples/s (median over rounds): the speed sync is held to."""
    return max((v for v in variants if v.startswith("async") and v not in TIMED),
               key=lambda v: statistics.median(r[v]["samples_per_s"] for r in rounds))


def summarize(rounds: list[dict[str, dict[str, Any]]], variants: tuple[str, ...]) -> dict[str, Any]:
    ref = reference(rounds, variants)
    summary: dict[str, Any] = {"reference": ref}
    for variant in variants:
        runs = [r[variant] for r in rounds]
        ratios = [r[variant]["samples_per_s"] / r[ref]["samples_per_s"] for r in rounds]
        summary[variant] = {
            "name": NAMES[variant], "median_ms_per_step": 1e3 * statistics.median(r["median_step_s"] for r in runs),
            "median_samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
            "ratio_vs_async": statistics.median(ratios), "ratio_vs_async_range": [min(ratios), max(ratios)],
            "host_step_ms": 1e3 * statistics.median(r["host_step_s"] for r in runs),
            "exposed_ms": 1e3 * statistics.median(r["exposed_s"] for r in runs)}
    return summary


def run_order(variants: tuple[str, ...], swap: bool) -> list[str]:
    """``variants`` in the order they run in a round: with ``swap`` (every second round) each timer variant runs
    before its twin rather than after it, so that neither gains from going first."""
    order = list(variants)
    if swap:
        for timed in TIMED:
            if timed in order and timed.removesuffix("_timer") in order:
                at = order.index(timed)
                order[at - 1], order[at] = order[at], order[at - 1]
    return order


def timer_verdict(rounds: list[dict[str, dict[str, Any]]], ref: str) -> dict[str, float]:
    """Print and return the timer callback's verdict (no clipping): per round, sync/async with the callback on
    both, each variant with the callback against itself without, and sync with it against async (``ref``, the
    faster async variant) without it; medians over the rounds."""
    def median_ratio(top: str, bottom: str) -> float:
        return statistics.median(r[top]["samples_per_s"] / r[bottom]["samples_per_s"] for r in rounds)

    figures = {"sync_vs_async": median_ratio("sync_timer", "async_timer"),
               "sync_vs_sync_without": median_ratio("sync_timer", "sync"),
               "async_vs_async_without": median_ratio("async_timer", "async"),
               "sync_vs_async_without": median_ratio("sync_timer", ref)}
    ratio = figures["sync_vs_async"]
    print(f"Verdict, no clipping, a timer callback on on_train_batch_end: sync/async {ratio:.2f} (target >= {TARGET}) "
          f"{'MET' if ratio >= TARGET else 'NOT MET'}; with it against without: sync "
          f"{figures['sync_vs_sync_without']:.2f}, async {figures['async_vs_async_without']:.2f}; sync with it "
          f"against {NAMES[ref]} without it {figures['sync_vs_async_without']:.2f}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 rounds of 5 measured steps, no synchronize() diagnostic (about 1 minute)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 4, quick 2, smoke 1)")
    parser.add_argument("--steps", type=int, default=None,
                        help="measured steps per run (default 10, quick 5, smoke 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps dropped per run (default 3, quick 2, smoke 1)")
    parser.add_argument("--width", type=int, default=None, help="(default 1448, smoke 256)")
    parser.add_argument("--layers", type=int, default=8,
                        help="(default 8: the shallowest layer 1/8 of the parameters, see the bound without clipping)")
    parser.add_argument("--layers-per-stage", type=int, default=1)
    parser.add_argument("--devices", type=int, default=2, help="CPU stand-in devices")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4, help="samples per microbatch")
    parser.add_argument("--backward-factor", type=float, default=2.0, help="backward sleep / forward sleep")
    parser.add_argument("--host-share", type=float, default=0.4,
                        help="size the sleeps so that the host step is this share of one iteration's compute span")
    parser.add_argument("--forward-ms", dest="forward_ms_fixed", type=float, default=None,
                        help="forward sleep per layer and microbatch (default: sized from --host-share)")
    parser.add_argument("--host-optimizer", choices=("exact", "fused"), default="exact",
                        help="the strategy's host_optimizer ('exact': AdamW's per-tensor loop; 'fused': one kernel)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (process-wide)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    add_smoke(parser, "width 256, one round of 2 measured steps, a short calibration, no synchronize() diagnostic")
    args = parser.parse_args()
    args.repeats = sized(args.repeats, args, full=4, quick=2, smoke=1)
    args.steps = sized(args.steps, args, full=10, quick=5, smoke=2)
    args.warmup = sized(args.warmup, args, full=3, quick=2, smoke=1)
    args.width = sized(args.width, args, full=1448, smoke=256)
    args.calibration_steps, args.calibration_warmup = (3, 1) if args.smoke else (8, 2)
    if args.layers < 2 or not 1 <= args.layers_per_stage < args.layers:
        parser.error("need --layers >= 2 and 1 <= --layers-per-stage < --layers")
    args.plan = make_plan(args.layers, args.layers_per_stage)
    variants = ("sync", "async", *(("sync_off", "async_off") if STREAMING else ()), *(() if args.quick or args.smoke else ("sync_nosync",)))
    # each timer variant beside its twin without the callback, so that the pair runs under the same load
    timed = tuple(v for variant in variants for v in (variant, f"{variant}_timer") if v in NAMES)
    per_config = {"no clip": timed, "clip 1.0": variants}
    torch.set_num_threads(args.threads)
    quiet()

    began = time.perf_counter()
    sizing, calibration = size(args)
    print(f"Emulated devices: {args.layers} x Linear({args.width}, {args.width}) + sleep, {sizing['params'] / 1e6:.1f}M "
          f"parameters, fp32, AdamW ({sizing['kernel']} CPU path), {args.devices} CPU devices, {args.microbatches} "
          f"microbatches of {args.rows} samples, plan {plan_shape(args.plan)}, torch threads {args.threads}")
    span, host = calibration["span_s"], calibration["host_step_s"]
    print(f"Host step: {sizing['ns_per_param']:.2f} ns/param measured alone -> {1e3 * sizing['measured_step_s']:.0f} ms; "
          f"sleeps {args.forward_ms:.2f} ms forward, {args.forward_ms * args.backward_factor:.2f} ms backward per layer "
          f"and microbatch. Calibration (engine alone, sync{', streaming off' if STREAMING else ''}): compute span "
          f"{1e3 * span:.0f} ms, host step {1e3 * host:.0f} ms = {host / span:.0%} of it, {1e3 * calibration['period_s']:.0f} "
          f"ms/step; forward stages and the fused stage start "
          f"{', '.join(f'{1e3 * o:.0f}' for o in calibration['offsets_s'])} ms after forward stage 0")
    streaming = ("streaming_step found: sync runs with its default, and with 'off' as a variant" +
                 ("" if STRATEGY_STREAMING else " (set in engine_options: the strategy takes no such keyword yet)")
                 if STREAMING else "no streaming_step option in this version: sync steps whole between iterations")
    sleeps = simulated_span(args) * args.forward_ms / 1e3
    if sleeps < span - sleeps:
        print(f"Note: the sleeps are {1e3 * sleeps:.0f} ms of the {1e3 * span:.0f} ms span: the stand-in devices' own host "
              "work (copies, gradient sums, hand-offs) is most of it, so the emulation is weak on this machine now")
    print(f"{streaming}. {args.repeats} interleaved rounds x {len(CONFIGS)} configurations x {len(variants)} "
          f"variants (+ {len(TIMED)} with a timer callback without clipping); per run {args.warmup} warm-up + "
          f"{args.steps} measured steps")
    rounds: dict[str, list[dict[str, dict[str, Any]]]] = {config: [] for config in CONFIGS}
    for index in range(args.repeats):
        for config in CONFIGS:
            row = {variant: run_once(variant, config != "no clip", args)
                   for variant in run_order(per_config[config], swap=index % 2 == 1)}
            rounds[config].append(row)
            print(f"  round {index + 1}, {config:>8}: " + "  ".join(
                f"{variant} {1e3 * row[variant]['median_step_s']:6.1f} ms" for variant in per_config[config]),
                flush=True)

    summary = {config: summarize(rounds[config], per_config[config]) for config in CONFIGS}
    print()
    print("| configuration | variant | ms/step | samples/s | vs async (min..max) | host step ms | exposed ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for config in CONFIGS:
        for entry in (summary[config][variant] for variant in per_config[config]):
            low, high = entry["ratio_vs_async_range"]
            print(f"| {config} | {entry['name']} | {entry['median_ms_per_step']:.1f} | {entry['median_samples_per_s']:.1f} | "
                  f"{entry['ratio_vs_async']:.3f} ({low:.2f}..{high:.2f}) | {entry['host_step_ms']:.1f} | "
                  f"{entry['exposed_ms']:.1f} |")
    no_clip, clip = summary["no clip"], summary["clip 1.0"]
    refs = {config: summary[config]["reference"] for config in CONFIGS}
    print(f"\n'vs async': against the faster async variant of each configuration ({'; '.join(f'{c}: {NAMES[r]}' for c, r in refs.items())}), "
          "per round, median (min..max)")
    ref = no_clip[refs["no clip"]]
    print(f"Host step / async step period (no clip, measured in the runs): {ref['host_step_ms'] / ref['median_ms_per_step']:.0%}")
    ratio = no_clip["sync"]["ratio_vs_async"]
    print(f"Verdict, no clipping: sync/async {ratio:.2f} (target >= {TARGET}) {'MET' if ratio >= TARGET else 'NOT MET'}")
    groups = group_parameters(make_trunk(args), args.plan)  # built once: both bounds weigh the same groups
    summary["no clip bound"] = no_clip_bound(groups, no_clip, refs["no clip"], variants)
    summary["timer callback"] = timer_verdict(rounds["no clip"], no_clip["reference"])
    if "async_off" in variants:
        print("  async with streaming_step 'auto' against 'off': "
              f"{statistics.median(r['async']['samples_per_s'] / r['async_off']['samples_per_s'] for r in rounds['no clip']):.2f}"
              " (no clip), "
              f"{statistics.median(r['async']['samples_per_s'] / r['async_off']['samples_per_s'] for r in rounds['clip 1.0']):.2f}"
              " (clip)")
    if "sync_nosync" in variants:
        for config in CONFIGS:
            with_wait, without = (summary[config][v]["median_ms_per_step"] for v in ("sync", "sync_nosync"))
            print(f"  {config}: the strategy's wait for each sync step costs {with_wait - without:.1f} "
                  f"ms/step ({with_wait:.1f} against {without:.1f} ms without it)")
    sync_step = min(clip[v]["host_step_ms"] for v in variants if v.startswith("sync"))  # the least contended
    clip_ref = clip[refs["clip 1.0"]]
    bound = clip_bound(groups, calibration["offsets_s"], sync_step / 1e3,
                       clip_ref["median_ms_per_step"] / 1e3, span)
    clip_ratio = clip["sync"]["ratio_vs_async"]
    waits = clip_ref["exposed_ms"]
    caveat = "" if waits <= 0.05 * clip_ref["median_ms_per_step"] else (
        f"; not a bound here: async waits {waits:.0f} ms/step for its steps")
    print(f"With clipping: sync/async {clip_ratio:.2f}, bound T_async/(T_async + exposed) {bound['ratio_bound']:.2f} "
          f"({clip_ratio / bound['ratio_bound']:.0%} of it{caveat}), strict bound T_async/(span + exposed) "
          f"{bound['strict_ratio_bound']:.2f}. Exposed step >= {1e3 * bound['exposed_bound_s']:.0f} ms: first group "
          f"{1e3 * bound['first_group_s']:.0f} ms, whole step {1e3 * bound['host_step_s']:.0f} ms against a forward span "
          f"of {1e3 * bound['forward_span_s']:.0f} ms; async period {1e3 * bound['async_period_s']:.0f} ms, compute span "
          f"{1e3 * span:.0f} ms [{time.perf_counter() - began:.0f} s]")
    if args.json is not None:
        config_out = {k: (plan_shape(v) if isinstance(v, Plan) else v) for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({
            "config": config_out, "streaming_step": STREAMING, "strategy_streaming_step": STRATEGY_STREAMING,
            "sizing": sizing, "calibration": calibration, "summary": summary, "clip_bound": bound, "rounds": rounds,
            "seconds": time.perf_counter() - began}, indent=2, default=str))


if __name__ == "__main__":
    try:
        main()
    except Exception as error:  # noqa: BLE001 - a benchmark, not a test: report and exit 0
        print(f"sync_async.py failed: {type(error).__name__}: {error}")
    sys.exit(0)

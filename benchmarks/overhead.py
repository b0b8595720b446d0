"""RoundPipe's per-step overhead on ONE CPU device: the engine against Lightning's single-device strategy.

Run: ``python benchmarks/overhead.py [--quick] [--json PATH]`` (default about 1.5-2.5 minutes on 2 cores,
``--quick`` about 15-25 s, ``--smoke`` seconds: one round of 2 measured steps of a width-32, 2-block
model). Not a test: it prints a table and a verdict and always exits 0. Model and batch flags (``--width``, ``--depth``, ``--context``, ``--batch``) change the size; the default (width
128, 4 blocks, context 64, batch 8) makes a step of (a)/(b) take about 35-50 ms on one core.

What is compared (the same byte GPT from ``lightning_roundpipe.app.model.gpt``, the same initial
weights, the same batches, AdamW, fp32, Lightning ``Trainer(max_steps=...)`` with no logger, no
checkpointing, no progress bar):

* ``(a) plain``: Lightning's ``SingleDeviceStrategy`` on the CPU, nothing recomputed.
* ``(b) checkpointed``: the same, with ``torch.utils.checkpoint`` around every transformer block (the
  embedding and the head are not wrapped). It does the FLOPs RoundPipe does: a backward stage
  recomputes its blocks' forward from a stage-boundary checkpoint, and the fused stage (the deepest
  layers and the loss) is never recomputed, like the head here.
* ``(c) roundpipe``: ``RoundPipeStrategy(num_microbatches=1, num_stages=1)`` on one CPU device, sync step, the
  loss fused with ``pipeline_loss`` (``ByteLM(fused=True)``): one forward stage, the head fused with the loss,
  and backward stages that recompute every layer before it, so the FLOPs are (b)'s (the embedding is
  recomputed too, which (b) does not wrap, a negligible difference). The planner sizes the backward stages
  as for a ring, each about as costly as the forward stage (at the default size four of them, so six jobs a
  step: the output's plan line shows them). The difference to (b) is the engine's
  own cost: per-stage parameter copies to the "device" and gradient copies back (real copies even on a CPU
  device), thread hand-offs between the main, worker, stream and optimizer threads, and bookkeeping.
  ``--num-stages auto`` lets the planner choose instead (on one device without a memory limit it weighs
  the measured fixed cost per job and fuses everything: then (c) recomputes nothing and the output says so).
* ``(d) roundpipe, no recompute``: the same with every layer in the fused stage (``num_stages=Plan((),
  range(0, layers), ())``): one job a step, nothing recomputed, so the FLOPs are (a)'s. What (d) adds to (a)
  is the engine's fixed cost per step: one stage's upload and gradient download, the hand-offs, the host step.

Targets: (c) runs at least 0.9x the speed of (b) (equal FLOPs, recomputed), (d) at least 0.85x the speed of
(a) (equal FLOPs, nothing recomputed).

Threads: the machine this was written for has 2 cores and other jobs may run beside it. Every variant
runs with ``torch.set_num_threads(1)`` (``--threads``): the setting is process-wide, so it also holds
for the engine's worker, stream and optimizer threads. On one device the engine's compute is serial
(one compute stream; the sync step's successor uploads wait for it), so each variant uses about one
core and the other core absorbs the engine's hand-off threads and any neighbour's noise, which then
hits all three variants alike.

Timing: per step, from one ``on_train_batch_start`` to the next (a callback). Start-to-start time is
the steady-state step period of every variant: it includes the data loading, the training step, the
optimizer step and Lightning's own per-batch work, and for RoundPipe also the optimizer step queued on
its thread (its ``on_train_batch_end`` can come before the queued step has run; the next batch's
uploads wait for it). Wall time over ``fit`` would include the Trainer's and engine's setup and
teardown, which are not per-step overheads. The first ``--warmup`` steps of every run are dropped
(allocator, first-call and planner warm-up: RoundPipe re-plans from measured times after a step).

``CPU ms/step`` is the process's CPU time (all threads) per step, from the same callback: less
sensitive to a busy machine than wall time, and for (c) it shows the work the engine's helper threads
add (copies, hand-offs), which on an idle machine can partly overlap the compute on the second core.
``switches/step`` counts the process's context switches per step (``getrusage``): voluntary ones (a thread
blocked: waiting for another thread's event or queue, or for the GIL) and involuntary ones (a thread preempted:
more runnable threads than cores). (a) and (b) run on one thread and make next to none; the engine's
hand-offs between its threads are each a voluntary switch and a wake-up, whose latency (tens of microseconds
on a virtual machine) a CPU stand-in device pays on its critical path.
``CPU ms/step by thread`` (Linux only, (c) and (d)): each thread's CPU time over the measured steps, from
``/proc/self/task``, the median over rounds: where the engine's extra CPU goes (its compute thread, the host
optimizer, the main thread's Lightning loop and dispatch, the copies and hand-offs of the stream threads). The
kernel counts it in clock ticks (10 ms), so a figure is exact to about 10 ms over the measured steps.
The verdict lines ((c)/(b) and (d)/(a)) add two cross-checks: by CPU time, and by each run's 10th-percentile step
time (noise from other processes only ever adds time, so the fastest steps are the least disturbed).

``--profile VARIANT`` (a, b, c or d) runs that variant once under ``cProfile`` on every thread, timed by each
thread's CPU time, and prints the package's functions by CPU milliseconds per measured step: where the engine's
fixed cost goes (the profiler inflates Python calls, so compare its figures with each other).

Repeats are interleaved (a, b, c, d, a, b, c, d, ...), each a fresh ``fit`` from the same initial weights, so
slow drift of the machine's load hits all variants alike. Per run the median step time gives
tokens/s; the table shows the median over repeats, and the ratios are medians of the per-repeat
ratios (each taken between runs of the same round), with their min..max over the rounds.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import os
import pstats
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from common import add_smoke, quiet, sized  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_roundpipe import Plan, RoundPipeStrategy  # noqa: E402
from lightning_roundpipe.app.data import stdlib_bytes  # noqa: E402
from lightning_roundpipe.app.model import Block, ByteLM, gpt  # noqa: E402

VARIANTS = ("a", "b", "c", "d")
NAMES = {"a": "(a) plain single-device", "b": "(b) single-device + ckpt", "c": "(c) roundpipe, 1 device",
         "d": "(d) roundpipe, no recompute"}
TARGET = 0.9  # (c) / (b)
TARGET_PLAIN = 0.85  # (d) / (a)


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (``torch.utils.checkpoint``)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.block(x)
        return checkpoint(self.block, x, use_reentrant=False)


CLOCK_TICK_S = 1 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
"""The unit of the kernel's per-thread CPU times (``/proc/self/task/*/stat``)."""


def thread_cpu_seconds() -> dict[str, float]:
    """Each live thread's CPU time so far (user + system), by thread name; empty where ``/proc`` does not have it."""
    seconds = {}
    for thread in threading.enumerate():
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
        except (OSError, IndexError):
            continue
        seconds[thread.name] = (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S  # utime, stime: fields 14, 15
    return seconds


class StepTimer(pl.Callback):
    """Times from one ``on_train_batch_start`` to the next; also samples the engine's compute counter and, given
    ``measured`` (the steps after the warm-up), each thread's CPU time at the first and the last measured start."""

    roundpipe_reads_gradients = False  # reads no gradient: RoundPipe need not gather them for this hook

    def __init__(self, warmup: int, measured: int | None = None) -> None:
        self.warmup = warmup
        self.measured = measured
        self.thread_cpu: list[dict[str, float]] = []  # at the first and the last measured start
        self.starts: list[float] = []
        self.cpu: list[float] = []  # process CPU time, all threads
        self.switches: list[tuple[int, int]] = []  # the process's context switches so far: voluntary, involuntary
        self.compute: list[float] = []
        self.engine = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())
        self.cpu.append(time.process_time())
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.switches.append((usage.ru_nvcsw, usage.ru_nivcsw))
        if self.measured is not None and len(self.starts) - 1 in (self.warmup, self.warmup + self.measured):
            self.thread_cpu.append(thread_cpu_seconds())
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.engine = engine
            self.compute.append(sum(device.counters.compute_seconds for device in engine.devices))

    def step_seconds(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.starts[self.warmup:])]

    def cpu_seconds(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.cpu[self.warmup:])]

    def thread_cpu_per_step(self) -> dict[str, float]:
        """CPU seconds per measured step of each thread alive at both ends of the measured steps, by thread name
        (empty without ``measured`` or ``/proc``)."""
        if len(self.thread_cpu) < 2 or not self.measured:
            return {}
        first, last = self.thread_cpu[0], self.thread_cpu[-1]
        return {name: (last[name] - first[name]) / self.measured for name in last if name in first}

    def switches_per_step(self) -> tuple[float, float]:
        """Median context switches per step of the process's threads: voluntary (a thread blocked: waiting for
        another thread, an event, the GIL) and involuntary (preempted: more runnable threads than cores)."""
        steps = list(itertools.pairwise(self.switches[self.warmup:]))
        return (statistics.median(b[0] - a[0] for a, b in steps), statistics.median(b[1] - a[1] for a, b in steps))

    def compute_share(self) -> float | None:
        """Share of the measured wall time the (one) device spent computing; None if not RoundPipe."""
        if len(self.compute) <= self.warmup + 1:
            return None
        busy = self.compute[-1] - self.compute[self.warmup]
        wall = self.starts[-1] - self.starts[self.warmup]
        return busy / wall if wall > 0 else None


class CpuProfile(pl.Callback):
    """``--profile``: ``cProfile`` of every thread, timed by each thread's CPU time (so a busy machine adds
    little), from the first measured step to the end of the fit. The engine's threads start before that: a
    light hook on each (``threading.setprofile``) starts its profiler at its first call once measuring."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.batches = 0
        self.profiles: list[cProfile.Profile] = []
        self._measuring = False
        self._lock = threading.Lock()
        threading.setprofile(self._gate)

    def _gate(self, frame, event, arg) -> None:
        if self._measuring:
            self._start()  # replaces this hook on this thread

    def _start(self) -> None:
        profile = cProfile.Profile(time.thread_time)
        with self._lock:
            self.profiles.append(profile)
        profile.enable()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches += 1
        if self.batches == self.warmup + 1:
            self._measuring = True
            self._start()

    def table(self, top: int = 16) -> str:
        """The package's functions by cumulative CPU ms per measured step (waits excluded)."""
        threading.setprofile(None)
        stats = pstats.Stats(*self.profiles)
        steps = max(self.batches - self.warmup, 1)
        rows = sorted(((cumulative, calls, path, name) for (path, _, name), (_, calls, _, cumulative, _)
                       in stats.stats.items()  # type: ignore[attr-defined]
                       if "lightning_roundpipe" in path and "wait" not in name), reverse=True)[:top]
        total = sum(entry[2] for entry in stats.stats.values())  # type: ignore[attr-defined]
        lines = [f"all threads, CPU ms/step: {1e3 * total / steps:.1f}", "| function | CPU ms/step | calls/step |",
                 "| --- | --- | --- |"]
        lines += [f"| `{path.split('lightning_roundpipe/')[-1]}:{name}` | "
                  f"{1e3 * cumulative / steps:.2f} | {calls / steps:.1f} |" for cumulative, calls, path, name in rows]
        return "\n".join(lines)


def make_batches(context: int, batch: int, count: int, seed: int = 0) -> DataLoader:
    """``count`` batches of random windows of the standard library's bytes, fixed once for every run."""
    data = stdlib_bytes(2_000_000)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - context - 1, (count * batch,), generator=generator)
    windows = torch.stack([data[s: s + context + 1] for s in starts.tolist()])
    return DataLoader(TensorDataset(windows[:, :-1], windows[:, 1:]), batch_size=batch, shuffle=False)


def make_module(variant: str, args: argparse.Namespace) -> ByteLM:
    torch.manual_seed(1234)  # the same initial weights for every variant and repeat
    net = gpt(width=args.width, depth=args.depth, heads=args.heads, context=args.context)
    if variant == "b":
        net = nn.Sequential(*[Checkpointed(layer) if isinstance(layer, Block) else layer for layer in net])
    return ByteLM(net, fused=True, context=args.context)


def run_once(variant: str, args: argparse.Namespace, profile: CpuProfile | None = None) -> dict:
    steps = args.warmup + args.steps + 1  # + 1: the last measured step ends at the next step's start
    module = make_module(variant, args)
    if variant in ("c", "d"):
        # (d): the embedding, the blocks and the head (trunk layers 0..depth + 1), all in the fused stage
        stages = (Plan((), range(0, args.depth + 2), ()) if variant == "d" else
                  args.num_stages if args.num_stages == "auto" else int(args.num_stages))
        strategy = RoundPipeStrategy(num_microbatches=1, num_stages=stages)
    else:
        strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    timer = StepTimer(args.warmup, args.steps)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[timer] if profile is None else [timer, profile])
    trainer.fit(module, make_batches(args.context, args.batch, steps))
    times = timer.step_seconds()
    median = statistics.median(times)
    result = {"variant": variant, "median_step_s": median, "tokens_per_s": args.batch * args.context / median,
              "median_cpu_s": statistics.median(timer.cpu_seconds()), "steps": len(times),
              "p10_step_s": statistics.quantiles(times, n=10)[0], "switches_per_step": timer.switches_per_step(),
              "thread_cpu_s": timer.thread_cpu_per_step()}
    if timer.engine is not None:
        result["compute_share"] = timer.compute_share()
        result["plan"] = plan_shape(timer.engine.plan)
        result["recomputed_blocks"] = recomputed_blocks(timer.engine.plan, args.depth)
    return result


def variant_label(variant: str) -> str:
    return NAMES[variant].split(" ", 1)[0]


def median_by_thread(per_run: list[dict[str, float]]) -> dict[str, float]:
    """CPU ms per step by thread (``StepTimer.thread_cpu_per_step`` of each run), the median over the runs that
    measured the thread, the largest first; the engine's threads named without their ``roundpipe-`` prefix,
    Lightning's thread as ``main``."""
    names = {name for measured in per_run for name in measured}
    medians = {}
    for name in names:
        values = [measured[name] for measured in per_run if name in measured]
        short = "main" if name == "MainThread" else name.removeprefix("roundpipe-")
        medians[short] = 1e3 * statistics.median(values)
    return dict(sorted(medians.items(), key=lambda item: -item[1]))


def by_thread_line(by_thread: dict[str, float], steps: int) -> str:
    """``median_by_thread``'s figures in one line, with the resolution of the kernel's clock over ``steps``."""
    return (f"CPU ms/step by thread (median over rounds, each to {1e3 * CLOCK_TICK_S / steps:.1f}): "
            + ", ".join(f"{name} {ms:.1f}" for name, ms in by_thread.items()))


def recomputed_blocks(plan, depth: int) -> int:
    """Transformer blocks (trunk layers 1..depth) the plan recomputes: those before its fused stage."""
    return len(range(1, min(plan.fused.start, depth + 1)))


def plan_shape_of(rounds: list[dict[str, dict]], variant: str) -> str:
    return "; ".join(sorted({r[variant]["plan"] for r in rounds}))


def plan_shape(plan) -> str:
    """Layers per stage: ``forward | fused | backward`` (backward deep to shallow)."""
    return (f"{','.join(str(len(r)) for r in plan.forward) or '-'} | {len(plan.fused)} | "
            f"{','.join(str(len(r)) for r in plan.backward) or '-'}")


def verdict(rounds: list[dict[str, dict]], summary: dict, num: str, den: str, target: float) -> str:
    """The verdict line of ``num``/``den`` against ``target``, with two cross-checks less sensitive to a busy
    machine (by CPU time, by each run's fastest-decile step), which also go into ``summary``."""
    ratio = summary[num][f"ratio_vs_{den}"]
    low, high = summary[num][f"ratio_vs_{den}_range"]
    cpu_ratio = statistics.median(r[den]["median_cpu_s"] / r[num]["median_cpu_s"] for r in rounds)
    fast_ratio = statistics.median(r[den]["p10_step_s"] / r[num]["p10_step_s"] for r in rounds)
    summary[f"cpu_ratio_{num}_vs_{den}"] = cpu_ratio
    summary[f"p10_ratio_{num}_vs_{den}"] = fast_ratio
    return (f"Verdict: ({num})/({den}) = {ratio:.3f} (median of {len(rounds)} paired rounds, {low:.2f}..{high:.2f}) "
            f"-> target >= {target} {'MET' if ratio >= target else 'NOT MET'}. Cross-checks: by CPU time "
            f"{cpu_ratio:.3f}, by the fastest-decile step {fast_ratio:.3f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 12 measured steps (under 40 s)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 11, quick 3, smoke 1)")
    parser.add_argument("--steps", type=int, default=None,
                        help="measured steps per run (default 30, quick 12, smoke 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps dropped per run (default 5, quick 3, smoke 1)")
    parser.add_argument("--width", type=int, default=None, help="(default 128, smoke 32)")
    parser.add_argument("--depth", type=int, default=None, help="(default 4, smoke 2)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=None, help="(default 64, smoke 16)")
    parser.add_argument("--batch", type=int, default=None, help="(default 8, smoke 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (process-wide)")
    parser.add_argument("--num-stages", default="1",
                        help="(c)'s num_stages: an int (default 1: recompute every block) or 'auto'")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--profile", choices=VARIANTS, default=None,
                        help="instead: one run of this variant under cProfile (CPU time, every thread), its top entries")
    add_smoke(parser, "one round of 2 measured steps of a width-32, 2-block model")
    args = parser.parse_args()
    args.repeats = sized(args.repeats, args, full=11, quick=3, smoke=1)
    args.steps = sized(args.steps, args, full=30, quick=12, smoke=2)
    args.warmup = sized(args.warmup, args, full=5, quick=3, smoke=1)
    args.width = sized(args.width, args, full=128, smoke=32)
    args.depth = sized(args.depth, args, full=4, smoke=2)
    args.context = sized(args.context, args, full=64, smoke=16)
    args.batch = sized(args.batch, args, full=8, smoke=4)
    return args


def summarize(rounds: list[dict[str, dict]], args: argparse.Namespace) -> dict:
    """Print the table of the medians over rounds, the plans used and a note when (c) recomputed less than (b);
    returns the summary."""

    def ratios(num: str, den: str) -> list[float]:
        return [r[num]["tokens_per_s"] / r[den]["tokens_per_s"] for r in rounds]

    summary = {}
    print()
    print(f"{'variant':<27} {'ms/step':>8} {'tokens/s':>9} {'vs (b)':>7} {'(min..max)':>12} {'vs (a)':>7} "
          f"{'(min..max)':>12} {'CPU ms/step':>12} {'switches/step':>14}")
    for variant in VARIANTS:
        tps = statistics.median(r[variant]["tokens_per_s"] for r in rounds)
        ms = 1e3 * statistics.median(r[variant]["median_step_s"] for r in rounds)
        cpu = 1e3 * statistics.median(r[variant]["median_cpu_s"] for r in rounds)
        voluntary, involuntary = (statistics.median(r[variant]["switches_per_step"][kind] for r in rounds)
                                  for kind in (0, 1))
        vb, va = ratios(variant, "b"), ratios(variant, "a")
        summary[variant] = {"name": NAMES[variant], "median_ms_per_step": ms, "median_tokens_per_s": tps,
                            "ratio_vs_b": statistics.median(vb), "ratio_vs_a": statistics.median(va),
                            "ratio_vs_b_range": [min(vb), max(vb)], "ratio_vs_a_range": [min(va), max(va)],
                            "median_cpu_ms_per_step": cpu, "switches_per_step": [voluntary, involuntary]}
        print(f"{NAMES[variant]:<27} {ms:8.1f} {tps:9.0f} {statistics.median(vb):7.3f} "
              f"{min(vb):5.2f}..{max(vb):<5.2f} {statistics.median(va):7.3f} {min(va):5.2f}..{max(va):<5.2f} {cpu:12.1f} {f'{voluntary:.0f} + {involuntary:.0f}':>14}")
    shares = [r["c"]["compute_share"] for r in rounds if r["c"].get("compute_share") is not None]
    if shares:
        print(f"\n(c) plans (layers per stage, forward | fused | backward): {plan_shape_of(rounds, 'c')}; (d): "
              f"{plan_shape_of(rounds, 'd')}. (c)'s device compute share of the step period: median "
              f"{statistics.median(shares):.2f} (the rest: copies, hand-offs, host step, Lightning)")
    for variant in ("c", "d"):
        by_thread = median_by_thread([r[variant].get("thread_cpu_s") or {} for r in rounds])
        if by_thread:
            summary[variant]["thread_cpu_ms_per_step"] = by_thread
            print(f"{variant_label(variant)} {by_thread_line(by_thread, args.steps)}")
    fewer = sorted({r["c"]["recomputed_blocks"] for r in rounds if r["c"].get("recomputed_blocks", args.depth) < args.depth})
    if fewer:
        print(f"Note: (c)'s last plans recomputed only {' or '.join(map(str, fewer))} of the {args.depth} blocks (b) "
              "recomputes (a larger fused stage): fewer FLOPs than (b); at equal FLOPs compare (c)/(a), or fix a "
              "recomputing plan with --num-stages")
    return summary


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    quiet()

    if args.profile is not None:
        profile = CpuProfile(args.warmup)
        result = run_once(args.profile, args, profile)
        print(f"{NAMES[args.profile]}, {result['steps']} measured steps under cProfile (CPU time; the profiler slows "
              f"Python calls):\n{profile.table()}")
        return 0
    began = time.perf_counter()
    params = sum(p.numel() for p in {id(p): p for p in gpt(args.width, args.depth, args.heads, args.context).parameters()}.values())
    print(f"Byte GPT: width {args.width}, depth {args.depth}, heads {args.heads}, context {args.context}, batch "
          f"{args.batch} ({args.batch * args.context} tokens/step), {params:,} parameters; fp32, AdamW; "
          f"torch threads {args.threads}")
    print(f"{args.repeats} interleaved rounds x (a, b, c, d); per run {args.warmup} warm-up + {args.steps} measured steps")
    rounds: list[dict[str, dict]] = []
    for index in range(args.repeats):
        row = {variant: run_once(variant, args) for variant in VARIANTS}
        rounds.append(row)
        print(f"  round {index + 1}: " + "  ".join(
            f"{v} {1e3 * row[v]['median_step_s']:6.1f} ms" for v in VARIANTS), flush=True)

    summary = summarize(rounds, args)
    elapsed = time.perf_counter() - began
    print(verdict(rounds, summary, "c", "b", TARGET) + f"; (c)/(a) = {summary['c']['ratio_vs_a']:.3f}")
    print(verdict(rounds, summary, "d", "a", TARGET_PLAIN) + f". [{elapsed:.0f} s]")
    if args.json is not None:
        args.json.write_text(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "json"},
                                         "summary": summary, "rounds": rounds, "seconds": elapsed}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

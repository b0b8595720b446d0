"""How long a device waits between consecutive backward jobs: the host's gradient sum on the ring's path or off it.

Run: ``python benchmarks/device_wait.py [--json PATH] [--before PATH]`` (about a minute on 2 cores; ``--smoke``
seconds: width 128, 4 layers, one measured step). Not a test: it prints a table and always exits 0.

What is measured. The engine alone (no Lightning) trains the emulated trunk of ``sync_async.py`` (its
:class:`~sync_async.EmulatedLayer`: a real ``Linear(width, width)`` beside a GIL-free sleep that stands for the
device's kernel time) on ``--devices`` CPU devices, ``--layers-per-stage`` layers per stage (``make_plan``), with
``--calls`` calls per optimizer step (gradient accumulation: every call after a step's first adds into the step's
sums, a pass over each gradient on the host) and SGD. From the engine's timeline: on each device, a job's compute
runs from its first compute event (a backward job's first recompute) to its last; the *wait* between two
consecutive jobs with gradients on one device (the fused job, then the backward jobs of the same call) is from the
first's compute end to the next's compute start. What fills it: the gradients' download, the next stage's
parameter upload (which waits until the stage two jobs back is released) and its input gradients (downloaded
behind the previous job's finish); with the sum on the download thread, also the host sum. The first
``--warmup`` steps are dropped; the table gives the median and the mean wait per pair, and the device's compute
per backward job for scale, each the median over ``--repeat`` engine runs. The defaults (width 2048, one
microbatch of one row) keep a stand-in device's own arithmetic small: its weight gradients are real host work on
the same cores as the host sum, which a GPU would not share, and they grow with the rows and microbatches.

Before and after. ``--json PATH`` writes the figures; ``--before PATH`` reads those of an earlier run (the same
script run against another commit: copy it into that checkout's ``benchmarks/`` and run it there, as
``sync_async.py`` is imported from the checkout the script sits in; where the package is installed in editable
mode from another checkout, set ``LIGHTNING_ROUNDPIPE_NO_AUTOLOAD=1`` and ``PYTHONPATH`` to that checkout) and
prints both rows with their ratio. The numbers are host-load dependent; the ratio of the two rows is what to read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import add_smoke, quiet, sized  # noqa: E402
from sync_async import make_plan, make_trunk  # noqa: E402

from lightning_roundpipe.engine.engine import RoundPipeEngine  # noqa: E402
from lightning_roundpipe.engine.options import EngineOptions  # noqa: E402

GRADIENT_KINDS = ("fused", "recompute", "backward")  # the compute events of jobs that produce gradients


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke(parser, "width 128, 4 layers, one measured step")
    parser.add_argument("--width", type=int, default=None, help="Linear width (default 2048)")
    parser.add_argument("--layers", type=int, default=None, help="trunk layers (default 8)")
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--rows", type=int, default=1, help="samples per microbatch")
    parser.add_argument("--calls", type=int, default=4, help="calls per optimizer step (gradient accumulation)")
    parser.add_argument("--forward-ms", type=float, default=0.5, help="emulated device time per layer forward")
    parser.add_argument("--backward-factor", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=None, help="measured optimizer steps (default 4)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=None, help="engine runs; each figure is their median (5)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--before", type=Path, default=None, help="figures of an earlier run (--json), compared")
    args = parser.parse_args(argv)
    args.width = sized(args.width, args, full=2048, smoke=128)
    args.layers = sized(args.layers, args, full=8, smoke=4)
    args.steps = sized(args.steps, args, full=4, smoke=1)
    args.repeat = sized(args.repeat, args, full=5, smoke=1)
    return args


def job_spans(events: list[Any], after: float) -> dict[int, list[tuple[float, float, str]]]:
    """Per device, its jobs' compute spans ``(start, end, kind)`` in order, of the jobs that start after ``after``."""
    jobs: dict[tuple[int, int], list[Any]] = {}
    for event in events:
        if event.kind in ("forward", *GRADIENT_KINDS) and event.device is not None and event.job is not None:
            jobs.setdefault((event.device, event.job), []).append(event)
    spans: dict[int, list[tuple[float, float, str]]] = {}
    for (device, _), parts in jobs.items():
        start = min(part.start for part in parts)
        if start >= after:
            kind = "grad" if any(part.kind in GRADIENT_KINDS for part in parts) else "forward"
            spans.setdefault(device, []).append((start, max(part.end for part in parts), kind))
    return {device: sorted(found) for device, found in spans.items()}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    trunk = make_trunk(args)
    optimizer = torch.optim.SGD(trunk.parameters(), lr=1e-4)
    options = EngineOptions(num_microbatches=args.microbatches, num_stages=make_plan(args.layers, args.layers_per_stage),
                            record_timeline=True, seed=0)
    generator = torch.Generator().manual_seed(0)
    samples = args.microbatches * args.rows
    waits: list[float] = []
    computes: list[float] = []
    with RoundPipeEngine(trunk, args.devices, options) as engine:
        measured_from = float("inf")
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                engine.synchronize()
                measured_from = engine.timeline.now()
            for _ in range(args.calls):
                x = torch.randn(samples, args.width, generator=generator)
                engine.forward_backward(x, torch.randn(samples, args.width, generator=generator), F.mse_loss,
                                        scale=1 / args.calls)
            engine.step(optimizer)
        engine.synchronize()
        for spans in job_spans(engine.events(), measured_from).values():
            for (start, end, kind), (next_start, _, next_kind) in zip(spans, spans[1:], strict=False):
                if kind == "grad":
                    computes.append(end - start)
                    if next_kind == "grad":
                        waits.append(next_start - end)
    return {"label": args.label, "pairs": len(waits), "wait_median_ms": 1e3 * statistics.median(waits),
            "wait_mean_ms": 1e3 * statistics.fmean(waits), "compute_median_ms": 1e3 * statistics.median(computes)}


def main(argv: list[str] | None = None) -> None:
    quiet()
    args = parse(argv)
    torch.set_num_threads(args.threads)
    print(f"Device wait between consecutive backward jobs: width {args.width}, {args.layers} layers, "
          f"{args.layers_per_stage} per stage, {args.devices} CPU device(s), {args.microbatches} microbatches of "
          f"{args.rows} rows, {args.calls} calls per step, emulated {args.forward_ms:g} ms per layer forward "
          f"(x{args.backward_factor:g} backward), {args.steps} measured steps, {torch.get_num_threads()} thread(s); "
          f"each figure the median of {args.repeat} run(s)")
    started = time.perf_counter()
    runs = [measure(args) for _ in range(args.repeat)]
    figures = {name: statistics.median(run[name] for run in runs) if name != "label" else args.label
               for name in runs[0]}
    rows = [figures]
    if args.before is not None:
        rows.insert(0, json.loads(args.before.read_text()))
    print(f"{'run':<28} {'pairs':>5} {'wait median ms':>15} {'wait mean ms':>13} {'backward job ms':>16}")
    for row in rows:
        print(f"{row['label']:<28} {row['pairs']:>5} {row['wait_median_ms']:>15.2f} {row['wait_mean_ms']:>13.2f} "
              f"{row['compute_median_ms']:>16.2f}")
    if len(rows) == 2:
        print(f"wait before/after: {rows[0]['wait_median_ms'] / max(rows[1]['wait_median_ms'], 1e-9):.2f}x (median), "
              f"{rows[0]['wait_mean_ms'] / max(rows[1]['wait_mean_ms'], 1e-9):.2f}x (mean)")
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()

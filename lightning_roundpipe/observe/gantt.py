"""Pictures of pipelines: Gantt charts (PNG) of recorded timelines and of simulated schedules.

:func:`draw_timeline` draws what the engine recorded (:class:`~lightning_roundpipe.observe.trace.TimelineEvent`,
``record_timeline=True`` or the strategy's ``timeline_dir``); :func:`draw_schedule` draws what
:mod:`.simulate` planned. One row per device (and one for the host optimizer), bars coloured by
kind, time on the x axis. Needs matplotlib (``pip install 'lightning_roundpipe[plot]'``), imported
only when something is drawn, with the Agg backend (no display).

Command line (the pure :mod:`.schedule` module cannot draw: it imports nothing outside the standard
library, so the drawing command lives here and takes the same schedule options)::

    python -m lightning_roundpipe.observe.gantt schedule --layers 12 --devices 4 --png schedule.png
    python -m lightning_roundpipe.observe.gantt schedule --paper Llama3-8B --png llama.png
    python -m lightning_roundpipe.observe.gantt trace outputs/.../timeline.json --png timeline.png
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from lightning_roundpipe.observe.trace import COMPUTE_KINDS, HOST_OPTIMIZER, TimelineEvent, load_chrome_trace
from lightning_roundpipe.planning.cli import CALLS, add_cli_arguments, plan_from_cli
from lightning_roundpipe.planning.partition import LayerCost, Plan
from lightning_roundpipe.planning.schedule import default_microbatches, format_plan, validate
from lightning_roundpipe.planning.simulate import (
    SimResult,
    SimulatedEvent,
    simulate_jobs,
    simulate_paper_roundpipe,
    simulate_roundpipe,
)

INSTALL_HINT = "pip install 'lightning_roundpipe[plot]'"

KIND_COLORS = {
    "forward": "#4C78A8",        # blue
    "fused": "#8E5EA2",          # purple
    "backward": "#E45756",       # red
    "recompute": "#F4A582",      # light red: a backward stage recomputing its forward
    "upload_params": "#54A24B",  # green
    "upload_acts": "#A0D68E",    # light green
    "allreduce": "#72B7B2",      # teal: gradients averaged across processes
    "broadcast": "#B279A2",      # mauve: updated weights sent by their owners (sharded optimizer)
    "download": "#9D9D9D",       # grey
    "release": "#D0D0D0",        # light grey: gradients to the host, memory released
    "optimizer": "#B07A3B",      # brown
}
KIND_NAMES = {
    "forward": "forward", "fused": "fused (fwd + loss + bwd)", "backward": "backward",
    "recompute": "recompute", "upload_params": "upload params", "upload_acts": "upload activations",
    "download": "download", "release": "gradients + release", "optimizer": "optimizer step",
    "allreduce": "gradients averaged across processes", "broadcast": "updated weights broadcast",
}
_OTHER_COLOR = "#F2CF5B"
# lanes of a row (its centre at y = row): (offset of the top edge, height); y grows downwards
_LANES = {"params": (-0.48, 0.09), "acts": (-0.38, 0.08), "main": (-0.28, 0.56), "bottom": (0.3, 0.13)}
_LANE_OF_KIND = {"upload_params": "params", "upload_acts": "acts", "download": "bottom", "release": "bottom",
                 "allreduce": "bottom", "broadcast": "bottom"}


class _Bar(NamedTuple):
    row: int
    lane: str
    start: float
    end: float
    kind: str
    text: str


def _matplotlib() -> tuple[Any, Any, Any]:
    """``Figure``, ``FigureCanvasAgg`` and ``Patch``, or an ImportError that says what to install."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError(f"drawing a PNG needs matplotlib: {INSTALL_HINT}") from error
    return Figure, FigureCanvasAgg, Patch


def _render(rows: Sequence[str], bars: Sequence[_Bar], path: str | os.PathLike[str], *, title: str,
            xlabel: str, marks: Sequence[float] = ()) -> None:
    Figure, FigureCanvasAgg, Patch = _matplotlib()
    span = max((b.end for b in bars), default=1.0) or 1.0
    width_in, dpi = 14.0, 110
    height_in = min(2.0 + 0.6 * len(rows), 40.0)
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)  # Agg: renders to a file, no display
    ax = fig.add_subplot(1, 1, 1)
    groups: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
    for bar in bars:
        groups.setdefault((bar.row, bar.lane, bar.kind), []).append((bar.start, max(bar.end - bar.start, 0.0)))
    for (row, lane, kind), spans in groups.items():
        top, height = _LANES[lane]
        ax.broken_barh(spans, (row + top, height), facecolors=KIND_COLORS.get(kind, _OTHER_COLOR),
                       edgecolor="white" if lane == "main" else "none", linewidth=0.4)
    # label the bars that are wide enough for their text (about 6 px per character at size 6)
    px_per_unit = width_in * dpi * 0.8 / span
    for bar in bars:
        if bar.text and (bar.end - bar.start) * px_per_unit >= 5.5 * len(bar.text) + 4:
            ax.text((bar.start + bar.end) / 2, bar.row, bar.text, ha="center", va="center", fontsize=6,
                    color="white", clip_on=True)
    for t in marks:
        ax.axvline(t, color="black", linewidth=0.8, linestyle="--", alpha=0.6)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=11)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    ax.set_axisbelow(True)
    present = list(dict.fromkeys(b.kind for b in bars))
    ordered = [k for k in KIND_COLORS if k in present] + [k for k in present if k not in KIND_COLORS]
    handles = [Patch(facecolor=KIND_COLORS.get(k, _OTHER_COLOR), label=KIND_NAMES.get(k, k)) for k in ordered]
    if handles:
        below = 0.6 / (0.77 * height_in)  # about 0.6 in under the axes: clear of the tick labels and x label
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -below),
                  ncol=min(len(handles), 5), fontsize=8, frameon=False)
    fig.savefig(os.fspath(path), format="png", bbox_inches="tight")


def draw_timeline(events: Iterable[TimelineEvent], path: str | os.PathLike[str], *, title: str | None = None,
                  num_devices: int | None = None) -> None:
    """Draw recorded engine events as a PNG at ``path``: one row per device (compute in the middle,
    parameter and activation uploads in two thin lanes above, downloads below) and one for the host
    optimizer, time in ms from the first event. ``num_devices`` also shows devices that recorded nothing."""
    events = sorted(events, key=lambda e: e.start)
    origin = events[0].start if events else 0.0
    devices = sorted({e.device for e in events if e.device is not None} | set(range(num_devices or 0)))
    has_optimizer = any(e.device is None for e in events)
    rows = [f"device {d}" for d in devices] + ([HOST_OPTIMIZER] if has_optimizer else [])
    row_of = {d: i for i, d in enumerate(devices)}
    bars = []
    for e in events:
        row = len(devices) if e.device is None else row_of[e.device]  # the host's row last
        lane = _LANE_OF_KIND.get(e.kind, "main")
        text = f"{e.label}.{e.microbatch}" if e.kind in COMPUTE_KINDS else e.label if e.kind == "optimizer" else ""
        bars.append(_Bar(row, lane, (e.start - origin) * 1e3, (e.end - origin) * 1e3, e.kind, text))
    if title is None:
        span = max((e.end for e in events), default=origin) - origin
        busy = sum(e.end - e.start for e in events if e.kind in COMPUTE_KINDS)
        idle = 1.0 - busy / (span * len(devices)) if span > 0 and devices else 0.0
        title = (f"RoundPipe timeline: {len(devices)} devices, {span * 1e3:.1f} ms, "
                 f"compute idle {idle:.0%}")
    _render(rows, bars, path, title=title, xlabel="time (ms)")


def _schedule_kind(event: SimulatedEvent) -> str:
    if event.label.startswith("L"):
        return "fused"
    if event.phase == "recompute":
        return "recompute"
    return "backward" if event.phase == "bwd" else "forward"


def draw_schedule(result: SimResult | Sequence[SimulatedEvent], path: str | os.PathLike[str], *,
                  title: str | None = None, unit: str = "cost units", num_devices: int | None = None) -> None:
    """Draw a simulated schedule (a :class:`~lightning_roundpipe.planning.simulate.SimResult`, or its events) as
    a PNG at ``path``: one row per device, a bar per phase of each job's microbatch (forward, fused,
    recompute, backward), in the costs' ``unit``. Iteration ends of a multi-iteration result are dashed
    lines."""
    events = list(result.events if isinstance(result, SimResult) else result)
    n = num_devices or (result.num_devices if isinstance(result, SimResult) else 0)
    n = max(n, max((e.device for e in events), default=-1) + 1)
    bars = [_Bar(e.device, "main", e.start, e.end, _schedule_kind(e),
                 "" if e.phase == "recompute" else f"{e.label}.{e.microbatch}") for e in events]
    marks: Sequence[float] = ()
    if isinstance(result, SimResult):
        if len(result.iteration_ends) > 1:
            marks = result.iteration_ends
        if title is None:
            title = (f"Simulated schedule: {n} devices, makespan {result.makespan:,.1f} {unit}, "
                     f"bubble {result.bubble_ratio:.1%}")
    _render([f"device {d}" for d in range(n)], bars, path, title=title or "Simulated schedule",
            xlabel=f"time ({unit})", marks=marks)


# ---------------------------------------------------------------------------- command line
_PAPER_JSON = pathlib.Path(__file__).resolve().with_name("paper_profiles.json")  # shipped with the package


def _paper_model(path: str | None, name: str) -> tuple[list[LayerCost], Plan, int, int, float]:
    """Costs (the LM head as the last layer), the paper's plan, devices, microbatches and hop of ``name``
    from the paper's figures (``paper_profiles.json`` beside this module, or ``--paper-json``)."""
    source = pathlib.Path(path) if path else _PAPER_JSON
    if not source.is_file():
        raise ValueError(f"--paper needs the paper's figures: {source} does not exist; pass --paper-json PATH "
                         "in the format of lightning_roundpipe/observe/paper_profiles.json")
    sim = json.loads(source.read_text())["simulation"]
    models = sim["models"]
    if name not in models:
        raise ValueError(f"--paper {name!r} is not one of {', '.join(models)}")
    m = models[name]
    costs = [LayerCost(m["fwd"], m["bwd"])] * m["layers"] + [LayerCost(m["lm_head_fwd"], m["lm_head_bwd"])]
    partition = sim["paper_partitions_fwd_bwd_layers_per_stage"][name]
    fwd, bwd = ([int(x) for x in part.split(",")] for part in partition.split("|"))
    plan = Plan.from_sizes(fwd, 1, bwd[1:])  # bwd[0] = 0: the fused stage is the LM head alone
    return costs, plan, sim["num_devices"], sim["num_microbatches"], float(m["comm"])


def _schedule_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        unit = args.unit
        if args.paper is not None:
            costs, paper_plan, devices, micro, hop = _paper_model(args.paper_json, args.paper)
            if args.layers is not None and args.layers != len(costs):
                raise ValueError(f"--layers {args.layers} does not fit {args.paper}: {len(costs)} layers with the "
                                 "LM head")
            args.layers = len(costs)
            args.devices = args.devices if args.devices is not None else devices
            micro = args.microbatches if args.microbatches is not None else micro
            hop = args.hop if args.hop is not None else hop
            unit = unit or "ms"
            plan = paper_plan if args.plan is None and args.stages is None else plan_from_cli(args, costs)
        else:
            if args.layers is None or args.devices is None:
                raise ValueError("give --layers and --devices (or --paper MODEL)")
            costs = [LayerCost(args.forward_cost, args.backward_cost)] * max(args.layers, 0)
            plan = plan_from_cli(args, costs)
            micro = args.microbatches if args.microbatches is not None else default_microbatches(args.devices)
            hop = args.hop if args.hop is not None else 0.0
        if args.iterations < 1:
            raise ValueError(f"--iterations must be >= 1, got {args.iterations}")
        if args.simulator == "paper":
            if args.path != "training" or args.iterations != 1:
                raise ValueError("--simulator paper times one isolated training iteration: drop --path/--iterations")
            result = simulate_paper_roundpipe(plan, costs, args.devices, micro, hop)
            what = "the paper's simulator, one isolated training iteration"
        elif args.iterations > 1:
            if args.path != "training":
                raise ValueError("--iterations > 1 needs --path training")
            result = simulate_roundpipe(plan, costs, args.devices, micro, hop, iterations=args.iterations,
                                        mode=args.mode)
            what = f"{args.iterations} {args.mode} training iterations"
        else:
            jobs = CALLS[args.path](plan, args.devices, micro, args.first_index)
            validate(jobs, args.layers, args.devices)
            result = simulate_jobs(jobs, costs, args.devices, hop)
            what = f"one {args.path} call"
    except ValueError as err:
        parser.error(str(err))
    unit = unit or "cost units"
    name = f"{args.paper}: " if args.paper else ""
    title = (f"{name}{what}, {args.devices} devices, {micro} microbatches: makespan {result.makespan:,.1f} {unit}, "
             f"bubble {result.bubble_ratio:.1%}")
    draw_schedule(result, args.png, title=title, unit=unit)
    print(format_plan(plan))
    print(f"\n{what}: {args.devices} devices, {micro} microbatches, makespan {result.makespan:,.2f} {unit}, "
          f"bubble {result.bubble_ratio:.1%}")
    print(f"wrote {args.png}")
    return 0


def _trace_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        events = load_chrome_trace(args.trace)
    except (OSError, ValueError, KeyError) as err:
        parser.error(f"cannot read {args.trace}: {err}")
    draw_timeline(events, args.png)
    print(f"wrote {args.png} ({len(events)} events)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_roundpipe.observe.gantt {schedule,trace} ... --png FILE``."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_roundpipe.observe.gantt",
        description=f"Draw RoundPipe pipelines as Gantt charts (PNG; needs matplotlib: {INSTALL_HINT}).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    schedule = commands.add_parser(
        "schedule", help="simulate and draw a planned schedule",
        description="Simulate a RoundPipe schedule (the runtime's ring order; lightning_roundpipe.planning.simulate) "
        "and draw it. Options as `python -m lightning_roundpipe.planning.schedule`, plus per-layer costs, or a model "
        "of the paper (its costs, partition, 8 devices and 16 microbatches).")
    add_cli_arguments(schedule, required=False)
    schedule.add_argument("--forward-cost", type=float, default=1.0, help="forward time per layer and microbatch")
    schedule.add_argument("--backward-cost", type=float, default=2.0,
                          help="backward time per layer and microbatch, recompute excluded")
    schedule.add_argument("--hop", type=float, default=None, help="delay of a stage boundary between devices")
    schedule.add_argument("--iterations", type=int, default=1, help="training iterations back to back")
    schedule.add_argument("--mode", choices=("async", "sync"), default="async",
                          help="with --iterations: may an iteration start before the previous one ended")
    schedule.add_argument("--paper", metavar="MODEL", help="a model of the paper's figures, e.g. Llama3-8B")
    schedule.add_argument("--paper-json", metavar="PATH", help="the paper's figures (default: "
                          "lightning_roundpipe/observe/paper_profiles.json)")
    schedule.add_argument("--simulator", choices=("runtime", "paper"), default="runtime",
                          help="our runtime's order, or the paper's simulator (rounds of N microbatches)")
    schedule.add_argument("--unit", default=None, help="name of the time unit on the axis (--paper: ms)")
    schedule.add_argument("--png", required=True, help="the picture to write")
    trace = commands.add_parser("trace", help="draw a Chrome trace written by the engine",
                                description="Draw a timeline.json written by RoundPipeStrategy(timeline_dir=...) "
                                "or lightning_roundpipe.observe.trace.to_chrome_trace.")
    trace.add_argument("trace", help="the Chrome trace JSON")
    trace.add_argument("--png", required=True, help="the picture to write")
    args = parser.parse_args(argv)
    try:
        if args.command == "schedule":
            return _schedule_command(args, schedule)
        return _trace_command(args, trace)
    except ImportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

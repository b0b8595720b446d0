"""The schedule's command line: ``python -m lightning_roundpipe.planning --layers 10 --devices 2``.

Prints a plan and the ring schedule of one call as an ASCII grid. Pure, like the rest of
:mod:`lightning_roundpipe.planning`: it starts in milliseconds and never imports torch. The options are
shared with the drawing command (``python -m lightning_roundpipe.observe.gantt schedule``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from lightning_roundpipe.planning.partition import LayerCost, Plan, plan_auto, plan_chunks
from lightning_roundpipe.planning.schedule import (
    Job,
    backward_jobs,
    default_microbatches,
    format_grid,
    format_plan,
    forward_jobs,
    training_jobs,
    validate,
)


def _parse_plan(text: str) -> Plan:
    try:
        fwd, fused, bwd = (part.strip() for part in text.split("|"))
        sizes = [[int(x) for x in p.split(",") if x.strip()] for p in (fwd, bwd)]
        return Plan.from_sizes(sizes[0], int(fused), sizes[1])
    except ValueError as err:
        raise ValueError(
            f"--plan {text!r} is not 'forward sizes|fused size|backward sizes (deep to shallow)', "
            f"e.g. '3,3,3,2|1|1,1,1,1,1,1,1,1,1,1,1': {err}"
        ) from None


CALLS: dict[str, Callable[..., list[Job]]] = {
    "training": training_jobs, "forward": forward_jobs, "backward": backward_jobs}
"""The job builders by call (``--path``)."""


def add_cli_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """The schedule options of this module's command line, shared with the drawing command
    (``python -m lightning_roundpipe.observe.gantt schedule``)."""
    parser.add_argument("--layers", type=int, required=required, help="number of layers in the trunk")
    parser.add_argument("--devices", type=int, required=required, help="number of devices in the ring")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches per call (default: devices + 1, one device: 1)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--stages", type=int, help="number of forward stages (plan_chunks); default: plan_auto")
    group.add_argument("--plan", help="explicit plan 'fwd sizes|fused size|bwd sizes', bwd deep to shallow, "
                       "e.g. '3,3,3,2|1|1,1,1'")
    parser.add_argument("--path", choices=tuple(CALLS), default="training", help="which call to show")
    parser.add_argument("--first-index", type=int, default=0, help="ring counter at the start of the call")


def plan_from_cli(args: argparse.Namespace, costs: Sequence[LayerCost]) -> Plan:
    """The plan that :func:`add_cli_arguments`' options ask for, for per-layer ``costs``; raises
    ``ValueError`` with a message naming the option."""
    if args.layers < 1 or args.devices < 1:
        raise ValueError(f"--layers and --devices must be >= 1, got {args.layers} and {args.devices}")
    if args.plan is not None:
        plan = _parse_plan(args.plan)
        plan.validate(args.layers)
        return plan
    if args.stages is not None:
        return plan_chunks(costs, args.stages)
    return plan_auto(costs, num_devices=args.devices)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_roundpipe.planning``: print a plan and its ring schedule."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_roundpipe.planning",
        description="Print a RoundPipe plan and the ring schedule of one call as an ASCII grid "
        "(unit time per job per microbatch). Layers are assumed to cost the same (backward = 2x "
        "forward) unless --plan gives the partition.",
        epilog="For a picture of the simulated schedule (PNG, needs matplotlib), run "
        "`python -m lightning_roundpipe.observe.gantt schedule` with the same options plus --png FILE.",
    )
    add_cli_arguments(parser)
    # Drawing needs matplotlib, which this pure module never imports: point to the command that draws.
    parser.add_argument("--png", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.png is not None:
        parser.error("this command prints; to draw the schedule run `python -m lightning_roundpipe.observe.gantt "
                     "schedule` with the same options (--png included)")
    try:
        micro = args.microbatches if args.microbatches is not None else default_microbatches(args.devices)
        plan = plan_from_cli(args, [LayerCost(1.0, 2.0)] * max(args.layers, 0))
        jobs = CALLS[args.path](plan, args.devices, micro, args.first_index)
        validate(jobs, args.layers, args.devices)
    except ValueError as err:
        parser.error(str(err))
    print(format_plan(plan))
    print(f"\n{args.path} call: {len(jobs)} jobs on {args.devices} devices, {micro} microbatches each")
    print(format_grid(jobs, args.devices))
    return 0


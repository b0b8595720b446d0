"""Pipeline bubble on the paper's inputs (arXiv 2604.27085, Fig. 17): paper vs our simulator and planner.

Run: ``python benchmarks/bubble_paper.py [--json PATH] [--smoke]``. Not a test: it prints tables.
``--smoke``: the two smallest models only (the full run takes seconds too).

Inputs per model: L decoder layers (measured 4090 fwd/bwd per microbatch) plus the LM head as the
final layer (the embedding costs nothing and is left out), a per-hop cost, 8 devices, 16
microbatches, no memory limit and no optimizer time (the paper's figures exclude it).

Columns:
* ``paper``: the published figure.
* ``sim/paper-plan``: our re-implementation of the paper's simulator on the paper's partition
  (this checks the simulator; it should equal ``paper`` up to rounding).
* ``sim/our-plan``: the same simulator on ``plan_auto(costs, num_devices=8)``: planner vs planner.
* ``runtime/*``: our runtime's schedule with our plan and with the paper's: backward stages recompute
  ahead of their output gradient; ``sync`` is one isolated iteration in the dispatch
  ``choose_round_size`` picks (whole jobs or rounds, the runtime's ``round_size="auto"``). ``async``
  runs whole jobs (as the runtime does in async mode), two figures: the paper's definition (``switch +
  intra`` of one isolated iteration) and the measured steady state of a run of N + 3 iterations (2
  warm-up iterations, then a whole rotation of the ring).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import add_smoke  # noqa: E402

from lightning_roundpipe.planning.partition import LayerCost, Plan, plan_auto  # noqa: E402
from lightning_roundpipe.planning.simulate import (  # noqa: E402
    choose_round_size,
    simulate_1f1b,
    simulate_gpipe,
    simulate_paper_roundpipe,
    simulate_roundpipe,
)

DEFAULT_JSON = ROOT / "lightning_roundpipe" / "observe" / "paper_profiles.json"


def sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def model_inputs(sim: dict, name: str) -> tuple[list[LayerCost], Plan, list[int], float]:
    p = sim["models"][name]
    costs = [LayerCost(p["fwd"], p["bwd"])] * p["layers"] + [LayerCost(p["lm_head_fwd"], p["lm_head_bwd"])]
    fwd, bwd = (sizes(part) for part in sim["paper_partitions_fwd_bwd_layers_per_stage"][name].split("|"))
    if bwd[0] != 0:
        raise ValueError(f"{name}: expected the fused stage to be the LM head alone, got bwd[0] = {bwd[0]}")
    plan = Plan.from_sizes(fwd, 1, bwd[1:])
    baseline = sizes(sim["baseline_partitions_one_stage_per_device"][name])
    baseline[-1] += 1  # the LM head sits on the last device
    return costs, plan, baseline, p["comm"]


def pct(x: float) -> str:
    return f"{100 * x:6.2f}"


def shape(plan: Plan) -> str:
    """Layers per stage, run-length coded: ``1,9x3 | 1 | 1,3x9``."""

    def runs(stages: tuple[range, ...]) -> str:
        out: list[list[int]] = []
        for r in stages:
            if out and out[-1][0] == len(r):
                out[-1][1] += 1
            else:
                out.append([len(r), 1])
        return ",".join(f"{size}x{count}" if count > 1 else str(size) for size, count in out)

    return f"{runs(plan.forward)} | {len(plan.fused)} | {runs(plan.backward)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"the paper's reference figures (default {DEFAULT_JSON})")
    add_smoke(parser, "the two smallest models")
    args = parser.parse_args()
    ref = json.loads(args.json.read_text())["simulation"]
    if args.smoke:  # the paper's models in its order, smallest first
        ref["models"] = dict(list(ref["models"].items())[:2])
    n, m = ref["num_devices"], ref["num_microbatches"]
    rows = ref["bubble_ratio_percent"]
    spans = ref["makespan_ms"]

    print(f"Reproduction of the paper's simulator ({n} devices, {m} microbatches); bubble %, makespan ms")
    print(f"{'model':<12} {'schedule':<14} {'paper %':>8} {'ours %':>8} {'paper ms':>11} {'ours ms':>11}")
    for name in ref["models"]:
        costs, plan, baseline, hop = model_inputs(ref, name)
        g, o = simulate_gpipe(baseline, costs, m, hop), simulate_1f1b(baseline, costs, m, hop)
        r = simulate_paper_roundpipe(plan, costs, n, m, hop)
        for label, row, res, span_key, value in (
            ("GPipe", "GPipe", g, "GPipe", g.bubble_ratio),
            ("1F1B", "1F1B", o, "1F1B", o.bubble_ratio),
            ("RoundPipe-sync", "RoundPipe-sync (one isolated iteration)", r, "RoundPipe (one isolated iteration)", r.bubble_ratio),
            ("RoundPipe-async", "RoundPipe-async (steady state)", None, "", r.async_bubble_ratio),
        ):
            ms = f"{spans[span_key][name]:11.3f} {res.makespan:11.3f}" if res else ""
            print(f"{name:<12} {label:<14} {rows[row][name]:8.1f} {pct(value):>8} {ms}")
        split = ref["roundpipe_bubble_split_percent"][name]
        ours = (r.fill_ratio, r.switch_ratio, r.drain_ratio, r.intra_ratio)
        print(f"{'':<12} {'  split paper':<14} " + " ".join(f"{split[k]:.4f}" for k in ("fill", "switch", "drain", "intra")))
        print(f"{'':<12} {'  split ours':<14} " + " ".join(f"{100 * x:.4f}" for x in ours))

    print(f"\nPlanner and runtime, bubble % ({n} devices, {m} microbatches, unlimited memory)")
    print(
        f"{'model':<12} {'stages':>9} | {'sync: paper':>11} {'sim/paper':>9} {'sim/ours':>8} {'rt/ours':>7} {'rt/paper':>8} "
        f"| {'async: paper':>12} {'sim/paper':>9} {'sim/ours':>8} {'rt/ours':>7} {'steady':>6} {'rt/paper':>8} {'steady':>6}"
    )
    plans = {}
    for name in ref["models"]:
        costs, plan, _, hop = model_inputs(ref, name)
        ours = plan_auto(costs, num_devices=n)
        plans[name] = (plan, ours)
        sp, so = simulate_paper_roundpipe(plan, costs, n, m, hop), simulate_paper_roundpipe(ours, costs, n, m, hop)
        iters = n + 3
        rt_o = simulate_roundpipe(ours, costs, n, m, hop, iterations=iters, recompute_ahead=True)
        rt_p = simulate_roundpipe(plan, costs, n, m, hop, iterations=iters, recompute_ahead=True)
        one_o, one_p = (simulate_roundpipe(ours, costs, n, m, hop, recompute_ahead=True),
                        simulate_roundpipe(plan, costs, n, m, hop, recompute_ahead=True))
        sync_o, sync_p = (simulate_roundpipe(p, costs, n, m, hop, mode="sync", recompute_ahead=True,
                                             round_size=choose_round_size(p, costs, n, m, hop, recompute_ahead=True))
                          for p in (ours, plan))
        print(
            f"{name:<12} {plan.num_stages:>4}/{ours.num_stages:<4} | "
            f"{rows['RoundPipe-sync (one isolated iteration)'][name]:11.1f} {pct(sp.bubble_ratio):>9} {pct(so.bubble_ratio):>8} "
            f"{pct(sync_o.bubble_ratio):>7} {pct(sync_p.bubble_ratio):>8} | "
            f"{rows['RoundPipe-async (steady state)'][name]:12.1f} {pct(sp.async_bubble_ratio):>9} {pct(so.async_bubble_ratio):>8} "
            f"{pct(one_o.async_bubble_ratio):>7} {pct(rt_o.steady_bubble_ratio()):>6} "
            f"{pct(one_p.async_bubble_ratio):>8} {pct(rt_p.steady_bubble_ratio()):>6}"
        )
    print("\nstages = paper/ours (forward + fused + backward). rt = our runtime's schedule; steady = measured")
    print("async steady state. Partitions (layers per stage, forward | fused | backward deep->shallow):")
    for name, (plan, ours) in plans.items():
        print(f"  {name:<12} paper {shape(plan)}")
        print(f"  {'':<12} ours  {shape(ours)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

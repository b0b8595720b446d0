"""Where the pipeline bubble goes: the paper's model profiles under GPipe, 1F1B and our schedules.

Run: ``python benchmarks/bubble.py [--plot bubble.png] [--adam-ns-per-param 0.5]``. Not a test: it
prints tables (and draws a picture with ``--plot``, which needs matplotlib).

Inputs are the paper's measured per-layer costs (RTX 4090, ``lightning_roundpipe/observe/paper_profiles.json``); every
schedule is simulated with the same costs and per-hop time (``lightning_roundpipe.planning.simulate``):

1. 8 devices, 16 microbatches: GPipe and 1F1B on the paper's one-stage-per-device baselines, our
   runtime's sync and async schedules on our planner's partition (``plan_auto``), beside the paper's
   figures and stage counts. Async is the measured steady state of N + 3 iterations.
2. A sweep of devices and microbatches (one model): our sync bubble shrinks as microbatches grow and
   as the ring gets shorter, and async removes most of what is left.
3. The host optimizer: a step costing ``ns-per-param x parameters`` (AdamW on the CPU; the default is
   an assumption, measure yours) is exposed in sync mode (the next iteration waits for it) and hidden
   in async mode (it overlaps the next iteration). Shown as a share of the iteration.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bubble_paper import DEFAULT_JSON, model_inputs  # noqa: E402

from lightning_roundpipe.planning.partition import plan_auto  # noqa: E402
from lightning_roundpipe.planning.simulate import simulate_1f1b, simulate_gpipe, simulate_roundpipe  # noqa: E402


def parameters(name: str) -> float:
    """The parameter count in a profile's name: ``Qwen3-1.7B`` -> 1.7e9, ``GPT-OSS-20B`` -> 20e9."""
    match = re.search(r"(\d+(?:\.\d+)?)B", name)
    if match is None:
        raise ValueError(f"no parameter count in model name {name!r}")
    return float(match.group(1)) * 1e9


def pct(value: float) -> str:
    return f"{100 * max(value, 0.0):5.1f}"  # a steady state can round to -1e-12


def iteration_time(result, iterations: int) -> float:
    """Mean time per iteration after the first two (warm-up)."""
    ends = result.iteration_ends
    return (ends[-1] - ends[1]) / (iterations - 2)


def schedules_table(ref: dict) -> dict[str, dict[str, float]]:
    n, m = ref["num_devices"], ref["num_microbatches"]
    paper = ref["bubble_ratio_percent"]
    print(f"1. Bubble %, {n} devices, {m} microbatches (paper's costs; ours = our planner + runtime schedule)")
    print(f"{'model':<12} {'stages p/o':>10} {'GPipe':>6} {'1F1B':>6} | {'sync':>5} {'paper':>5} | "
          f"{'async':>5} {'paper':>5}")
    rows = {}
    for name in ref["models"]:
        costs, plan, baseline, hop = model_inputs(ref, name)
        ours = plan_auto(costs, num_devices=n)
        gpipe, one_f_one_b = simulate_gpipe(baseline, costs, m, hop), simulate_1f1b(baseline, costs, m, hop)
        sync = simulate_roundpipe(ours, costs, n, m, hop, mode="sync")
        steady = simulate_roundpipe(ours, costs, n, m, hop, iterations=n + 3).steady_bubble_ratio()
        rows[name] = {"gpipe": gpipe.bubble_ratio, "1f1b": one_f_one_b.bubble_ratio, "sync": sync.bubble_ratio,
                      "async": steady}
        print(f"{name:<12} {plan.num_stages:>4}/{ours.num_stages:<5} {pct(gpipe.bubble_ratio):>6} "
              f"{pct(one_f_one_b.bubble_ratio):>6} | {pct(sync.bubble_ratio):>5} "
              f"{paper['RoundPipe-sync (one isolated iteration)'][name]:5.1f} | {pct(steady):>5} "
              f"{paper['RoundPipe-async (steady state)'][name]:5.1f}")
    return rows


def sweep_table(ref: dict, name: str, devices: list[int], microbatches: list[int]) -> dict[int, list[tuple]]:
    costs, _, _, hop = model_inputs(ref, name)
    print(f"\n2. {name}: our sync / async-steady bubble % by devices (rows) and microbatches (columns)")
    print(f"{'devices':>7} " + " ".join(f"{f'M={m}':>11}" for m in microbatches))
    sweep: dict[int, list[tuple]] = {}
    for n in devices:
        plan = plan_auto(costs, num_devices=n)
        cells = []
        for m in microbatches:
            sync = simulate_roundpipe(plan, costs, n, m, hop, mode="sync").bubble_ratio
            steady = simulate_roundpipe(plan, costs, n, m, hop, iterations=n + 3).steady_bubble_ratio()
            cells.append((m, sync, steady))
        sweep[n] = cells
        print(f"{n:>7} " + " ".join(f"{pct(s)}/{pct(a)}".rjust(11) for _, s, a in cells))
    return sweep


def optimizer_table(ref: dict, ns_per_param: float) -> dict[str, tuple[float, float, float]]:
    n, m = ref["num_devices"], ref["num_microbatches"]
    iterations = 6
    print(f"\n3. Host optimizer step ({ns_per_param} ns/parameter) exposed per iteration, {n} devices, {m} microbatches")
    print(f"{'model':<12} {'step ms':>8} {'iter ms':>8} | {'sync exposed %':>14} {'async exposed %':>15}")
    rows = {}
    for name in ref["models"]:
        costs, _, _, hop = model_inputs(ref, name)
        plan = plan_auto(costs, num_devices=n)
        step_ms = parameters(name) * ns_per_param * 1e-6
        runs = {(mode, t): simulate_roundpipe(plan, costs, n, m, hop, iterations=iterations, mode=mode, optimizer_time=t)
                for mode in ("sync", "async") for t in (0.0, step_ms)}
        base = iteration_time(runs[("sync", 0.0)], iterations)
        sync = iteration_time(runs[("sync", step_ms)], iterations)
        # async: the step of iteration k runs beside iteration k+1 and is exposed only past it
        async_base = iteration_time(runs[("async", 0.0)], iterations)
        async_exposed = max(step_ms - async_base, 0.0) / max(step_ms, async_base)
        rows[name] = (step_ms, (sync - base) / sync, async_exposed)
        print(f"{name:<12} {step_ms:8.1f} {base:8.1f} | {pct((sync - base) / sync):>14} {pct(async_exposed):>15}")
    return rows


def draw(path: Path, sweep_model: str, schedules: dict, sweep: dict, optimizer: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    names = list(schedules)
    width = 0.2
    for offset, (key, label) in enumerate([("gpipe", "GPipe"), ("1f1b", "1F1B"), ("sync", "RoundPipe sync"),
                                           ("async", "RoundPipe async")]):
        left.bar([i + (offset - 1.5) * width for i in range(len(names))],
                 [100 * schedules[name][key] for name in names], width, label=label)
    left.set_xticks(range(len(names)), names, rotation=20)
    left.set_ylabel("bubble %")
    left.set_title("8 devices, 16 microbatches")
    left.legend()
    for n, cells in sweep.items():
        middle.plot([m for m, _, _ in cells], [100 * s for _, s, _ in cells], marker="o", label=f"{n} dev sync")
        middle.plot([m for m, _, _ in cells], [100 * a for _, _, a in cells], marker="x", linestyle="--",
                    label=f"{n} dev async")
    middle.set_xscale("log", base=2)
    middle.set_xlabel("microbatches")
    middle.set_ylabel("bubble %")
    middle.set_title(f"{sweep_model}: where the bubble vanishes")
    middle.legend(fontsize=7)
    right.bar([i - 0.2 for i in range(len(names))], [100 * optimizer[name][1] for name in names], 0.4, label="sync")
    right.bar([i + 0.2 for i in range(len(names))], [100 * optimizer[name][2] for name in names], 0.4, label="async")
    right.set_xticks(range(len(names)), names, rotation=20)
    right.set_ylabel("% of the iteration")
    right.set_title("host optimizer step, exposed")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\npicture: {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="the paper's profiles and figures")
    parser.add_argument("--sweep-model", default="Llama3-8B")
    parser.add_argument("--devices", default="2,4,8")
    parser.add_argument("--microbatches", default="4,8,16,32,64")
    parser.add_argument("--adam-ns-per-param", type=float, default=0.5,
                        help="host AdamW time per parameter (an assumption: ~32 bytes moved a parameter at ~64 GB/s)")
    parser.add_argument("--plot", type=Path, help="also draw the three panels into this PNG (needs matplotlib)")
    args = parser.parse_args()
    ref = json.loads(args.json.read_text())["simulation"]
    if args.sweep_model not in ref["models"]:
        parser.error(f"--sweep-model must be one of {sorted(ref['models'])}")
    schedules = schedules_table(ref)
    sweep = sweep_table(ref, args.sweep_model, [int(x) for x in args.devices.split(",")],
                        [int(x) for x in args.microbatches.split(",")])
    optimizer = optimizer_table(ref, args.adam_ns_per_param)
    if args.plot:
        draw(args.plot, args.sweep_model, schedules, sweep, optimizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())

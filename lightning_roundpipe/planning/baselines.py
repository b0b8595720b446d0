"""Weight-bound pipeline baselines: GPipe and 1F1B, one stage per device, timed on the simulated timeline to
compare RoundPipe's bubble against (``benchmarks/bubble.py``, ``benchmarks/bubble_paper.py``).

Pure module (standard library, :mod:`.plan`, :mod:`.simulated_timeline`). Backward ops recompute every layer
but the model's last (the loss head, kept from the forward).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_roundpipe.planning.plan import LayerCost
from lightning_roundpipe.planning.simulated_timeline import SimResult, _breakdown, _SimulatedTimeline


def _bound(stages: Sequence[int], costs: Sequence[LayerCost], num_microbatches: int) -> list[range]:
    if sum(stages) != len(costs) or any(s < 1 for s in stages):
        raise ValueError(f"stage sizes {list(stages)} must be positive and sum to the {len(costs)} layers")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    out, start = [], 0
    for s in stages:
        out.append(range(start, start + s))
        start += s
    return out


def _simulate_bound(
    programs: list[list[tuple[str, int]]], ranges: list[range], costs: Sequence[LayerCost], hop: float
) -> SimResult:
    """Weight-bound pipelines: device ``s`` holds stage ``s`` and runs ``programs[s]``, a list of
    ``("F" | "B", microbatch)``. F(s, m) needs F(s-1, m); B(s, m) needs B(s+1, m) (and its own F).
    Devices advance whenever their next op is ready; the resulting times do not depend on the
    order in which ready ops are committed."""
    n, last = len(ranges), len(costs) - 1
    tl = _SimulatedTimeline(n, hop)
    done: dict[tuple[str, int, int], float] = {}
    cursor = [0] * n
    remaining = sum(len(p) for p in programs)
    while remaining:
        progressed = False
        for s in range(n):
            if cursor[s] == len(programs[s]):
                continue
            kind, m = programs[s][cursor[s]]
            dep = ("F", s - 1, m) if kind == "F" else ("B", s + 1, m)
            need = [("F", s, m)] if kind == "B" else []
            if not all(k in done for k in need) or (0 <= dep[1] < n and dep not in done):
                continue
            deps = [(done[dep], dep[1])] if 0 <= dep[1] < n else []
            fwd = sum(costs[i].forward for i in ranges[s])
            if kind == "F":
                phases = (("fwd", 0.0), ("fwd", fwd))
            else:  # recompute everything but the loss head, whose activations the forward kept
                recompute = fwd - (costs[last].forward if last in ranges[s] else 0.0)
                phases = (("recompute", recompute), ("bwd", sum(costs[i].backward for i in ranges[s])))
            done[(kind, s, m)] = tl.place(s, f"{kind}{s}", s, m, phases, deps)
            cursor[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("weight-bound schedule deadlocked: no device's next op is ready")
    return _breakdown(tl, warmup_phase=True)


def simulate_gpipe(stages: Sequence[int], costs: Sequence[LayerCost], num_microbatches: int,
                   hop: float = 0.0) -> SimResult:
    """GPipe with ``len(stages)`` devices, device ``s`` holding ``stages[s]`` consecutive layers
    (sizes cover every layer of ``costs``; the loss head is the last). All forwards, then all
    backwards, microbatches in order."""
    ranges = _bound(stages, costs, num_microbatches)
    prog = [[("F", m) for m in range(num_microbatches)] + [("B", m) for m in range(num_microbatches)] for _ in ranges]
    return _simulate_bound(prog, ranges, costs, hop)


def simulate_1f1b(stages: Sequence[int], costs: Sequence[LayerCost], num_microbatches: int,
                  hop: float = 0.0) -> SimResult:
    """1F1B (PipeDream-flush, as PyTorch's ``Schedule1F1B``): device ``s`` runs ``min(M, N - s)``
    warm-up forwards, then alternates one backward and one forward, then the remaining backwards."""
    ranges = _bound(stages, costs, num_microbatches)
    n, m_total = len(ranges), num_microbatches
    prog: list[list[tuple[str, int]]] = []
    for s in range(n):
        warm = min(m_total, n - s)
        ops = [("F", m) for m in range(warm)]
        f, b = warm, 0
        while b < m_total:
            ops.append(("B", b))
            b += 1
            if f < m_total:
                ops.append(("F", f))
                f += 1
        prog.append(ops)
    return _simulate_bound(prog, ranges, costs, hop)

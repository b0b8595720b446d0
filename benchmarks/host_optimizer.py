"""The host optimizer: ns per parameter of torch's CPU kernels, and how far the fast ones are from the default.

Run: ``python benchmarks/host_optimizer.py [--params 20e6] [--threads 1,2] [--repeats 5] [--smoke]``. Not a
test: it prints two tables and always exits 0 (about 30 s on 2 cores with the defaults; ``--smoke``, seconds:
200K parameters, 2 timed steps on 1 thread, 12K elements for the exactness table).

1. Speed. fp32 parameters split into ``--tensors`` equal tensors (a model's layers), a random gradient in
   every ``param.grad``; one warm-up step allocates the state, then the best of ``--repeats`` timed steps
   gives ns per parameter, for each ``torch.set_num_threads`` in ``--threads``. Paths: ``default`` (the
   optimizer as constructed: on CPU parameters torch runs its single-tensor loop), ``foreach=True`` (the
   multi-tensor path; on CPU it loops over the tensors too) and ``fused=True`` (one pass per tensor in C++).
   ``--rounds`` repeats the table and keeps each cell's best, for a machine that other work shares.
   The host step of a model is about ``ns/param x trainable parameters``: that is what sync mode adds to
   every iteration, and what async mode must hide behind one.
2. Exactness. Five steps from the same start on 1M elements (three tensors, gradients of three
   magnitudes), ``fused=True`` against the default path: the largest difference in units in the last
   place (ulp; large only for elements near zero), the largest absolute difference (the parameters are of
   order one) and the share of elements that differ. RoundPipe's ``host_optimizer="exact"`` uses the fused
   kernel only where this is 0 (``lightning_roundpipe.engine.step.kernels``). ``ATEN_CPU_CAPABILITY=default``
   (or ``avx2``) in the environment runs both tables with that kernel set.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_smoke, sized  # noqa: E402

Factory = Callable[..., torch.optim.Optimizer]

SPEED: list[tuple[str, Factory, dict]] = [
    ("AdamW", lambda p, **kw: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, **kw), {}),
    ("AdamW", lambda p, **kw: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, **kw), {"foreach": True}),
    ("AdamW", lambda p, **kw: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, **kw), {"fused": True}),
    ("Adam", lambda p, **kw: torch.optim.Adam(p, lr=1e-3, **kw), {}),
    ("Adam", lambda p, **kw: torch.optim.Adam(p, lr=1e-3, **kw), {"fused": True}),
    ("SGD momentum=0.9", lambda p, **kw: torch.optim.SGD(p, lr=0.1, momentum=0.9, **kw), {}),
    ("SGD momentum=0.9", lambda p, **kw: torch.optim.SGD(p, lr=0.1, momentum=0.9, **kw), {"fused": True}),
    ("SGD", lambda p, **kw: torch.optim.SGD(p, lr=0.1, **kw), {}),
    ("SGD", lambda p, **kw: torch.optim.SGD(p, lr=0.1, **kw), {"fused": True}),
    ("SGD wd=0.01", lambda p, **kw: torch.optim.SGD(p, lr=0.1, weight_decay=0.01, **kw), {}),
    ("SGD wd=0.01", lambda p, **kw: torch.optim.SGD(p, lr=0.1, weight_decay=0.01, **kw), {"fused": True}),
]

EXACTNESS: list[tuple[str, Factory]] = [
    ("Adam", lambda p, **kw: torch.optim.Adam(p, lr=1e-3, **kw)),
    ("Adam weight_decay amsgrad", lambda p, **kw: torch.optim.Adam(p, lr=1e-3, weight_decay=0.1, amsgrad=True,
                                                                    **kw)),
    ("AdamW", lambda p, **kw: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, **kw)),
    ("AdamW maximize", lambda p, **kw: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, maximize=True, **kw)),
    ("SGD", lambda p, **kw: torch.optim.SGD(p, lr=0.1, **kw)),
    ("SGD weight_decay maximize", lambda p, **kw: torch.optim.SGD(p, lr=0.1, weight_decay=0.01, maximize=True,
                                                                    **kw)),
    ("SGD momentum", lambda p, **kw: torch.optim.SGD(p, lr=0.1, momentum=0.9, **kw)),
    ("SGD nesterov weight_decay", lambda p, **kw: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True,
                                                                    weight_decay=0.01, **kw)),
]


def ns_per_param(factory: Factory, flags: dict, total: int, tensors: int, repeats: int) -> float:
    size = total // tensors
    params = [torch.nn.Parameter(torch.randn(size)) for _ in range(tensors)]
    for param in params:
        param.grad = torch.randn(size) * 1e-2
    optimizer = factory(params, **flags)
    optimizer.step()  # allocates the state
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        best = min(best, time.perf_counter() - start)
    return best * 1e9 / (size * tensors)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, float]:
    """The largest distance in ulps between two fp32 tensors, how many elements differ, and the largest
    absolute difference."""
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    # map the sign-magnitude bit patterns onto a line, so that -0.0 and 0.0 are neighbours
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max()), int((a != b).sum()), float((a - b).abs().max())


EXACTNESS_SHAPES = [(900_000,), (300, 333), (7,)]
SMOKE_SHAPES = [(9_000,), (30, 33), (7,)]


def stepped(factory: Factory, flags: dict, shapes: list[tuple[int, ...]], steps: int = 5) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator) * 10.0 ** (k % 3 - 1) for shape in shapes]
             for k in range(steps)]
    optimizer = factory(params, **flags)
    for k in range(steps):
        for param, grad in zip(params, grads[k], strict=True):
            param.grad = grad
        optimizer.step()
    return [param.detach() for param in params]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=None, help="parameters stepped (default 20e6, smoke 2e5)")
    parser.add_argument("--tensors", type=int, default=20, help="split into this many tensors (default 20)")
    parser.add_argument("--threads", default=None, help="torch.set_num_threads values (default 1,2, smoke 1: two "
                                                        "threads on a busy machine wait for each other)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps, the best counts (default 5, smoke 2)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure the whole table this many times and keep each cell's best (default 1): "
                             "on a shared machine other work only ever slows a step down")
    add_smoke(parser, "200K parameters, 2 timed steps on 1 thread, 12K elements for the exactness table")
    args = parser.parse_args()
    args.params = sized(args.params, args, full=20e6, smoke=2e5)
    args.repeats = sized(args.repeats, args, full=5, smoke=2)
    args.threads = sized(args.threads, args, full="1,2", smoke="1")
    shapes = SMOKE_SHAPES if args.smoke else EXACTNESS_SHAPES
    threads = [int(value) for value in args.threads.split(",")]
    total = int(args.params)
    print(f"torch {torch.__version__}, CPU kernels {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads by default")

    print(f"\n1. ns per parameter, {total / 1e6:g}M fp32 parameters in {args.tensors} tensors (best of "
          f"{args.repeats} steps{f' in each of {args.rounds} rounds' if args.rounds > 1 else ''})")
    header = f"{'optimizer':<18} {'path':<14}" + "".join(f" {f'{t} thread' + 's' * (t > 1):>10}" for t in threads)
    print(header)
    print("-" * len(header))
    default_threads = torch.get_num_threads()
    best = [[float("inf")] * len(threads) for _ in SPEED]
    for _ in range(args.rounds):
        for row, (_, factory, flags) in enumerate(SPEED):
            for column, count in enumerate(threads):
                torch.set_num_threads(count)
                figure = ns_per_param(factory, flags, total, args.tensors, args.repeats)
                best[row][column] = min(best[row][column], figure)
    torch.set_num_threads(default_threads)
    for (name, _, flags), figures in zip(SPEED, best, strict=True):
        path = ", ".join(f"{key}=True" for key in flags) or "default"
        print(f"{name:<18} {path:<14}" + "".join(f" {figure:>10.2f}" for figure in figures))

    elements = sum(torch.Size(shape).numel() for shape in shapes)
    print(f"\n2. fused=True against the default path, 5 steps on {elements / 1e6:.2g}M fp32 elements "
          "(parameters ~N(0, 1))")
    print(f"{'optimizer':<28} {'max ulp':>8} {'max |difference|':>17} {'elements differing':>19}")
    for name, factory in EXACTNESS:
        worst = differing = elements = 0
        largest = 0.0
        for ours, reference in zip(stepped(factory, {"fused": True}, shapes), stepped(factory, {}, shapes),
                                     strict=True):
            distance, count, absolute = ulp_distance(ours, reference)
            worst, differing, elements = max(worst, distance), differing + count, elements + ours.numel()
            largest = max(largest, absolute)
        print(f"{name:<28} {worst:>8} {largest:>17.2e} {100 * differing / elements:>18.4f}%")


if __name__ == "__main__":
    main()

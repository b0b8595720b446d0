"""Train a small byte-level GPT with the RoundPipe engine on simulated CPU devices.

The data is real text that needs no download: the source files of the Python standard library
installed with this interpreter. Run with ``make demo`` (or ``python examples/engine_demo.py``).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from lightning_roundpipe import EngineOptions, RoundPipeEngine
from lightning_roundpipe.app.data import stdlib_bytes  # shared with the Hydra app
from lightning_roundpipe.app.model import gpt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices in the ring")
    parser.add_argument("--microbatches", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--async-step", action="store_true", help="the paper's one-step-stale optimizer")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    context, width, batch = 64, 64, 12
    data = stdlib_bytes(400_000)
    model = gpt(width=width, depth=4, heads=4, context=context)  # Sequential(embedding, *blocks, tied head)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    options = EngineOptions(num_microbatches=args.microbatches, async_step=args.async_step, record_timeline=True)
    start = time.perf_counter()
    with RoundPipeEngine(model, args.devices, options) as engine:
        print(f"Python {sys.version.split()[0]} stdlib: {len(data):,} bytes; plan {engine.plan}")
        for step in range(1, args.steps + 1):
            offsets = torch.randint(0, len(data) - context - 1, (batch,))
            window = torch.stack([data[o: o + context + 1] for o in offsets])
            loss = engine.forward_backward(window[:, :-1], window[:, 1:],
                                           lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
            engine.step(optimizer)
            if step % 10 == 0 or step == 1:
                print(f"step {step:4d}  loss {loss.item():.3f}  perplexity {loss.exp().item():.1f}")
        engine.synchronize()
        elapsed = time.perf_counter() - start
        tokens = args.steps * batch * context
        compute = [e for e in engine.events() if e.kind in ("forward", "fused", "backward")]
        span = max(e.end for e in compute) - min(e.start for e in compute)
        busy = sum(e.end - e.start for e in compute)
        print(f"{tokens / elapsed:,.0f} tokens/s; device busy {busy / (span * args.devices):.0%} of the span; "
              f"peak resident bytes per device {engine.peak_resident_bytes()}")


if __name__ == "__main__":
    main()

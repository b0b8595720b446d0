"""Train a small byte-level GPT with the RoundPipe engine on simulated CPU devices.

The data is real text that needs no download: the source files of the Python standard library
installed with this interpreter. Run with ``make demo`` (or ``python examples/engine_demo.py``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

from lightning_roundpipe import EngineOptions, RoundPipeEngine


def stdlib_bytes(limit: int) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's sources, in sorted path order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if {"site-packages", "test", "tests", "__pycache__"} & set(path.relative_to(root).parts):
            continue
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


class Embedding(nn.Module):
    def __init__(self, width: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(256, width)
        nn.init.normal_(self.tokens.weight, std=0.02)  # tied with the head: keep the first logits small
        self.positions = nn.Parameter(torch.randn(context, width) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, embedding: Embedding, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.weight = embedding.tokens.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.weight)


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
    embedding = Embedding(width, context)
    model = nn.Sequential(embedding, *[Block(width, 4) for _ in range(4)], Head(embedding, width))
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

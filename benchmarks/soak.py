"""Soak: a long RoundPipe run must not grow in host memory, open files or threads.

Run: ``python benchmarks/soak.py [--steps 2000] [--every 100] [--json PATH]``. Not a test (a few
minutes on 2 cores): it prints its samples and a verdict, and exits 1 if anything grew. ``--smoke`` (seconds:
8 steps sampled every 2, validation every 4, a 200 kB data window) runs the same, too short for its verdict to
mean anything.

Trains the app's small byte-level GPT (``lightning_roundpipe.app.model.gpt``) on the embedded standard
library bytes with ``Trainer(strategy=RoundPipeStrategy(...))`` on simulated CPU devices, with validation
every ``--val-every`` steps (the pipelined no-grad path) and the engine's pipeline metrics logged, and
samples after every ``--every`` steps:

* resident set size (``/proc/self/statm``) and the Python heap's live objects count (``gc``),
* open file descriptors (``/proc/self/fd``),
* threads (``threading.active_count()`` and the kernel's count from ``/proc/self/status``).

Verdict: after a warm-up (the first quarter of the samples: allocator pools and caches fill), the
last sample may exceed the warm-up's peak by at most ``--rss-slack`` MiB of RSS, and file descriptors and
threads must not exceed it at all. Then the strategy is torn down and no ``roundpipe-`` thread may remain.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from common import add_smoke, sized  # noqa: E402

from lightning_roundpipe import RoundPipeStrategy  # noqa: E402
from lightning_roundpipe.app.data import StdlibDataModule  # noqa: E402
from lightning_roundpipe.app.model import ByteLM, gpt  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def sample() -> dict[str, float]:
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * PAGE
    with open("/proc/self/status") as status:
        kernel_threads = next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    return {"rss_mib": rss / 2**20, "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
            "kernel_threads": kernel_threads, "objects": len(gc.get_objects())}


class Sampler(pl.Callback):
    roundpipe_reads_gradients = False  # reads no gradient: RoundPipe need not gather them for its hook

    def __init__(self, every: int) -> None:
        self.every = every
        self.samples: list[dict[str, float]] = []
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every == 0:
            gc.collect()
            row = {"step": step, "seconds": round(time.perf_counter() - self.started, 1), **sample()}
            self.samples.append(row)
            print(f"{row['step']:>6} {row['seconds']:>8.1f} {row['rss_mib']:>9.1f} {row['fds']:>5} "
                  f"{row['threads']:>8} {row['kernel_threads']:>8} {row['objects']:>9}", flush=True)


def verdict(samples: list[dict[str, float]], rss_slack_mib: float) -> list[str]:
    """What grew after the warm-up, as messages; empty when nothing did."""
    warm = max(1, len(samples) // 4)
    baseline, last = samples[:warm], samples[-1]
    problems = []
    rss_peak = max(row["rss_mib"] for row in baseline)
    if last["rss_mib"] > rss_peak + rss_slack_mib:
        problems.append(f"RSS grew from a warm-up peak of {rss_peak:.1f} MiB to {last['rss_mib']:.1f} MiB")
    for key in ("fds", "threads", "kernel_threads"):
        peak = max(row[key] for row in baseline)
        if last[key] > peak:
            problems.append(f"{key} grew from a warm-up peak of {peak} to {last[key]}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="(default 2000, smoke 8)")
    parser.add_argument("--every", type=int, default=None, help="sample every this many steps (default 100, smoke 2)")
    parser.add_argument("--val-every", type=int, default=None,
                        help="validate every this many steps (default 500, smoke 4)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--async-step", action="store_true", help="roundpipe_async instead of sync")
    parser.add_argument("--rss-slack", type=float, default=16.0, help="MiB of RSS growth tolerated (allocator noise)")
    parser.add_argument("--json", type=Path, help="also write the samples and verdict here")
    add_smoke(parser, "8 steps sampled every 2, validation every 4, a 200 kB data window")
    args = parser.parse_args()
    args.steps = sized(args.steps, args, full=2000, smoke=8)
    args.every = sized(args.every, args, full=100, smoke=2)
    args.val_every = sized(args.val_every, args, full=500, smoke=4)
    torch.set_num_threads(1)  # one intra-op thread per simulated device fits 2 cores
    torch.manual_seed(0)
    module = ByteLM(gpt(width=64, depth=6, heads=4, context=64), lr=3e-3, context=64)
    data = StdlibDataModule(context=64, batch_size=12, limit_bytes=200_000 if args.smoke else 2_000_000, val_windows=16)
    sampler = Sampler(args.every)
    strategy = RoundPipeStrategy(num_microbatches=3, async_step=args.async_step)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps,
                         val_check_interval=args.val_every, check_val_every_n_epoch=None, limit_val_batches=4,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[sampler])
    print(f"soak: {args.steps} steps, {args.devices} devices, {'async' if args.async_step else 'sync'}; "
          f"sampling every {args.every} steps")
    print(f"{'step':>6} {'seconds':>8} {'rss MiB':>9} {'fds':>5} {'threads':>8} {'kernel':>8} {'objects':>9}")
    trainer.fit(module, datamodule=data)
    left = [t.name for t in threading.enumerate() if t.name.startswith("roundpipe-")]
    problems = verdict(sampler.samples, args.rss_slack)
    if left:
        problems.append(f"threads left after teardown: {left}")
    print("verdict: " + ("no growth after warm-up; no thread left after teardown" if not problems
                         else "GREW: " + "; ".join(problems)))
    if args.json:
        args.json.write_text(json.dumps({"samples": sampler.samples, "problems": problems}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

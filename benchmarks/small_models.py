"""Small models on ONE CPU device, one thread: milliseconds per step under Lightning's default strategy and
under ``roundpipe``, and their ratio (target: ``roundpipe`` at most 1.3x the default's time).

Run: ``python benchmarks/small_models.py [--quick] [--json PATH]`` (about 40 s on 2 cores, ``--quick``
about 20 s, ``--smoke`` seconds: the same code path at toy sizes). Not a test: it prints a table and a
verdict and always exits 0.

The models, written here (no timm or torchvision), each trained by a plain ``Trainer(max_steps=...)``
(no logger, no checkpointing, no progress bar), the same initial weights and batches for both strategies:

* ``cli-app``: what a ``LightningCLI`` application looks like: a ``LightningModule`` holding a small CNN in
  an ``nn.Sequential`` (two 3x3 convolutions with pooling, then a linear classifier) with Adam, fed by a
  ``LightningDataModule`` of random 28x28 images, batch 64; its ``training_step`` computes the loss from
  ``self(x)`` (the transparent forward: nothing in it names the strategy).
* ``vit-tiny``: ViT-Tiny's structure (width 192, 12 pre-norm blocks of 3-head attention and a 768-wide GELU
  MLP, a class token, learned position embeddings), on 32x32 images cut into 8x8 patches (16 patches and
  the class token) so that a step takes a fraction of a second on one core, batch 8, AdamW. Its blocks are an
  ``nn.Sequential`` (as in timm), which ``roundpipe`` pipelines; the patch embedding and the head stay on
  the host.

``roundpipe`` runs as a user would select it: ``strategy="roundpipe"``, ``accelerator="cpu"``, ``devices=1``
(the planner's plan, its defaults). Timing as ``overhead.py`` does: from one ``on_train_batch_start`` to the
next, the first ``--warmup`` steps dropped, interleaved rounds of fresh ``fit``s, the median step per run,
then the median over rounds; the ratio is the median of the per-round ratios (min..max shown). Two cross-checks
less sensitive to a busy machine, each the median over rounds of a paired ratio: by CPU time (the process's, all
threads), and by each run's fastest-decile step (noise from other processes only ever adds time, so the fastest
steps are the least disturbed). The verdict is the medians'. Then, per model and strategy (Linux only), each
thread's CPU ms per step as ``overhead.py`` prints them: where the engine's extra CPU goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import add_smoke, quiet, sized  # noqa: E402
from overhead import StepTimer, by_thread_line, median_by_thread  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

TARGET = 1.3  # roundpipe's ms/step over the default strategy's, at most
STRATEGIES = ("auto", "roundpipe")


class RandomImages(pl.LightningDataModule):
    """``count`` batches of random images and labels, fixed by ``seed``."""

    def __init__(self, shape: tuple[int, ...], classes: int, batch: int, count: int, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randn(count * batch, *shape, generator=generator)
        self.labels = torch.randint(0, classes, (count * batch,), generator=generator)
        self.batch = batch

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.images, self.labels), batch_size=self.batch, shuffle=False)


class Classifier(pl.LightningModule):
    """An image classifier as an application writes one: cross entropy on ``self(x)``."""

    def __init__(self, net: nn.Module, optimizer: str) -> None:
        super().__init__()
        self.net = net
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        kind = torch.optim.AdamW if self.optimizer == "adamw" else torch.optim.Adam
        return kind(self.parameters(), lr=1e-3)


def small_cnn(channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * channels * 7 * 7, 10))


class Block(nn.Module):
    """A pre-norm transformer block: attention, then an MLP, each added to the stream."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """ViT-Tiny's layout: patch embedding, class token, position embeddings, blocks, norm, head."""

    def __init__(self, width: int, depth: int, heads: int, image: int, patch: int, classes: int = 10) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, width, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.position = nn.Parameter(0.02 * torch.randn(1, (image // patch) ** 2 + 1, width))
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], dim=1) + self.position
        return self.head(self.norm(self.blocks(x))[:, 0])


def build(model: str, args: argparse.Namespace) -> tuple[Classifier, RandomImages]:
    torch.manual_seed(1234)  # the same initial weights for both strategies and every round
    count = args.warmup + args.steps + 1
    if model == "cli-app":
        net: nn.Module = small_cnn(args.channels)
        return Classifier(net, "adam"), RandomImages((1, 28, 28), 10, args.cnn_batch, count)
    net = ViT(args.width, args.depth, 3, args.image, args.patch)
    return Classifier(net, "adamw"), RandomImages((3, args.image, args.image), 10, args.vit_batch, count)


Run = tuple[float, float, float, dict[str, float]]
"""One ``fit``'s figures (:func:`run_once`)."""


def run_once(model: str, strategy: str, args: argparse.Namespace) -> Run:
    """One fresh ``fit``: its median step, its median CPU time (the process's, all threads), its fastest-decile
    step (the 10th percentile), in seconds, and each thread's CPU seconds per measured step, by thread name."""
    module, data = build(model, args)
    timer = StepTimer(args.warmup, args.steps)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=args.warmup + args.steps + 1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer])
    trainer.fit(module, datamodule=data)
    steps = timer.step_seconds()
    return (statistics.median(steps), statistics.median(timer.cpu_seconds()), statistics.quantiles(steps, n=10)[0],
            timer.thread_cpu_per_step())


def paired_ratio(runs: dict[str, list[Run]], field: int) -> float:
    """The median over rounds of roundpipe's figure ``field`` (0: median step, 1: CPU time, 2: fastest-decile step)
    over the default strategy's in the same round."""
    return statistics.median(r[field] / a[field] for a, r in zip(runs["auto"], runs["roundpipe"], strict=True))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 8 measured steps")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 5, quick 3, smoke 1)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default 15, quick 8)")
    parser.add_argument("--warmup", type=int, default=None, help="steps dropped per run (default 4, quick 3)")
    parser.add_argument("--channels", type=int, default=None, help="cli-app: first conv's channels (default 16)")
    parser.add_argument("--cnn-batch", type=int, default=None, help="cli-app batch (default 64)")
    parser.add_argument("--width", type=int, default=None, help="vit-tiny width (default 192)")
    parser.add_argument("--depth", type=int, default=None, help="vit-tiny blocks (default 12)")
    parser.add_argument("--image", type=int, default=32, help="vit-tiny image side (default 32)")
    parser.add_argument("--patch", type=int, default=8, help="vit-tiny patch side (default 8)")
    parser.add_argument("--vit-batch", type=int, default=None, help="vit-tiny batch (default 8)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    add_smoke(parser, "one round of 2 measured steps of a 4-channel CNN and a width-24, 2-block ViT")
    args = parser.parse_args()
    args.repeats = sized(args.repeats, args, full=5, quick=3, smoke=1)
    args.steps = sized(args.steps, args, full=15, quick=8, smoke=2)
    args.warmup = sized(args.warmup, args, full=4, quick=3, smoke=1)
    args.channels = sized(args.channels, args, full=16, smoke=4)
    args.cnn_batch = sized(args.cnn_batch, args, full=64, smoke=8)
    args.width = sized(args.width, args, full=192, smoke=24)
    args.depth = sized(args.depth, args, full=12, smoke=2)
    args.vit_batch = sized(args.vit_batch, args, full=8, smoke=2)
    return args


def main() -> int:
    args = parse()
    torch.set_num_threads(1)
    quiet()
    began = time.perf_counter()
    print(f"One CPU device, torch threads 1; {args.repeats} interleaved rounds, per run {args.warmup} warm-up + "
          f"{args.steps} measured steps; cli-app: CNN {args.channels}/{2 * args.channels} channels, batch "
          f"{args.cnn_batch}, Adam; vit-tiny: width {args.width}, {args.depth} blocks, {args.image}px images in "
          f"{args.patch}px patches, batch {args.vit_batch}, AdamW; fp32")
    results: dict[str, dict[str, list[Run]]] = {model: {s: [] for s in STRATEGIES}
                                                                 for model in ("cli-app", "vit-tiny")}
    for index in range(args.repeats):
        for model, runs in results.items():
            for strategy in STRATEGIES:
                runs[strategy].append(run_once(model, strategy, args))
        print(f"  round {index + 1}: " + "  ".join(
            f"{model} {1e3 * runs['auto'][-1][0]:.1f} / {1e3 * runs['roundpipe'][-1][0]:.1f} ms"
            for model, runs in results.items()), flush=True)
    print()
    print("| model | default strategy ms/step | roundpipe ms/step | roundpipe / default (min..max) | CPU ms/step, "
          "default / roundpipe | by CPU time | by fastest-decile step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    for model, runs in results.items():
        ratios = [r[0] / a[0] for a, r in zip(runs["auto"], runs["roundpipe"], strict=True)]
        cpu = {strategy: 1e3 * statistics.median(run[1] for run in runs[strategy]) for strategy in STRATEGIES}
        summary[model] = {"default_ms": 1e3 * statistics.median(run[0] for run in runs["auto"]),
                          "roundpipe_ms": 1e3 * statistics.median(run[0] for run in runs["roundpipe"]),
                          "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                          "default_cpu_ms": cpu["auto"], "roundpipe_cpu_ms": cpu["roundpipe"],
                          "cpu_ratio": paired_ratio(runs, 1), "fast_ratio": paired_ratio(runs, 2)}
        row = summary[model]
        print(f"| {model} | {row['default_ms']:.1f} | {row['roundpipe_ms']:.1f} | {row['ratio']:.2f} "
              f"({min(ratios):.2f}..{max(ratios):.2f}) | {cpu['auto']:.1f} / {cpu['roundpipe']:.1f} | "
              f"{row['cpu_ratio']:.2f} | {row['fast_ratio']:.2f} |")
    print()
    for model, runs in results.items():
        for strategy in STRATEGIES:
            by_thread = median_by_thread([run[3] for run in runs[strategy]])
            if by_thread:
                summary[model][f"{strategy}_thread_cpu_ms"] = by_thread
                print(f"{model}, {'default strategy' if strategy == 'auto' else strategy}: "
                      f"{by_thread_line(by_thread, args.steps)}")
    worst = max(row["ratio"] for row in summary.values())
    print(f"Verdict: roundpipe / default at most {worst:.2f}x -> target <= {TARGET}x "
          f"{'MET' if worst <= TARGET else 'NOT MET'}. Cross-checks, the worst model: by CPU time "
          f"{max(row['cpu_ratio'] for row in summary.values()):.2f}x, by the fastest-decile step "
          f"{max(row['fast_ratio'] for row in summary.values()):.2f}x [{time.perf_counter() - began:.0f} s]")
    if args.json is not None:
        args.json.write_text(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "json"},
                                         "summary": summary, "runs": results}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

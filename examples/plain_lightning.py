"""An ordinary LightningModule, written for plain Lightning, trained unchanged with RoundPipe.

Nothing in the module knows about RoundPipe: its model is an ``nn.Sequential`` attribute, its
``training_step`` calls it and returns the loss. Switching is one Trainer argument. The script trains
the same module twice, with Lightning's default strategy and with ``strategy="roundpipe"`` on two
simulated CPU devices, and prints both final losses: with one microbatch per batch they agree.

    python examples/plain_lightning.py
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_roundpipe  # noqa: F401 - registers "roundpipe" (a regular install does this at start-up)


class SpiralClassifier(pl.LightningModule):
    """Classifies points of three interleaved spirals. Plain Lightning code, no RoundPipe in sight."""

    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = [layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.GELU())]
        self.net = nn.Sequential(nn.Linear(2, width), nn.GELU(), *blocks, nn.Linear(width, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def spirals(samples: int = 1536) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (samples,), generator=generator)
    radius = torch.rand(samples, generator=generator)
    angle = radius * 4.0 + labels * (2.0944) + 0.2 * torch.randn(samples, generator=generator)
    points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
    return DataLoader(TensorDataset(points, labels), batch_size=64, shuffle=False)


def train(strategy: str | pl.strategies.Strategy, devices: int) -> float:
    module = SpiralClassifier()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=3, logger=False,
                         enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module, spirals())
    return trainer.callback_metrics["train_loss"].item()


if __name__ == "__main__":
    plain = train("auto", devices=1)
    pipelined = train(lightning_roundpipe.RoundPipeStrategy(num_microbatches=1), devices=2)
    print(f"final loss, Lightning's default strategy: {plain:.6f}")
    print(f"final loss, RoundPipe on 2 CPU devices:   {pipelined:.6f}")

"""The fused path: ``pipeline_loss`` computes the loss inside the pipeline's last stage.

A language model's output (batch x sequence x vocabulary logits) is the largest tensor of the step.
With ``pipeline_loss`` the forward, the loss and the backward of the last stage run per microbatch on
the device, so the whole batch's logits never exist, and backward stages start right away. The
module stays portable: under any other strategy ``pipeline_loss`` is ``loss_fn(net(x), y)``.

This script trains a small byte-level language model on a few kilobytes of this file's own text,
with a token-mean loss whose ignored targets (-100) are weighted correctly across microbatches.

    python examples/fused_loss.py
"""

from __future__ import annotations

import pathlib

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_roundpipe
from lightning_roundpipe import pipeline_loss, token_count

CONTEXT = 32


def next_byte_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


class ByteModel(pl.LightningModule):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Embedding(256, width),
            *[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(4)],
            nn.Linear(width, 256),
        )

    def training_step(self, batch, batch_idx):
        ids, target = batch
        loss = pipeline_loss(self.net, ids, target, next_byte_loss, loss_weight=token_count(-100))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def windows() -> DataLoader:
    data = torch.tensor(list(pathlib.Path(__file__).read_bytes()[:8192]))
    starts = torch.arange(0, len(data) - CONTEXT - 1, CONTEXT)
    ids = torch.stack([data[s: s + CONTEXT] for s in starts])
    target = torch.stack([data[s + 1: s + CONTEXT + 1] for s in starts])
    target[::3, : CONTEXT // 2] = -100  # some positions carry no target, as padding would
    return DataLoader(TensorDataset(ids, target), batch_size=16, shuffle=True,
                      generator=torch.Generator().manual_seed(0))


if __name__ == "__main__":
    trainer = pl.Trainer(strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), accelerator="cpu",
                         devices=2, max_epochs=4, logger=False, enable_checkpointing=False,
                         enable_model_summary=False)
    trainer.fit(ByteModel(), windows())
    print(f"final train loss {trainer.callback_metrics['train_loss'].item():.3f} "
          f"(a uniform guess over 256 bytes is {torch.tensor(256.0).log().item():.3f})")

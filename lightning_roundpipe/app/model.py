"""Byte-level language models for the app (and the engine demo), as RoundPipe-ready LightningModules.

Each model keeps its layers in one ``nn.Sequential`` at ``self.net`` (embedding, blocks, head): that is
the trunk RoundPipe pipelines, one child per layer. Hugging Face models (Llama, Qwen3) are the other
LightningModule, :class:`lightning_roundpipe.app.hf_model.CausalLM`.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

from lightning_roundpipe.app.optimizers import build_optimizer, forget_settings
from lightning_roundpipe.engine.pipelined import pipeline_loss

VOCAB = 256  # bytes


class Embedding(nn.Module):
    """Byte and learned position embeddings."""

    def __init__(self, width: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)
        nn.init.normal_(self.tokens.weight, std=0.02)  # tied with the head: keep the first logits small
        self.positions = nn.Parameter(torch.randn(context, width) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class Block(nn.Module):
    """A pre-norm causal transformer block."""

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
    """Final norm and the output projection, tied to the byte embedding."""

    def __init__(self, embedding: Embedding, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.weight = embedding.tokens.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.weight)


class ResidualMLP(nn.Module):
    """A position-wise residual MLP block (no mixing across positions)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                  nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def gpt(width: int = 64, depth: int = 6, heads: int = 4, context: int = 64) -> nn.Sequential:
    """A small byte-level GPT: ``Sequential(embedding, *blocks, head)`` with a tied head."""
    if width % heads:
        raise ValueError(f"`model.net.width` ({width}) must be a multiple of `model.net.heads` ({heads})")
    embedding = Embedding(width, context)
    return nn.Sequential(embedding, *[Block(width, heads) for _ in range(depth)], Head(embedding, width))


def mlp(width: int = 64, depth: int = 4) -> nn.Sequential:
    """A byte-level MLP: each byte predicts the next one (a deep bigram model); fast, a sanity baseline."""
    return nn.Sequential(nn.Embedding(VOCAB, width), *[ResidualMLP(width) for _ in range(depth)],
                         nn.LayerNorm(width), nn.Linear(width, VOCAB))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


class LanguageModelLogging(pl.LightningModule):
    """What the app's language models log: training loss and perplexity per step, and the validation set's
    token-weighted mean loss per epoch; ``tokens_seen`` feeds the run summary."""

    def __init__(self) -> None:
        super().__init__()
        self.val_loss = MeanMetric()
        self.tokens_seen = 0

    optimizer_name = "adamw"  # model.optimizer: app/optimizers.py

    def teardown(self, stage: str) -> None:
        forget_settings(self.optimizer_name, self)

    def log_training_loss(self, loss: torch.Tensor, tokens: int, batch_size: int) -> None:
        self.tokens_seen += tokens
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=batch_size)
        self.log("train/perplexity", loss.detach().exp(), batch_size=batch_size)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/perplexity", loss.exp())


class ByteLM(LanguageModelLogging):
    """Next-byte language modelling around any byte-level trunk ``net``.

    ``fused=True`` (default) computes the loss with :func:`pipeline_loss`, inside the pipeline's last
    stage, so the (batch, context, 256) logits never travel; ``fused=False`` calls ``self.net`` like
    plain Lightning code (the transparent path). Both are plain PyTorch under any other strategy.
    """

    def __init__(self, net: nn.Sequential, lr: float = 3e-3, weight_decay: float = 0.01, fused: bool = True,
                 context: int | None = None, optimizer: str = "adamw") -> None:
        super().__init__()
        self.net, self.lr, self.weight_decay, self.fused = net, lr, weight_decay, fused
        self.context, self.optimizer_name = context, optimizer

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = pipeline_loss(self.net, x, y, lm_loss) if self.fused else lm_loss(self.net(x), y)
        self.log_training_loss(loss, y.numel(), x.shape[0])
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_loss.update(lm_loss(self.net(x), y), weight=y.numel())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return build_optimizer(self.optimizer_name, self, self.parameters(), self.lr, self.weight_decay)

    @torch.no_grad()
    def sample(self, prompt: bytes, length: int, temperature: float = 0.8, seed: int = 0) -> bytes:
        """Sample ``length`` bytes after ``prompt`` by calling the trunk directly on the host.

        A documented bypass of the pipeline: after ``fit`` the strategy has removed its patches and the
        trunk is a plain ``nn.Sequential`` holding the trained weights.
        """
        was_training = self.net.training
        self.net.eval()
        generator = torch.Generator().manual_seed(seed)
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        for _ in range(length):
            window = ids[:, -self.context:] if self.context else ids
            logits = self.net(window)[0, -1].float() / max(temperature, 1e-5)
            ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=generator)[None]], 1)
        self.net.train(was_training)
        return bytes(ids[0].tolist())

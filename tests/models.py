"""Small models and an independent plain-PyTorch reference for the engine tests."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, CONTEXT = 17, 16, 8


class SharedLog(list):
    """A list that layer replicas share with the host layer (deepcopy returns the same object)."""

    def __deepcopy__(self, memo: dict) -> SharedLog:
        return self


def bn_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(),
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh(),
        nn.Linear(16, 4),
    )


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)  # no key bias: its true gradient is 0
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, 2, c // 2).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.dropout(self.proj(attention))
        return x + self.dropout(self.mlp(self.norm2(x)))


class Head(nn.Module):
    def __init__(self, embed: Embed) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.weight = embed.tokens.weight  # tied with the embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.weight)


def tiny_gpt(seed: int = 0, blocks: int = 3, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    embed = Embed()
    return nn.Sequential(embed, *[Block(dropout) for _ in range(blocks)], Head(embed))


def gpt_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def gpt_batch(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, CONTEXT), generator=generator)
    target = torch.roll(ids, -1, dims=1)
    target[:, -1] = -100
    target[0, :3] = -100  # ignored targets: the loss is a token mean, not a sample mean
    return ids, target


def bn_batch(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(samples, 6, generator=generator), torch.randint(0, 4, (samples,), generator=generator)


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def reference_microbatch_step(model: nn.Module, inputs: torch.Tensor, target: torch.Tensor, loss_fn,
                              weights: list[float], sizes: list[int]) -> float:
    """Plain PyTorch: the same microbatches one after another, gradients accumulated. Returns the loss."""
    total = sum(weights)
    loss_value = 0.0
    for x, y, weight in zip(torch.split(inputs, sizes), torch.split(target, sizes), weights):
        loss = loss_fn(model(x), y) * (weight / total)
        loss.backward()
        loss_value += loss.item()
    return loss_value


def split_sizes(samples: int, parts: int) -> list[int]:
    """``torch.tensor_split``'s rule, written out independently of the package."""
    return [chunk.shape[0] for chunk in torch.tensor_split(torch.empty(samples), min(samples, parts))]


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)

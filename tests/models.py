"""Small models, the LightningModule the strategy and fault tests share, and independent plain-PyTorch
references (the sync and the async formula). Test modules import these from here, never from each other."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import TypeVar

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_roundpipe import RoundPipeStrategy, pipeline_loss, token_count

VOCAB, WIDTH, CONTEXT = 17, 16, 8
R = TypeVar("R")


class SharedLog(list):
    """A list that layer replicas share with the host layer (deepcopy returns the same object)."""

    def __deepcopy__(self, memo: dict) -> SharedLog:
        return self


def bn_model(seed: int = 0) -> nn.Sequential:
    # No bias before a BatchNorm: the normalization removes it, so its true gradient is 0 and AdamW would make
    # its trajectory (and the running means it shifts) rounding noise scaled by lr / eps, ~1e-9 apart in float64
    # between two kernels' summation orders (one and two threads), where float64 checks allow 1e-12.
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(),
        nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(),
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


def without_dropout(module: nn.Module) -> nn.Module:
    """``module`` with every dropout off, functional attention dropout included (for bitwise comparisons)."""
    for layer in module.modules():
        if isinstance(layer, nn.Dropout):
            layer.p = 0.0
        if isinstance(layer, nn.MultiheadAttention):
            layer.dropout = 0.0  # functional attention dropout
    return module


class RecordsLosses(pl.LightningModule):
    """Records each training and validation loss of ``loss(batch)``, which a subclass defines."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def loss(self, batch) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_losses.append(self.loss(batch).item())


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
    for x, y, weight in zip(torch.split(inputs, sizes), torch.split(target, sizes), weights, strict=True):
        loss = loss_fn(model(x), y) * (weight / total)
        loss.backward()
        loss_value += loss.item()
    return loss_value


def reference_transparent_step(model: nn.Module, inputs: torch.Tensor, target: torch.Tensor, loss_fn,
                               sizes: list[int]) -> float:
    """Plain PyTorch for the transparent path: the loss of the merged microbatch outputs, then each
    microbatch's backward from its share of the output gradient. Returns the loss."""
    outputs = [model(x) for x in torch.split(inputs, sizes)]
    detached = [output.detach().requires_grad_(True) for output in outputs]
    loss = loss_fn(torch.cat(detached), target)
    loss.backward()
    for output, leaf in zip(outputs, detached, strict=True):
        output.backward(leaf.grad)
    return loss.item()


def async_reference(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn, sizes: list[int],
                    optimizer_kind: str, weights=None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch of ``async_step``'s formula (:func:`delayed_update_reference`) over ``batches``, the
    iterations' ``(inputs, target)``, each in the microbatches of ``sizes``; ``weights(target)`` gives the
    microbatches' loss weights (default: their sample counts). Runs in the model's dtype. Returns the final
    parameters (the optimizer's masters) and buffers by name, and the losses."""

    def gradients(compute: nn.Module, iteration: int) -> float:
        inputs, target = batches[iteration]
        microbatch_weights = [float(s) for s in sizes] if weights is None else weights(target)
        return reference_microbatch_step(compute, inputs, target, loss_fn, microbatch_weights, sizes)

    return delayed_update_reference(model, lambda params: make_optimizer(optimizer_kind, params), len(batches),
                                    gradients)


def delayed_update_reference(model: nn.Module, optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                             iterations: int, gradients: Callable[[nn.Module, int], R]
                             ) -> tuple[dict[str, torch.Tensor], list[R]]:
    """Plain PyTorch of ``async_step``'s formula, independent of the engine: iteration k computes g(k) on
    W(k-2), and W(k) = step(W(k-1), g(k)). ``gradients(compute, k)`` leaves g(k) in the ``.grad`` of
    ``compute`` (a copy of ``model`` holding W(k-2); ``None`` where a parameter has none, which its master
    keeps) and returns what is collected per iteration (the loss); ``optimizer(masters)`` makes the optimizer.
    Returns the final parameters (the optimizer's masters) and buffers by name, and what ``gradients``
    returned."""
    compute = clone(model)
    masters = [p.detach().clone().requires_grad_(True) for p in compute.parameters()]
    stepper = optimizer(masters)
    collected = []
    for iteration in range(iterations):
        collected.append(gradients(compute, iteration))
        published = [m.detach().clone() for m in masters]  # W(k-1): what iteration k+1 will run on
        for master, param in zip(masters, compute.parameters(), strict=True):
            master.grad = None if param.grad is None else param.grad.clone()
            param.grad = None
        stepper.step()
        with torch.no_grad():
            for param, value in zip(compute.parameters(), published, strict=True):
                param.copy_(value)
    names = [name for name, _ in compute.named_parameters()]
    state = {**dict(zip(names, (m.detach() for m in masters), strict=True)),
             **{name: b.detach() for name, b in compute.named_buffers()}}
    return state, collected


def transparency_case(model_name: str):
    """``(model, batch maker, samples per batch, loss function, the engine's loss weight)`` of a transparency
    case: ``bn`` (BatchNorm, a per-sample mean loss) or ``gpt`` (a token-mean loss with ignored targets)."""
    if model_name == "bn":
        return bn_model(), bn_batch, 11, F.cross_entropy, None
    return tiny_gpt(), gpt_batch, 7, gpt_loss, token_count(-100)


def microbatch_weights(model_name: str, target: torch.Tensor, sizes: list[int]) -> list[float]:
    """What each microbatch of ``target`` weighs in a :func:`transparency_case`'s whole-batch loss, counted
    independently of the package: its samples (``bn``) or its valid tokens (``gpt``)."""
    if model_name == "bn":
        return [float(s) for s in sizes]
    return [float((chunk != -100).sum()) for chunk in torch.split(target, sizes)]


def split_sizes(samples: int, parts: int) -> list[int]:
    """``torch.tensor_split``'s rule, written out independently of the package."""
    return [chunk.shape[0] for chunk in torch.tensor_split(torch.empty(samples), min(samples, parts))]


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


class Classifier(pl.LightningModule):
    """A plain LightningModule; ``fused`` picks ``pipeline_loss`` instead of calling the trunk."""

    def __init__(self, optimizer: str = "sgd", fused: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16),
                                 nn.Tanh(), nn.Linear(16, 3))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.hparams.fused:
            loss = pipeline_loss(self.net, x, y, F.cross_entropy)
        else:
            loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self.net(x), y))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        if self.hparams.optimizer == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def classifier_data(samples: int = 48, batch: int = 8) -> DataLoader:
    """``Classifier``'s data: ``samples`` random samples of 6 features and 3 classes, in batches of ``batch``."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 6, generator=generator)
    y = torch.randint(0, 3, (samples,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def state_bytes(state: Mapping) -> int:
    """The bytes of every tensor in an optimizer's state (``optimizer.state``, or a state dict's ``"state"``),
    counted as they are held: what a process keeps of it."""
    return sum(value.nbytes for entry in state.values() for value in entry.values() if isinstance(value, torch.Tensor))


def adamw_with_step_lr(params) -> dict:
    """AdamW and a StepLR stepped every optimizer step: ``configure_optimizers``'s return."""
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def three_class_data(width: int, samples: int = 24) -> DataLoader:
    """``samples`` inputs of ``width`` features and labels in 0-2, batches of 8 (three an epoch by default: Lightning
    resumes a plain DataLoader at an epoch's end only)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, width, generator=generator)
    return DataLoader(TensorDataset(x, torch.randint(0, 3, (samples,), generator=generator)), batch_size=8)


def one_microbatch_strategy(**options) -> RoundPipeStrategy:
    """RoundPipe on two ring members of one CPU device, one microbatch a batch, three stages and a frozen plan (with
    jitter): its sync step is then bitwise plain training. ``options`` add to or override these."""
    return RoundPipeStrategy(**{"ring": [0, 0], "num_microbatches": 1, "num_stages": 3, "round_size": "whole",
                                "freeze_plan": True, "jitter": 0.0005, **options})


def fit_three_class(module: pl.LightningModule, strategy, root, width: int, *, epochs: int = 2, ckpt_path=None,
                    checkpointing: bool = False, precision: str = "32-true") -> pl.Trainer:
    """Fit ``module`` on :func:`three_class_data` of ``width`` features, one CPU device, for ``epochs``."""
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                         precision=precision, enable_checkpointing=checkpointing, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root)
    trainer.fit(module, three_class_data(width), ckpt_path=ckpt_path)
    return trainer

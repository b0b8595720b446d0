"""Deferred BatchNorm (``EngineOptions.deferred_batchnorm``): running statistics of the whole batch.

Without it a BatchNorm in training mode updates its running statistics once per microbatch, from that
microbatch's statistics, as under gradient accumulation. With it, each BatchNorm still *normalizes* every
microbatch with that microbatch's own statistics (inherent to microbatching), but its running statistics
are updated once per trunk call, from the statistics of all the microbatches it saw together: the update
one BatchNorm forward over the whole batch would make (``momentum``, the unbiased variance with the whole
batch's count, the cumulative average when ``momentum`` is None, ``num_batches_tracked`` + 1).

How: a forward or fused job runs all microbatches of a call for its layers on one device, so the job
collects the statistics and commits them before its buffers go back to the host (``worker.py`` [8]):

* :func:`defer` (at bind, after the training flags are set) gives each training-mode BatchNorm of the
  layer's replica throwaway copies of its running buffers, which its own forward updates per microbatch
  and nobody reads afterwards, and a ``forward`` of its own (an instance attribute of the replica, never
  of the host module) that runs the class's forward and then records the input's per-channel mean, sum of
  squared deviations and count, combined over microbatches with Chan et al.'s pairwise formula (stable:
  no sum of squares minus squared sum). The i-th application of a BatchNorm within a microbatch feeds
  the i-th update, so a BatchNorm applied twice per call commits twice, as it would on the whole batch.
* :func:`commit` (at unbind, before the replica is checked for writes) removes that ``forward``, binds
  the stage's own buffers back and updates them once per application.

Forward snapshots for recomputation are copies of the stage's buffers, which the job does not change
until it commits, so a backward stage recomputes on the running statistics the call started from (what
an eval-mode layer normalized with; a training-mode BatchNorm normalizes with batch statistics and ignores
them). Backward stages never collect or commit: their recompute updates only the snapshots, as without
the option.

Which modules: ``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm`` (in one process it does not synchronize)
and subclasses that keep torch's ``forward``, when they track running statistics. A BatchNorm without
running statistics (``track_running_stats=False``) or in eval mode needs nothing. :func:`check_trunk`
refuses other modules that track running statistics in their forward (a BatchNorm subclass with its own
``forward``, ``InstanceNorm`` with ``track_running_stats=True``): their update cannot be deferred.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

from lightning_roundpipe.engine.layers import LayerState, Trunk

_FORWARDS = (_BatchNorm.forward, nn.SyncBatchNorm.forward)
_RUNNING = ("running_mean", "running_var", "num_batches_tracked")


def deferrable(module: nn.Module) -> bool:
    """A BatchNorm whose update this module can defer: torch's own forward, tracking running statistics."""
    return (isinstance(module, _BatchNorm) and type(module).forward in _FORWARDS and module.track_running_stats
            and module.running_mean is not None and module.running_var is not None)


def check_trunk(trunk: Trunk) -> None:
    """Refuse trunk modules that track running statistics in a forward this module cannot defer."""
    for index, layer in enumerate(trunk.layers):
        for path, module in layer.named_modules():
            tracks = isinstance(module, _NormBase) and module.track_running_stats
            if tracks and not deferrable(module):
                where = f"`{path}` " if path else ""
                raise ValueError(
                    f"`deferred_batchnorm` cannot defer the running statistics of trunk layer {index}'s {where}"
                    f"({type(module).__name__}): it updates them in a forward of its own, which RoundPipe would "
                    "have to replay. It defers nn.BatchNorm1d/2d/3d, nn.SyncBatchNorm and subclasses that keep "
                    "torch's forward. Set track_running_stats=False on that module, or deferred_batchnorm=False "
                    "(its statistics are then updated per microbatch)")


@dataclass(frozen=True)
class NormBuffers:
    """Where one deferrable BatchNorm of a layer sits: its module path and the positions of its running
    buffers in the layer's :class:`LayerState` buffers (``count`` None without ``num_batches_tracked``)."""

    path: str
    mean: int
    var: int
    count: int | None


def norm_buffers(layer: nn.Module, state: LayerState) -> list[NormBuffers]:
    """The layer's deferrable BatchNorms, by module path (computed once per layer)."""
    positions = {(where.module_path, where.name): position
                 for position, paths in enumerate(state.buffer_paths) for where in paths}
    found = []
    for path, module in layer.named_modules():
        if deferrable(module):
            found.append(NormBuffers(path, positions[(path, "running_mean")], positions[(path, "running_var")],
                                     positions.get((path, "num_batches_tracked"))))
    return found


@dataclass
class _Moments:
    """Per channel over the microbatches seen so far: the count, the mean and the sum of squared deviations."""

    count: int
    mean: torch.Tensor
    m2: torch.Tensor

    def merge(self, count: int, mean: torch.Tensor, m2: torch.Tensor) -> None:
        total = self.count + count
        delta = mean - self.mean
        self.mean = self.mean + delta * (count / total)
        self.m2 = self.m2 + m2 + delta * delta * (self.count * count / total)
        self.count = total


@dataclass
class DeferredNorm:
    """One training-mode BatchNorm of a bound replica, from :func:`defer` to :func:`commit`."""

    module: nn.Module
    where: NormBuffers
    moments: list[_Moments] = field(default_factory=list)  # per application within a microbatch
    applied: int = 0                                       # applications in the current microbatch

    def observe(self, input: torch.Tensor) -> None:
        with torch.no_grad():
            x = input.detach()
            if x.dtype not in (torch.float32, torch.float64):
                x = x.float()  # float16/bfloat16 under autocast: statistics in float32, as the kernels keep them
            var, mean = torch.var_mean(x, dim=[0, *range(2, x.dim())], correction=0)
            count = x.numel() // x.shape[1]
            m2 = var * count
        if self.applied == len(self.moments):
            self.moments.append(_Moments(count, mean, m2))
        else:
            self.moments[self.applied].merge(count, mean, m2)
        self.applied += 1


def defer(replica: nn.Module, norms: list[NormBuffers], buffers: list[torch.Tensor]) -> list[DeferredNorm]:
    """Defer the updates of the replica's training-mode BatchNorms ``norms`` (``buffers``: the stage's, bound)."""
    deferred = []
    for where in norms:
        module = replica.get_submodule(where.path) if where.path else replica
        if not module.training:
            continue  # eval mode: normalizes with the running statistics and updates nothing
        norm = DeferredNorm(module, where)
        positions = {"running_mean": where.mean, "running_var": where.var, "num_batches_tracked": where.count}
        for name in _RUNNING:
            position = positions[name]
            if position is not None:  # throwaway copies: the forward's own per-microbatch update lands there
                module._buffers[name] = buffers[position].clone()
        module.__dict__["forward"] = _observing_forward(module, norm)
        deferred.append(norm)
    return deferred


def _observing_forward(module: nn.Module, norm: DeferredNorm) -> Callable[[torch.Tensor], Any]:
    forward = type(module).forward

    def observed(input: torch.Tensor) -> Any:
        output = forward(module, input)  # first: the module checks its input
        norm.observe(input)
        return output

    return observed


def start_microbatch(deferred: list[DeferredNorm]) -> None:
    for norm in deferred:
        norm.applied = 0


def commit(deferred: list[DeferredNorm], buffers: list[torch.Tensor]) -> None:
    """Restore the replica's BatchNorms (their own forward, ``buffers`` bound again by the caller) and update
    their running statistics in ``buffers`` once per application, from the whole batch's statistics."""
    for norm in deferred:
        module, where = norm.module, norm.where
        module.__dict__.pop("forward", None)
        mean, var = buffers[where.mean], buffers[where.var]
        count = buffers[where.count] if where.count is not None else None
        momentum: float | None = getattr(module, "momentum")  # noqa: B009 - typed: a plain attribute
        with torch.no_grad():
            for moments in norm.moments:
                factor: float | torch.Tensor
                if count is not None:
                    count.add_(1)
                if momentum is not None:
                    factor = momentum
                elif count is not None:  # cumulative average; a tensor: no host sync on a GPU
                    factor = 1.0 / count.to(torch.float64)
                else:
                    factor = 0.0  # what torch's BatchNorm does without a counter
                unbiased = moments.m2 / (moments.count - 1)
                mean.copy_(mean * (1 - factor) + moments.mean.to(mean.dtype) * factor)
                var.copy_(var * (1 - factor) + unbiased.to(var.dtype) * factor)
        norm.moments = []

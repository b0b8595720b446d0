"""Per-device replicas of layers, so the same layer can run on two devices at once.

Why not ``torch.func.functional_call`` on the host layer: it swaps the module's attributes for the
duration of the call, so two threads running the same layer (async mode runs iteration k+1's
forward beside iteration k's recompute) would see each other's tensors. Each device instead owns a
structural copy of each layer it ran; a job binds its uploaded tensors into that copy and unbinds
them when done, so the copy holds no device memory between jobs.

A replica is made once, so hooks or attributes added to the host layer later are not seen by it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_roundpipe.layers import LayerState, TensorSlot


def make_replica(layer: nn.Module, state: LayerState) -> nn.Module:
    """A copy of ``layer``'s structure that shares (does not copy) its parameters and buffers."""
    memo = {id(tensor): tensor for tensor in (*state.params, *state.buffers)}
    return copy.deepcopy(layer, memo)


def _assign(replica: nn.Module, slots: list[TensorSlot], tensor: torch.Tensor, kind: str) -> None:
    for slot in slots:
        module = replica.get_submodule(slot.module_path) if slot.module_path else replica
        getattr(module, kind)[slot.name] = tensor


def bind(replica: nn.Module, state: LayerState, params: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
    """Make ``replica`` compute with ``params`` and ``buffers`` (device tensors, in ``state``'s order)."""
    for slots, tensor in zip(state.param_slots, params):
        _assign(replica, slots, tensor, "_parameters")
    bind_buffers(replica, state, buffers)


def bind_buffers(replica: nn.Module, state: LayerState, buffers: list[torch.Tensor]) -> None:
    for slots, tensor in zip(state.buffer_slots, buffers):
        _assign(replica, slots, tensor, "_buffers")


def unbind(replica: nn.Module, state: LayerState) -> None:
    """Point ``replica`` back at the host tensors, dropping its references to device memory."""
    bind(replica, state, list(state.params), list(state.buffers))


def set_training_flags(replica: nn.Module, flags: list[bool]) -> None:
    for module, flag in zip(replica.modules(), flags):
        module.training = flag

"""Per-device replicas of layers, so the same layer can run on two devices at once.

Why not ``torch.func.functional_call`` on the host layer: it swaps the module's attributes for the
duration of the call, so two threads running the same layer (async mode runs iteration k+1's
forward beside iteration k's recompute) would see each other's tensors. Each device instead owns a
structural copy of each layer it ran; a job binds its uploaded tensors into that copy and unbinds
them when done, so the copy holds no device memory between jobs.

Why not ``copy.deepcopy``: it would also copy whatever a layer's attributes or hooks reach (a hook
bound to the LightningModule drags in the whole model) and freeze their state. The copy made here
is structural: every submodule gets its own object with its own parameter, buffer and child tables
and its own ``training`` flag, while other attributes and the hook tables are shared with the host
layer, so hooks registered later fire in the replicas too.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_roundpipe.layers import LayerState, TensorSlot


def make_replica(layer: nn.Module, state: LayerState) -> nn.Module:
    """A structural copy of ``layer`` that shares (does not copy) its parameters, buffers and hooks."""
    del state  # the tables are copied as they are; binding fills them per job
    return _structural_copy(layer, {})


def _structural_copy(module: nn.Module, copies: dict[int, nn.Module]) -> nn.Module:
    if id(module) in copies:  # a submodule used twice inside the layer stays one object
        return copies[id(module)]
    replica = copy.copy(module)
    copies[id(module)] = replica
    replica._parameters = dict(module._parameters)
    replica._buffers = dict(module._buffers)
    replica._modules = {
        name: None if child is None else _structural_copy(child, copies) for name, child in module._modules.items()
    }
    return replica


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

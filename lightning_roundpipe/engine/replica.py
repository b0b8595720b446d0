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

Plain attributes follow the host: every job starts by giving the replica the host layer's current
attributes (:func:`sync_attributes`), so ``layer.scale = 0.5`` or ``dropout.p = 0.2`` set on the host
between steps reaches the devices. The other way does not work: an attribute a layer assigns in its
forward (``self.calls += 1``, ``self.last = x``) lands on the replica, and the host layer never sees
it. :func:`written_attributes` and :func:`rebound_buffers` find such writes after a job, so the stage
runner can warn (state belongs in registered buffers updated in place).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_roundpipe.engine.layers import LayerState, TensorSlot

_OWN = frozenset({"_parameters", "_buffers", "_modules", "training"})
"""Instance attributes a replica keeps its own: its tensor and child tables, and its training flag."""

_MISSING = object()

TRANSIENT_ATTRIBUTES: dict[type, frozenset[str]] = {nn.RNNBase: frozenset({"_flat_weights", "_flat_weight_refs"})}
"""Caches torch modules rebuild in their forward from the bound tensors: rebinding them loses no state. A
layer class declares its own with ``roundpipe_transient = ("name", ...)``."""

AttributeSnapshot = list[tuple[nn.Module, dict]]


def make_replica(layer: nn.Module) -> nn.Module:
    """A structural copy of ``layer`` that shares (does not copy) its parameters, buffers and hooks; its
    tensor tables start as copies of the host layer's, and :func:`bind` fills them per job."""
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
    for slots, tensor in zip(state.param_slots, params, strict=True):
        _assign(replica, slots, tensor, "_parameters")
    bind_buffers(replica, state, buffers)


def bind_buffers(replica: nn.Module, state: LayerState, buffers: list[torch.Tensor]) -> None:
    for slots, tensor in zip(state.buffer_slots, buffers, strict=True):
        _assign(replica, slots, tensor, "_buffers")


def unbind(replica: nn.Module, state: LayerState) -> None:
    """Point ``replica`` back at the host tensors, dropping its references to device memory."""
    bind(replica, state, list(state.params), list(state.buffers))


def module_pairs(replica: nn.Module, host: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """``(replica submodule, host submodule)`` pairs, the layer itself first (the structures match)."""
    return list(zip(replica.modules(), host.modules(), strict=True))


def sync_attributes(pairs: list[tuple[nn.Module, nn.Module]]) -> AttributeSnapshot:
    """Give every replica submodule its host module's current plain attributes (the tables and ``training``
    excepted); return a snapshot of them for :func:`written_attributes`."""
    snapshot = []
    for copied, original in pairs:
        # a copy taken under the GIL: the main thread may add an attribute to the host module meanwhile
        mine, theirs = copied.__dict__, original.__dict__.copy()
        for name, value in theirs.items():
            if name not in _OWN and mine.get(name, _MISSING) is not value:
                mine[name] = value
        if len(mine) != len(theirs):
            for name in [name for name in mine if name not in theirs]:
                del mine[name]
        snapshot.append((copied, dict(mine)))
    return snapshot


def written_attributes(replica: nn.Module, snapshot: AttributeSnapshot) -> list[str]:
    """The plain attributes (``path.name``) assigned, added or deleted on ``replica`` since ``snapshot``."""
    written = []
    paths: dict[int, str] | None = None
    for copied, before in snapshot:
        now = copied.__dict__
        if len(now) == len(before) and all(now.get(name, _MISSING) is value for name, value in before.items()):
            continue  # the common case, checked cheaply
        if paths is None:
            paths = {id(module): path for path, module in replica.named_modules()}
        path = paths.get(id(copied), "?")
        transient = _transient(copied)
        for name in sorted(set(now) | set(before)):
            if name in _OWN or name in transient:
                continue
            if now.get(name, _MISSING) is not before.get(name, _MISSING):
                written.append(f"{path}.{name}" if path else name)
    return written


def _transient(module: nn.Module) -> set[str]:
    names = set(getattr(module, "roundpipe_transient", ()))
    for kind, known in TRANSIENT_ATTRIBUTES.items():
        if isinstance(module, kind):
            names |= known
    return names


def rebound_buffers(replica: nn.Module, state: LayerState, buffers: list[torch.Tensor]) -> list[str]:
    """The buffer slots of ``replica`` that no longer hold the tensors :func:`bind` put there (the layer
    assigned new tensors to them in its forward instead of updating them in place)."""
    rebound = []
    for slots, tensor in zip(state.buffer_slots, buffers, strict=True):
        for slot in slots:
            module = replica.get_submodule(slot.module_path) if slot.module_path else replica
            if module._buffers.get(slot.name) is not tensor:
                rebound.append(f"{slot.module_path}.{slot.name}" if slot.module_path else slot.name)
    return rebound


def set_training_flags(replica: nn.Module, flags: list[bool]) -> None:
    """Set each submodule's ``training`` flag, in ``modules()`` order (the host layer's flags at call time)."""
    # not strict: a submodule added to the host layer after its replica was made has no copy to set
    for module, flag in zip(replica.modules(), flags, strict=False):
        module.training = flag

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
attributes (:meth:`Binding.sync_attributes`), so ``layer.scale = 0.5`` or ``dropout.p = 0.2`` set on the host
between steps reaches the devices. The other way does not work: an attribute a layer assigns in its
forward (``self.calls += 1``, ``self.last = x``) lands on the replica, and the host layer never sees
it. :func:`written_attributes` and :meth:`Binding.rebound_buffers` find such writes after a job, so the stage
runner can warn (state belongs in registered buffers updated in place).

Every job binds, syncs, checks and unbinds each of its layers, so the stage runner keeps a :class:`Binding`
per device and layer: the replica with the dictionaries its tensors go into resolved once (no submodule
lookups per job), and what it gave the replica at the last sync, so a job whose host layer and replica are
as the last job left them skips the attribute-by-attribute sync (one identity check per submodule,
done in C).
"""

from __future__ import annotations

import copy
import operator

import torch
from torch import nn

from lightning_roundpipe.engine.layers import LayerState, TensorPath

_OWN = frozenset({"_parameters", "_buffers", "_modules", "training"})
"""Instance attributes a replica keeps its own: its tensor and child tables, and its training flag."""

_MISSING = object()

TRANSIENT_ATTRIBUTES: dict[type, frozenset[str]] = {nn.RNNBase: frozenset({"_flat_weights", "_flat_weight_refs"})}
"""Caches torch modules rebuild in their forward from the bound tensors: rebinding them loses no state. A
layer class declares its own with ``roundpipe_transient = ("name", ...)``."""

AttributeSnapshot = list[tuple[nn.Module, dict]]


def make_replica(layer: nn.Module) -> nn.Module:
    """A structural copy of ``layer`` that shares (does not copy) its parameters, buffers and hooks; its
    tensor tables start as copies of the host layer's, and :meth:`Binding.bind` fills them per job."""
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


def _unchanged(now: dict, before: dict) -> bool:
    """``now`` holds ``before``'s names in the same order, bound to the very same objects. Loops in C (no bytecode
    runs between items, so another thread cannot change ``now`` midway); a dict resized meanwhile counts as
    changed."""
    try:
        return (len(now) == len(before) and all(map(operator.is_, now.values(), before.values()))
                and all(map(operator.eq, now, before)))
    except RuntimeError:  # changed size during iteration
        return False


def module_pairs(replica: nn.Module, host: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """``(replica submodule, host submodule)`` pairs, the layer itself first (the structures match)."""
    return list(zip(replica.modules(), host.modules(), strict=True))


def _sync(copied: nn.Module, original: nn.Module) -> dict:
    """Give ``copied`` the plain attributes of ``original``; returns the host attributes given (a copy)."""
    # a copy taken under the GIL: the main thread may add an attribute to the host module meanwhile
    mine, theirs = copied.__dict__, original.__dict__.copy()
    for name, value in theirs.items():
        if name not in _OWN and mine.get(name, _MISSING) is not value:
            mine[name] = value
    if len(mine) != len(theirs):
        for name in [name for name in mine if name not in theirs]:
            del mine[name]
    return theirs


def written_attributes(replica: nn.Module, snapshot: AttributeSnapshot) -> list[str]:
    """The plain attributes (``path.name``) assigned, added or deleted on ``replica`` since ``snapshot``."""
    written = []
    paths: dict[int, str] | None = None
    for copied, before in snapshot:
        now = copied.__dict__
        if _unchanged(now, before):
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


class Binding:
    """One device's replica of one host layer, and where its tensors go.

    The replica comes from :func:`make_replica`, and is bound once per job: the tensor dictionaries of its
    tensors' paths are looked up once, here, and :meth:`sync_attributes` skips a submodule whose host attributes and
    own attributes are still the very objects of its last sync. Made again (the stage runner drops it)
    when the trunk collects the layer's state again.
    """

    __slots__ = ("replica", "pairs", "modules", "_param_tables", "_buffer_tables", "_synced")

    def __init__(self, host: nn.Module, state: LayerState) -> None:
        self.replica = make_replica(host)
        self.pairs = module_pairs(self.replica, host)
        self.modules = [copied for copied, _ in self.pairs]  # in modules() order, as the training flags are
        self._param_tables = [self._tables(paths, "_parameters") for paths in state.param_paths]
        self._buffer_tables = [self._tables(paths, "_buffers") for paths in state.buffer_paths]
        # per pair, after its last full sync: the host attributes given, and the replica's own attributes
        self._synced: list[tuple[dict, dict] | None] = [None] * len(self.pairs)

    def _tables(self, paths: list[TensorPath], kind: str) -> list[tuple[dict, str]]:
        tables = []
        for where in paths:
            module = self.replica.get_submodule(where.module_path) if where.module_path else self.replica
            tables.append((getattr(module, kind), where.name))
        return tables

    def bind(self, params: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        """Make the replica compute with ``params`` and ``buffers`` (device tensors, in the state's order)."""
        for tables, tensor in zip(self._param_tables, params, strict=True):
            for table, name in tables:
                table[name] = tensor
        self.bind_buffers(buffers)

    def bind_buffers(self, buffers: list[torch.Tensor]) -> None:
        for tables, tensor in zip(self._buffer_tables, buffers, strict=True):
            for table, name in tables:
                table[name] = tensor

    def unbind(self, state: LayerState) -> None:
        """Point the replica back at ``state``'s host tensors, dropping its references to device memory."""
        self.bind(list(state.params), list(state.buffers))

    def set_training_flags(self, flags: tuple[bool, ...] | list[bool]) -> None:
        """Set each submodule's ``training`` flag, in ``modules()`` order (the host layer's flags at call time)."""
        # not strict: a submodule added to the host layer after its replica was made has no copy to set
        for module, flag in zip(self.modules, flags, strict=False):
            if module.training != flag:
                module.training = flag

    def sync_attributes(self) -> AttributeSnapshot:
        """Give every replica submodule its host module's current plain attributes (the tables and ``training``
        excepted); return a snapshot of them for :func:`written_attributes`. The snapshot's dicts may be shared
        with later jobs' snapshots: read only."""
        snapshot = []
        for index, (copied, original) in enumerate(self.pairs):
            synced = self._synced[index]
            if synced is not None and _unchanged(original.__dict__, synced[0]) and _unchanged(copied.__dict__,
                                                                                                synced[1]):
                snapshot.append((copied, synced[1]))  # both sides as the last sync left them
                continue
            given = _sync(copied, original)
            kept = dict(copied.__dict__)
            self._synced[index] = (given, kept)
            snapshot.append((copied, kept))
        return snapshot

    def rebound_buffers(self, state: LayerState, buffers: list[torch.Tensor]) -> list[str]:
        """The buffer entries that no longer hold the tensors :meth:`bind` put there (``buffers``): the layer
        assigned new tensors to them in its forward instead of updating them in place."""
        rebound = []
        for tables, paths, tensor in zip(self._buffer_tables, state.buffer_paths, buffers, strict=True):
            for (table, name), where in zip(tables, paths, strict=True):
                if table.get(name) is not tensor:
                    rebound.append(f"{where.module_path}.{where.name}" if where.module_path else where.name)
        return rebound

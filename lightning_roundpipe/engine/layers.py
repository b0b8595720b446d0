"""The trunk: the ordered layers the pipeline runs, and which parameters each layer owns.

A trunk is built from an ``nn.Sequential`` (each child is a layer). Layer 0 receives the caller's
arguments; every later layer receives the previous layer's output as its single argument (a tensor,
or a tuple/dict of tensors and plain values). Other module shapes get a trunk through a *preset*:
a function that returns the layers of a known model family (see :func:`build_trunk`).

A parameter may be used by several layers (a tied embedding and head). Each layer then uploads and
differentiates its own device copy; the host sums those gradients once into the one parameter, and
the optimizer steps it once, because the module's parameter is the only master copy.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_roundpipe.engine.transfer import nbytes_of, tensors_nbytes

LayerInput = tuple[tuple[Any, ...], dict[str, Any]]
"""What a trunk layer is called with, ``(args, kwargs)``: the caller's for layer 0, the previous layer's
output as the single positional argument for every later one (see :func:`as_layer_input`)."""


def as_layer_input(output: Any) -> LayerInput:
    """A layer's output as the next layer's input: its single positional argument."""
    return (output,), {}


def single_argument(layer_input: LayerInput) -> Any:
    """The output that :func:`as_layer_input` wrapped: what the last layer before ``layer_input`` returned."""
    return layer_input[0][0]


@dataclass(frozen=True)
class TensorPath:
    """Where a parameter or buffer sits inside a layer: ``layer.get_submodule(module_path)._parameters[name]``."""

    module_path: str
    name: str


@dataclass
class LayerState:
    """The parameters and buffers one layer reads, each listed once even if registered at several paths."""

    params: list[nn.Parameter] = field(default_factory=list)
    param_paths: list[list[TensorPath]] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    buffer_paths: list[list[TensorPath]] = field(default_factory=list)

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.params if p.requires_grad]

    def param_bytes(self) -> int:
        """What one upload of the layer copies: its parameters and buffers."""
        return tensors_nbytes(self.params) + tensors_nbytes(self.buffers)

    def grad_bytes(self) -> int:
        return tensors_nbytes(self.trainable)


class Trunk:
    """An ordered list of layers with known parameter ownership."""

    def __init__(self, layers: list[nn.Module], source: str = "nn.Sequential") -> None:
        if not layers:
            raise ValueError(
                f"the trunk ({source}) has no layers: give `pipeline` a module with at least one child "
                "layer, e.g. an nn.Sequential(embedding, *blocks, head)"
            )
        for index, layer in enumerate(layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"trunk layer {index} is a {type(layer).__name__}, not an nn.Module")
        self.layers = list(layers)
        self.source = source
        collected = [_collect_state(layer) for layer in self.layers]
        self.states = [state for state, _ in collected]
        self._registrations = [registration for _, registration in collected]
        self._all = Registration.joined(self._registrations)
        _check_buffers(self.states)

    def __len__(self) -> int:
        return len(self.layers)

    def changed_layers(self) -> list[int]:
        """The layers whose registered state is no longer what :attr:`states` holds: a parameter, buffer or
        submodule assigned anew (``module.running_mean = torch.zeros(...)``, ``module.weight = nn.Parameter(...)``,
        ``load_state_dict(..., assign=True)``), added or removed, a tensor given other memory or another dtype
        through ``.data`` (``param.data = ...``, ``module.to(torch.float64)``). In-place writes (``copy_``, a
        plain ``load_state_dict``) keep the tensors, and freezing or unfreezing (``requires_grad_``, which
        Lightning's ``toggle_optimizer`` does every step) keeps them too: neither is a change. One pass
        of identity and pointer checks over the whole trunk (see :class:`Registration`), then per layer only
        when something changed."""
        if not self._all.changed():
            return []
        return [index for index, registration in enumerate(self._registrations) if registration.changed()]

    def recollect(self, index: int) -> tuple[LayerState, set[int]]:
        """Collect layer ``index``'s state again (after :meth:`changed_layers` named it); returns the state it
        replaces and the ids of the new state's tensors that are new objects or have new memory (or dtype)."""
        old_state, old_registration = self.states[index], self._registrations[index]
        state, registration = _collect_state(self.layers[index])
        _check_buffers([*self.states[:index], state, *self.states[index + 1:]])
        kept = old_registration.unchanged_tensors()
        renewed = {id(tensor) for tensor in (*state.params, *state.buffers) if id(tensor) not in kept}
        self.states[index], self._registrations[index] = state, registration
        self._all = Registration.joined(self._registrations)
        return old_state, renewed

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of the trunk once, in layer order."""
        seen: set[int] = set()
        for state in self.states:
            for param in state.params:
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def describe_parameters(self) -> str:
        """The trunk's parameters on the host by trainable/frozen and dtype, e.g. for LoRA: ``trainable 327,680
        float32 (1.2 MiB); frozen 12,517,376 bfloat16 (23.9 MiB)``. Frozen ones are kept and uploaded as stored."""
        groups: dict[tuple[bool, torch.dtype], list[int]] = {}
        for param in self.parameters():
            counts = groups.setdefault((param.requires_grad, param.dtype), [0, 0])
            counts[0] += param.numel()
            counts[1] += nbytes_of(param)
        trainable_first = sorted(groups.items(), key=lambda item: (not item[0][0], str(item[0][1])))
        parts = [
            f"{'trainable' if trainable else 'frozen'} {count:,} {str(dtype).removeprefix('torch.')} "
            f"({size / 2**20:.1f} MiB)"
            for (trainable, dtype), (count, size) in trainable_first
        ]
        return "; ".join(parts) or "no parameters"


def parameter_count(module: nn.Module) -> int:
    """The parameter elements ``module`` holds: each parameter once, a tied one too (how trunks are compared)."""
    return sum(p.numel() for p in module.parameters())


_DATA_PTR = torch.Tensor.data_ptr


class Registration:
    """What some layers had registered when their state was collected, to tell cheaply when that changed.

    Between steps a callback may give a layer new tensors: Lightning's ``StochasticWeightAveraging`` assigns
    new BatchNorm running statistics, ``load_state_dict(assign=True)`` new parameters, ``module.to(dtype)``
    new memory to the same parameters (through ``.data``). The engine's view of the layer (its
    :class:`LayerState`, the upload copies, the device replicas) must follow, or it keeps training tensors the
    module no longer holds. :meth:`changed` compares, by identity, every entry of every parameter, buffer and
    submodule table with what was collected (and the tables' sizes: an entry added), and every collected
    tensor's data pointer. The memory collected is kept allocated until the next collection, so no other
    memory can get its address meanwhile: an equal pointer is the same memory (a new dtype is new memory).
    Parallel lists compared by C-level ``map``: under 2 us per layer of a transformer block's size."""

    def __init__(self) -> None:
        self.tables: list[dict[str, Any]] = []     # every table, and its size when collected
        self.sizes: list[int] = []
        self.entry_tables: list[dict[str, Any]] = []  # every entry: its table, name and what it held
        self.names: list[str] = []
        self.values: list[Any] = []
        self.tensors: list[torch.Tensor] = []      # the collected tensors and their data pointers
        self.pointers: list[int] = []
        self.storages: list[torch.UntypedStorage] = []  # their memory, kept allocated while compared

    def record(self, table: dict[str, Any]) -> None:
        self.tables.append(table)
        self.sizes.append(len(table))
        for name, value in table.items():
            self.entry_tables.append(table)
            self.names.append(name)
            self.values.append(value)

    def record_tensors(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.pointers = [tensor.data_ptr() for tensor in tensors]
        self.storages = [storage for storage in map(_storage, tensors) if storage is not None]

    @staticmethod
    def joined(registrations: list[Registration]) -> Registration:
        """One registration comparing all of ``registrations`` at once (the fast path of a trunk's check)."""
        joined = Registration()
        for registration in registrations:
            for name in ("tables", "sizes", "entry_tables", "names", "values", "tensors", "pointers"):
                getattr(joined, name).extend(getattr(registration, name))
        return joined

    def changed(self) -> bool:
        return not (list(map(len, self.tables)) == self.sizes
                    and all(map(operator.is_, map(dict.get, self.entry_tables, self.names), self.values))
                    and list(map(_DATA_PTR, self.tensors)) == self.pointers)

    def unchanged_tensors(self) -> set[int]:
        """Ids of the collected tensors that still have the memory they had."""
        return {id(tensor) for tensor, pointer in zip(self.tensors, self.pointers, strict=True)
                if tensor.data_ptr() == pointer}


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return tensor.untyped_storage()
    except RuntimeError:  # a wrapper subclass has no memory of its own (and a data pointer of 0)
        return None


def _collect_state(layer: nn.Module) -> tuple[LayerState, Registration]:
    state = LayerState()
    registration = Registration()
    # per kind: a module's own table (every entry, also a tensor's second one), the lists it fills, and
    # where each tensor already sits in them
    kinds: tuple[tuple[str, list[Any], list[list[TensorPath]], dict[int, int]], ...] = (
        ("_parameters", state.params, state.param_paths, {}),
        ("_buffers", state.buffers, state.buffer_paths, {}),
    )
    for path, module in layer.named_modules(remove_duplicate=False):
        registration.record(module._modules)
        for table, tensors, paths, position in kinds:
            entries = getattr(module, table)
            registration.record(entries)
            for name, tensor in entries.items():
                if tensor is None:
                    continue
                if id(tensor) not in position:  # a tensor registered at several paths is listed once
                    position[id(tensor)] = len(tensors)
                    tensors.append(tensor)
                    paths.append([])
                paths[position[id(tensor)]].append(TensorPath(path, name))
    registration.record_tensors([*state.params, *state.buffers])
    return state, registration


def _check_buffers(states: list[LayerState]) -> None:
    buffer_owners: dict[int, list[int]] = {}
    for index, state in enumerate(states):
        for buffer in state.buffers:
            if buffer.requires_grad:
                raise ValueError(f"a buffer of trunk layer {index} requires grad; buffers must not")
            buffer_owners.setdefault(id(buffer), []).append(index)
    shared_buffers = {k: v for k, v in buffer_owners.items() if len(v) > 1}
    if shared_buffers:
        layers_str = sorted({i for v in shared_buffers.values() for i in v})
        raise ValueError(
            f"trunk layers {layers_str} share a buffer; layers run on different devices at once, so "
            "a shared buffer would be written from two places. Register the buffer in one layer only."
        )


Preset = Callable[[nn.Module], "list[nn.Module] | None"]


def build_trunk(module: nn.Module, presets: tuple[Preset, ...] = ()) -> Trunk:
    """Turn ``module`` into a trunk: the first preset that recognises it wins, else an ``nn.Sequential``."""
    for preset in presets:
        layers = preset(module)
        if layers is not None:
            return Trunk(layers, source=f"{type(module).__name__} via {getattr(preset, '__name__', 'preset')}")
    if isinstance(module, nn.Sequential):
        return Trunk(list(module.children()), source="nn.Sequential")
    raise TypeError(
        f"cannot pipeline a {type(module).__name__}: the trunk must be an nn.Sequential (each child is a "
        "layer) or a model family with a preset. Wrap your blocks in nn.Sequential, or point `pipeline` at "
        "the attribute that holds one."
    )

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

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class TensorSlot:
    """Where a parameter or buffer sits inside a layer: ``layer.get_submodule(module_path)._parameters[name]``."""

    module_path: str
    name: str


@dataclass
class LayerState:
    """The parameters and buffers one layer reads, each listed once even if used at several slots."""

    params: list[nn.Parameter] = field(default_factory=list)
    param_slots: list[list[TensorSlot]] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    buffer_slots: list[list[TensorSlot]] = field(default_factory=list)

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.params if p.requires_grad]

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params) + sum(
            b.numel() * b.element_size() for b in self.buffers
        )

    def grad_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.trainable)


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
        self.states = [_collect_state(layer) for layer in self.layers]
        owners: dict[int, list[int]] = {}
        for index, state in enumerate(self.states):
            for param in state.params:
                owners.setdefault(id(param), []).append(index)
            for buffer in state.buffers:
                if buffer.requires_grad:
                    raise ValueError(f"a buffer of trunk layer {index} requires grad; buffers must not")
        self.shared_param_layers = {key: idx for key, idx in owners.items() if len(idx) > 1}
        buffer_owners: dict[int, list[int]] = {}
        for index, state in enumerate(self.states):
            for buffer in state.buffers:
                buffer_owners.setdefault(id(buffer), []).append(index)
        shared_buffers = {k: v for k, v in buffer_owners.items() if len(v) > 1}
        if shared_buffers:
            layers_str = sorted({i for v in shared_buffers.values() for i in v})
            raise ValueError(
                f"trunk layers {layers_str} share a buffer; layers run on different devices at once, so "
                "a shared buffer would be written from two places. Register the buffer in one layer only."
            )

    def __len__(self) -> int:
        return len(self.layers)

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
            counts[1] += param.numel() * param.element_size()
        parts = [
            f"{'trainable' if trainable else 'frozen'} {count:,} {str(dtype).removeprefix('torch.')} "
            f"({nbytes / 2**20:.1f} MiB)"
            for (trainable, dtype), (count, nbytes) in sorted(groups.items(), key=lambda item: (not item[0][0], str(item[0][1])))
        ]
        return "; ".join(parts) or "no parameters"


def _collect_state(layer: nn.Module) -> LayerState:
    state = LayerState()
    param_index: dict[int, int] = {}
    buffer_index: dict[int, int] = {}
    for path, module in layer.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is None:
                continue
            slot = TensorSlot(path, name)
            if id(param) in param_index:
                state.param_slots[param_index[id(param)]].append(slot)
            else:
                param_index[id(param)] = len(state.params)
                state.params.append(param)
                state.param_slots.append([slot])
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            slot = TensorSlot(path, name)
            if id(buffer) in buffer_index:
                state.buffer_slots[buffer_index[id(buffer)]].append(slot)
            else:
                buffer_index[id(buffer)] = len(state.buffers)
                state.buffers.append(buffer)
                state.buffer_slots.append([slot])
    return state


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

"""The layers of a traced trunk (:mod:`~lightning_roundpipe.traced`): each holds the modules and tensors it owns
and runs its part of the graph recorded for the call's input signature; and those signatures (what a recorded
graph is specialized to: shapes, dtypes, other arguments, ``training`` flags).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_roundpipe.engine.transfer import NoGrad, tree_flatten
from lightning_roundpipe.hf.base_model import draws_functional_dropout

if TYPE_CHECKING:
    from lightning_roundpipe.traced import Registry


class Modes:
    """The ``training`` flags of the traced modules at a call: part of the signature a graph is recorded
    for (a forward may branch on ``self.training``). Passed to the prologue as its first argument, an
    opaque value every microbatch gets whole."""

    __slots__ = ("key",)

    def __init__(self, key: tuple[bool, ...]) -> None:
        self.key = key


@dataclass
class Program:
    """One layer's code for one signature: ``fn(layer, *inputs)`` returns the values live after it (or,
    for the last layer, the output's computed leaves); ``constant_in``/``constant_out`` say which of those
    travel in the ``NoGrad`` (values that follow from the signature alone)."""

    fn: Callable[..., Any]
    constant_in: tuple[bool, ...]
    constant_out: tuple[bool, ...]


@dataclass
class Captured:
    programs: list[Program]
    out_spec: pytree.TreeSpec
    out_leaves: list[Any]  # the output's leaves: None where the last program computes one, else the value
    computed: list[bool]


class TracedLayer(nn.Module):
    """A layer of a traced trunk: holds (outside the user's module tree) the modules and tensors it owns at
    their paths within the root, so the recorded code's ``self.path.to.module`` finds them here (or in a
    device replica of this layer)."""

    def __init__(self, index: int, label: str, registry: Registry) -> None:
        super().__init__()
        self.index = index
        self.label = label
        self.registry = registry  # plain attribute: shared with the replicas, never part of the state

    def mount(self, path: str, value: nn.Module | torch.Tensor) -> None:
        owner: nn.Module = self
        *parents, leaf = path.split(".")
        for part in parents:
            child = owner._modules.get(part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        if isinstance(value, nn.Module):
            owner.add_module(leaf, value)
        elif isinstance(value, nn.Parameter):
            owner.register_parameter(leaf, value)
        else:
            owner.register_buffer(leaf, value)

    @property
    def roundpipe_random(self) -> bool:  # a random op in the recorded code (functional dropout, say)
        return self.index in self.registry.random_layers or draws_functional_dropout(self)

    def extra_repr(self) -> str:
        return self.label

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        registry = self.registry
        inputs: list[Any]
        if self.index == 0:
            modes, *given = args
            leaves, spec = tree_flatten((tuple(given), kwargs))
            sig = signature(leaves, spec)
            ident = registry.ids.get((modes.key, sig))
            if ident is None:
                raise RuntimeError(f"RoundPipe has recorded no graph for the inputs {describe_signature(sig)} "
                                   "(TracedForward records one before each call)")
            captured = registry.captured[ident]
            inputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        else:
            (carried,) = args
            ident, data, constants = carried
            captured = registry.captured[ident]
            inputs = _merge(data, constants.values, captured.programs[self.index].constant_in)
        program = captured.programs[self.index]
        outputs = program.fn(self, *inputs)
        if self.index < len(captured.programs) - 1:
            data = tuple(v for v, constant in zip(outputs, program.constant_out, strict=True) if not constant)
            constants = tuple(v for v, constant in zip(outputs, program.constant_out, strict=True) if constant)
            return ident, data, NoGrad(values=constants)
        computed = iter(outputs)
        leaves = [next(computed) if is_computed else leaf
                  for leaf, is_computed in zip(captured.out_leaves, captured.computed, strict=True)]
        return pytree.tree_unflatten(leaves, captured.out_spec)


def _merge(data: tuple[Any, ...], constants: tuple[Any, ...], mask: tuple[bool, ...]) -> list[Any]:
    """The live values in order, from the differentiable ones and the ``NoGrad`` ones. A ``torch.device``
    recorded earlier (``x.device``) is this layer's device now: the layers run on different devices."""
    here = next((v.device for v in (*data, *constants) if isinstance(v, torch.Tensor)), None)
    data_iter, constant_iter = iter(data), iter(constants)
    values = [next(constant_iter) if constant else next(data_iter) for constant in mask]
    if here is not None:
        values = [here if isinstance(v, torch.device) else v for v in values]
    return values


def signature(leaves: list[Any], spec: Any, samples: int | None = None) -> tuple[Any, ...]:
    """What a recorded graph is specialized to: the structure, each tensor's shape (dim 0 given as
    ``samples`` when set) and dtype, and the other arguments' values."""
    parts: list[Any] = [spec]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            shape = tuple(leaf.shape)
            if samples is not None and shape:
                shape = (samples, *shape[1:])
            parts.append(("tensor", shape, leaf.dtype))
        else:
            try:
                hash(leaf)
                parts.append(("value", type(leaf), leaf))
            except TypeError:
                parts.append(("object", id(leaf)))
    return tuple(parts)


def describe_signature(sig: tuple[Any, ...]) -> str:
    """``(float32[4, 8], int64[4, 8], None)``: the inputs a signature stands for."""
    shown = []
    for kind, *rest in sig[1:]:
        if kind == "tensor":
            shape, dtype = rest
            shown.append(f"{str(dtype).removeprefix('torch.')}{list(shape)}")
        else:
            shown.append(repr(rest[1]) if kind == "value" else "an object")
    return f"({', '.join(shown)})"

"""Host <-> device copies of tensors and of pytrees of tensors.

Copies are always real copies, also between CPU devices: aliasing a host tensor would let a device
see a later write to it (the optimizer's, say) and hide staleness and fencing bugs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

HOST = torch.device("cpu")


class NoGrad:
    """Values that travel between layers with the activations but take no gradient.

    Attention masks, rotary tables and labels are computed once per microbatch by the first layer and
    read by the later ones. Wrapped in a ``NoGrad`` they are copied wherever the activations go (to a
    device, into a recompute checkpoint) but are never made differentiable, so no gradient the size of
    an attention mask is computed or sent back. They are read-only: layers must not modify them in place
    (checkpoints share them instead of cloning). Fields are read as attributes: ``context.labels``.
    """

    __slots__ = ("_fields",)

    def __init__(self, **fields: Any) -> None:
        object.__setattr__(self, "_fields", fields)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(f"this NoGrad has no field {name!r} (it has {sorted(self._fields)})") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("NoGrad is immutable: make a new one with replace(...)")

    def replace(self, **fields: Any) -> NoGrad:
        return NoGrad(**{**self._fields, **fields})

    def map_tensors(self, fn: Any) -> NoGrad:
        return NoGrad(**pytree.tree_map(lambda leaf: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf,
                                        self._fields))

    def tensors(self) -> list[torch.Tensor]:
        return [leaf for leaf in pytree.tree_leaves(self._fields) if isinstance(leaf, torch.Tensor)]

    def __repr__(self) -> str:
        return f"NoGrad({', '.join(sorted(self._fields))})"


def copy_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A detached copy of ``tensor`` on ``device`` that shares no memory with it."""
    copied = tensor.detach().to(device, copy=True)
    return copied


def _map_tensors(fn: Any, tree: Any) -> Any:
    def apply(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return fn(leaf)
        return leaf.map_tensors(fn) if isinstance(leaf, NoGrad) else leaf

    return pytree.tree_map(apply, tree)


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif isinstance(leaf, NoGrad):
            found.extend(leaf.tensors())
    return found


def copy_tree(tree: Any, device: torch.device) -> Any:
    """Copy every tensor of ``tree`` (also inside a :class:`NoGrad`) to ``device``; other leaves are kept."""
    return _map_tensors(lambda tensor: copy_tensor(tensor, device), tree)


def clone_tree(tree: Any) -> Any:
    """Clone every tensor of ``tree`` on its own device; a :class:`NoGrad` is read-only and shared."""
    return pytree.tree_map(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, tree)


def tree_nbytes(tree: Any) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in _tensors(tree))


def detach_tree(tree: Any) -> Any:
    return pytree.tree_map(lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf, tree)


def differentiable_leaves(tree: Any) -> list[torch.Tensor]:
    """The floating-point tensors of ``tree`` outside any :class:`NoGrad`: the ones a gradient can flow through."""
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]

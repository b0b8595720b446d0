"""Host <-> device copies of tensors and of pytrees of tensors.

Copies are always real copies, also between CPU devices: aliasing a host tensor would let a device
see a later write to it (the optimizer's, say) and hide staleness and fencing bugs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

HOST = torch.device("cpu")


def copy_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A detached copy of ``tensor`` on ``device`` that shares no memory with it."""
    copied = tensor.detach().to(device, copy=True)
    return copied


def copy_tree(tree: Any, device: torch.device) -> Any:
    """Copy every tensor of ``tree`` to ``device``; other leaves are kept as they are."""
    return pytree.tree_map(lambda leaf: copy_tensor(leaf, device) if isinstance(leaf, torch.Tensor) else leaf, tree)


def clone_tree(tree: Any) -> Any:
    """Clone every tensor of ``tree`` on its own device."""
    return pytree.tree_map(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, tree)


def tree_nbytes(tree: Any) -> int:
    return sum(
        leaf.numel() * leaf.element_size() for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)
    )


def detach_tree(tree: Any) -> Any:
    return pytree.tree_map(lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf, tree)


def differentiable_leaves(tree: Any) -> list[torch.Tensor]:
    """The floating-point tensors of ``tree``: the ones a gradient can flow through."""
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]

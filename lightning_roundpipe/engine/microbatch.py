"""Split a batch into microbatches and merge per-microbatch outputs back.

The rule, the same everywhere: every tensor with at least one dimension is split on dim 0, all such
tensors must agree on that size, and everything else (0-dim tensors, plain values) is replicated.
``n`` samples in ``M`` microbatches give sizes that differ by at most one, the larger ones first
(``torch.tensor_split``'s rule: 10 in 4 -> 3, 3, 2, 2). A batch with fewer samples than ``M`` uses
one microbatch per sample, never an empty one; an empty batch (0 samples) is an error.

What is a container and what is a value:

* Containers are walked, and every microbatch gets a container of the same type and structure:
  tuples, lists, dicts, namedtuples (anything ``torch.utils._pytree`` knows) and dataclass instances
  (their ``init`` fields, rebuilt by calling the class; see :mod:`lightning_roundpipe.engine.transfer`).
* Every leaf that is not a tensor with a dim 0 is a value, replicated whole to every microbatch:
  strings, numbers, ``None``, 0-dim tensors, any other object. The trunk's first layer sees the same
  values it would see without microbatches.
* Lists are containers, not per-sample columns: a list of ``B`` strings (one id per sample) is ``B``
  values, and every microbatch gets all ``B`` of them, not its own share. To have per-sample values
  follow the split, make them a tensor (e.g. indices into a host-side list).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_roundpipe.engine.transfer import spec_has_dataclass, tree_flatten, tree_leaves, tree_unflatten


def microbatch_sizes(num_samples: int, num_microbatches: int) -> list[int]:
    """Sizes of the microbatches ``num_samples`` are split into (at most ``num_microbatches`` of them)."""
    if num_samples < 1:
        raise ValueError("the batch is empty (0 samples on dim 0); the pipeline needs at least one sample")
    count = min(num_samples, num_microbatches)
    base, extra = divmod(num_samples, count)
    return [base + 1 if index < extra else base for index in range(count)]


def batch_size(tree: Any, what: str = "inputs") -> int | None:
    """The common dim-0 size of the tensors in ``tree`` that have a dim 0, or ``None`` if there are none."""
    sizes = [leaf.shape[0] for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    if not sizes:
        return None
    if any(size != sizes[0] for size in sizes):
        raise ValueError(
            f"the tensors in the {what} have different sizes on dim 0 ({sizes}), so they cannot be split into "
            "microbatches. Make dim 0 the batch dimension of every tensor with one, or set `num_microbatches=1`."
        )
    return sizes[0]


def split(tree: Any, sizes: list[int]) -> list[Any]:
    """Split every tensor with a dim 0 of ``tree`` into chunks of ``sizes``; replicate the rest. One size:
    ``tree`` itself, whose tensors the one chunk would only view whole."""
    if len(sizes) == 1:
        return [tree]
    leaves, spec = tree_flatten(tree)
    columns = [
        torch.split(leaf, sizes) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else [leaf] * len(sizes)
        for leaf in leaves
    ]
    return [tree_unflatten([column[m] for column in columns], spec) for m in range(len(sizes))]


def merge(outputs: list[Any]) -> Any:
    """Concatenate per-microbatch outputs on dim 0; plain values must agree across microbatches. One output's
    tensors are not copied (checked as any): a language model's logits are most of the host's activations."""
    flat = [tree_flatten(output) for output in outputs]
    spec = flat[0][1]
    if spec_has_dataclass(spec):
        # the engine wires the merged output into autograd with plain ``_pytree``, which sees a dataclass
        # as one opaque leaf: its tensors would be left out of the backward
        raise ValueError(
            "the trunk returned a dataclass instance; its output must be tensors, or tuples, lists or dicts of "
            "them (dataclasses are fine as inputs, between layers and into the loss of `pipeline_loss`)"
        )
    for index, (_, other) in enumerate(flat[1:], start=1):
        if other != spec:
            raise ValueError(
                f"microbatch {index} returned an output of a different structure than microbatch 0 "
                f"({other} vs {spec}); the trunk's output must have the same structure for every microbatch"
            )
    merged = []
    for position, column in enumerate(zip(*(leaves for leaves, _ in flat), strict=True)):  # one spec: checked above
        first = column[0]
        if isinstance(first, torch.Tensor):
            if first.dim() == 0:
                raise ValueError(
                    f"output leaf {position} is a 0-dim tensor, which cannot be merged across microbatches "
                    "(sum or mean?). Return per-sample values with a batch dim 0, or compute the loss in the "
                    "last stage with `forward_backward`/`pipeline_loss`."
                )
            merged.append(torch.cat(column, dim=0) if len(column) > 1 else first)
        else:
            if any(value != first for value in column[1:]):
                raise ValueError(
                    f"output leaf {position} is a {type(first).__name__} that differs between microbatches "
                    f"({column[0]!r} vs others); only tensors are concatenated, plain values must agree"
                )
            merged.append(first)
    return tree_unflatten(merged, spec)


LossWeight = Callable[[Any], "int | float | torch.Tensor"]


def sample_count(target: Any) -> int:
    """Default loss weight: the number of samples, so a per-microbatch mean becomes the batch mean."""
    size = batch_size(target, "target")
    return 1 if size is None else size


def token_count(ignore_index: int = -100) -> LossWeight:
    """Loss weight for a token-mean loss: the number of target entries that are not ``ignore_index``."""

    def count(target: Any) -> torch.Tensor:
        leaves = [leaf for leaf in tree_leaves(target) if isinstance(leaf, torch.Tensor)]
        return sum((leaf != ignore_index).sum() for leaf in leaves)  # type: ignore[return-value]

    count.__name__ = f"token_count(ignore_index={ignore_index})"
    return count

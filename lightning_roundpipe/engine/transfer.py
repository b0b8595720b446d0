"""Host <-> device copies of tensors and of pytrees of tensors, and the tree walk every module uses.

Copies are always real copies, also between CPU devices: aliasing a host tensor would let a device
see a later write to it (the optimizer's, say) and hide staleness and fencing bugs.

Trees are ``torch.utils._pytree`` trees (tuples, lists, dicts, namedtuples and every type registered
with it) and, on top, **dataclass instances**, which ``_pytree`` treats as opaque leaves unless they are
registered. Here an unregistered dataclass instance is a container like a dict of its fields: the
fields with ``init=True`` (in ``dataclasses.fields`` order) are walked, and it is rebuilt by calling
its class with them, as ``dataclasses.replace`` does (fields with ``init=False`` are left to
``__post_init__`` and defaults). A dataclass registered with ``_pytree`` follows its registration.
Only one thing is registered with ``_pytree``, globally, at import: the private node type
:class:`_Fields`. Only this module makes instances of it (:func:`tree_flatten`, :func:`tree_unflatten`,
:func:`tree_map` and :func:`tree_leaves` open dataclasses up into them for the duration of a call), so
every other tree, in this package or outside it, flattens exactly as it would without the registration.

:func:`upload_to` and :func:`download_to_host` are a stage boundary's copies on a device stream: they own
what makes such a copy safe without a host sync on a GPU (``record_stream``, a CUDA event after the
copies) and complete on a CPU stand-in (a synchronize, at which stress mode's late copies land).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

HOST = torch.device("cpu")


class _Fields:
    """A dataclass instance opened up for ``_pytree``: its class, its init field names and their values."""

    __slots__ = ("cls", "names", "values")

    def __init__(self, cls: type, names: tuple[str, ...], values: list[Any]) -> None:
        self.cls, self.names, self.values = cls, names, values

    def rebuild(self) -> Any:
        return self.cls(**dict(zip(self.names, (_close(value) for value in self.values), strict=True)))


# the one global registration (see the module docstring): harmless, as no other code makes a `_Fields`
pytree.register_pytree_node(
    _Fields, lambda node: (node.values, (node.cls, node.names)),
    lambda values, context: _Fields(context[0], context[1], list(values)),
)


def _is_dataclass_instance(leaf: Any) -> bool:
    return not isinstance(leaf, (torch.Tensor, type)) and dataclasses.is_dataclass(leaf)


def _open(tree: Any) -> Any:
    """``tree`` with every (unregistered) dataclass instance replaced by a :class:`_Fields` node."""
    def open_leaf(leaf: Any) -> Any:
        if not _is_dataclass_instance(leaf):
            return leaf
        names = tuple(field.name for field in dataclasses.fields(leaf) if field.init)
        return _Fields(type(leaf), names, [_open(getattr(leaf, name)) for name in names])

    return pytree.tree_map(open_leaf, tree)


def _close(tree: Any) -> Any:
    """The inverse of :func:`_open`: rebuild the dataclass instances."""
    is_fields = lambda node: isinstance(node, _Fields)  # noqa: E731
    return pytree.tree_map(lambda node: node.rebuild() if is_fields(node) else node, tree, is_leaf=is_fields)


def spec_has_dataclass(spec: pytree.TreeSpec) -> bool:
    """Whether a spec from :func:`tree_flatten` holds a dataclass instance."""
    children = getattr(spec, "children", None)  # a method in newer torch; older ones have `children_specs`
    return spec.type is _Fields or any(
        spec_has_dataclass(child) for child in (children() if callable(children) else spec.children_specs))


def tree_flatten(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """``_pytree.tree_flatten`` that also walks into dataclass instances (see the module docstring)."""
    leaves, spec = pytree.tree_flatten(tree)
    if any(_is_dataclass_instance(leaf) for leaf in leaves):
        leaves, spec = pytree.tree_flatten(_open(tree))
    return leaves, spec


def tree_unflatten(leaves: list[Any], spec: pytree.TreeSpec) -> Any:
    """The inverse of :func:`tree_flatten`."""
    tree = pytree.tree_unflatten(leaves, spec)
    return _close(tree) if spec_has_dataclass(spec) else tree


# The trees the engine walks many times per step (a layer's ``((tensor,), {})``, a stage's outputs) are plain
# tuples, lists and dicts around tensors. ``_pytree`` walks those in 10-20 us a call; the plain walk below takes
# a tenth of that and gives the same leaves in the same order (a dict's in insertion order, ``None`` a leaf), the
# same containers around ``tree_map``'s results. Any other type (a namedtuple, an ``OrderedDict``, a dataclass, a
# ``NoGrad``, a tensor subclass other than ``Parameter``, anything registered with ``_pytree``) takes the
# general path.
_PLAIN_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str})


def _plain_leaves(tree: Any, leaves: list[Any]) -> bool:
    """Append the leaves of ``tree`` to ``leaves`` if it is plain (see above); False, with ``leaves`` partly
    filled, at the first thing that is not."""
    kind = type(tree)
    if kind is tuple or kind is list:
        return all(_plain_leaves(child, leaves) for child in tree)
    if kind is dict:
        return all(_plain_leaves(child, leaves) for child in tree.values())
    if kind in _PLAIN_LEAF_TYPES:
        leaves.append(tree)
        return True
    return False


def _plain_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """:func:`tree_map` of a plain tree (checked by the caller)."""
    kind = type(tree)
    if kind is tuple:
        return tuple(_plain_map(fn, child) for child in tree)
    if kind is list:
        return [_plain_map(fn, child) for child in tree]
    if kind is dict:
        return {key: _plain_map(fn, child) for key, child in tree.items()}
    return fn(tree)


def tree_leaves(tree: Any) -> list[Any]:
    leaves: list[Any] = []
    return leaves if _plain_leaves(tree, leaves) else tree_flatten(tree)[0]


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to every leaf of ``tree``, the containers (dataclasses too) rebuilt around the results."""
    if _plain_leaves(tree, []):
        return _plain_map(fn, tree)
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([fn(leaf) for leaf in leaves], spec)


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
        raise AttributeError("NoGrad is immutable: make a new one")

    def map_tensors(self, fn: Any) -> NoGrad:
        return NoGrad(**tree_map(lambda leaf: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf, self._fields))

    def tensors(self) -> list[torch.Tensor]:
        return [leaf for leaf in tree_leaves(self._fields) if isinstance(leaf, torch.Tensor)]

    def __repr__(self) -> str:
        return f"NoGrad({', '.join(sorted(self._fields))})"


#: Host-to-GPU copies larger than this are issued in pieces of this size, so that an activation upload
#: on the device's other upload stream slots in between them instead of waiting behind one long copy.
UPLOAD_CHUNK_BYTES = 64 * 2**20


def copy_tensor(tensor: torch.Tensor, device: torch.device, non_blocking: bool = False,
                pin: bool = False) -> torch.Tensor:
    """A detached copy of ``tensor`` on ``device`` that shares no memory with it.

    ``non_blocking`` (host-to-GPU uploads) and ``pin`` (GPU-to-host downloads, into pinned memory from
    torch's caching host allocator, so the next upload of it is fast and asynchronous too): enqueue on
    the current CUDA stream and return; the caller synchronizes that stream before anyone may rely on
    the copy or modify or free the source."""
    source = tensor.detach()
    if pin and device.type == "cpu" and source.device.type == "cuda":
        target = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        return target.copy_(source, non_blocking=True)
    if device.type != "cuda" or source.device.type != "cpu" or not non_blocking:
        return source.to(device, copy=True)
    target = torch.empty_like(source, device=device)
    if nbytes_of(source) <= UPLOAD_CHUNK_BYTES or not source.is_contiguous():
        return target.copy_(source, non_blocking=True)
    flat_source, flat_target = source.view(-1), target.view(-1)
    step = max(1, UPLOAD_CHUNK_BYTES // source.element_size())
    for start in range(0, flat_source.numel(), step):
        flat_target[start:start + step].copy_(flat_source[start:start + step], non_blocking=True)
    return target


def _map_tensors(fn: Any, tree: Any) -> Any:
    def apply(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return fn(leaf)
        return leaf.map_tensors(fn) if isinstance(leaf, NoGrad) else leaf

    return tree_map(apply, tree)


def tree_tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor of ``tree``, also those inside a :class:`NoGrad`."""
    found: list[torch.Tensor] = []
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif isinstance(leaf, NoGrad):
            found.extend(leaf.tensors())
    return found


def copy_tree(tree: Any, device: torch.device, non_blocking: bool = False, pin: bool = False) -> Any:
    """Copy every tensor of ``tree`` (also inside a :class:`NoGrad`) to ``device``; other leaves are kept.
    ``non_blocking`` and ``pin``: see :func:`copy_tensor`."""
    return _map_tensors(lambda tensor: copy_tensor(tensor, device, non_blocking, pin), tree)


def clone_tree(tree: Any) -> Any:
    """Clone every tensor of ``tree`` on its own device; a :class:`NoGrad` is read-only and shared."""
    return tree_map(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, tree)


def nbytes_of(tensor: torch.Tensor) -> int:
    """The bytes of ``tensor``'s elements (a view counts its own elements, not its whole storage)."""
    return tensor.numel() * tensor.element_size()


def tensors_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of all of ``tensors``, each counted as often as it appears."""
    return sum(nbytes_of(tensor) for tensor in tensors)


def tree_nbytes(tree: Any) -> int:
    """The bytes of every tensor of ``tree`` (also inside a :class:`NoGrad`)."""
    return tensors_nbytes(tree_tensors(tree))


def differentiable_leaves(tree: Any) -> list[torch.Tensor]:
    """The floating-point tensors of ``tree`` outside any :class:`NoGrad`: the ones a gradient can flow through."""
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]


class CopyStream(Protocol):
    """What the stage-boundary copies need of a device stream (``device.Stream``); they run as one of its
    operations."""

    cuda_stream: torch.cuda.Stream | None
    stress: bool

    def copy_late(self, sources: Iterable[torch.Tensor], targets: Iterable[torch.Tensor]) -> None: ...

    def mark(self) -> torch.cuda.Event | None: ...

    def synchronize(self) -> None: ...


def upload_to(tree: Any, device: torch.device, stream: CopyStream, consumer: CopyStream) -> Any:
    """Copy ``tree`` to ``device`` on ``stream``, for operations on ``consumer`` to read (which waits for the
    copies' event).

    On a CPU stand-in the copies are complete (in stress mode: landed) on return, so the host sources may be
    dropped. On CUDA there is no host sync: a source may be dropped while its copy runs, as torch's caching
    host allocator keeps a pinned block (every download lands in one) until the copies recorded on it have
    run, and a pageable source is staged before the copy call returns; the consumer waits for the copies on
    the GPU. The copies, allocated on ``stream``, are recorded on the consumer's: its thread drops them as
    soon as it has enqueued its kernels, so the allocator must not reuse them before those kernels have run."""
    copied = copy_tree(tree, device, non_blocking=device.type == "cuda")
    if stream.stress:  # they land late, at the synchronize below
        stream.copy_late(tree_tensors(tree), tree_tensors(copied))
    if device.type != "cuda":
        stream.synchronize()
    if consumer.cuda_stream is not None:
        for tensor in tree_tensors(copied):
            if tensor.is_cuda:  # (all of them: copied to the device) record_stream has no CPU kernel
                tensor.record_stream(consumer.cuda_stream)
    return copied


def download_to_host(tree: Any, stream: CopyStream, *, pin: bool) -> tuple[Any, torch.cuda.Event | None]:
    """Copy ``tree`` (device tensors) to the host on ``stream``; returns the host copy and, on a GPU, a CUDA
    event after the copies (None on a CPU stand-in, whose copies are complete on return).

    On a GPU no host sync: a reading stream waits for the event on the GPU and a host reader synchronizes
    it; the device tensors, recorded on ``stream``, keep their memory until the copies are done even if the
    caller drops them at once. ``pin``: into pinned host memory (see :func:`copy_tensor`)."""
    host = copy_tree(tree, HOST, pin=pin)
    released = tree_tensors(tree)
    if stream.stress:  # the host copies land late, at the synchronize below
        stream.copy_late(released, tree_tensors(host))
    copied = stream.mark()
    if copied is None or stream.cuda_stream is None:
        stream.synchronize()
    else:
        for tensor in released:
            if tensor.is_cuda:  # a layer may return a CPU tensor (in a NoGrad, say): no CPU kernel, nothing to keep
                tensor.record_stream(stream.cuda_stream)
    return host, copied

"""Activations inside a stage's compute: what autograd keeps for backward, counted as the layers save it.

The residency accounting (``device.py``) sees the tensors the engine itself holds: stage copies and
stage-boundary activations. What a fused or backward stage keeps *inside* its compute, from a layer's
forward to the backward that frees it, it would never see: the tensors autograd saves for backward (the
layers' inputs and intermediate results and, under autocast, the low-precision copies of the weights it
casts on every call, which the matmuls save). :class:`ActivationMeter` counts them with saved-tensor hooks
as they are saved, each storage once, and holds them in the device's residency from the layer that saved
them until the backward that freed them, so the accounted peak includes them and a device that would
run out raises :class:`~lightning_roundpipe.engine.device.OutOfDeviceMemory` instead of a CUDA
out-of-memory error. Each layer's figure (per microbatch) also goes to the planner, which sizes the fused
and backward stages with it.

Not counted: temporaries that live within one op or one layer call and are never saved (an attention score
matrix before its softmax, say); the activation reserve of the budget (``partition.ACTIVATION_RESERVE``)
covers them.

Counting costs a Python call per saved tensor in the forward, and one per saved tensor in the backward (the
unpack hook, which saved-tensor hooks cannot go without), where autograd must take the GIL for it: beside the
engine's other threads that stalls the backward. The unpack hook therefore only returns what ``pack`` kept
(releases are counted at :meth:`ActivationMeter.release`, after the backward, not per tensor), and a meter
can hold known figures instead (``figures``): it charges each layer's figure to the residency as the layer
runs and installs no hook. A stage's compute is metered until its figures have settled for the inputs'
shapes, then ever less often (see ``feedback.Measurements.activation_meter``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch

from lightning_roundpipe.engine.device import Residency


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """A key for the memory ``tensor`` lives in, and that memory's bytes (a view counts its whole storage:
    the storage is what stays allocated)."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no plain storage (a sparse or wrapper tensor): its own bytes
        return id(tensor), tensor.numel() * tensor.element_size()
    return storage.data_ptr(), storage.nbytes()


def _unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    """What autograd gets back: the detached tensor ``pack`` kept (autograd gives a saved output its
    ``grad_fn`` again). Runs on autograd's device thread with the GIL, so it does little: with hooks autograd
    skips its own check that a saved tensor was not written in place since, so it is made here."""
    tensor, version = packed
    if tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: a "
            f"{tuple(tensor.shape)} {tensor.dtype} tensor saved for backward is at version {tensor._version}; "
            f"expected version {version} instead (as plain PyTorch reports it: write a new tensor instead of "
            "modifying one an earlier operation saved)")
    return tensor


class ActivationMeter:
    """Counts what one microbatch's compute saves for backward, in ``residency``.

    ``accounted``: tensors already counted elsewhere (the stage's parameters and buffers, the microbatch's
    inputs), which a layer may save without any new memory. Used from the compute stream's thread only.

    ``figures`` (per layer, bytes): do not count, charge these instead, each layer's once between releases
    (:attr:`measured` is then False and :attr:`by_layer` stays empty). ``key``: the caller's, carried along.
    """

    def __init__(self, residency: Residency, accounted: Iterable[torch.Tensor],
                 figures: Mapping[int, int] | None = None, key: Hashable = None) -> None:
        self._residency = residency
        self._figures = figures
        self.measured = figures is None        # counted as saved, not charged from figures
        self.key = key
        self._accounted = frozenset(_storage(tensor)[0] for tensor in accounted) if figures is None else frozenset()
        self._seen: set[int] = set(self._accounted)
        self._charged: set[int] = set()       # figures: the layers charged since the last release
        self.held = 0                         # bytes held in the residency now
        self.by_layer: dict[int, int] = {}    # bytes each layer saved, this microbatch (measured only)

    @contextmanager
    def saving(self, layer: int) -> Iterator[None]:
        """Count what runs inside as saved by ``layer``; allocated in the residency once it has run. With
        ``figures``: the layer's figure, the first time it runs since the last release."""
        if self._figures is not None:
            yield
            if layer not in self._charged:
                self._charged.add(layer)
                charged = self._figures.get(layer, 0)
                self._residency.allocate(charged, f"the activations layer {layer} keeps for backward")
                self.held += charged
            return
        saved = 0

        def pack(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
            nonlocal saved
            key, nbytes = _storage(tensor)
            if key not in self._seen:
                self._seen.add(key)
                saved += nbytes
            # detached: a saved *output* kept with its grad_fn would form the cycle output -> grad_fn ->
            # saved variable -> this hook's result -> output, which nothing frees when the graph is dropped
            # without a backward (a microbatch whose loss has weight 0, a stage no gradient reaches).
            # Lossless: the detached tensor shares the version counter, which _unpack checks
            return tensor.detach(), tensor._version

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield
        self.by_layer[layer] = self.by_layer.get(layer, 0) + saved
        self._residency.allocate(saved, f"the activations layer {layer} keeps for backward")
        self.held += saved

    def release(self) -> None:
        """The backward has run: what was saved is freed (its memory may hold new tensors from now on)."""
        self._residency.release(self.held)
        self.held = 0
        self._seen = set(self._accounted)
        self._charged.clear()

"""What devices upload for each weight, and in which dtype.

PCIe bytes decide tokens/s in this design, so under mixed precision the weights that autocast would
cast anyway travel already cast. A weight qualifies when every place it sits in the trunk is the
``weight`` or ``bias`` of a module whose forward is the stock ``nn.Linear`` or ``nn.Conv1d/2d/3d`` one:
autocast runs those ops in its low-precision dtype and casts all three operands first, so a weight
uploaded in that dtype gives the same result, bit for bit, with half the bytes on the bus and on the
device. Everything else (norms, embeddings, a weight some other module also reads) is uploaded as stored.

The host keeps one low-precision copy of each such weight, made with one cast per optimizer step rather
than one per upload, and devices read it:

* sync mode: the optimizer thread refreshes the copy right after the step, before the uploads that
  wait for the step's weights run (2 bytes per parameter on the host, for bfloat16 and float16). A
  master written outside a step (a callback swapping in averaged weights, ``load_state_dict``) is seen by
  its version counter and cast again at its next upload, so sync mode stays exact;
* async mode: the copy *is* the async step's published copy (``step/__init__.py``, refreshed at publish), so one copy
  serves both jobs and costs nothing extra; the other trainable weights keep a published copy in their
  own dtype.

Gradients of low-precision weights are computed in that dtype on the device, as under plain autocast (where
the cast's gradient is the low-precision one), and summed over a job's microbatches in the master's dtype
(float32) on the device, as plain autocast sums them into the float32 ``param.grad``
(:class:`WideGradSums`: 4 bytes per such parameter on the device, counted in :func:`layer_device_bytes`);
the host adds the jobs' sums into float32 (``GradWindow``).

A call that does not run under autocast in the transport dtype (an evaluation outside the precision
context, say) uploads full precision: the masters in sync mode, the published copy widened back in async
mode.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from lightning_roundpipe.engine.device import AbortSignal
from lightning_roundpipe.engine.layers import LayerState, Trunk
from lightning_roundpipe.engine.pinned import PinnedStorages

_AUTOCAST_FORWARDS = frozenset({nn.Linear.forward, nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward})
"""Module forwards that use their ``weight`` and ``bias`` in one autocast-listed op (a matmul or a conv)."""


def transport_torch_dtype(name: str) -> torch.dtype | None:
    """The dtype an ``EngineOptions.transport_dtype`` names: None for ``"off"``, and for ``"auto"``, which
    only the strategy resolves (it knows the precision)."""
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name)


def autocast_only_weights(trunk: Trunk, dtype: torch.dtype) -> list[set[int]]:
    """Per trunk layer, the ids of its float32 parameters (wider than ``dtype``) that it uses only as a stock
    Linear's or Conv's ``weight`` or ``bias`` (which autocast casts to ``dtype`` before use). Per layer
    because each layer's upload is its own: a tied embedding and LM head is a lookup table in the
    embedding's layer (uploaded as stored) and a matmul weight in the head's (uploaded cast)."""
    return [layer_autocast_only_weights(layer, state, dtype) for layer, state in zip(trunk.layers, trunk.states,
                                                                                     strict=True)]


def layer_autocast_only_weights(layer: nn.Module, state: LayerState, dtype: torch.dtype) -> set[int]:
    """:func:`autocast_only_weights` of one layer. Autocast casts float32 tensors only (a float64 weight, of a
    module made float64 mid-training say, stays float64 under autocast), so only float32 weights qualify."""
    return {id(param) for param, paths in zip(state.params, state.param_paths, strict=True)
            if param.dtype == torch.float32 and param.element_size() > dtype.itemsize and all(
                where.name in ("weight", "bias")
                and type(layer.get_submodule(where.module_path)).forward in _AUTOCAST_FORWARDS for where in paths)}


def layer_device_bytes(state: LayerState, low_precision: set[int], transport: torch.dtype | None) -> tuple[int, int]:
    """One upload of a layer under autocast in the ``transport`` dtype, ``low_precision`` being the layer's
    ids from :func:`autocast_only_weights`: its parameter and buffer bytes on the device, and the bytes of
    the gradients a differentiating job keeps there (in the master's dtype: a low-precision weight's are
    summed over the microbatches in it, :class:`WideGradSums`)."""
    def size(param: nn.Parameter) -> int:
        itemsize = transport.itemsize if transport is not None and id(param) in low_precision else param.element_size()
        return param.numel() * itemsize

    params = sum(size(param) for param in state.params)
    buffers = sum(buffer.numel() * buffer.element_size() for buffer in state.buffers)
    return params + buffers, sum(param.numel() * param.element_size() for param in state.params if param.requires_grad)


def _low_by_layer(trunk: Trunk, transport: torch.dtype | None) -> list[set[int]]:
    return autocast_only_weights(trunk, transport) if transport is not None else [set() for _ in trunk.states]


def _low_sets(trunk: Trunk, low_by_layer: list[set[int]]) -> tuple[set[int], set[int]]:
    """The ids of the parameters some layer uploads in low precision, and of those every layer that reads
    them does (async publishes these in low precision only)."""
    anywhere = set().union(*low_by_layer)
    everywhere = set(anywhere)
    for state, low in zip(trunk.states, low_by_layer, strict=True):
        everywhere -= {id(param) for param in state.params} - low
    return anywhere, everywhere


def _copies_needed(trunk: Trunk, low_by_layer: list[set[int]], async_step: bool,
                   published_before: Iterable[int] = ()) -> tuple[set[int], set[int]]:
    """The ids of the parameters that get a low-precision copy (some layer uploads them in low precision), and
    in async mode those that get a full-precision published copy: every trainable parameter some layer reads
    in full precision. A frozen one in ``published_before`` keeps the copy it has (published while it was
    trainable: current again at the next publish)."""
    anywhere, everywhere = _low_sets(trunk, low_by_layer)
    before = set(published_before)
    published = {id(param) for param in trunk.parameters()
                 if async_step and (param.requires_grad or id(param) in before) and id(param) not in everywhere}
    return anywhere, published


def read_low_precision_only(trunk: Trunk, transport: torch.dtype | None) -> list[nn.Parameter]:
    """The trunk's parameters that every layer reading them uploads from a low-precision copy: under autocast no
    upload reads their masters (``offload="optimizer+masters"`` keeps those masters on disk)."""
    everywhere = _low_sets(trunk, _low_by_layer(trunk, transport))[1]
    return [param for param in trunk.parameters() if id(param) in everywhere]


def layer_sizes(trunk: Trunk, transport: torch.dtype | None) -> list[tuple[int, int]]:
    """:func:`layer_device_bytes` of every trunk layer."""
    return [layer_device_bytes(state, low, transport)
            for state, low in zip(trunk.states, _low_by_layer(trunk, transport), strict=True)]


def upload_copy_bytes(trunk: Trunk, *, async_step: bool, transport: torch.dtype | None) -> tuple[int, int]:
    """What :class:`UploadSources` will hold on the host, from sizes alone: the bytes of its copies, and the
    bytes uploads under autocast read (the copies, the masters uploaded as stored and the buffers: what the
    engine pins for CUDA devices)."""
    low_by_layer = _low_by_layer(trunk, transport)
    low, published = _copies_needed(trunk, low_by_layer, async_step)
    copies = 0
    for param in trunk.parameters():
        if transport is not None and id(param) in low:
            copies += param.numel() * transport.itemsize
        if id(param) in published:
            copies += param.numel() * param.element_size()
    read = copies
    read_masters: set[int] = set()
    for state, low_ids in zip(trunk.states, low_by_layer, strict=True):
        for param in state.params:
            as_stored = id(param) not in low_ids and not (async_step and param.requires_grad)
            if as_stored and id(param) not in read_masters:
                read_masters.add(id(param))
                read += param.numel() * param.element_size()
        read += sum(buffer.numel() * buffer.element_size() for buffer in state.buffers)
    return copies, read


class UploadSources:
    """The host tensors devices upload each trunk parameter from.

    ``async_step``: trainable weights are read from a published copy (see ``step/__init__.py``), never from the
    masters the optimizer writes. ``transport``: the low-precision dtype of autocast-only weights (see the
    module docstring), or None to upload every weight as stored. ``module_dtypes``: by id, the dtype the module
    gave each weight kept at compute width (``frozen_weights.py``), which a call outside autocast computes in.
    ``copies``: low-precision copies made already, by parameter id (``master_files.py``), taken instead of made.
    """

    def __init__(self, trunk: Trunk, *, async_step: bool, transport: torch.dtype | None,
                 module_dtypes: Mapping[int, torch.dtype] | None = None,
                 copies: Mapping[int, torch.Tensor] | None = None) -> None:
        self.transport = transport
        self._module_dtypes: Mapping[int, torch.dtype] = module_dtypes if module_dtypes is not None else {}
        self._async = async_step
        self._low_by_layer: list[set[int]] = [set() for _ in trunk.states]
        self._low: dict[int, torch.Tensor] = {}        # low-precision copies
        self._published: dict[int, torch.Tensor] = {}  # async: full-precision copies some layer reads
        self._versions: dict[int, int] = {}            # sync: the master's version when its low copy was made
        self._lock = threading.Lock()  # two devices may upload a weight shared by their stages at once
        self._made: dict[int, torch.Tensor] = dict(copies or {})  # the constructor's follow takes them
        self.follow(trunk, range(len(trunk.states)), renewed=set())  # every copy made from the masters now
        self._made = {}

    def follow(self, trunk: Trunk, layers: Iterable[int], renewed: set[int]) -> None:
        """Follow the trunk after :meth:`Trunk.recollect` gave ``layers`` new states. ``renewed``: ids of
        parameters that are new objects or have new memory (or dtype); their copies are made again from the
        masters as they are now, so the next upload reads the new value (in async mode too). Copies of
        parameters the trunk no longer holds are dropped; those of the others are kept as they are (async:
        still the published weights). Call it while nothing uploads or publishes (the engine waits for its
        jobs and steps first)."""
        transport = self.transport
        for layer in layers:
            self._low_by_layer[layer] = (layer_autocast_only_weights(trunk.layers[layer], trunk.states[layer],
                                                                     transport) if transport is not None else set())
        current = {id(param): param for param in trunk.parameters()}
        low, published = _copies_needed(trunk, self._low_by_layer, self._async, self._published)
        with torch.no_grad(), self._lock:
            for key in [key for key in self._low if key not in low or key in renewed]:
                del self._low[key], self._versions[key]
            for key in [key for key in self._published if key not in published or key in renewed]:
                del self._published[key]
            for key in low - self._low.keys():
                assert transport is not None
                made = self._made.pop(key, None)
                self._low[key] = made if made is not None else current[key].detach().to(transport, copy=True)
                self._versions[key] = current[key]._version
            for key in published - self._published.keys():
                self._published[key] = current[key].detach().clone()

    def module_dtype(self, param: nn.Parameter) -> torch.dtype:
        """The dtype a call outside autocast computes ``param`` in: the module's (wider than stored for a weight
        kept at compute width)."""
        return self._module_dtypes.get(id(param), param.dtype)

    def is_low_precision(self, layer: int, param: nn.Parameter) -> bool:
        """Whether ``layer`` uploads ``param`` in the transport dtype (under autocast in that dtype)."""
        return id(param) in self._low_by_layer[layer]

    def source(self, param: nn.Parameter, layer: int, low_precision: bool) -> torch.Tensor:
        """What ``layer`` uploads for ``param``. ``low_precision``: the call runs under autocast in the
        transport dtype. Otherwise the result may still be a low-precision copy in async mode: widen it on
        the device (a weight only ever read as a matmul weight is published in that dtype only)."""
        key = id(param)
        if low_precision and key in self._low_by_layer[layer]:
            if not self._async and param._version != self._versions[key]:
                self.refresh([param])  # written since its copy was made, outside an optimizer step
            return self._low[key]
        if self._async and param.requires_grad:
            copy = self._published.get(key)
            if copy is None:
                copy = self._low.get(key)
            return copy if copy is not None else self._publish_late(param)
        return param.detach()

    def _publish_late(self, param: nn.Parameter) -> torch.Tensor:
        """Async: the published copy of a parameter that had none, frozen when the copies were made and made
        trainable since (Lightning's ``BaseFinetuning`` unfreezes layers between epochs). While it was frozen no
        step changed it (it had no gradient), so its master is what it would have published; later publishes
        refresh it like the others. Not pinned (uploads of it stage through pageable memory)."""
        with torch.no_grad(), self._lock:
            key = id(param)
            if key not in self._published:  # two devices may reach it at once
                self._published[key] = param.detach().clone()
            return self._published[key]

    def refresh(self, params: Iterable[nn.Parameter]) -> None:
        """Copy the masters of ``params`` into their upload copies, casting where the copy is low precision:
        after a sync step, or at an async publish."""
        with torch.no_grad(), self._lock:
            for param in params:
                key = id(param)
                for copies in (self._low, self._published):
                    if key in copies:
                        copies[key].copy_(param.detach())
                if key in self._versions:
                    self._versions[key] = param._version

    def nbytes(self) -> int:
        """Host bytes of the copies."""
        return sum(copy.untyped_storage().nbytes() for copy in (*self._low.values(), *self._published.values()))


GRAD_STAGING_BUFFERS = 2
"""Host buffers per device that gradients download into (:class:`GradStaging`)."""


class GradStaging:
    """The host memory a device's gradients download into: a few buffers (two by default), one per job whose
    gradients are on their way into the step's window. The download thread takes a free buffer, copies a
    job's gradients into it, releases the stage and hands the buffer to the summing thread
    (``step/summing.py``), which gives it back once the window has summed out of it. So the next job's
    downloads overlap this job's sum, and the download thread waits only while every buffer is still being
    summed, which also bounds the host memory gradients in transit take.

    Each buffer is reused job after job, so no download page-faults fresh memory, and on CUDA (``pin``:
    registered with CUDA in place) a non-blocking copy into it runs at full bus speed. A buffer is exactly as
    large as the largest job it has held (no power-of-two rounding, as torch's caching host allocator would
    give), and one outgrown is unregistered and freed at once. CPU stand-ins reuse theirs too (stress mode
    poisons a buffer once it is summed)."""

    _ALIGN = 64  # bytes: every view starts on a cache line

    def __init__(self, *, pin: bool = False, count: int = GRAD_STAGING_BUFFERS) -> None:
        self._pinned = PinnedStorages() if pin else None
        self._free = [StagingBuffer(self) for _ in range(count)]
        self._all = list(self._free)
        self._lock = threading.Lock()
        self._available = threading.Event()
        self._available.set()

    def acquire(self, abort: AbortSignal) -> StagingBuffer:
        """A free buffer, once one is (each is given back with :meth:`StagingBuffer.release`)."""
        while True:
            with self._lock:
                if self._free:
                    buffer = self._free.pop()
                    if not self._free:
                        self._available.clear()
                    return buffer
            abort.wait(self._available, "a gradient staging buffer (every one still being summed on the host)")

    def _give_back(self, buffer: StagingBuffer) -> None:
        with self._lock:
            self._free.append(buffer)
            self._available.set()

    def _allocate(self, nbytes: int, outgrown: torch.Tensor | None) -> torch.Tensor:
        memory = torch.empty(nbytes, dtype=torch.uint8)
        if self._pinned is not None:
            # the outgrown buffer is unregistered here, before it is freed; once the driver has refused a buffer,
            # its successors stay pageable without asking again (and warning again)
            self._pinned.keep_only([tensor for tensor in self.allocated() if tensor is not outgrown])
            if self._pinned.refused is None:
                self._pinned.pin([memory])
        return memory

    def allocated(self) -> list[torch.Tensor]:
        """The buffers' host memory."""
        return [buffer.memory for buffer in self._all if buffer.memory is not None]

    def nbytes(self) -> int:
        return sum(memory.numel() for memory in self.allocated())

    def release(self) -> None:
        """Unregister the buffers (the engine has stopped: no copy reads them any more)."""
        if self._pinned is not None:
            self._pinned.release()


class StagingBuffer:
    """One buffer of a :class:`GradStaging`: host tensors for one job's gradients at a time."""

    _KEPT_LAYOUTS = 16  # the views of this many layouts are kept (a device's jobs each have one)

    def __init__(self, staging: GradStaging) -> None:
        self._staging = staging
        self.memory: torch.Tensor | None = None
        self._views: dict[tuple[tuple[torch.dtype, torch.Size], ...], list[torch.Tensor]] = {}

    def views(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors shaped like ``tensors``, carved out of the buffer's memory (grown if too small).

        The views of a layout (the dtypes and shapes, in order) are made once per memory and kept: a job's
        gradients then download with no tensor call besides their copies. Each torch call releases the GIL and
        takes it back, which, while another thread runs Python (Lightning's loop, the user's hooks), can wait
        for that thread's switch interval: carving 28 views took 68 ms beside a busy Python thread, 0.08 alone."""
        layout = tuple((tensor.dtype, tensor.shape) for tensor in tensors)
        kept = self._views.get(layout)
        if kept is not None:
            return list(kept)
        align = GradStaging._ALIGN
        sizes = [tensor.numel() * tensor.element_size() for tensor in tensors]
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-size // align) * align
        if self.memory is None or self.memory.numel() < total:
            outgrown, self.memory = self.memory, None
            self._views.clear()  # views of the outgrown memory would keep it alive
            self.memory = self._staging._allocate(total, outgrown)
            del outgrown  # freed now, after its registration
        memory = self.memory
        made = [memory[offset:offset + size].view(tensor.dtype).view(tensor.shape)
                for tensor, offset, size in zip(tensors, offsets, sizes, strict=True)]
        if len(self._views) >= self._KEPT_LAYOUTS:
            del self._views[next(iter(self._views))]  # the oldest layout
        self._views[layout] = made
        return list(made)

    def release(self) -> None:
        """The window has summed out of this buffer's tensors: the next job may use it."""
        self._staging._give_back(self)


class WideGradSums:
    """A device's sums, over a job's microbatches, of the gradients of its low-precision leaves (weights uploaded
    in the transport dtype), in the master's dtype. Under plain autocast each microbatch's gradient of a
    float32 weight is the low-precision gradient cast to float32 and summed into ``param.grad`` in float32;
    accumulated into a bfloat16 leaf instead, M microbatches would round the sum M times to bfloat16. A hook
    after each accumulation moves the leaf's gradient into its sum here (in microbatch order, as plain training
    adds them) and clears it."""

    def __init__(self) -> None:
        self._sums: dict[int, torch.Tensor] = {}  # by id of the leaf, until the job's finish takes it

    def watch(self, leaves: Iterable[tuple[torch.Tensor, torch.dtype]]) -> int:
        """Sum the gradients of each ``(leaf, dtype)`` in ``dtype``; returns the device bytes of the sums."""
        nbytes = 0
        for leaf, dtype in leaves:
            leaf.register_post_accumulate_grad_hook(functools.partial(self._add, dtype))
            nbytes += leaf.numel() * dtype.itemsize
        return nbytes

    def _add(self, dtype: torch.dtype, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        if grad is None:
            return
        total = self._sums.get(id(leaf))
        if total is None:
            self._sums[id(leaf)] = grad.to(dtype)
        else:
            total.add_(grad)  # promoted: the low-precision gradient widened exactly, then a sum in ``dtype``

    def gradient(self, leaf: torch.Tensor) -> torch.Tensor | None:
        """The job's gradient of ``leaf``: its sum where it has one (taken out of here), else ``leaf.grad``."""
        total = self._sums.pop(id(leaf), None)
        return total if total is not None else leaf.grad

"""Host tensors pinned in place, so host-to-GPU copies of them run at full speed without a staging copy.

``tensor.pin_memory()`` copies into torch's caching host allocator, which rounds every block up to a
power of two: pinning a model that way can nearly double its host memory. Registering the existing
storage with CUDA (``cudaHostRegister``, portable to every device's context) pins it where it is, at its
exact size. When the driver refuses (no CUDA, a sandbox without page pinning, a range someone else
registered), those tensors stay pageable and the engine warns, saying how many bytes of how many storages:
uploads from them then go through a staging copy, slower but correct. A refusal does not stop the others.

The driver pins whole pages, and refuses a range that overlaps one already registered: two small tensors
(norm weights, biases) often share a page. So the storages' page ranges are coalesced, every page registered
once: a registered range holds every storage whose pages touch it, and is unregistered (or registered again
over what is still wanted) only once its storages are dropped (:meth:`PinnedStorages.keep_only`).

The calls run on a short-lived helper thread. torch's binding does not clear a failed call's error, and
the CUDA runtime keeps it in the calling thread's last-error slot, where the next kernel launched on that
thread would raise it as an unrelated "CUDA error". On the helper thread it ends with the thread.
"""

from __future__ import annotations

import bisect
import mmap
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the current one
PAGE_BYTES = mmap.PAGESIZE  # the driver's grain of registration


def _on_helper_thread(work: Callable[[], T]) -> T:
    """``work()`` on a fresh thread (on the caller's CUDA device), returning its result or raising its error."""
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            outcome["result"] = work()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread below
            outcome["error"] = error

    thread = threading.Thread(target=run, name="roundpipe-pin", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def cuda_error_text(cudart: Any, status: Any) -> str:
    """``"<name> (error <code>)"`` from the runtime's own description when the binding has it."""
    describe = getattr(cudart, "cudaGetErrorString", None)
    text = ""
    if describe is not None:
        try:
            text = str(describe(status))
        except (TypeError, RuntimeError, ValueError):  # an older binding that wants another argument type
            text = ""
    return f"{text} (error {int(status)})" if text else f"error {int(status)}"


@dataclass(eq=False)  # compared and hashed by identity: one object per registration
class _Range:
    """Registered pages ``[start, end)`` and the storages on them, held so that their memory stays allocated
    while registered."""

    start: int
    end: int
    storages: dict[int, torch.UntypedStorage] = field(default_factory=dict)  # data pointer -> storage


def _pages(pointer: int, nbytes: int) -> tuple[int, int]:
    """The page-aligned range ``[start, end)`` holding ``nbytes`` bytes from ``pointer``."""
    return pointer // PAGE_BYTES * PAGE_BYTES, -(-(pointer + nbytes) // PAGE_BYTES) * PAGE_BYTES


def _coalesce(storages: dict[int, torch.UntypedStorage]) -> list[_Range]:
    """The storages' page ranges, those that share a page merged: each page in one range."""
    ranges: list[_Range] = []
    for pointer, storage in sorted(storages.items()):
        start, end = _pages(pointer, storage.nbytes())
        if ranges and start < ranges[-1].end:
            ranges[-1].end = max(ranges[-1].end, end)
        else:
            ranges.append(_Range(start, end))
        ranges[-1].storages[pointer] = storage
    return ranges


class PinnedStorages:
    """Registers the storages of host tensors with CUDA, page-coalesced (module docstring); :meth:`release`
    unregisters them. Call it while no copy reads the registered memory (the engine's start, or once every job
    has finished): ranges are unregistered and registered again as storages come and go.

    A registered storage is kept alive until its range is unregistered (:meth:`keep_only`, :meth:`release`): a
    module may drop a tensor the engine pinned (a callback assigns a new buffer, ``param.data = ...``), and
    memory freed while registered could be handed out again, still registered, or unmapped under the
    driver's registration.

    ``refused``: what the driver refused (``None`` while it refused nothing); :attr:`pageable_bytes` and
    :attr:`pageable_storages`: what stays pageable of what the engine still uses."""

    def __init__(self) -> None:
        self._ranges: list[_Range] = []            # registered, sorted by start, disjoint
        self._registered: dict[int, _Range] = {}   # data pointer of each storage held -> its range
        self._pageable: dict[int, int] = {}        # data pointer of each refused storage -> its bytes
        self.refused: str | None = None

    @property
    def pageable_bytes(self) -> int:
        return sum(self._pageable.values())

    @property
    def pageable_storages(self) -> int:
        return len(self._pageable)

    @property
    def registered_ranges(self) -> int:
        """How many ranges are registered (each a ``cudaHostRegister`` call)."""
        return len(self._ranges)

    def pin(self, tensors: Iterable[torch.Tensor]) -> None:
        """Register what of ``tensors``' storages is not registered yet (a tensor pinned by someone else, such as
        ``pin_memory()``'s, is left alone); warn saying what stayed pageable."""
        new: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            pointer, nbytes = storage.data_ptr(), storage.nbytes()
            if tensor.device.type != "cpu" or nbytes == 0 or pointer in self._registered or pointer in new:
                continue
            start, end = _pages(pointer, nbytes)
            within = self._overlapping(start, end)
            if len(within) == 1 and within[0].start <= start and end <= within[0].end:
                within[0].storages[pointer] = storage  # its pages are registered already: one more holder
                self._registered[pointer] = within[0]
            elif within or not tensor.is_pinned():  # is_pinned() is also true on our own ranges
                new[pointer] = storage
        if not new:
            return
        merged = {range_ for pointer, storage in new.items()
                  for range_ in self._overlapping(*_pages(pointer, storage.nbytes()))}
        for range_ in merged:  # registered again together with the new storages that share their pages
            new.update(range_.storages)
        self._replace(list(merged), new)

    def keep_only(self, tensors: Iterable[torch.Tensor]) -> None:
        """Unregister the storages that none of ``tensors`` uses any more (then they may be freed): a range whose
        storages are all dropped is unregistered, one with some still used is registered again over those."""
        wanted = {tensor.untyped_storage().data_ptr() for tensor in tensors if tensor.device.type == "cpu"}
        self._pageable = {pointer: nbytes for pointer, nbytes in self._pageable.items() if pointer in wanted}
        for range_ in [range_ for range_ in self._ranges if not wanted.issuperset(range_.storages)]:
            kept = {pointer: storage for pointer, storage in range_.storages.items() if pointer in wanted}
            coalesced = _coalesce(kept)
            if len(coalesced) == 1 and (coalesced[0].start, coalesced[0].end) == (range_.start, range_.end):
                # the kept storages touch every page of the range: it stays as registered, and what the dropped
                # ones free (heap memory between them) cannot be unmapped under the registration
                for pointer in set(range_.storages) - set(kept):
                    del range_.storages[pointer], self._registered[pointer]
            else:
                self._replace([range_], kept)

    def release(self) -> None:
        self._replace(list(self._ranges), {})

    def _overlapping(self, start: int, end: int) -> list[_Range]:
        """The registered ranges that share a page with ``[start, end)``."""
        first = max(0, bisect.bisect_right(self._ranges, start, key=lambda range_: range_.start) - 1)
        found = []
        for range_ in self._ranges[first:]:
            if range_.start >= end:
                break
            if range_.end > start:
                found.append(range_)
        return found

    def _replace(self, dropped: list[_Range], storages: dict[int, torch.UntypedStorage]) -> None:
        """Unregister ``dropped``, then register ``storages`` page-coalesced: each refusal leaves its storages
        pageable, the others are registered all the same."""
        wanted = _coalesce(storages)
        if not dropped and not wanted:
            return  # no CUDA call (none is possible without CUDA)

        def apply() -> list[tuple[_Range, str]]:
            cudart = torch.cuda.cudart()
            for range_ in dropped:
                cudart.cudaHostUnregister(range_.start)
            refusals = []
            for range_ in wanted:
                status = cudart.cudaHostRegister(range_.start, range_.end - range_.start, HOST_REGISTER_PORTABLE)
                if int(status) != 0:
                    refusals.append((range_, cuda_error_text(cudart, status)))
            return refusals

        try:
            refusals = _on_helper_thread(apply)
        finally:  # the dropped storages go only now, after their registration
            for range_ in dropped:
                self._ranges.remove(range_)
                for pointer in range_.storages:
                    self._registered.pop(pointer, None)
        refused = {range_ for range_, _ in refusals}
        for range_ in wanted:
            if range_ in refused:
                self._pageable.update((pointer, storage.nbytes()) for pointer, storage in range_.storages.items())
                continue
            bisect.insort(self._ranges, range_, key=lambda registered: registered.start)
            for pointer in range_.storages:
                self._registered[pointer] = range_
                self._pageable.pop(pointer, None)
        if refusals:
            self._warn_refused(refusals)

    def _warn_refused(self, refusals: list[tuple[_Range, str]]) -> None:
        nbytes = sum(storage.nbytes() for range_, _ in refusals for storage in range_.storages.values())
        count = sum(len(range_.storages) for range_, _ in refusals)
        errors = sorted({error for _, error in refusals})
        self.refused = (f"cudaHostRegister refused {len(refusals)} range(s): {nbytes} bytes of {count} tensor "
                        f"storage(s) stay pageable ({'; '.join(errors)})")
        warnings.warn(
            f"RoundPipe could not pin host memory ({self.refused}). Uploads from it use pageable "
            "memory, which is slower; pass pin_memory=False to silence this.", stacklevel=5)

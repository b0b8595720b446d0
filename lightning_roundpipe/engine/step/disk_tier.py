"""The disk tier: the optimizer's state (and masters) in files, read ahead of each step group and written behind it.

With ``EngineOptions.offload="optimizer"`` every tensor of the optimizer's state larger than a page (Adam's
``exp_avg`` and ``exp_avg_sq``, SGD's momentum; not the 0-dim step count) lives in a file under ``offload_dir``,
mapped into memory (``mmap``, shared): ``optimizer.state`` keeps ordinary CPU tensors whose memory is the file's
pages, so the optimizer's own arithmetic (fused kernel or not), ``state_dict()`` and the checkpoints read and write
them as before, bit for bit. ``"optimizer+masters"`` also maps there the parameters no upload reads
(:meth:`DiskTier.adopt_masters`: their devices read a low-precision copy), through ``param.data``: the module keeps
its parameters, whose memory is the file's. What bounds host memory is when the pages are in memory:

* **read ahead**: before a step group steps, this module's I/O thread reads its state from the file in large
  sequential reads and maps it (``MADV_POPULATE_WRITE``; the step then finds it in memory);
* **written behind**: once the group has stepped, the thread unmaps its pages (``MADV_DONTNEED``; the mapping is
  shared, so they stay the file's), writes them to disk (``sync_file_range``) and drops them from the page cache
  (``POSIX_FADV_DONTNEED``), so that the memory the state holds follows the groups in flight, not the model, and
  does not move into the page cache instead.

Either order of the thread's work and the step's would be correct: the mapping is the state, and a page the step
touches before its read-ahead or after its write-behind is read from the file by the kernel. For speed and a bound
on memory the optimizer thread waits, though: for a group's read-ahead before stepping it (a step faulting its
state in a page at a time was four times slower), and while :data:`QUEUED_WRITES` writes are queued. With the
groups read ahead (``queued.READ_AHEAD``) and the one stepping, that bounds the state in memory whatever the
disk's speed. The thread holds no device.

The files have no names (``tempfile.TemporaryFile``: ``O_TMPFILE`` where the file system has it, else a name
removed at once): they exist while the process does, so a crash leaves nothing a resume could mistake for state;
resuming reads the last Lightning checkpoint. Each file's blocks are reserved when it is made
(``posix_fallocate``): a full disk raises :class:`OffloadError` then, naming the directory and the bytes
needed, never a ``SIGBUS`` in the middle of a step.

State comes here (:meth:`DiskTier.adopt`) the first time a group steps (the optimizer makes its state then) and
after ``optimizer.load_state_dict`` (a resumed checkpoint), in one file per adoption. Linux only (``madvise``).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_roundpipe.engine.device import AbortSignal, join_until
from lightning_roundpipe.engine.errors import EngineAborted, OffloadError
from lightning_roundpipe.engine.transfer import nbytes_of
from lightning_roundpipe.planning.device_budget import format_bytes

PAGE = mmap.PAGESIZE
QUEUED_WRITES = 2
"""Write-behinds that may wait for the I/O thread before the optimizer thread waits for them (:meth:`DiskTier.adopt`):
with the groups read ahead, what bounds the state in memory whatever the disk's speed."""
SCRATCH_BYTES = 4 * 2**20
"""The I/O thread's read buffer: reads of this size keep the disk streaming."""
_MADV_RANDOM = 1  # a fault reads its own page only: what is in memory is what was asked for
_MADV_DONTNEED = 4
_MADV_POPULATE_WRITE = 23  # Linux 5.14
# SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER: the range's dirty pages written and waited for (the data only:
# the files have no names, so nothing on disk has to survive a crash)
_SYNC_FILE_RANGE_WRITE_AND_WAIT = 7


def offload_refusal() -> str | None:
    """Why this machine cannot keep state in the disk tier, or ``None``."""
    if not sys.platform.startswith("linux"):
        return f"the disk tier needs Linux (madvise and posix_fadvise); this is {sys.platform}"
    return None


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)  # a foreign call releases the GIL while the kernel works
    for name in ("madvise", "mincore"):
        getattr(libc, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_void_p if name == "mincore" else ctypes.c_int]
        getattr(libc, name).restype = ctypes.c_int
    libc.readahead.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_size_t]
    libc.readahead.restype = ctypes.c_ssize_t
    libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    libc.sync_file_range.restype = ctypes.c_int
    return libc


def _round_up(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class _File:
    """One nameless file, its blocks reserved and mapped shared."""

    def __init__(self, directory: str, nbytes: int, whole_state: int, what: str = "optimizer state") -> None:
        handle = tempfile.TemporaryFile(dir=directory, prefix=".roundpipe-state-", buffering=0)
        try:
            try:
                os.posix_fallocate(handle.fileno(), 0, nbytes)
            except OSError as error:
                if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise
                free = os.statvfs(directory)
                raise OffloadError(
                    f"offload_dir {directory!r} has no room for {format_bytes(nbytes)} more of {what} "
                    f"({format_bytes(free.f_bavail * free.f_frsize)} free there; the whole {what} needs about "
                    f"{format_bytes(whole_state)}): free space there or set offload_dir to a larger disk "
                    f"({os.strerror(error.errno)}). Checkpoints already written are untouched.") from error
            self.map = mmap.mmap(handle.fileno(), nbytes, flags=mmap.MAP_SHARED,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.map.madvise(_MADV_RANDOM)
            # nor does a read through the file read ahead of what was asked (the next run, not in flight, would
            # stay in the page cache until its own write-behind)
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            handle.close()
            raise
        self.handle = handle
        self.nbytes = nbytes
        self.address = torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()

    def tensor(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A tensor of ``like``'s dtype and shape (contiguous) in this file's pages from ``offset``."""
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes_of(like), offset=offset).view(
            like.dtype).view(like.shape)


@dataclass(frozen=True)
class _Extent:
    """Where one state tensor lives: a page-aligned run of one file, and the address of the tensor there."""

    file: _File
    offset: int
    nbytes: int  # rounded up to whole pages
    data_ptr: int


class DiskTier:
    """The optimizer state's files under ``directory`` and the thread that reads them ahead and writes them behind
    (see the module docstring). ``abort`` is the engine's: an I/O error fails the engine; :meth:`close` ends the
    thread."""

    def __init__(self, directory: str, abort: AbortSignal) -> None:
        refusal = offload_refusal()
        if refusal is not None:
            raise OffloadError(refusal)
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self._abort = abort
        self._libc = _libc()
        self._populate = True  # MADV_POPULATE_WRITE works here (until the kernel says otherwise)
        self._readahead = True  # readahead(2) works here (until the kernel says otherwise)
        # per optimizer, where each of its state tensors in a file lives, by (id(param), state key); an entry whose
        # tensor the state no longer holds (a load_state_dict replaced it) is replaced at the next adopt
        self._extents: weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[tuple[int, str], _Extent]] = \
            weakref.WeakKeyDictionary()
        self._masters: dict[int, _Extent] = {}  # by id(param): the parameters whose memory is a file's
        # one thread for reads and writes, in the order asked (two, one each, measured slower on 2 cores: the kernel's
        # share of the work is CPU time, which the devices and the optimizer need too)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))  # the I/O thread's reads land here, then in the cache
        self._writes = threading.Condition()
        self._queued_writes = 0  # write requests not done yet
        # what the tier did, over its life (read by PipelineFigures): the bytes its reads and writes asked the disk
        # for (a write of pages no step changed moves nothing), and the time steps waited for their reads
        self.bytes_read = 0
        self.bytes_written = 0
        self.read_wait_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="roundpipe-disk", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the optimizer thread's (or the caller's) calls
    def adopt(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> None:
        """Move the state of ``params`` that is not in a file yet into a new one (a bitwise copy), replacing the
        tensors in ``optimizer.state``, then write the state of ``params`` behind. Call only while nothing else
        uses that state (on the optimizer thread once they stepped; on the caller's between steps)."""
        extents = self._extents.setdefault(optimizer, {})
        params = list(params)
        moving: list[tuple[nn.Parameter, str, torch.Tensor]] = []
        for param in params:
            for key, value in optimizer.state.get(param, {}).items():
                known = extents.get((id(param), key))
                if _belongs_here(value) and (known is None or known.data_ptr != value.data_ptr()):
                    moving.append((param, key, value))
        if moving:
            sizes = [_round_up(nbytes_of(value)) for _, _, value in moving]
            file = _File(self.directory, sum(sizes), _whole_state(optimizer, moving, sum(sizes)))
            offset = 0
            for (param, key, value), size in zip(moving, sizes, strict=True):
                mapped = file.tensor(offset, value)
                mapped.copy_(value)
                optimizer.state[param][key] = mapped
                extents[(id(param), key)] = _Extent(file, offset, size, mapped.data_ptr())
                offset += size
        self.write_behind(optimizer, params)

    def adopt_masters(self, params: list[nn.Parameter]) -> None:
        """Map ``params`` into a new file (``param.data`` becomes the file's pages, the values bitwise the same),
        each written behind once copied, so that they are never all in memory twice. Call before the engine's
        first call (its follower then sees the new memory) and only with parameters no upload reads."""
        params = [param for param in params if id(param) not in self._masters and _belongs_here(param.data)]
        if not params:
            return
        sizes = [_round_up(nbytes_of(param)) for param in params]
        file = _File(self.directory, sum(sizes), sum(sizes), what="master weights")
        offset = 0
        with torch.no_grad():
            for param, size in zip(params, sizes, strict=True):
                mapped = file.tensor(offset, param.data)
                mapped.copy_(param.data)
                param.data = mapped
                extent = self._masters[id(param)] = _Extent(file, offset, size, mapped.data_ptr())
                self._queue_write([extent])
                offset += size

    def master_bytes(self) -> int:
        """The bytes of the master weights in files."""
        return sum(extent.nbytes for extent in self._masters.values())

    def adopt_all(self, optimizer: torch.optim.Optimizer) -> None:
        """:meth:`adopt` every parameter's state, one parameter at a time, so that state loaded into memory
        (``optimizer.load_state_dict``) is never whole there. The files of the state it replaced go once nothing
        maps them."""
        for group in optimizer.param_groups:
            for param in group["params"]:
                self.adopt(optimizer, [param])

    def read_ahead(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> threading.Event:
        """Ask the I/O thread to bring the state of ``params`` (and their masters in files) into memory; the event
        is set once it is there (or at once if there is nothing to read)."""
        done = threading.Event()
        extents = self._extents_of(optimizer, params)
        if extents:
            self._requests.put(("read", extents, done))
        else:
            done.set()
        return done

    def wait(self, event: threading.Event, what: str) -> None:
        """Until ``event`` (a :meth:`read_ahead`'s) is set; the engine's abort or ``wait_timeout`` end it. The time
        waited counts in :attr:`read_wait_seconds` (one thread waits: the optimizer's)."""
        if event.is_set():
            return
        start = time.perf_counter()
        try:
            self._abort.wait(event, what)
        finally:
            self.read_wait_seconds += time.perf_counter() - start

    def write_behind(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> None:
        """Ask the I/O thread to write the state of ``params`` (and their masters in files) to disk and drop it
        from memory; first wait while :data:`QUEUED_WRITES` requests are still waiting (a disk slower than the step
        holds the step back instead of letting the state in memory grow)."""
        extents = self._extents_of(optimizer, params)
        if extents:
            self._queue_write(extents)

    def drop_all(self, wait: bool = False) -> None:
        """Write every file's pages behind (after a checkpoint read them all, say); with ``wait``, return once
        the I/O thread has done so and every write asked before."""
        self._queue_write(self._all_extents())
        if wait:
            self.wait_for_writes()

    def wait_for_writes(self) -> None:
        """Until every write asked so far is done (the engine's abort or ``wait_timeout`` end it)."""
        self._wait_writes(0)

    def _queue_write(self, extents: list[_Extent]) -> None:
        self._wait_writes(QUEUED_WRITES - 1)
        with self._writes:
            self._queued_writes += 1
        self._requests.put(("write", extents, None))

    def _wait_writes(self, at_most: int) -> None:
        """Until at most ``at_most`` write requests are queued (or the engine aborts: :class:`EngineAborted`)."""
        deadline = time.monotonic() + self._abort.timeout
        with self._writes:
            while self._queued_writes > at_most:
                if self._abort.aborted:
                    raise EngineAborted("engine stopped while waiting for the disk tier's writes")
                if time.monotonic() > deadline:
                    error = TimeoutError(f"the disk tier's writes to {self.directory!r} took more than "
                                         f"{self._abort.timeout:g} s; raise `wait_timeout` if the disk is that slow")
                    self._abort.fail(error)
                    raise error
                self._writes.wait(0.05)

    def _state_extents(self) -> list[_Extent]:
        return [extent for extents in list(self._extents.values()) for extent in extents.values()]

    def _all_extents(self) -> list[_Extent]:
        return [*self._state_extents(), *self._masters.values()]

    def state_bytes(self) -> int:
        """The bytes of the state tensors in files."""
        return sum(extent.nbytes for extent in self._state_extents())

    def resident_bytes(self) -> int:
        """The files' bytes in memory now (mapped or in the page cache; ``mincore``)."""
        total = 0
        for file in {id(extent.file): extent.file for extent in self._all_extents()}.values():
            pages = file.nbytes // PAGE
            flags = (ctypes.c_ubyte * pages)()
            if self._libc.mincore(file.address, file.nbytes, flags) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            # counted in one vectorised pass: a Python loop over the pages took milliseconds a call at 50M params
            total += int(torch.frombuffer(flags, dtype=torch.uint8).bitwise_and(1).sum()) * PAGE
        return total

    def close(self, deadline: float) -> str | None:
        """End the I/O thread once the work asked of it is done (after an abort, after the request it is running);
        wait until ``deadline`` at most and return its name if it is still running then. The files go when the
        last tensor in them does."""
        self._requests.put(None)
        return join_until(self._thread, deadline)

    def _extents_of(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> list[_Extent]:
        known = self._extents.get(optimizer, {})
        extents = []
        for param in params:
            master = self._masters.get(id(param))
            if master is not None and master.data_ptr == param.data_ptr():  # not replaced since (param.data = ...)
                extents.append(master)
            for key, value in optimizer.state.get(param, {}).items():
                extent = known.get((id(param), key))
                if extent is not None and isinstance(value, torch.Tensor) and extent.data_ptr == value.data_ptr():
                    extents.append(extent)
        return extents

    # ------------------------------------------------------------------ the I/O thread

    def _run(self) -> None:
        while True:
            request = self._requests.get()
            if request is None or self._abort.aborted:
                return
            kind, extents, done = request
            try:
                for extent in extents:
                    if kind == "read":
                        self._read(extent)
                        self.bytes_read += extent.nbytes
                    else:
                        self._write(extent)
                        self.bytes_written += extent.nbytes
            except BaseException as error:  # noqa: BLE001 - the engine's next wait raises it
                self._abort.fail(OffloadError(f"the disk tier in {self.directory!r} failed: {error}"))
                return
            finally:
                if done is not None:
                    done.set()
                if kind == "write":
                    with self._writes:
                        self._queued_writes -= 1
                        self._writes.notify_all()

    def _advise(self, extent: _Extent, advice: int) -> int:
        return self._libc.madvise(extent.file.address + extent.offset, extent.nbytes, advice)

    def _read(self, extent: _Extent) -> None:
        # into the page cache in large sequential reads (the mapping is MADV_RANDOM: a fault reads one page), then
        # mapped without another read: readahead(2) reads into the cache and copies nothing (fadvise's WILLNEED is
        # asynchronous and left the mapping to fault page by page); where it is refused, reads through the file
        # into the scratch buffer, a copy far cheaper than the disk
        fd, done = extent.file.handle.fileno(), 0
        if self._readahead and self._libc.readahead(fd, extent.offset, extent.nbytes) != 0:
            self._readahead = False  # a file system without it
        while not self._readahead and done < extent.nbytes:
            read = os.preadv(fd, [self._scratch[:extent.nbytes - done]], extent.offset + done)
            if read <= 0:
                raise OSError(errno.EIO, f"the disk tier's file ended at {extent.offset + done} bytes")
            done += read
        if self._populate and self._advise(extent, _MADV_POPULATE_WRITE) != 0:
            if ctypes.get_errno() != errno.EINVAL:
                raise OSError(ctypes.get_errno(), f"madvise: {os.strerror(ctypes.get_errno())}")
            self._populate = False  # a kernel before 5.14: the pages are in the cache, the step maps them

    def _write(self, extent: _Extent) -> None:
        # unmapped first (a shared mapping: the pages stay in the file, their dirty bits move to the page cache, one
        # TLB flush for the range), then written: writing mapped dirty pages (msync) write-protects them one at a
        # time, each an interrupt to every core running this process's threads (measured 6x slower beside a busy
        # thread on 2 cores), then dropped from the cache
        if self._advise(extent, _MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), f"madvise: {os.strerror(ctypes.get_errno())}")
        fd = extent.file.handle.fileno()
        if self._libc.sync_file_range(fd, extent.offset, extent.nbytes, _SYNC_FILE_RANGE_WRITE_AND_WAIT) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"sync_file_range: {os.strerror(error)}")
        os.posix_fadvise(fd, extent.offset, extent.nbytes, os.POSIX_FADV_DONTNEED)


def _whole_state(optimizer: torch.optim.Optimizer, moving: list[tuple[nn.Parameter, str, torch.Tensor]],
                 nbytes: int) -> int:
    """About what the files take once every parameter of ``optimizer`` has state: ``nbytes`` for the parameters
    in ``moving``, scaled to all of them (for the error message of a full disk)."""
    moved = sum({id(param): param.numel() for param, _, _ in moving}.values())
    every = sum(param.numel() for group in optimizer.param_groups for param in group["params"])
    return nbytes * every // max(moved, 1)


def _belongs_here(value: object) -> bool:
    """A state tensor the files keep: a dense CPU tensor of at least a page (not a step count)."""
    return (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.layout == torch.strided
            and value.is_contiguous() and nbytes_of(value) >= PAGE)

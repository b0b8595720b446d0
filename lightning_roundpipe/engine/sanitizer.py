"""Race checks in every engine thread: the CUDA sanitizer on a GPU, a happens-before checker on CPU stand-ins.

Why this exists: a ``TorchDispatchMode`` is per thread. torch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``,
``torch.cuda._sanitizer``) enters its mode on the thread that imports torch, so the kernels the engine's stream
threads launch (uploads, computes, downloads, and the backward that autograd runs from them) would all escape it
and a sanitized run would report no race whatever the engine did. Each stream thread therefore enters
:func:`thread_checks` for its whole life (``device.Stream._run``): when a checker is active, a dispatch mode on
that thread hands it every operator, and autograd's device thread inherits the mode from the thread that runs
the backward. When none is active it enters nothing: no cost beyond one lookup per thread start.

Two checkers:

* :class:`CudaSanitizer`: forwards to torch's sanitizer, which sees the CUDA streams' event records and waits
  itself. Active whenever the sanitizer is enabled (``TORCH_CUDA_SANITIZER=1`` before torch is imported).
* :class:`HappensBefore`, installed by a test (``with HappensBefore() as checker:``): the same question on CPU
  stand-ins, where CSAN cannot run. Each stream thread carries a vector clock; an event a stream records
  (``Stream.record``) keeps a copy of its clock when the stream reaches it, and a stream that then waits for it
  on the host (``HostEvent.wait`` on a stream thread, which ``Stream.wait_event`` does) merges that copy. A
  storage written on one stream and then read or written on another whose clock does not cover the write (or
  written over a read not covered) is reported with both threads' names, as CSAN would report a missing
  ``wait_event``. A fresh output is a new allocation: what its memory held before is forgotten (on a GPU the
  caching allocator's per-stream pools and ``record_stream`` guard reuse; stress mode tests that). Only stream
  threads are checked: the host threads launch no device work.

Both count the operators each thread handed over (``ops_by_thread``), so a report says what was checked.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_installed: HappensBefore | None = None  # the CPU checker a test installed, if any


class _Checker:
    """What a thread's dispatch mode hands each operator to: counts it per thread, then :meth:`run` runs it."""

    def __init__(self) -> None:
        self.ops_by_thread: Counter[str] = Counter()
        self._count_lock = threading.Lock()

    def handle(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        with self._count_lock:
            self.ops_by_thread[threading.current_thread().name] += 1
        return self.run(func, types, args, kwargs)

    def run(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError


class _InThread(TorchDispatchMode):
    """The per-thread mode: every operator of its thread (and of the autograd work it starts) to ``checker``."""

    def __init__(self, checker: _Checker) -> None:
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return self.checker.handle(func, types, args, kwargs or {})


class CudaSanitizer(_Checker):
    """torch's CUDA sanitizer, entered in this thread too (it is entered only on the importing thread)."""

    def __init__(self, sanitizer: Any) -> None:
        super().__init__()
        self._dispatch = sanitizer.dispatch

    def run(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        return self._dispatch.__torch_dispatch__(func, types, args, kwargs)


_cuda_checker: CudaSanitizer | None = None


def cuda_sanitizer() -> CudaSanitizer | None:
    """The checker forwarding to torch's CUDA sanitizer when it is enabled, else None. Never imports the
    sanitizer: torch imports it at start-up only when ``TORCH_CUDA_SANITIZER`` is set."""
    global _cuda_checker
    module = sys.modules.get("torch.cuda._sanitizer")
    sanitizer = getattr(module, "cuda_sanitizer", None)
    if sanitizer is None or not getattr(sanitizer, "enabled", False):
        return None
    if _cuda_checker is None:
        _cuda_checker = CudaSanitizer(sanitizer)
    return _cuda_checker


def active_checker() -> _Checker | None:
    """The checker stream threads enter now: the CPU checker a test installed, else CSAN's, else None."""
    return _installed if _installed is not None else cuda_sanitizer()


@contextlib.contextmanager
def thread_checks() -> Iterator[None]:
    """Entered by each stream thread for its life: hands its operators to the active checker, if any."""
    checker = active_checker()
    if checker is None:
        yield
        return
    with _InThread(checker):
        yield


@dataclass
class _Access:
    """What the checker knows of one storage: its last write and the reads since, as (thread, epoch)."""

    writer: tuple[str, int, str] | None = None         # thread, its epoch then, operator
    readers: list[tuple[str, int, str]] = field(default_factory=list)


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, a wrapper subclass)
        return None
    return pointer or None


class HappensBefore(_Checker):
    """The CPU stand-ins' race checker (see the module docstring). ``reports`` lists what it found."""

    def __init__(self) -> None:
        super().__init__()
        self.reports: list[str] = []
        self._lock = threading.Lock()
        self._clocks: dict[str, dict[str, int]] = {}
        self._accesses: dict[int, _Access] = {}
        self._snapshots: dict[int, tuple[object, dict[str, int]]] = {}  # id(event) -> (event, clock at record)
        self._recorded: dict[int, object] = {}
        self._published: dict[str, dict[str, int]] = {}  # thread -> its clock at its last mark or synchronize
        self._originals: dict[tuple[type, str], Any] = {}

    # -- installation: Stream.record, .mark and .synchronize say what is complete; HostEvent.set/wait carry it
    # (and Stream.wait_event, which enqueues no wait for an event set already)
    def __enter__(self) -> HappensBefore:
        global _installed
        if _installed is not None:
            raise RuntimeError("a HappensBefore checker is installed already")
        from lightning_roundpipe.engine.device import HostEvent, Stream

        checker = self
        record, mark, synchronize, wait_event = Stream.record, Stream.mark, Stream.synchronize, Stream.wait_event
        event_set, event_wait = HostEvent.set, HostEvent.wait

        def recorded(stream: Stream, *args: Any, **kwargs: Any) -> HostEvent:
            with checker._lock:  # the stream thread may reach the event before `record` returns
                event = record(stream, *args, **kwargs)
                checker._recorded[id(event)] = event
            return event

        def marked(stream: Stream) -> Any:
            checker._publish()
            return mark(stream)

        def synchronized(stream: Stream) -> None:
            synchronize(stream)
            checker._publish()

        def waited(stream: Stream, event: HostEvent | None) -> None:
            # a CPU stand-in enqueues no wait for an event set already: the stream is ordered after it all the same
            set_already = event is not None and event.is_set()
            wait_event(stream, event)
            if set_already and (event.cuda_event is None or stream.cuda_stream is None):  # type: ignore[union-attr]
                stream.submit(lambda: checker._acquire(event))

        def set_and_snapshot(event: HostEvent) -> None:
            checker._release(event)
            event_set(event)

        def wait_and_merge(event: HostEvent, *args: Any, **kwargs: Any) -> None:
            event_wait(event, *args, **kwargs)
            checker._acquire(event)

        for owner, name, replacement in ((Stream, "record", recorded), (Stream, "mark", marked),
                                         (Stream, "synchronize", synchronized), (Stream, "wait_event", waited),
                                         (HostEvent, "set", set_and_snapshot), (HostEvent, "wait", wait_and_merge)):
            self._originals[(owner, name)] = owner.__dict__[name]
            setattr(owner, name, replacement)
        _installed = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _installed
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)
        self._originals.clear()
        _installed = None
        with self._lock:
            self._snapshots.clear()
            self._recorded.clear()

    # -- clocks
    def _clock(self, thread: str) -> dict[str, int]:
        clock = self._clocks.get(thread)
        if clock is None:
            clock = self._clocks[thread] = {thread: 1}
        return clock

    @staticmethod
    def _checked() -> str | None:
        name = threading.current_thread().name
        return name if name.startswith("roundpipe-") and _installed is not None else None

    def _publish(self) -> None:
        """A mark (a CUDA event after the work so far) or a synchronize on this stream thread: an event it sets
        next without recording it (a host cell's) orders what came before, as its CUDA event or the sync would."""
        thread = self._checked()
        if thread is None:
            return
        with self._lock:
            clock = self._clock(thread)
            self._published[thread] = dict(clock)
            clock[thread] += 1

    def _release(self, event: object) -> None:
        thread = self._checked()
        if thread is None:
            return
        with self._lock:
            clock = self._clock(thread)
            if id(event) in self._recorded:  # the stream reached its recorded event: everything before it
                self._snapshots[id(event)] = (event, dict(clock))
                clock[thread] += 1
            elif thread in self._published:  # a host event: what its last mark or synchronize covered
                self._snapshots[id(event)] = (event, self._published[thread])

    def _acquire(self, event: object) -> None:
        thread = self._checked()
        if thread is None:
            return
        with self._lock:
            snapshot = self._snapshots.get(id(event))
            if snapshot is None or snapshot[0] is not event:
                return
            clock = self._clock(thread)
            for other, epoch in snapshot[1].items():
                clock[other] = max(clock.get(other, 0), epoch)

    # -- accesses
    def run(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        result = func(*args, **kwargs)
        thread = self._checked()
        if thread is None or func.is_view:  # a view reads no memory
            return result
        reads: list[int] = []
        writes: list[int] = []
        schema = func._schema
        for index, argument in enumerate(schema.arguments):
            value = kwargs.get(argument.name) if index >= len(args) else args[index]
            written = argument.alias_info is not None and argument.alias_info.is_write
            for tensor in tree_leaves(value):
                if isinstance(tensor, torch.Tensor) and (key := _storage_key(tensor)) is not None:
                    (writes if written else reads).append(key)
        inputs = set(reads) | set(writes)
        fresh = {key for tensor in tree_leaves(result) if isinstance(tensor, torch.Tensor)
                 and (key := _storage_key(tensor)) is not None and key not in inputs}
        with self._lock:
            clock = self._clock(thread)
            epoch = clock[thread]
            operator = str(schema.name)
            for key in fresh:
                self._accesses[key] = _Access(writer=(thread, epoch, operator))
            for key in reads:
                self._read(key, thread, clock, operator)
            for key in writes:
                self._write(key, thread, clock, operator)
        return result

    def _unordered(self, access: tuple[str, int, str] | None, thread: str, clock: dict[str, int]) -> bool:
        return access is not None and access[0] != thread and clock.get(access[0], 0) < access[1]

    def _read(self, key: int, thread: str, clock: dict[str, int], operator: str) -> None:
        access = self._accesses.setdefault(key, _Access())
        if self._unordered(access.writer, thread, clock):
            self._report("read", thread, operator, "written", access.writer)
        access.readers = [reader for reader in access.readers if reader[0] != thread]
        access.readers.append((thread, clock[thread], operator))

    def _write(self, key: int, thread: str, clock: dict[str, int], operator: str) -> None:
        access = self._accesses.setdefault(key, _Access())
        if self._unordered(access.writer, thread, clock):
            self._report("wrote", thread, operator, "written", access.writer)
        for reader in access.readers:
            if self._unordered(reader, thread, clock):
                self._report("wrote", thread, operator, "read", reader)
        self._accesses[key] = _Access(writer=(thread, clock[thread], operator))

    def _report(self, did: str, thread: str, operator: str, done: str, earlier: tuple[str, int, str] | None) -> None:
        assert earlier is not None
        report = (
            f"possible data race: thread {thread} {did} a tensor ({operator}) that thread {earlier[0]} {done} "
            f"({earlier[2]}) with no event recorded after that and waited for before this")
        if report not in self.reports:
            self.reports.append(report)

"""The gradient window: one optimizer step's gradients, summed on the host in a fixed order.

Gradients from the devices accumulate in a :class:`GradWindow` (one per optimizer step), never in
``param.grad`` directly, so the next iteration's gradients cannot mix into a step in flight. They become
final per parameter: once the window is closed (the step was queued) and every job that had a slot for
it delivered (:meth:`GradWindow.final_groups`, per group of parameters).

Only the thread that calls the engine (the main thread) ever reads or assigns ``param.grad``
(:meth:`GradWindow.publish`). The optimizer thread steps stand-ins of the parameters
(:func:`~.thread.step_with_groups`) that share their storage and carry the step's gradients as their own
``.grad``: the references the caller's thread handed over when it queued the step, plus what the window still
held. torch can crash when one thread reads a tensor's ``.grad`` while another assigns it; with a single
thread touching the attribute that cannot happen, and the caller may clear or replace ``param.grad`` while a
step is in flight (but not change a gradient it handed over in place: the step reads it).
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

from lightning_roundpipe.engine.device import AbortSignal, HostEvent
from lightning_roundpipe.engine.errors import EngineAborted

# torch's reference counts of a tensor and of its storage (private, as torch.utils.swap_tensors and the CUDA graph
# trees use them); without them no sum reuses memory
_COUNTS_REFERENCES = hasattr(torch._C, "_storage_Use_Count") and hasattr(torch.Tensor, "_use_count")


@functools.cache
def _alone_counts() -> tuple[int, int, int]:
    """The reference counts of a tensor that one frame alone holds, measured as :func:`_unseen` measures its
    argument's (Python references, holders of the tensor, holders of its storage): made once, since making the
    probe is a torch call, and each gives up the GIL (``transport.StagingBuffer.views`` says what that costs)."""
    probe = torch.empty(1)
    return (sys.getrefcount(probe), probe._use_count(),  # type: ignore[attr-defined]
            torch._C._storage_Use_Count(probe.untyped_storage()._cdata))


def _unseen(tensor: torch.Tensor) -> bool:
    """Whether nothing but the caller's one reference can see ``tensor`` or its memory: no other Python reference
    (``param.grad`` kept by a callback), no weak one, no C++ holder of it (a parameter's or a stand-in's ``.grad``)
    and no other tensor on its storage (a view). The counts are compared with those of a tensor one frame alone
    holds (:func:`_alone_counts`), so they do not depend on how the interpreter counts a frame's references."""
    if not _COUNTS_REFERENCES:
        return False
    references, holders, storage_holders = _alone_counts()
    return (sys.getrefcount(tensor) <= references + 1  # the caller's reference on top of this frame's
            and weakref.getweakrefcount(tensor) == 0
            and tensor._use_count() == holders  # type: ignore[attr-defined]
            and tensor._base is None
            and torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) <= storage_holders)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_Kind = tuple[torch.Size, torch.dtype, torch.device]
"""What a gradient sum's memory can serve: its shape, dtype and device."""


class SumBuffers:
    """The host memory of gradient sums, reused for later sums (C1's persistent accumulators): a fresh allocation
    of the whole model's float32 gradients every step costs the host as much again as the copy into it (page
    faults), and grows with the model.

    Two sources of memory, both reused only where nothing else can see it (:func:`_unseen`):

    * each parameter's **last sum**, for its next one: once the step that read it is over and ``param.grad`` no
      longer holds it, and no callback kept a reference, a view or a weak reference;
    * sums a step **gave back** (:meth:`give_back`) once it had applied them and nothing keeps them
      (``keep_gradients=False``): any later sum of the same shape and dtype reuses them, in the same step too.
      Gradients then exist on the host only while in flight: from a parameter's first contribution until its
      group is stepped, and the memory follows the groups in flight, not the model.

    Otherwise a sum goes into fresh memory, and what a caller kept stays as it was. One per engine; the summing
    threads take from it, the optimizer thread gives back. Given-back memory is kept only as far as the last step
    needed it (:meth:`trim`): a step whose groups all waited at once (the first, while the optimizer builds its
    state) does not make the pool hold the whole model's gradients for the rest of the run.

    **Back-pressure.** Where the host step is slower than the backward (a large model's AdamW on a few cores, the
    disk tier), every group's sums would wait for the optimizer at once. While a step that gives its sums back runs
    (:meth:`reclaiming`), a summing thread first waits (:meth:`wait_for_room`) until the sums the windows hold (not
    yet taken by a step: :meth:`taken`) leave room for its job's within the step's budget. Its device then waits
    for its staging buffer, so the backward slows to the host step's pace (which bounds the iteration anyway) and
    the sums in memory stay within the budget and the group being stepped. It waits only while the step will take
    sums without waiting for more (a group whose gradients are final): a sum that would complete a group is never
    held back by the groups that need it, so the budget bends rather than deadlocks (a weight tied across stages,
    several calls per step)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[int, torch.Tensor] = {}  # by parameter id: the buffer of its latest sum
        self._free: dict[_Kind, list[torch.Tensor]] = {}  # given back, by shape, dtype and device
        self._out: dict[_Kind, int] = {}   # per kind, sums handed out and not given back
        self._peak: dict[_Kind, int] = {}  # per kind, the most handed out at once since the last trim
        self._in_windows: dict[int, int] = {}  # by buffer id, the bytes of each sum handed out and not yet taken
        self._out_bytes = 0  # their sum: what the windows hold (a taken sum is a step's, or the caller's)
        # while a step that gives back runs: its budget of sums out, and whether it holds sums it will give back
        self._reclaimer: tuple[int, Callable[[], bool]] | None = None
        self._room = threading.Event()  # set when sums come back (or the step ends): waiters look again
        self.fresh_bytes = 0  #: bytes of the sums that found no reusable memory, over the engine's life
        self.waited_seconds = 0.0  #: time summing threads waited for room, over the engine's life

    def first_sum(self, param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        """A tensor of ``param``'s dtype holding a copy of ``grad``, the first contribution to its sum."""
        key, kind = id(param), (grad.shape, param.dtype, grad.device)
        buffer = None
        with self._lock:
            last = self._last.pop(key, None)
            free = self._free.get(kind)
            while free and buffer is None:  # what is seen now stays seen by whoever holds it: let it go
                candidate = free.pop()
                buffer = candidate if _unseen(candidate) else None
                del candidate
        if buffer is None and (last is not None and last.shape == grad.shape and last.dtype == param.dtype
                               and last.device == grad.device and _unseen(last)):
            buffer, last = last, None
        del last  # a last sum not reused goes with its last holder
        if buffer is None:
            buffer = grad.to(param.dtype, copy=True)
            with self._lock:
                self.fresh_bytes += buffer.numel() * buffer.element_size()
        else:
            buffer.copy_(grad)
        with self._lock:
            self._last[key] = buffer
            self._in_windows[id(buffer)] = _nbytes(buffer)
            self._out_bytes += _nbytes(buffer)
            self._out[kind] = self._out.get(kind, 0) + 1
            self._peak[kind] = max(self._peak.get(kind, 0), self._out[kind])
        return buffer

    def give_back(self, sums: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Sums a step applied and keeps no more, for any later sum of their shape and dtype; ``sums`` is emptied
        (the only references left are this pool's, so a summing thread may take them at once)."""
        with self._lock:
            while sums:
                param, buffer = sums.pop()
                if self._last.get(id(param)) is buffer:
                    del self._last[id(param)]
                kind = (buffer.shape, buffer.dtype, buffer.device)
                self._free.setdefault(kind, []).append(buffer)
                self._out[kind] = max(0, self._out.get(kind, 0) - 1)
                del param, buffer
            self._room.set()

    def taken(self, sums: Iterable[torch.Tensor]) -> None:
        """``sums`` left their window (:meth:`GradWindow.take`: a step took them, or ``param.grad``): no longer
        counted against the budget of sums out; a summing thread waiting for room looks again."""
        with self._lock:
            for buffer in sums:
                self._out_bytes -= self._in_windows.pop(id(buffer), 0)
        self._room.set()

    @contextmanager
    def reclaiming(self, budget: int, will_take_sums: Callable[[], bool]) -> Iterator[None]:
        """While a step that gives its sums back runs: summing threads keep the sums in windows within ``budget``
        bytes while ``will_take_sums()`` (called on a summing thread) says the step will take some without waiting
        for more sums."""
        with self._lock:
            self._reclaimer = (budget, will_take_sums)
        try:
            yield
        finally:
            with self._lock:
                self._reclaimer = None
            self._room.set()

    def wait_for_room(self, nbytes: int, abort: AbortSignal, what: str) -> None:
        """Before summing ``nbytes`` of new sums (on a summing thread): wait while they would take the sums in windows
        past the running step's budget and that step will take some (see the class docstring)."""
        started = None
        deadline = time.monotonic() + abort.timeout
        while True:
            with self._lock:
                reclaimer = self._reclaimer
                if reclaimer is None or self._out_bytes == 0 or self._out_bytes + nbytes <= reclaimer[0]:
                    break
                self._room.clear()
            if not reclaimer[1]():
                break
            started = time.monotonic() if started is None else started
            self._room.wait(0.02)  # the step's next take wakes it
            if abort.aborted:
                raise EngineAborted(f"engine stopped while {what} waited for the host step")
            if time.monotonic() > deadline:
                break  # never a hang: the engine's other waits report a stuck step
        if started is not None:
            with self._lock:
                self.waited_seconds += time.monotonic() - started

    def trim(self) -> None:
        """After a step: keep of each kind only as many given-back buffers as were handed out at once since the
        last trim (those still out included); the rest goes back to the allocator."""
        with self._lock:
            for kind, free in self._free.items():
                excess = len(free) + self._out.get(kind, 0) - self._peak.get(kind, 0)
                if excess > 0:
                    del free[:excess]  # the oldest
            self._free = {kind: free for kind, free in self._free.items() if free}
            self._peak = {kind: out for kind, out in self._out.items() if out}

    def held(self) -> list[torch.Tensor]:
        """The memory this pool holds for reuse, each buffer once (one may be in use elsewhere too)."""
        with self._lock:
            buffers = {id(buffer): buffer for buffer in self._last.values()}
            buffers.update((id(buffer), buffer) for free in self._free.values() for buffer in free)
        return list(buffers.values())

    def held_bytes(self) -> int:
        """Bytes of :meth:`held`."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self.held())


class GradWindow:
    """Gradients of one optimizer step, summed on the host in a fixed order.

    Why not in the order jobs finish: float addition is not associative, and a parameter may get several
    contributions in a step (a tied weight read by layers of two stages; every call of a step under gradient
    accumulation), from jobs on different devices whose finishing order depends on timing. Summed as they
    arrive, two identical runs would then differ in the last bits. So every contribution has a *slot*, made
    when its job is dispatched (on the main thread, in a deterministic order): the job's place in dispatch
    order, then within the job its layers deepest first. Backward jobs are dispatched deep to shallow, so that
    order is also the same whichever stage holds a layer. Each parameter's contributions are summed in slot
    order; one that arrives before an earlier slot of its parameter is resolved is held until it is (a copy,
    bounded by the jobs in flight), and a job that computed no gradient for a slot resolves it empty.
    """

    def __init__(self, abort: AbortSignal, number: int = 0, sums: SumBuffers | None = None) -> None:
        self._abort = abort
        self.number = number  #: the optimizer step this window accumulates (measurements are filed by it)
        self._sums = sums  # where each parameter's sum starts: reused memory (None: fresh memory every step)
        self._lock = threading.Lock()
        self._grads: dict[int, torch.Tensor] = {}
        self._params: dict[int, nn.Parameter] = {}
        self._order: dict[int, deque[tuple[int, int]]] = {}  # per parameter, its unresolved slots in order
        self._slots: dict[int, list[nn.Parameter]] = {}      # per ticket (job), its slots' parameters
        self._held: dict[tuple[int, int], torch.Tensor | None] = {}  # resolved out of order, not yet summed
        self._tickets = 0
        self._outstanding = 0
        self._closed = False
        self._complete = threading.Event()
        self._idle = threading.Event()  # no job in flight (the window may still get more)
        self._idle.set()
        # the uploads of each layer's parameters; under ``None`` those of jobs that read no layer
        self._uploads_by_layer: dict[int | None, list[HostEvent]] = {}
        # set by close(groups): per parameter id its group, per group the parameters still open, and per group
        # an event set once none is (its gradients are final)
        self._group_of: dict[int, int] = {}
        self._open: list[int] = []
        self._final: list[threading.Event] = []
        self._progress = threading.Event()  # a group's gradients became final, or an upload finished

    def job_started(self, upload_done: HostEvent | None, params: Sequence[nn.Parameter] = (),
                    layers: Iterable[int] = ()) -> int:
        """A job that adds gradients; ``params`` are its slots in summation order (a parameter read by two of
        its layers is listed twice), ``layers`` the layers it uploads. Returns the job's ticket for
        :meth:`deliver`."""
        with self._lock:
            self._outstanding += 1
            self._idle.clear()
            if upload_done is not None:
                self._add_upload(upload_done, layers)
            ticket, self._tickets = self._tickets, self._tickets + 1
            if params:
                self._slots[ticket] = list(params)
                for position, param in enumerate(params):
                    self._order.setdefault(id(param), deque()).append((ticket, position))
        return ticket

    def job_read_only(self, upload_done: HostEvent, layers: Iterable[int] = ()) -> None:
        """A job that produces no gradient but reads the weights of ``layers`` (a forward stage)."""
        with self._lock:
            self._add_upload(upload_done, layers)

    def _add_upload(self, upload_done: HostEvent, layers: Iterable[int]) -> None:
        keys: Iterable[int | None] = tuple(layers) or (None,)  # an upload of no layer is still waited for
        for key in keys:
            self._uploads_by_layer.setdefault(key, []).append(upload_done)

    def wait_for_room(self, ticket: int, grads: Sequence[torch.Tensor | None], what: str) -> None:
        """Before :meth:`deliver` of job ``ticket``'s ``grads`` (on a summing thread, holding no lock): wait while the
        sums they would start take the pool's sums out past the running step's budget
        (:meth:`SumBuffers.wait_for_room`)."""
        if self._sums is None:
            return
        with self._lock:
            params = self._slots.get(ticket, [])
            started = {id(param): param for param, grad in zip(params, grads, strict=False)
                       if grad is not None and id(param) not in self._grads}
        nbytes = sum(param.numel() * param.element_size() for param in started.values())
        if nbytes:
            self._sums.wait_for_room(nbytes, self._abort, what)

    def deliver(self, ticket: int, grads: Sequence[torch.Tensor | None], *, borrowed: bool = False) -> None:
        """The gradients of job ``ticket``, one per slot given to :meth:`job_started` (``None``: none), computed
        on a device and already copied to the host. Each is summed in the parameter's dtype (a low-precision
        gradient in the master's precision) once the slots before it are. ``borrowed``: the tensors are a
        staging buffer the caller reuses, so the window keeps copies, never the tensors themselves."""
        with self._lock:
            params = self._slots.pop(ticket, [])
            if len(params) != len(grads):
                raise RuntimeError(f"job ticket {ticket} delivered {len(grads)} gradients for {len(params)} slots")
            for position, (param, grad) in enumerate(zip(params, grads, strict=True)):
                key, order = id(param), self._order[id(param)]
                if order[0] != (ticket, position):  # an earlier slot is still open: hold this one
                    self._held[(ticket, position)] = None if grad is None else self._own(param, grad, borrowed)
                    continue
                order.popleft()
                if grad is not None:
                    self._sum(key, param, grad, borrowed)
                while order and order[0] in self._held:
                    held = self._held.pop(order.popleft())
                    if held is not None:
                        self._sum(key, param, held, borrowed=False)
                if not order and self._closed:
                    self._resolved(key)

    def _resolved(self, key: int) -> None:
        """The parameter ``key`` has no open slot in a closed window: its gradient is final."""
        group = self._group_of.pop(key, None)
        if group is not None:
            self._open[group] -= 1
            if self._open[group] == 0:
                self._final[group].set()
                self._progress.set()

    @staticmethod
    def _own(param: nn.Parameter, grad: torch.Tensor, borrowed: bool) -> torch.Tensor:
        return grad.to(param.dtype, copy=True) if borrowed or grad.dtype != param.dtype else grad

    def _sum(self, key: int, param: nn.Parameter, grad: torch.Tensor, borrowed: bool) -> None:
        existing = self._grads.get(key)
        if existing is None:
            sums = self._sums if borrowed and grad.dtype.is_floating_point else None
            self._grads[key] = sums.first_sum(param, grad) if sums is not None else self._own(param, grad, borrowed)
            self._params[key] = param
        else:
            existing.add_(grad)

    def job_finished(self) -> None:
        with self._lock:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._idle.set()
                if self._closed:
                    self._complete.set()

    def follow_dtypes(self) -> None:
        """Cast the sums held so far to their parameters' dtypes again, after a parameter's dtype changed
        between calls (``module.to(torch.float64)`` in a callback, mid-accumulation): plain training's
        ``module.to`` casts ``param.grad`` too. Call it once no job of the window can start any more; it
        waits for the sums of those in flight (the summing thread's, ``summing.py``)."""
        self.wait_idle()
        with self._lock:
            for key, grad in self._grads.items():
                dtype = self._params[key].dtype
                if grad.dtype != dtype:
                    self._grads[key] = grad.to(dtype)

    def close(self, groups: Sequence[Sequence[nn.Parameter]] = ()) -> None:
        """No job adds to the window any more. ``groups``: parameters stepped together, each with an event set
        once all of its gradients are final (:meth:`wait_final`), which for a parameter with no job in flight
        is now."""
        with self._lock:
            self._closed = True
            self._final = [threading.Event() for _ in groups]
            self._open = [0] * len(groups)
            for index, params in enumerate(groups):
                for param in params:
                    self._group_of[id(param)] = index
                    self._open[index] += 1
            for key in list(self._group_of):
                if not self._order.get(key):
                    self._resolved(key)
            for index, event in enumerate(self._final):
                if self._open[index] == 0:
                    event.set()
            if self._outstanding == 0:
                self._complete.set()

    def wait_final(self, group: int) -> None:
        """Until the gradients of ``group`` (an index into :meth:`close`'s groups) are final."""
        self._abort.wait(self._final[group], f"the gradients of part {group} of the step")

    def final_groups(self, groups: Sequence[int]) -> list[int]:
        """Those of ``groups`` (indices into :meth:`close`'s groups) whose gradients are final, now."""
        with self._lock:
            return [group for group in groups if self._final[group].is_set()]

    def forget_progress(self) -> None:
        """Start watching for progress: :meth:`wait_progress` returns at the next one (or at once if one came
        since this call)."""
        self._progress.clear()

    def wait_progress(self) -> None:
        """Until a group's gradients became final or an upload of the window's jobs finished, since
        :meth:`forget_progress`."""
        self._abort.wait(self._progress, f"the gradients of optimizer step {self.number}")

    def upload_finished(self) -> None:
        """An upload of one of the window's jobs is done (the async step may publish what it read)."""
        self._progress.set()

    def uploads_done(self, layers: Iterable[int]) -> bool:
        """Whether every upload of ``layers`` by the window's jobs so far is done."""
        with self._lock:
            return all(event.is_set() for layer in layers for event in self._uploads_by_layer.get(layer, ()))

    def wait_complete(self) -> None:
        self._abort.wait(self._complete, "the gradients of the iteration")

    def wait_idle(self) -> None:
        self._abort.wait(self._idle, "the gradients dispatched so far")

    def wait_uploads(self, layers: Iterable[int] | None = None) -> None:
        """Until every upload of the window's jobs (of those reading ``layers``; ``None``: all) is done."""
        with self._lock:
            if layers is None:  # each upload once, though it is filed under every layer it reads
                events = list({id(event): event for uploads in self._uploads_by_layer.values()
                               for event in uploads}.values())
            else:
                events = [event for layer in layers for event in self._uploads_by_layer.get(layer, ())]
        for event in events:
            event.wait(self._abort)

    def take(self, params: Iterable[nn.Parameter] | None = None) -> dict[int, tuple[nn.Parameter, torch.Tensor]]:
        """The summed gradients by parameter id, as ``(parameter, gradient)``, of ``params`` (``None``: all),
        leaving them out of the window. Call it once their jobs are done (:meth:`wait_complete`,
        :meth:`wait_idle` or :meth:`wait_final`)."""
        with self._lock:
            keys = list(self._grads) if params is None else [id(param) for param in params if id(param) in self._grads]
            taken = {key: (self._params.pop(key), self._grads.pop(key)) for key in keys}
        if self._sums is not None:
            self._sums.taken(grad for _, grad in taken.values())
        return taken

    def give_back(self, sums: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Sums taken from this window that a step applied and keeps no more: their memory serves later sums
        (:meth:`SumBuffers.give_back`; without a pool they are simply dropped). ``sums`` is emptied."""
        if self._sums is not None:
            self._sums.give_back(sums)
        sums.clear()

    def reclaiming(self, budget: int, will_take_sums: Callable[[], bool]) -> AbstractContextManager[None]:
        """:meth:`SumBuffers.reclaiming` of the pool (without one, nothing)."""
        return self._sums.reclaiming(budget, will_take_sums) if self._sums is not None else nullcontext()

    def trim_given_back(self) -> None:
        """A step that gave its sums back is over: :meth:`SumBuffers.trim`."""
        if self._sums is not None:
            self._sums.trim()

    def publish(self, lent: Container[int] = (), params: Iterable[nn.Parameter] | None = None) -> None:
        """Move the summed gradients (of ``params``; ``None``: all) into ``param.grad`` (adding to what is
        there), on the calling thread, which must be the only one that touches ``param.grad`` (the engine's
        caller).

        First wait for their jobs (:meth:`wait_complete`, :meth:`wait_idle` or :meth:`wait_final`). ``lent``:
        ids of gradient tensors a step in flight still reads; a ``param.grad`` among them is replaced by the
        sum, never added to in place."""
        for param, grad in self.take(params).values():
            existing = param.grad
            if existing is None:
                param.grad = grad
            elif id(existing) in lent:
                param.grad = existing + grad
            else:
                existing.add_(grad)

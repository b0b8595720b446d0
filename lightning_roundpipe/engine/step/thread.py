"""The host optimizer: gradient windows, and steps on a dedicated thread, sync or async.

The module's parameters are the master weights; the user's optimizer steps them directly. Devices
never read them while a step may be writing:

* ``sync``: every upload after a step waits for that step to have updated the parameters it uploads, so
  results are exactly those of plain training (with ``host_optimizer="fused"``, up to the fused kernels'
  float rounding). The step itself runs off the main thread, cut by stage where the optimizer allows
  (``groups.py``): each part as soon as its gradients are final, so most of it overlaps the backward.
* ``async`` (the paper's schedule): devices read a *published* copy of the weights
  (``transport.UploadSources``, which also holds the low-precision copies devices read under mixed
  precision). Step k first publishes the masters (which hold W(k-1)) once every upload of iteration k
  has read the old copy, then computes W(k) = step(W(k-1), g(k)), both part by part. Iteration k+1 waits
  only for the publish of what it uploads, so it runs on W(k-1) while step k runs: exactly one step stale,
  whatever the timing.

Gradients become final per parameter: once the window is closed (the step was queued) and every job that
had a slot for it delivered (:meth:`GradWindow.final_groups`, per group of parameters).

Gradients from the devices accumulate in a :class:`GradWindow` (one per optimizer step), never in
``param.grad`` directly, so the next iteration's gradients cannot mix into a step in flight.
Hyperparameters (lr, ...) are copied when a step is queued, so a scheduler or user write that
follows ``step()`` applies to the next step, as in plain training.

Only the thread that calls the engine (the main thread) ever reads or assigns ``param.grad``. The
optimizer thread steps stand-ins of the parameters (:func:`step_with_groups`) that share their storage
and carry the step's gradients as their own ``.grad``: the references the caller's thread handed over
when it queued the step, plus what the window still held. torch can crash when one thread reads a
tensor's ``.grad`` while another assigns it; with a single thread touching the attribute that cannot
happen, and the caller may clear or replace ``param.grad`` while a step is in flight (but not change a
gradient it handed over in place: the step reads it).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_roundpipe.engine.device import AbortSignal, EngineAborted, HostEvent
from lightning_roundpipe.engine.step.kernels import use_fused
from lightning_roundpipe.observe.trace import Timeline


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

    def __init__(self, abort: AbortSignal, number: int = 0) -> None:
        self._abort = abort
        self.number = number  #: the optimizer step this window accumulates (measurements are filed by it)
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
            self._grads[key] = self._own(param, grad, borrowed)
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
        ``module.to`` casts ``param.grad`` too. Call it while no job of the window is in flight."""
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
        return taken

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


def snapshot_param_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """A copy of every param group's hyperparameters, sharing the parameter lists."""
    groups = []
    for group in optimizer.param_groups:
        copied = {key: (value.clone() if isinstance(value, torch.Tensor) else value)
                  for key, value in group.items() if key != "params"}
        copied["params"] = group["params"]
        groups.append(copied)
    return groups


def step_with_groups(optimizer: torch.optim.Optimizer, groups: list[dict],
                     grads: Mapping[int, torch.Tensor], *, host_kernels: str | None = None) -> None:
    """Run ``optimizer``'s step arithmetic with ``groups`` as its param groups and ``grads`` (by parameter id)
    as the gradients, without reading or writing any ``param.grad``.

    The step runs on a shallow twin of the optimizer that shares its hooks but has its own ``param_groups``:
    the main thread may meanwhile write ``lr`` into the real groups (a scheduler step) without changing this
    step. The twin's parameters are stand-ins (``param.detach()``: the same storage, so the update lands in
    the parameter) whose ``.grad`` is the step's gradient, and its ``state`` finds each stand-in's entry under
    its parameter, so the optimizer's state stays keyed by the module's parameters. A parameter without an
    entry in ``grads`` has no gradient in this step and is skipped, as torch skips a ``None`` gradient. The
    class's ``step`` is called directly because an LR scheduler replaces the instance's ``step`` with a
    wrapper bound to the original. ``host_kernels`` (the engine's ``host_optimizer``; ``None``: as built):
    the groups it steps with torch's fused CPU kernel get ``fused=True``, in these copies only
    (:func:`~lightning_roundpipe.engine.step.kernels.use_fused`).
    """
    owners: dict[int, nn.Parameter] = {}
    stand_ins: dict[int, torch.Tensor] = {}
    twin_groups = []
    for group in groups:
        params = []
        for param in group["params"]:
            stand_in = stand_ins.get(id(param))
            if stand_in is None:
                stand_in = param.detach().requires_grad_(param.requires_grad)
                grad = grads.get(id(param))
                if grad is not None:
                    stand_in.grad = grad
                stand_ins[id(param)] = stand_in
                owners[id(stand_in)] = param
            params.append(stand_in)
        twin_groups.append({**group, "params": params})
    twin = object.__new__(type(optimizer))
    twin.__dict__.update(optimizer.__dict__)
    twin.param_groups = twin_groups
    twin.state = _StateOfOwners(optimizer.state, owners)  # type: ignore[assignment]
    if host_kernels is not None:
        use_fused(twin, twin_groups, host_kernels)
    type(optimizer).step(twin)


class _StateOfOwners(MutableMapping):
    """An optimizer's ``state`` seen through stand-ins: a key that is a stand-in reads and writes its
    parameter's entry (creating it on first read, as the ``defaultdict`` of torch's optimizers does)."""

    def __init__(self, state: MutableMapping, owners: dict[int, nn.Parameter]) -> None:
        self._state = state
        self._owners = owners

    def _key(self, key: object) -> object:
        return self._owners.get(id(key), key)

    def __getitem__(self, key: object) -> Any:
        return self._state[self._key(key)]

    def __setitem__(self, key: object, value: Any) -> None:
        self._state[self._key(key)] = value

    def __delitem__(self, key: object) -> None:
        del self._state[self._key(key)]

    def __contains__(self, key: object) -> bool:
        return self._key(key) in self._state

    def get(self, key: object, default: Any = None) -> Any:
        return self._state.get(self._key(key), default)

    def __iter__(self) -> Iterator[object]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


class HostOptimizer:
    """The optimizer thread: runs queued tasks in order, one at a time."""

    def __init__(self, abort: AbortSignal, timeline: Timeline) -> None:
        self._abort = abort
        self._timeline = timeline
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_seconds = 0.0  # running total of step time, for pipeline metrics
        self._handled = 0  # tasks taken off the queue and run, skipped or failed: progress, for close()
        self.running: str | None = None  # the label of the task being run
        self._thread = threading.Thread(target=self._run, name="roundpipe-optimizer", daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], None], done: HostEvent, label: str) -> None:
        """Run ``task``, then set ``done``. The task times its arithmetic with :meth:`timed` (its waits for
        gradients are not optimizer time)."""
        self._tasks.put((task, done, label))

    @contextmanager
    def timed(self, label: str) -> Iterator[None]:
        """Optimizer time, on the timeline as ``label``; only on this thread."""
        start = self._timeline.now()
        yield
        self.busy_seconds += self._timeline.now() - start
        self._timeline.add(-1, -1, label, 0, "optimizer", start)

    def close(self, timeout: float) -> str | None:
        """End the thread after the queued tasks (after an abort they are dropped, but one already running
        finishes). Waits as long as the thread keeps making progress: it gives up once no task has ended
        for ``timeout`` seconds, and returns the thread's name if it is still running then (stuck inside a
        step: it ends by itself once the step returns)."""
        self._tasks.put(None)
        while True:
            handled = self._handled
            self._thread.join(timeout)
            if not self._thread.is_alive():
                return None
            if self._handled == handled:
                return self._thread.name

    def _run(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            self.running = item[2]
            try:
                self._handle(*item)
            finally:
                self.running = None
                self._handled += 1
            item = None  # a finished step (its task) holds its gradient window

    def _handle(self, task: Callable[[], None], done: HostEvent, label: str) -> None:
        if self._abort.aborted:
            return
        try:
            task()
        except EngineAborted:
            return
        except BaseException as error:  # noqa: BLE001 - surfaced by the engine's next wait
            self._abort.fail(error)
            return
        done.set()

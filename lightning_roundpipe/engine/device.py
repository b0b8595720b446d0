"""The device pool: per-device streams and events, on CUDA GPUs and as CPU stand-ins that are truly asynchronous.

Why the stand-ins are threads and not plain function calls: if a CPU "copy" or "event" completed
inside the call that enqueued it, a missing wait between two streams would never fail on CPU, and
ordering bugs would only show up on a GPU. Each stand-in stream is a thread with its own queue; an
event is set when its stream reaches it; ``jitter`` adds random delays before every operation so a
missing wait makes a test fail instead of passing by luck.

``stress`` (CPU stand-ins only) adds two CUDA semantics a plain thread would hide:

* **Late copies.** A copy an operation registers with :meth:`Stream.copy_late` is poisoned at once and
  lands (re-read from its source) only :data:`STRESS_LANDING_DELAY` seconds later, when the stream
  synchronizes or reaches its next recorded event: as on a GPU, the copy is complete only for whoever
  waited for that event, and it reads its source when it lands, not when it was enqueued.
* **Poisoned releases.** Tensors the engine frees (a stage's copy after its release, a microbatch's device
  inputs and outputs after their last use, host staging after its last reader) are filled with NaN (a
  sentinel for integers, see :func:`poison`), so a reader that was not ordered before the release sees
  garbage, as it could on a GPU whose allocator reuses the memory. The engine calls
  :meth:`Stress.poison_released` (a no-op outside stress mode) at each release.

Every wait takes the engine's :class:`AbortSignal` and a timeout, so an error anywhere wakes every
waiter and nothing hangs.

On a CUDA device the same host thread per stream issues its operations on a CUDA stream of its own
(and sets the thread's current device, since CUDA streams, RNG and memory are per thread and device).
A recorded event then also records a CUDA event, and a stream that waits for it makes its CUDA stream
wait on the GPU: the host thread learns that the work was *enqueued*, the GPU orders the *execution*,
and no host thread blocks on the GPU except the transfer threads where a host buffer must be complete
(see :mod:`lightning_roundpipe.engine.worker`).

Every host wait on the GPU sleeps: the CUDA events a host thread may wait for are made with ``blocking=True``
(``cudaEventBlockingSync``), and :meth:`Stream.synchronize` waits for such an event rather than calling
``cudaStreamSynchronize``. Under CUDA's default scheduling a process with fewer contexts than CPUs busy-waits
in a plain stream or event synchronize, a core per waiting thread, which the host optimizer step needs.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from lightning_roundpipe.engine.errors import EngineAborted, OutOfDeviceMemory
from lightning_roundpipe.engine.sanitizer import thread_checks
from lightning_roundpipe.engine.timing import CudaStreamTimer, HostStreamTimer, StreamTimer
from lightning_roundpipe.engine.transfer import tree_tensors
from lightning_roundpipe.planning.partition import CUDA_WORKSPACE_RESERVE, Plan


class AbortSignal:
    """The engine's shared failure flag: the first error wins, every wait checks it."""

    def __init__(self, timeout: float) -> None:
        self._flag = threading.Event()
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self.timeout = timeout

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
        self._flag.set()

    def abort(self) -> None:
        """Stop without an error (shutdown): waiters raise :class:`EngineAborted`."""
        self._flag.set()

    @property
    def aborted(self) -> bool:
        return self._flag.is_set()

    def wait(self, event: threading.Event, what: str) -> None:
        """Block until ``event`` is set; raise if the engine aborts or the timeout passes."""
        deadline = time.monotonic() + self.timeout
        while not event.wait(0.02):
            if self._flag.is_set():
                raise EngineAborted(f"engine stopped while waiting for {what}")
            if time.monotonic() > deadline:
                error = TimeoutError(
                    f"{threading.current_thread().name} waited more than {self.timeout:g} s for {what}; the "
                    "pipeline is stuck. Raise `wait_timeout` if a single stage really takes that long."
                )
                self.fail(error)
                raise error


class HostEvent:
    """An event on the host: set once, waited on by any thread. Recorded on a CUDA stream, it also carries
    that stream's CUDA event (``cuda_event``), which a waiting CUDA stream waits for on the GPU."""

    __slots__ = ("_flag", "name", "cuda_event")

    def __init__(self, name: str = "event") -> None:
        self._flag = threading.Event()
        self.name = name
        self.cuda_event: torch.cuda.Event | None = None

    def set(self) -> None:
        self._flag.set()

    def is_set(self) -> bool:
        return self._flag.is_set()

    def wait(self, abort: AbortSignal) -> None:
        abort.wait(self._flag, self.name)

    def wait_until(self, deadline: float) -> bool:
        """Wait until the event is set or ``time.monotonic()`` passes ``deadline``; whether it was set."""
        return self._flag.wait(max(0.0, deadline - time.monotonic()))


_STOP = object()

STRESS_LANDING_DELAY = 0.002
"""Stress mode: seconds between a late copy's enqueue and its landing (see the module docstring)."""


def poison(tensors: Iterable[torch.Tensor]) -> None:
    """Stress mode: fill released tensors in place with NaN (floating point, complex), the smallest value
    (integers) or ``True`` (booleans), so a read after the release gives a visibly wrong result."""
    for tensor in tensors:
        if tensor.is_floating_point() or tensor.is_complex():
            value: float | bool | int = float("nan")
        elif tensor.dtype is torch.bool:
            value = True
        else:
            value = torch.iinfo(tensor.dtype).min
        with _writable(tensor):
            tensor.fill_(value)


class Stress:
    """Stress mode's poisoned releases (see the module docstring), one per device; a no-op unless ``enabled``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def poison_released(self, released: object, kept: object = ()) -> None:
        """Poison the tensors of the tree ``released`` whose memory no tensor of the tree ``kept`` shares (a
        layer may return its input, or a view of it, and a ``NoGrad`` travels on unchanged)."""
        if not self.enabled:
            return
        shared = {tensor.untyped_storage().data_ptr() for tensor in tree_tensors(kept)}
        poison([tensor for tensor in tree_tensors(released) if tensor.untyped_storage().data_ptr() not in shared])


def _writable(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Where ``tensor`` may be written in place off the autograd graph: an inference tensor (made under the
    caller's ``torch.inference_mode``) only in inference mode."""
    return torch.inference_mode() if tensor.is_inference() else torch.no_grad()


def host_waitable_event() -> torch.cuda.Event:
    """A CUDA event a host thread may wait for: its ``synchronize()`` sleeps until the GPU reaches it
    (``cudaEventBlockingSync``) instead of spinning on a core (see the module docstring)."""
    return torch.cuda.Event(blocking=True)


class Stream:
    """A device stream: operations run in order on the stream's own host thread.

    On a CPU device the thread *is* the stream (a stand-in that is truly asynchronous). On a CUDA device
    the thread issues each operation on its own CUDA stream, with that device current.
    """

    def __init__(self, name: str, abort: AbortSignal, jitter: float = 0.0, seed: int = 0,
                 device: torch.device | None = None, stress: bool = False) -> None:
        self.name = name
        self._abort = abort
        self._jitter = jitter
        self._random = random.Random(seed)
        self._device = device if device is not None and device.type == "cuda" else None
        self.cuda_stream = torch.cuda.Stream(device=self._device) if self._device is not None else None
        self._reached: torch.cuda.Event | None = None  # what synchronize() waits for (CUDA; made at first use)
        self.stress = stress and self.cuda_stream is None  # CPU stand-ins only
        self._landing: list[tuple[torch.Tensor, torch.Tensor]] = []  # stress: late copies (source, target)
        self._landing_since = 0.0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"roundpipe-{name}", daemon=True)
        self._thread.start()

    def submit(self, operation: Callable[[], None]) -> None:
        """Run ``operation`` on this stream after everything enqueued before it."""
        self._queue.put(operation)

    def record(self, name: str = "event") -> HostEvent:
        """An event that is set when the stream reaches this point (on CUDA: with a CUDA event recorded there)."""
        event = HostEvent(f"{name} (stream {self.name})")
        if self.cuda_stream is None:
            if self.stress:
                def land_then_set() -> None:
                    self._land()  # the event is recorded only once the copies before it have landed
                    event.set()

                self._queue.put(land_then_set)
            else:
                self._queue.put(event.set)
            return event
        stream = self.cuda_stream

        def record_on_gpu() -> None:
            event.cuda_event = host_waitable_event()
            event.cuda_event.record(stream)
            event.set()

        self._queue.put(record_on_gpu)
        return event

    def mark(self) -> torch.cuda.Event | None:
        """A CUDA event recorded at this point of the stream, without waiting for it (None on CPU stand-ins); a
        host thread that synchronizes it sleeps. Called only from operations on this stream."""
        if self.cuda_stream is None:
            return None
        event = host_waitable_event()
        event.record(self.cuda_stream)
        return event

    def wait_event(self, event: HostEvent | None) -> None:
        """Later operations on this stream wait until ``event`` is set (on CUDA: and until the GPU work it
        recorded has run, waited for on the GPU, not on the host)."""
        if event is None or (event.is_set() and (event.cuda_event is None or self.cuda_stream is None)):
            return
        stream = self.cuda_stream

        def wait() -> None:
            event.wait(self._abort)
            if stream is not None and event.cuda_event is not None:
                stream.wait_event(event.cuda_event)

        self._queue.put(wait)

    def synchronize(self) -> None:
        """Block this stream's host thread until its GPU work has run (no-op on CPU), sleeping rather than
        spinning (the module docstring). Called only from operations on this stream, where a host buffer must be
        complete before others read it."""
        if self.cuda_stream is not None:
            if self._reached is None:  # one per stream, reused: only this stream's thread records and waits on it
                self._reached = host_waitable_event()
            self._reached.record(self.cuda_stream)
            self._reached.synchronize()
        elif self.stress:
            self._land()

    def copy_late(self, sources: Iterable[torch.Tensor], targets: Iterable[torch.Tensor]) -> None:
        """Stress mode (no-op otherwise): ``targets``, just copied from ``sources`` by an operation on this
        stream, are poisoned now and land later, re-read from ``sources``, when this stream synchronizes or
        reaches its next recorded event. Called only from operations on this stream."""
        if not self.stress:
            return
        pairs = list(zip(sources, targets, strict=True))
        poison(target for _, target in pairs)
        if not self._landing:
            self._landing_since = time.monotonic()
        self._landing.extend(pairs)

    def _land(self) -> None:
        if not self._landing:
            return
        time.sleep(max(0.0, self._landing_since + STRESS_LANDING_DELAY - time.monotonic()))
        for source, target in self._landing:
            with _writable(target):
                target.copy_(source.detach())
        self._landing.clear()

    def stop(self) -> None:
        """Let the thread end after what is queued (after an abort: after the operation it is running)."""
        self._queue.put(_STOP)

    def join(self, deadline: float) -> str | None:
        """Wait for the thread to end until ``deadline``; returns its name if it is still running then
        (inside an operation that has not returned: it ends by itself once it does)."""
        return join_until(self._thread, deadline)

    def _run(self) -> None:
        if self._device is not None:
            torch.cuda.set_device(self._device)  # per thread: the current device of RNG, streams, memory
        context = torch.cuda.stream(self.cuda_stream) if self.cuda_stream is not None else contextlib.nullcontext()
        with thread_checks(), context:  # race checks in this thread too, when a checker is on (sanitizer.py)
            while True:
                operation = self._queue.get()
                if operation is _STOP:
                    return
                if self._abort.aborted:
                    continue  # drain without running: waiters are woken by the abort flag
                if self._jitter:
                    time.sleep(self._random.uniform(0.0, self._jitter))
                try:
                    operation()
                except EngineAborted:
                    pass
                except BaseException as error:  # noqa: BLE001 - reported to the caller through the abort signal
                    self._abort.fail(error)
                operation = None  # its closure may hold a call's host activations alive while idle


_DEVICE_MISMATCH = ("on the same device", "on different devices")
"""Phrases of torch's device-mismatch errors ("Expected all tensors to be on the same device, but ...")."""


def memory_advice(*, recompute: str, num_stages: object, num_layers: int, num_microbatches: int) -> tuple[str, ...]:
    """What is left to change, besides the memory limit, when a device's memory is short: only what the options
    set do not do already (no `recompute='layer'` when it is set, no more stages when every stage holds one layer
    already). ``num_stages``: the option (``"auto"``, an int or an explicit plan)."""
    left = []
    if num_stages == "auto":
        left.append("use more stages (a `num_stages` above the plan's: 'auto' sizes them by parameter bytes "
                    "until the activations are measured)")
    elif isinstance(num_stages, int) and num_stages < num_layers - 1:  # the most: one layer each, and the fused one
        left.append(f"use more stages (`num_stages`, now {num_stages}, at most {num_layers - 1} for the trunk's "
                    f"{num_layers} layers)")
    elif isinstance(num_stages, Plan) and max(map(len, (*num_stages.forward, num_stages.fused,
                                                        *num_stages.backward))) > 1:
        left.append("give `num_stages` a plan with smaller stages")
    left.append(f"put fewer samples in each microbatch (more than the {num_microbatches} of `num_microbatches`, "
                "or a smaller batch)")
    if recompute != "layer":
        left.append(f"use `recompute='layer'` (now {recompute!r}; backward stages then keep every layer's input and "
                    "hold one layer's activations at a time)")
    return tuple(left)


MEMORY_ADVICE = ("use more stages (`num_stages`)", "put fewer samples in each microbatch (`num_microbatches`)",
                 "use `recompute='layer'`")
""":func:`memory_advice` for a device that knows nothing of the options."""


def either(phrases: Sequence[str]) -> str:
    """``a, b, or c``: alternatives in one sentence."""
    return phrases[0] if len(phrases) == 1 else f"{', '.join(phrases[:-1])}, or {phrases[-1]}"


def error_hint(error: BaseException, advice: Sequence[str] = MEMORY_ADVICE) -> str:
    """What to change after ``error`` in a pipeline operation, when it is one we can explain (empty otherwise):
    a device out-of-memory error (``advice``: what :func:`memory_advice` says is left), or tensors of a layer
    on different devices."""
    if isinstance(error, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
        return (". The device ran out of memory: " + either([
            "lower `device_memory_limit` so that the planner makes smaller stages", *advice, "use a shorter sequence"]))
    if isinstance(error, RuntimeError) and any(phrase in str(error) for phrase in _DEVICE_MISMATCH):
        return (". Trunk layers run on per-device copies: each device computes with its own copy of the layer's "
                "parameters and buffers, and its inputs arrive on that device. Do not hard-code a device or keep "
                "tensors in plain attributes: create tensors on the input's device (`torch.zeros(n, "
                "device=x.device)`) or register them as buffers (`self.register_buffer(...)`) so they travel with "
                "the layer")
    return ""


def join_until(thread: threading.Thread, deadline: float) -> str | None:
    """Wait for ``thread`` to end until ``deadline`` (``time.monotonic()``); its name if it is still running."""
    thread.join(max(0.0, deadline - time.monotonic()))
    return thread.name if thread.is_alive() else None


def with_index(device: torch.device) -> torch.device:
    """``device`` with its index: a CUDA device given without one (``"cuda"``) is the current one, so that
    ``"cuda"`` and ``"cuda:0"`` compare equal when the current device is 0."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def cuda_memory_budget(device: torch.device, sharing: int) -> int:
    """What one ring member may use of ``device`` when no ``device_memory_limit`` is given: what this
    process can still allocate there (free memory plus torch's cached blocks, capped by a per-process
    memory fraction, which ``mem_get_info`` ignores), less 10% for what the accounting cannot see (the
    allocator's rounding and fragmentation, deferred frees), split between the ``sharing`` ring members on
    this GPU. Kernel workspaces are accounted within it (see :class:`Device`)."""
    free, total = torch.cuda.mem_get_info(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    fraction_of = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = fraction_of(device) if fraction_of is not None else 1.0
    usable = min(free + reserved - allocated, int(fraction * total) - allocated)
    return max(0, int(0.9 * usable)) // max(1, sharing)


@dataclass
class Residency:
    """Bytes resident on one device, by kind, with the peak; raises past the budget."""

    device_index: int
    budget: int | None = None
    current: int = 0
    peak: int = 0
    resident_stages: int = 0
    peak_stages: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    advice: tuple[str, ...] = MEMORY_ADVICE  #: what else to change when it runs out (:func:`memory_advice`)

    def allocate(self, nbytes: int, what: str, stage: bool = False) -> None:
        with self._lock:
            if self.budget is not None and self.current + nbytes > self.budget:
                raise OutOfDeviceMemory(
                    f"device {self.device_index} would hold {self.current + nbytes} bytes for {what}, over its "
                    f"budget of {self.budget} bytes. {either(['Raise `device_memory_limit`', *self.advice])}."
                )
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            if stage:
                self.resident_stages += 1
                self.peak_stages = max(self.peak_stages, self.resident_stages)

    def release(self, nbytes: int, stage: bool = False) -> None:
        with self._lock:
            self.current -= nbytes
            if stage:
                self.resident_stages -= 1


@dataclass
class DeviceCounters:
    """Running totals of one device, for pipeline metrics.

    Each field has a single writer, the stream thread named beside it, so its unlocked ``+=`` never
    loses an update; other threads only read. Bytes uploaded by two streams are therefore two fields,
    summed by :attr:`uploaded_bytes`.
    """

    compute_seconds: float = 0.0            # download stream: device time computing, added as each job finishes
    uploaded_param_bytes: int = 0           # parameter stream: parameters and buffers copied to the device
    uploaded_activation_bytes: int = 0      # activation stream: inputs, checkpoints, snapshots, targets
    weight_wait_seconds: float = 0.0        # parameter stream: uploads blocked waiting for an optimizer step
    gradient_download_seconds: float = 0.0  # download stream: gradients copied to the host (summed off the ring)

    @property
    def uploaded_bytes(self) -> int:
        """Everything copied to the device: parameters, buffers and activations."""
        return self.uploaded_param_bytes + self.uploaded_activation_bytes


class Device:
    """One member of the ring: a torch device, its four streams and its residency accounting.

    Streams: parameter upload, activation upload, compute, download. Activation uploads have their
    own stream so a large parameter prefetch never delays an input the compute stream is about to use.

    On a GPU the residency holds :data:`~lightning_roundpipe.planning.partition.CUDA_WORKSPACE_RESERVE` from
    the start: what kernels and the allocator keep beyond tensors. ``compute_timer`` times the compute
    stream's operations in device time (``timing.py``).
    """

    def __init__(self, index: int, torch_device: torch.device, abort: AbortSignal, *,
                 budget: int | None, jitter: float, pin_memory: bool = True, stress: bool = False,
                 memory_advice: tuple[str, ...] = MEMORY_ADVICE) -> None:
        if torch_device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"device {torch_device} is not supported: RoundPipe drives CUDA GPUs and CPU devices (simulated, "
                "running the same schedule)"
            )
        torch_device = with_index(torch_device)
        self.index = index
        self.torch_device = torch_device
        self.is_cuda = torch_device.type == "cuda"
        self.pin_downloads = self.is_cuda and pin_memory  # stage boundaries land in pinned host memory
        self.stress = stress and not self.is_cuda  # late copies and poisoned releases (module docstring)
        self.stress_mode = Stress(self.stress)
        self.residency = Residency(index, budget, advice=memory_advice)
        if self.is_cuda:
            self.residency.allocate(CUDA_WORKSPACE_RESERVE, "kernel workspaces (cuBLAS) and the streams' memory pools")
        self.counters = DeviceCounters()
        seed = 1000 * (index + 1)
        device = torch_device if self.is_cuda else None
        self.param_stream = Stream(f"dev{index}-params", abort, jitter, seed, device, self.stress)
        self.act_stream = Stream(f"dev{index}-acts", abort, jitter, seed + 1, device, self.stress)
        self.compute_stream = Stream(f"dev{index}-compute", abort, jitter, seed + 2, device, self.stress)
        self.download_stream = Stream(f"dev{index}-download", abort, jitter, seed + 3, device, self.stress)
        cuda_compute = self.compute_stream.cuda_stream
        self.compute_timer: StreamTimer = (CudaStreamTimer(cuda_compute) if cuda_compute is not None
                                           else HostStreamTimer())

    def wait_idle(self, deadline: float) -> bool:
        """Whether the GPU has run all the work enqueued on this device's streams by ``deadline``
        (``time.monotonic()``); at once on a CPU stand-in. After an abort a copy from pinned host memory may still
        be running when the threads have ended: the memory is unregistered only once it has. Polls without
        spinning; bounded, so a GPU that never finishes cannot hang the caller. False also after a CUDA error
        (the context is then unusable: the caller keeps its memory registered rather than raise while closing)."""
        if not self.is_cuda:
            return True
        try:
            reached = []
            for stream in self.streams:
                event = host_waitable_event()
                event.record(stream.cuda_stream)
                reached.append(event)
            while not all(event.query() for event in reached):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.001)
        except RuntimeError:  # a CUDA error (an earlier kernel's, say)
            return False
        return True

    def stop(self) -> None:
        """Let the four stream threads end (see :meth:`Stream.stop`)."""
        for stream in self.streams:
            stream.stop()

    def join(self, deadline: float) -> list[str]:
        """Wait for the stream threads to end until ``deadline`` at most; returns those still running."""
        return [name for name in (stream.join(deadline) for stream in self.streams) if name is not None]

    @property
    def streams(self) -> tuple[Stream, ...]:
        return self.param_stream, self.act_stream, self.compute_stream, self.download_stream

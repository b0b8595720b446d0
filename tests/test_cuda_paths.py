"""CUDA-only paths run on CPU with fakes of torch's CUDA classes: host waits that sleep instead of spinning, device
time that keeps its precision as a run ages, ``record_stream`` only on CUDA tensors, pinned memory unregistered
only once the GPUs are idle, ``"cuda"`` and ``"cuda:0"`` counted as one GPU, and the LM loss's chunk size fixed
for a run. What only a GPU can show (that a blocking wait leaves its core idle) is the ``spin_wait`` probe of the
first GPU run."""

from __future__ import annotations

import contextlib
import itertools
import struct
import time

import pytest
import torch
import torch.nn.functional as F

from lightning_roundpipe import EngineOptions, RoundPipeEngine
from lightning_roundpipe.engine import device as device_module
from lightning_roundpipe.engine import ring as ring_module
from lightning_roundpipe.engine import timing
from lightning_roundpipe.engine.device import AbortSignal, Device
from lightning_roundpipe.engine.transfer import NoGrad, download_to_host, upload_to
from lightning_roundpipe.hf import lm_loss
from lightning_roundpipe.planning.plan import Plan
from tests.models import bn_batch, bn_model
from tests.test_pinned import FakeCudart

GiB = 2**30


def float32(value: float) -> float:
    """``value`` rounded to float32, as ``cudaEventElapsedTime`` returns it."""
    return struct.unpack("f", struct.pack("f", value))[0]


class FakeClock:
    """The GPU's clock and the host's at once (a test sets it): events are complete when recorded."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeCudaEvent:
    """``torch.cuda.Event``'s interface: remembers its flags, where it was recorded, and its host waits."""

    made: list[FakeCudaEvent] = []
    clock = FakeClock()

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing, self.blocking = enable_timing, blocking
        self.stream: FakeCudaStream | None = None
        self.time: float | None = None
        self.waits = 0
        FakeCudaEvent.made.append(self)

    def record(self, stream: FakeCudaStream) -> None:
        self.stream, self.time = stream, self.clock()

    def synchronize(self) -> None:
        self.waits += 1

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        assert self.enable_timing and end.enable_timing and self.time is not None and end.time is not None
        return float32((end.time - self.time) * 1000.0)


class FakeCudaStream:
    """``torch.cuda.Stream``'s interface; its own ``synchronize`` (``cudaStreamSynchronize``, which spins under
    CUDA's default scheduling) is counted so a test can say it is never called."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1

    def wait_event(self, event: FakeCudaEvent) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch's CUDA streams and events replaced by the fakes, and device 0 current."""
    FakeCudaEvent.made = []
    FakeCudaEvent.clock = FakeClock()
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "Stream", FakeCudaStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return FakeCudaEvent


# ---------------------------------------------------------------------------- C2: host waits sleep
def test_every_host_wait_on_a_cuda_stream_is_a_blocking_event(fake_cuda):
    """The events a host thread may synchronize (a stream's recorded events, the download copies' marks, what
    ``Stream.synchronize`` waits for) are blocking ones, and the stream's own spinning synchronize is never
    called. A device's timer makes timing events, blocking too."""
    abort = AbortSignal(timeout=5.0)
    device = Device(0, torch.device("cuda"), abort, budget=None, jitter=0.0)
    stream = device.download_stream
    assert device.torch_device == torch.device("cuda", 0) and isinstance(stream.cuda_stream, FakeCudaStream)
    marks: list[FakeCudaEvent | None] = []
    recorded = stream.record("copies")
    stream.submit(lambda: marks.append(stream.mark()))
    stream.submit(stream.synchronize)
    stream.submit(stream.synchronize)
    done = stream.record("done")
    done.wait(abort)
    device.stop()
    assert device.join(time.monotonic() + 5.0) == []
    waited = [event for event in fake_cuda.made if event.waits]
    assert len(waited) == 1 and waited[0].waits == 2 and waited[0].stream is stream.cuda_stream  # one, reused
    assert stream.cuda_stream.synchronized == 0
    assert all(event.blocking and not event.enable_timing
               for event in [recorded.cuda_event, done.cuda_event, *marks, *waited])
    timer = device.compute_timer
    assert isinstance(timer, timing.CudaStreamTimer)
    span = timer.stop(timer.start())
    assert span.start.enable_timing and span.start.blocking and span.end.enable_timing and span.end.blocking


# ---------------------------------------------------------------------------- B4: device time over a long run
def test_device_time_spans_stay_precise_a_day_into_the_run(fake_cuda):
    """``elapsed_time`` is a float32 of milliseconds: from an anchor a day old its step is 8 ms. Spans of
    1.5 ms every 7.3 s over a simulated day are placed within 2.5 microseconds of the GPU's own clock (the fake
    GPU and host clocks are one), which a never-renewed anchor misses by milliseconds, and the anchor is renewed
    about once a minute, not at every operation (each renewal is a wait)."""
    clock = fake_cuda.clock
    timer = timing.CudaStreamTimer(FakeCudaStream(), clock=clock)
    worst, anchors = 0.0, set()
    for step in range(int(86_400 / 7.3)):
        clock.now = 1000.0 + step * 7.3 + 0.0123456
        started = timer.start()
        true_start = clock.now
        clock.now += 0.0015
        span = timer.stop(started)
        begin, end = span.bounds()
        worst = max(worst, abs(begin - true_start), abs(end - clock.now))
        anchors.add(span.anchor.host_time)
    assert worst < 2.5e-6
    # renewed at the first operation 60 s after the anchor: at most 67.3 s apart
    renewal = timing.ANCHOR_RENEWAL_SECONDS
    assert 86_400 / (renewal + 7.3) - 1 <= len(anchors) <= 86_400 / renewal + 1


# ---------------------------------------------------------------------------- D1: record_stream, CUDA tensors only
def test_record_stream_is_called_only_on_cuda_tensors(monkeypatch):
    """A layer may return a CPU tensor (inside a ``NoGrad``, say): ``record_stream`` has no CPU kernel, so the
    download (and the upload) must not call it on one. Stand-ins for a CUDA copy stream; every tensor is a CPU
    one here, so ``record_stream`` must not be called at all."""
    recorded: list[torch.Tensor] = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: recorded.append(tensor))

    class CudaCopyStream:
        cuda_stream = FakeCudaStream()
        stress = False
        synchronized = 0

        def copy_late(self, sources, targets) -> None:
            pass

        def mark(self) -> str:
            return "copies done"

        def synchronize(self) -> None:
            self.synchronized += 1

    stream = CudaCopyStream()
    output = (torch.arange(3.0), NoGrad(mask=torch.ones(2, dtype=torch.bool)))
    host, copied = download_to_host(output, stream, pin=False)
    assert copied == "copies done" and stream.synchronized == 0  # the CUDA path: no host sync
    assert torch.equal(host[0], output[0]) and host[0].data_ptr() != output[0].data_ptr()
    uploaded = upload_to(output, torch.device("cpu"), stream, stream)
    assert torch.equal(uploaded[0], output[0])
    assert recorded == []


# ---------------------------------------------------------------------------- D2: unregister after the GPUs
def _pinned_engine(monkeypatch, idle: bool) -> tuple[list[tuple[str, int]], FakeCudart]:
    """Close a (CPU) engine that pinned its weights as with a GPU in the ring, each device saying whether its
    GPU work has run (``idle``); returns the order of the waits and the CUDA calls."""
    fake = FakeCudart(accept=10**6)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    order: list[tuple[str, int]] = []

    def wait_idle(self, deadline: float) -> bool:
        order.append(("wait_idle", self.index))
        return idle

    monkeypatch.setattr(Device, "wait_idle", wait_idle)
    original = fake.cudaHostUnregister
    monkeypatch.setattr(fake, "cudaHostUnregister", lambda pointer: order.append(("unregister", 0)) or original(
        pointer))
    model = bn_model()
    engine = RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=2, wait_timeout=2.0))
    with engine:
        engine.follower.start_pinning(engine._ring.sources)
        assert fake.registered
        x, y = bn_batch(8, 0)
        engine.forward_backward(x, y, F.cross_entropy)
    return order, fake


def test_pinned_memory_is_unregistered_only_once_every_ring_gpu_is_idle(monkeypatch):
    order, fake = _pinned_engine(monkeypatch, idle=True)
    waits = [entry for entry in order if entry[0] == "wait_idle"]
    assert waits == [("wait_idle", 0), ("wait_idle", 1)] and order[:2] == waits  # every device, then unregister
    assert len(order) > 2 and fake.registered == {}


def test_pinned_memory_stays_registered_while_a_gpu_still_runs_copies(monkeypatch):
    with pytest.warns(RuntimeWarning, match=r"still had GPU work running .* stays registered"):
        order, fake = _pinned_engine(monkeypatch, idle=False)
    assert all(kind == "wait_idle" for kind, _ in order) and fake.registered


# ---------------------------------------------------------------------------- D3: backward uploads no buffer
def test_backward_jobs_upload_parameters_but_no_buffers():
    """A backward job recomputes on the buffer snapshots its forward saw: forward and fused jobs upload the
    layers' parameters and buffers, backward jobs their parameters only (the live buffers may be being written
    back by another job). Bytes from the model's own tensors."""
    model = bn_model()
    plan = Plan((range(0, 3),), range(3, 7), (range(0, 3),))

    def nbytes(layers: range, kind: str) -> int:
        return sum(t.numel() * t.element_size() for layer in layers
                   for t in getattr(model[layer], kind)())

    every = range(0, 7)
    expected = nbytes(every, "parameters") + nbytes(every, "buffers") + nbytes(range(0, 3), "parameters")
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=plan)) as engine:
        x, y = bn_batch(8, 0)
        engine.forward_backward(x, y, F.cross_entropy)
        engine.synchronize()
        uploaded = sum(device.counters.uploaded_param_bytes for device in engine.devices)
    assert nbytes(range(0, 3), "buffers") > 0 and uploaded == expected


# ---------------------------------------------------------------------------- D4: one GPU named two ways
def test_cuda_and_cuda_0_are_one_gpu_when_splitting_the_automatic_budget(monkeypatch):
    asked = []

    def budget(device: torch.device, sharing: int) -> int:
        asked.append((device, sharing))
        return 12 * GiB // sharing

    monkeypatch.setattr(ring_module, "cuda_memory_budget", budget)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    devices = [torch.device("cuda"), torch.device("cuda:0"), torch.device("cuda:1")]
    assert ring_module.cuda_budget(devices) == 6 * GiB
    assert asked == [(torch.device("cuda", 0), 2), (torch.device("cuda", 0), 2), (torch.device("cuda", 1), 1)]
    assert device_module.with_index(torch.device("cpu")) == torch.device("cpu")


# ---------------------------------------------------------------------------- D6: chunk rows fixed per run
def test_lm_loss_chunk_rows_are_measured_once_per_device_and_kept(monkeypatch):
    """On CUDA the chunk size comes from the free memory; measured again at every call it would change the
    weight gradient's summation order whenever the free memory crossed a power of two. The first call's size is
    kept (for this device, vocabulary and dtype), whatever the free memory does afterwards."""
    free = itertools.chain([8 * GiB, 1 * GiB], itertools.repeat(64 * GiB))
    asked = []

    def budget(device: torch.device, sharing: int) -> int:
        asked.append(device)
        return next(free)

    monkeypatch.setattr(device_module, "cuda_memory_budget", budget)
    monkeypatch.setattr(lm_loss, "_RUN_CHUNK_ROWS", {})
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    first = lm_loss.run_chunk_rows(cuda0, 128_256, torch.bfloat16)
    assert first == lm_loss.chunk_rows_for_memory(8 * GiB, 128_256, torch.bfloat16) == 512
    assert [lm_loss.run_chunk_rows(cuda0, 128_256, torch.bfloat16) for _ in range(3)] == [512] * 3
    assert asked == [cuda0]
    assert lm_loss.run_chunk_rows(cuda1, 128_256, torch.bfloat16) == 64  # another device: its own first size
    assert lm_loss.run_chunk_rows(torch.device("cpu"), 128_256, torch.bfloat16) == lm_loss.chunk_rows(128_256)
    assert asked == [cuda0, cuda1]

"""The CUDA runtime on a real GPU (skipped without one): transparency, a ring that visits one GPU twice,
the bf16 transport path bitwise equal to fp32 uploads, the allocator's real peak within the memory budget, no
growth over many iterations, measured times that are GPU time rather than launch time, and a refused pin that
leaves no CUDA error behind.
Run from the repository root with ``python -m pytest -m gpu tests/test_gpu.py``."""

from __future__ import annotations

import statistics
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

from lightning_roundpipe import EngineOptions, RoundPipeEngine
from lightning_roundpipe.engine.pinned import PinnedStorages
from lightning_roundpipe.planning.partition import CUDA_WORKSPACE_RESERVE
from tests.models import clone, gpt_batch, gpt_loss, tiny_gpt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _train(model, devices, steps: int, options: EngineOptions, autocast: bool = False,
           uploaded: list[int] | None = None) -> list[float]:
    """``steps`` SGD steps; ``uploaded``, if given, receives the bytes the ring copied to its devices."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    with RoundPipeEngine(model, devices, options) as engine:
        for step in range(steps):
            x, y = gpt_batch(8, step)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                losses.append(engine.forward_backward(x, y, gpt_loss).item())
            engine.step(optimizer)
        engine.synchronize()
        if uploaded is not None:
            uploaded.append(sum(device.counters.uploaded_bytes for device in engine.devices))
    return losses


def _reference(model, steps: int, autocast: bool, microbatches: int) -> list[float]:
    """Plain PyTorch on the GPU, accumulating the same microbatches."""
    model = model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = gpt_batch(8, step)
        total = 0.0
        for xs, ys in zip(x.cuda().tensor_split(microbatches), y.cuda().tensor_split(microbatches), strict=True):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = gpt_loss(model(xs), ys) * (len(xs) / len(x))
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


# Tolerances: both sides run the same CUDA kernels on the same microbatches, so only the order of the
# gradient sums differs. fp32 (TF32 off, torch's default for matmuls): ~1e-6 relative per step, and 1e-4
# covers 4 SGD steps with momentum with a wide margin. bf16-mixed: the matmuls round to bf16 (eps 2**-7,
# 7.8e-3) and may round differently on either side, so the bound is 2.5 bf16 eps. Unlike the CPU tests these
# are constants: a float64 reference on the GPU would not use the same kernels.
@pytest.mark.parametrize("autocast,tolerance", [(False, dict(rtol=1e-4, atol=1e-5)), (True, dict(rtol=2e-2, atol=2e-2))],
                         ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize("ring", [["cuda:0"], ["cuda:0", "cuda:0"]], ids=["one", "ring-0-0"])
def test_training_equals_plain_pytorch_on_the_gpu(ring, autocast, tolerance):
    model = tiny_gpt()
    reference = clone(model)
    options = EngineOptions(num_microbatches=2, num_stages=2)
    losses = _train(model, ring, 4, options, autocast)
    expected = _reference(reference, 4, autocast, 2)
    torch.testing.assert_close(losses, expected, **tolerance)
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, ref.cpu(), **tolerance)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("roundpipe-")]


@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
def test_bf16_transport_equals_float32_uploads_under_autocast_on_the_gpu(async_step):
    """The bf16 transport path (the default under Lightning's bf16-mixed: weights cast once on the host, uploaded
    in bf16, gradients widened into the fp32 staging) against fp32 uploads cast by autocast on the device. With one
    microbatch no bf16 gradient is summed over microbatches, so the two are bitwise equal (tests/test_transport.py
    checks the same on CPU stand-ins), and the transport uploads fewer bytes."""
    results = {}
    for transport in ("off", "bfloat16"):
        model, uploaded = tiny_gpt(), []
        options = EngineOptions(num_microbatches=1, num_stages=2, async_step=async_step, transport_dtype=transport)
        losses = _train(model, ["cuda:0"], 4, options, autocast=True, uploaded=uploaded)
        results[transport] = losses, model, uploaded[0]
    (losses_off, off, bytes_off), (losses_on, on, bytes_on) = results["off"], results["bfloat16"]
    assert losses_on == losses_off
    for name, param in on.named_parameters():
        assert torch.equal(param, off.get_parameter(name)), name
    assert bytes_on < 0.9 * bytes_off, (bytes_on, bytes_off)


def test_the_allocator_stays_within_the_budget_and_memory_does_not_grow():
    """The accounting is honest: the caching allocator's real peak (``max_memory_reserved``, what an out-of-memory
    error is about) stays within the budgets of the ring members on the GPU, and nothing grows over many steps."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()  # what the process holds already (cuBLAS workspaces of earlier tests)
    model = tiny_gpt(blocks=6)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # beyond the workspace reserve, twice the model: stages of a fraction of it with their gradients, and what a
    # backward stage's recompute keeps for backward (here about twice a block's weights: the CPU run peaks at
    # 1.27x the model)
    limit = CUDA_WORKSPACE_RESERVE + 2 * model_bytes
    ring = ["cuda:0", "cuda:0"]
    options = EngineOptions(num_microbatches=2, device_memory_limit=limit)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peaks = []
    with RoundPipeEngine(model, ring, options) as engine:
        for step in range(50):
            x, y = gpt_batch(8, step)
            engine.forward_backward(x, y, gpt_loss)
            engine.step(optimizer)
            if step in (10, 49):
                engine.synchronize()
                peaks.append(torch.cuda.memory_allocated())
        figures = engine.cuda_memory_figures()
    budget = len(ring) * limit  # both ring members live on cuda:0
    reserved = figures["cuda0_max_reserved_bytes"] - before
    accounted = figures["cuda0_accounted_peak_bytes"]
    assert accounted <= budget
    assert reserved <= budget, (
        f"the allocator held {reserved} bytes at its peak (allocated in tensors: "
        f"{figures['cuda0_max_allocated_bytes']:.0f}), over the {budget} bytes the ring members' budgets allow; "
        f"the accounting's peak was {accounted:.0f}: the reserve or the activation accounting misses something")
    assert peaks[1] <= peaks[0] * 1.05 + 2**20, f"device memory grew from {peaks[0]} to {peaks[1]} bytes"


def test_measured_times_are_gpu_time_not_launch_time():
    """A layer whose kernel keeps the GPU busy for tens of milliseconds takes microseconds to launch: the planner,
    the timeline and the compute seconds see the GPU's time (CUDA events), not the launch."""
    cycles = 50_000_000
    before = _spin_seconds(cycles)

    class Spin(torch.nn.Module):
        def forward(self, x):
            torch.cuda._sleep(cycles)
            return x

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Spin(), torch.nn.Linear(8, 2))
    options = EngineOptions(num_microbatches=2, num_stages=1, record_timeline=True)
    with RoundPipeEngine(model, ["cuda:0"], options) as engine:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            engine.forward_backward(torch.randn(4, 8), torch.tensor([0, 1, 0, 1]), F.cross_entropy)
            engine.step(optimizer)
        engine.synchronize()
        estimate = engine.planner.estimate
        forward = [event for event in engine.events() if event.kind == "forward"]
        busy = engine.devices[0].counters.compute_seconds
    after = _spin_seconds(cycles)
    # the envelope of the spins measured before and after: `_sleep` counts SM cycles, so its time follows the clock
    low, high = min(before, after), max(before, after)
    assert estimate is not None, "no step was measured whole"
    assert 0.7 * low <= estimate[1].forward <= 1.5 * high, (estimate[1].forward, before, after)
    assert estimate[0].forward < 0.1 * low  # the Linear layers: no spin inside
    # one forward stage (num_stages=1) holds layers 0 and 1: each of its microbatches runs Spin once
    assert forward and all(event.end - event.start >= 0.7 * low for event in forward)
    assert busy >= 0.7 * low * len(forward)


def _spin_seconds(cycles: int, repeats: int = 3) -> float:
    """GPU seconds of ``torch.cuda._sleep(cycles)``: the median of ``repeats`` after as many warm-up spins, so
    that a GPU idling at a low clock (an H200 idles at 345 MHz and boosts to 1980) has ramped up first."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spins = []
    for _ in range(2 * repeats):
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        spins.append(start.elapsed_time(end) / 1000.0)
    return statistics.median(spins[repeats:])


def test_a_cuda_out_of_memory_error_names_the_stage_and_what_to_change():
    class Hog(torch.nn.Module):
        def forward(self, x):
            free, _ = torch.cuda.mem_get_info()
            return x + torch.empty(free * 2, dtype=torch.uint8, device=x.device).float().sum()

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Hog(), torch.nn.Linear(4, 2))
    with pytest.raises(Exception, match=r"(?s)trunk layer 1 .*ran out of memory.*device_memory_limit"):
        with RoundPipeEngine(model, ["cuda:0"], EngineOptions(num_microbatches=1)) as engine:
            engine.forward_backward(torch.randn(2, 4), torch.tensor([0, 1]), F.cross_entropy)


def test_a_refused_pin_leaves_no_cuda_error_on_the_main_thread(monkeypatch):
    """cudaHostRegister's error stays in the calling thread's last-error slot, where the next kernel launched on
    that thread would raise it: PinnedStorages registers from a helper thread, so the main thread stays clean."""
    torch.cuda.init()
    host = torch.zeros(2**20)
    first = PinnedStorages()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a machine that refuses every registration refuses this one already
        first.pin([host])
    try:
        if first.refused is None:  # register the same range again; is_pinned() would skip it, so it says no
            assert host.is_pinned()
            monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *args, **kwargs: False)
            second = PinnedStorages()
            with pytest.warns(UserWarning, match="could not pin host memory"):
                second.pin([host])
            monkeypatch.undo()
            assert second.refused is not None and "cudaHostRegister refused" in second.refused
        x = torch.arange(8.0, device="cuda")
        assert (x * 2).sum().item() == 56.0  # a kernel launch on the main thread, then a sync
    finally:
        first.release()
    assert not host.is_pinned()

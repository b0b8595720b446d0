"""The CUDA runtime on a real GPU (skipped without one): transparency, a ring that visits one GPU twice,
the memory budget, and no growth over many iterations. Run with ``pytest -m gpu``."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from lightning_roundpipe import EngineOptions, RoundPipeEngine
from tests.models import clone, gpt_batch, gpt_loss, tiny_gpt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _train(model, devices, steps: int, options: EngineOptions, autocast: bool = False) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    with RoundPipeEngine(model, devices, options) as engine:
        for step in range(steps):
            x, y = gpt_batch(8, step)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                losses.append(engine.forward_backward(x, y, gpt_loss).item())
            engine.step(optimizer)
        engine.synchronize()
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


def test_memory_stays_under_a_set_budget_and_does_not_grow():
    torch.cuda.empty_cache()
    model = tiny_gpt(blocks=6)
    stage_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    limit = stage_bytes  # the whole model's bytes: two stages of a fraction of it must fit
    options = EngineOptions(num_microbatches=2, device_memory_limit=limit)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peaks = []
    with RoundPipeEngine(model, ["cuda:0", "cuda:0"], options) as engine:
        for step in range(50):
            x, y = gpt_batch(8, step)
            engine.forward_backward(x, y, gpt_loss)
            engine.step(optimizer)
            if step in (10, 49):
                engine.synchronize()
                peaks.append(torch.cuda.memory_allocated())
        assert max(engine.peak_resident_bytes()) <= limit
    assert peaks[1] <= peaks[0] * 1.05 + 2**20, f"device memory grew from {peaks[0]} to {peaks[1]} bytes"


def test_a_cuda_out_of_memory_error_names_the_stage_and_what_to_change():
    class Hog(torch.nn.Module):
        def forward(self, x):
            free, _ = torch.cuda.mem_get_info()
            return x + torch.empty(free * 2, dtype=torch.uint8, device=x.device).float().sum()

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Hog(), torch.nn.Linear(4, 2))
    with pytest.raises(Exception, match=r"(?s)trunk layer 1 .*ran out of memory.*device_memory_limit"):
        with RoundPipeEngine(model, ["cuda:0"], EngineOptions(num_microbatches=1)) as engine:
            engine.forward_backward(torch.randn(2, 4), torch.tensor([0, 1]), F.cross_entropy)

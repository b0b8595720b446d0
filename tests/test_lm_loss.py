"""chunked_lm_loss against plain F.cross_entropy on full logits: values, gradients,
mixed precision and (measured) peak memory.

Tolerances (tests/numerics.py): in float64 the chunked loss equals full logits to 1e-12 (the same
arithmetic, summed in chunks); in float32 it is within 4x the float32 full-logits reference's own
distance from full logits in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from lightning_roundpipe.hf import lm_loss
from lightning_roundpipe.hf.lm_loss import (
    DEFAULT_CHUNK_BYTES,
    chunk_rows,
    chunk_rows_for_memory,
    chunked_lm_loss,
    default_chunk_rows,
)
from tests.numerics import assert_close_to_reference, assert_float64_equal

IGNORE = -100
MiB = 2**20


def _case(lead, H, V, dtype, *, bias=True, seed=0, p_ignore=0.3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) / H**0.5
    b = torch.randn(V, generator=g, dtype=dtype) if bias else None
    labels = torch.randint(0, V, lead, generator=g)
    labels[torch.rand(lead, generator=g) < p_ignore] = IGNORE
    return hidden, weight, b, labels


def _leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def _reference(hidden, weight, bias, labels, reduction="none"):
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE, reduction=reduction)


def _grads(*ts):
    return [None if t is None else t.grad for t in ts]


def _double(*ts):
    return [None if t is None else t.double() for t in ts]


def _full_logits(hidden, weight, bias, labels, grad_out, lead):
    """The full-logits reference on leaf copies of the given tensors: its loss and gradients."""
    rh, rw, rb = _leaves(hidden, weight, bias)
    ref = _reference(rh, rw, rb, labels).view(lead)
    ref.backward(grad_out)
    return ref.detach(), _grads(rh, rw, rb)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("lead", [(37,), (3, 13)])
@pytest.mark.parametrize("rows", [1, 8, 10, 1000])  # 1 row; 8, 10 do not divide N (37 or 39); > N
@pytest.mark.parametrize("bias", [True, False])
def test_matches_full_logits_cross_entropy(dtype, lead, rows, bias):
    V = 50
    h0, w0, b0, labels = _case(lead, 16, V, dtype, bias=bias)
    assert (labels == IGNORE).any() and (labels != IGNORE).any()
    grad_out = torch.rand(lead, dtype=dtype)  # non-uniform upstream grad per token

    h, w, b = _leaves(h0, w0, b0)
    loss = chunked_lm_loss(h, w, labels, bias=b, chunk_bytes=rows * V * 4)
    assert loss.shape == labels.shape and loss.dtype == dtype
    loss.backward(grad_out)
    assert (loss.detach()[labels == IGNORE] == 0).all()

    ref, ref_grads = _full_logits(h0, w0, b0, labels, grad_out, lead)
    if dtype == torch.float64:
        assert_float64_equal(loss.detach(), ref, what="loss")
        for name, got, want in zip("hwb", _grads(h, w, b), ref_grads, strict=True):
            if got is not None or want is not None:
                assert_float64_equal(got, want, what=f"grad {name}")
    else:  # the same float32 inputs, upcast, through full logits in float64
        ref64, ref64_grads = _full_logits(*_double(h0, w0, b0), labels, grad_out.double(), lead)
        assert_close_to_reference(loss.detach(), ref, ref64, what="loss")
        for name, got, want, want64 in zip("hwb", _grads(h, w, b), ref_grads, ref64_grads, strict=True):
            if got is not None or want is not None:
                assert_close_to_reference(got, want, want64, what=f"grad {name}")


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_mean_over_valid_tokens(rows):
    """The usual LM reduction (sum / number of valid tokens) scales the upstream grad."""
    V = 40
    h0, w0, b0, labels = _case((4, 16), 8, V, torch.float32, seed=1)
    h, w, b = _leaves(h0, w0, b0)
    loss = chunked_lm_loss(h, w, labels, bias=b, chunk_bytes=rows * V * 4)
    mean = loss.sum() / (labels != IGNORE).sum()
    mean.backward()
    refs = {}
    for dtype, inputs in ((torch.float32, (h0, w0, b0)), (torch.float64, _double(h0, w0, b0))):
        rh, rw, rb = _leaves(*inputs)
        ref = _reference(rh, rw, rb, labels, reduction="mean")
        ref.backward()
        refs[dtype] = ref.detach(), _grads(rh, rw, rb)
    (ref, ref_grads), (ref64, ref64_grads) = refs[torch.float32], refs[torch.float64]
    assert_close_to_reference(mean.detach(), ref, ref64, what="mean loss")
    for name, got, want, want64 in zip("hwb", _grads(h, w, b), ref_grads, ref64_grads, strict=True):
        assert_close_to_reference(got, want, want64, what=f"grad {name}")


def test_gradcheck_float64():
    h, w, b = _leaves(*_case((5,), 4, 7, torch.float64, seed=2)[:3])
    labels = torch.tensor([0, IGNORE, 6, 3, 3])
    fn = lambda h, w, b: chunked_lm_loss(h, w, labels, bias=b, chunk_bytes=2 * 7 * 4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h, w, b))


def test_all_ignored_gives_zero_loss_and_zero_grads():
    h0, w0, b0, labels = _case((6, 5), 8, 30, torch.float32, seed=3)
    labels.fill_(IGNORE)
    h, w, b = _leaves(h0, w0, b0)
    loss = chunked_lm_loss(h, w, labels, bias=b, chunk_bytes=7 * 30 * 4)
    # Upstream grad is inf/NaN on ignored tokens: it must not leak into the grads.
    loss.backward(torch.full_like(loss, float("nan")))
    assert torch.equal(loss.detach(), torch.zeros_like(loss))
    for grad in _grads(h, w, b):
        assert torch.equal(grad, torch.zeros_like(grad))


def test_bf16_autocast_matches_bf16_logits_reference():
    h0, w0, _, labels = _case((64,), 32, 1000, torch.float32, bias=False, seed=4)
    h, w = _leaves(h0, w0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_lm_loss(h, w, labels, chunk_bytes=16 * 1000 * 4)
    (loss.sum() / (labels != IGNORE).sum()).backward()  # backward outside autocast

    rh, rw = _leaves(h0, w0)
    logits = (rh.bfloat16() @ rw.bfloat16().T).float()  # what HF does under bf16
    ref = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="none")
    ref.sum().div((labels != IGNORE).sum()).backward()

    assert loss.dtype == torch.float32
    # Same bf16 logits; only the fp32 softmax summation may differ, by float32 roundings over 1000 classes
    # (~1e-6 relative), far inside these bounds. They are set by the alternative they must exclude: fp32
    # matmuls would be off by ~1e-2 here, so these tolerances do check the bf16 path.
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-3, atol=1e-4)
    for g in (h.grad, w.grad):
        assert g.dtype == torch.float32 and torch.isfinite(g).all()
    # Backward ran outside autocast yet must still use bf16 matmuls like the forward:
    # an fp32 backward would differ here by ~6e-5 (max |grad| ~2e-2).
    torch.testing.assert_close(h.grad, rh.grad, rtol=1e-3, atol=1e-5)
    # The reference rounds the whole weight grad to bf16 (one rounding, up to 2**-8 = 3.9e-3 relative); ours
    # sums chunks in fp32: 2e-2 allows a few bf16 roundings of the chunks' partial sums.
    torch.testing.assert_close(w.grad, rw.grad, rtol=2e-2, atol=1e-3)


def test_validation_errors():
    h, w, _, labels = _case((2, 3), 8, 10, torch.float32)
    with pytest.raises(ValueError, match="last dim"):
        chunked_lm_loss(h[..., :7], w, labels)
    with pytest.raises(ValueError, match="labels shape"):
        chunked_lm_loss(h, w, labels.reshape(-1))
    with pytest.raises(ValueError, match="integer"):
        chunked_lm_loss(h, w, labels.float())
    with pytest.raises(ValueError, match="bias"):
        chunked_lm_loss(h, w, labels, bias=torch.zeros(9))


def test_chunk_rows():
    assert chunk_rows(32768, 4 * MiB) == 32  # 32 rows * 32768 * 4 B = 4 MiB
    assert chunk_rows(10**9, 4 * MiB) == 1  # never zero rows
    assert chunk_rows(128_256) == DEFAULT_CHUNK_BYTES // (128_256 * 4)


GiB = 2**30
BF16_128K_ROW = 128_256 * (2 + 2 * 4)  # bytes per row: bf16 logits, their float32 copy, one float32 buffer


@pytest.mark.parametrize(("available", "vocab", "dtype", "rows"), [
    # available bytes / 8 // row bytes, clamped to [32, 4096], rounded down to a power of two
    (48 * GiB, 128_256, torch.bfloat16, 4096),       # 6_442_450_944 // 1_282_560 = 5023 -> the 4096 cap
    (8 * GiB, 128_256, torch.bfloat16, 512),         # 1_073_741_824 // 1_282_560 = 837 -> 512
    (1 * GiB, 128_256, torch.bfloat16, 64),          # 134_217_728 // 1_282_560 = 104 -> 64
    (100 * MiB, 128_256, torch.bfloat16, 32),        # 13_107_200 // 1_282_560 = 10 -> the 32 floor
    (0, 128_256, torch.bfloat16, 32),                # nothing free: the floor, not zero rows
    (-5, 128_256, torch.bfloat16, 32),               # (a budget already overdrawn)
    (8 * GiB, 128_256, torch.float32, 512),          # row 128_256 * 12 = 1_539_072: 1_073_741_824 // it = 697
    (4 * GiB, 32_000, torch.float16, 1024),          # row 320_000: 536_870_912 // 320_000 = 1677 -> 1024
    (2048 * 320_000 * 8, 32_000, torch.float16, 2048),      # exactly 2048 rows
    (2048 * 320_000 * 8 - 1, 32_000, torch.float16, 1024),  # one byte short: 2047 -> 1024
    (1 * GiB, 50, torch.float64, 4096),              # row 50 * (8 + 2 * 8) = 1200: 111_848 -> the cap
])
def test_chunk_rows_for_memory(available, vocab, dtype, rows):
    assert chunk_rows_for_memory(available, vocab, dtype) == rows


def test_default_chunk_rows_measures_cuda_memory_only(monkeypatch):
    from lightning_roundpipe.engine import device as device_module

    asked = []

    def budget(device, sharing):
        asked.append((device, sharing))
        return 8 * GiB

    monkeypatch.setattr(device_module, "cuda_memory_budget", budget)
    cuda = torch.device("cuda", 0)  # only its type is looked at: no GPU needed
    assert default_chunk_rows(cuda, 128_256, torch.bfloat16) == 512
    assert asked == [(cuda, 1)]
    assert default_chunk_rows(torch.device("cpu"), 128_256, torch.bfloat16) == chunk_rows(128_256) == 130
    assert asked == [(cuda, 1)]  # the CPU size is fixed


def test_chunk_size_defaults_to_default_chunk_rows(monkeypatch):
    """Without ``chunk_bytes`` the loss asks :func:`default_chunk_rows` (with the compute dtype) and
    computes exactly what the same explicit chunking computes."""
    V = 300
    h0, w0, b0, labels = _case((5, 9), 16, V, torch.float32, seed=6)
    asked = []

    def rows(device, vocab_size, compute_dtype):
        asked.append((device.type, vocab_size, compute_dtype))
        return 8

    monkeypatch.setattr(lm_loss, "default_chunk_rows", rows)
    results = []
    for chunk_bytes in (None, 8 * V * 4):
        h, w, b = _leaves(h0, w0, b0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = chunked_lm_loss(h, w, labels, bias=b, chunk_bytes=chunk_bytes)
        loss.sum().backward()
        results.append([loss.detach(), *_grads(h, w, b)])
    assert asked == [("cpu", V, torch.bfloat16)]
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [7, 1000], ids=["chunks", "one_chunk"])
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_weight_under_autocast_gets_a_bf16_gradient(rows, bias):
    """A head weight (and bias) uploaded already in the autocast dtype: the same loss as the float32 weight
    that autocast casts to those very values, and a gradient in bfloat16 that is the float32 weight's
    gradient rounded once. Both sum the chunks' products in float32 from the same bfloat16 operands, so
    the arithmetic is the same and the equalities are exact."""
    V = 1000
    h0, w0, b0, labels = _case((6, 11), 32, V, torch.float32, bias=bias, seed=7)
    w0 = w0.bfloat16().float()  # values a bfloat16 weight can hold: autocast's cast of them changes nothing
    b0 = None if b0 is None else b0.bfloat16().float()
    grad_out = torch.rand(labels.shape, generator=torch.Generator().manual_seed(8))
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        h, w, b = _leaves(h0, w0.to(dtype), None if b0 is None else b0.to(dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = chunked_lm_loss(h, w, labels, bias=b, chunk_bytes=rows * V * 4)
        loss.backward(grad_out)  # outside autocast, as the engine's backward stages may run
        runs[dtype] = loss.detach(), *_grads(h, w, b)
    (loss32, gh32, gw32, gb32), (loss16, gh16, gw16, gb16) = runs[torch.float32], runs[torch.bfloat16]
    assert loss16.dtype == torch.float32 and torch.equal(loss16, loss32)
    assert gh16.dtype == torch.float32 and torch.equal(gh16, gh32)
    assert gw16.dtype == torch.bfloat16 and torch.equal(gw16, gw32.bfloat16())
    if bias:
        assert gb16.dtype == torch.bfloat16 and torch.equal(gb16, gb32.bfloat16())
    # and the float32 gradient is that of the bfloat16 logits (not of float32 ones): see the test above
    rh, rw = _leaves(h0, w0)
    logits = F.linear(rh.bfloat16(), rw.bfloat16(), None if b0 is None else b0.bfloat16()).float()  # as autocast
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none")
    ref.backward(grad_out.flatten())
    torch.testing.assert_close(loss32, ref.detach().view(labels.shape), rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(gw32, rw.grad, rtol=2e-2, atol=1e-3)


def _peak_allocated_bytes(fn) -> int:
    """Peak of torch CPU bytes allocated while ``fn`` runs, above the level at its start.

    With ``profile_memory=True`` every allocator call becomes a ``[memory]`` event in
    the kineto results carrying its signed size (``nbytes()``: + alloc, - free).
    (``prof.events()`` is no good here: it folds allocations made inside an op into
    that op's ``cpu_memory_usage``, so the ``[memory]`` events there are mostly frees.)
    A running sum in time order gives the live bytes; frees of tensors allocated
    before the profile start push it negative, which only lowers it, never the peak.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    assert events, "profiler recorded no memory events"
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_peak_memory_vs_full_logits():
    N, H, V = 2048, 64, 32768
    chunk_bytes = 4 * MiB
    h0, w0, b0, labels = _case((N,), H, V, torch.float32, seed=5, p_ignore=0.1)
    full_logits = N * V * 4  # 256 MiB

    def run(loss_fn):
        h, w, b = _leaves(h0, w0, b0)
        grads = []

        def step():
            loss_fn(h, w, b).backward()
            grads.extend(_grads(h, w, b))
        return _peak_allocated_bytes(step), grads

    chunked_peak, got = run(lambda h, w, b: chunked_lm_loss(
        h, w, labels, bias=b, chunk_bytes=chunk_bytes).sum() / (labels != IGNORE).sum())
    plain_peak, want = run(lambda h, w, b: _reference(h, w, b, labels, reduction="mean"))

    # The method can see a big allocation: plain CE holds at least the logits.
    assert plain_peak >= full_logits
    # What the chunked loss must hold at once (fp32, so no dtype-cast copies): the
    # gradients it returns, i.e. one buffer the size of hidden + weight + bias (the
    # autograd engine adopts them as .grad without copying), plus one chunk of
    # recomputed logits that the backward turns in place into the softmax and then
    # the logit grad. Allow one more chunk for a temporary (e.g. logsumexp's
    # exp(x - max)) and O(N) for loss/lse/labels-sized vectors. Keeping every
    # chunk alive, or a (V, H) temporary per chunk for the weight grad, breaks it.
    param_bytes = (N * H + V * H + V) * 4
    bound = param_bytes + 2 * chunk_bytes + 64 * N
    assert chunked_peak < bound, (chunked_peak / MiB, bound / MiB)
    assert chunked_peak < plain_peak / 8
    # and it computed the right thing. Full logits in float64 would need 1 GiB here; the float64 reference is
    # the chunked loss in float64 instead, which equals full logits to 1e-12 (see the test above)
    h64, w64, b64 = _leaves(*_double(h0, w0, b0))
    (chunked_lm_loss(h64, w64, labels, bias=b64, chunk_bytes=chunk_bytes).sum() / (labels != IGNORE).sum()).backward()
    for name, grad, grad32, grad64 in zip("hwb", got, want, _grads(h64, w64, b64), strict=True):
        assert_close_to_reference(grad, grad32, grad64, what=f"grad {name}")

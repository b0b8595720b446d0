"""chunked_lm_loss against plain F.cross_entropy on full logits: values, gradients,
mixed precision and (measured) peak memory."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from lightning_roundpipe.hf.lm_loss import DEFAULT_CHUNK_BYTES, chunk_rows, chunked_lm_loss

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


@pytest.mark.parametrize("dtype,tol", [(torch.float64, dict(rtol=1e-5, atol=1e-6)),
                                       (torch.float32, dict(rtol=1e-4, atol=1e-6))])
@pytest.mark.parametrize("lead", [(37,), (3, 13)])
@pytest.mark.parametrize("rows", [1, 8, 10, 1000])  # 1 row; 8, 10 do not divide N (37 or 39); > N
@pytest.mark.parametrize("bias", [True, False])
def test_matches_full_logits_cross_entropy(dtype, tol, lead, rows, bias):
    V = 50
    h0, w0, b0, labels = _case(lead, 16, V, dtype, bias=bias)
    assert (labels == IGNORE).any() and (labels != IGNORE).any()
    grad_out = torch.rand(lead, dtype=dtype)  # non-uniform upstream grad per token

    h, w, b = _leaves(h0, w0, b0)
    loss = chunked_lm_loss(h, w, labels, bias=b, chunk_bytes=rows * V * 4)
    assert loss.shape == labels.shape and loss.dtype == dtype
    loss.backward(grad_out)

    rh, rw, rb = _leaves(h0, w0, b0)
    ref = _reference(rh, rw, rb, labels).view(lead)
    ref.backward(grad_out)

    torch.testing.assert_close(loss.detach(), ref.detach(), **tol)
    assert (loss.detach()[labels == IGNORE] == 0).all()
    for got, want in zip(_grads(h, w, b), _grads(rh, rw, rb)):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_mean_over_valid_tokens(rows):
    """The usual LM reduction (sum / number of valid tokens) scales the upstream grad."""
    V = 40
    h0, w0, b0, labels = _case((4, 16), 8, V, torch.float32, seed=1)
    h, w, b = _leaves(h0, w0, b0)
    loss = chunked_lm_loss(h, w, labels, bias=b, chunk_bytes=rows * V * 4)
    mean = loss.sum() / (labels != IGNORE).sum()
    mean.backward()
    rh, rw, rb = _leaves(h0, w0, b0)
    ref = _reference(rh, rw, rb, labels, reduction="mean")
    ref.backward()
    torch.testing.assert_close(mean, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(_grads(h, w, b), _grads(rh, rw, rb)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


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
    # Same bf16 logits; only the fp32 softmax summation may differ. (fp32 matmuls
    # would be off by ~1e-2 here, so these tolerances do check the bf16 path.)
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-3, atol=1e-4)
    for g in (h.grad, w.grad):
        assert g.dtype == torch.float32 and torch.isfinite(g).all()
    # Backward ran outside autocast yet must still use bf16 matmuls like the forward:
    # an fp32 backward would differ here by ~6e-5 (max |grad| ~2e-2).
    torch.testing.assert_close(h.grad, rh.grad, rtol=1e-3, atol=1e-5)
    # The reference rounds the whole weight grad to bf16; ours sums chunks in fp32.
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

    t0 = time.perf_counter()
    chunked_peak, got = run(lambda h, w, b: chunked_lm_loss(
        h, w, labels, bias=b, chunk_bytes=chunk_bytes).sum() / (labels != IGNORE).sum())
    plain_peak, want = run(lambda h, w, b: _reference(h, w, b, labels, reduction="mean"))
    print(f"\nchunked peak {chunked_peak / MiB:.1f} MiB vs full logits {plain_peak / MiB:.1f} MiB "
          f"({time.perf_counter() - t0:.1f} s)")

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
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)

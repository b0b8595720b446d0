"""Fused, chunked LM-head cross entropy that never materializes full-vocabulary logits.

A language model's last layer turns ``N`` hidden states into ``N x V`` logits; with
``V`` in the tens of thousands that tensor (plus its float32 upcast, its softmax and
its gradient) is usually the largest activation of the whole step, often larger
than the rest of the model's activations together. For a pipeline stage that holds
the LM head, that single spike decides how many micro-batches fit in memory.

:func:`chunked_lm_loss` computes the same per-token losses as
``F.cross_entropy(hidden @ weight.T + bias, labels, reduction="none")`` but walks the
tokens a chunk of rows at a time: the forward keeps only the per-token
log-sum-exp (``N`` floats), and the backward recomputes each chunk's logits to form
``softmax - onehot`` and folds it straight into the gradients of ``hidden``,
``weight`` and ``bias``. Peak extra memory is a few chunk-sized logit buffers plus
the gradients themselves, instead of several ``N x V`` tensors; the price is one
extra ``hidden @ weight.T`` matmul in the backward.

Chunk size: on CUDA, from the memory the device still has for this process
(:func:`chunk_rows_for_memory`: an eighth of it, 32 to 4096 rows, a power of two),
measured at the first call for a device, vocabulary and compute dtype and kept for
the process (:func:`run_chunk_rows`); elsewhere a fixed 64 MiB of float32 logits
(:func:`chunk_rows`). Fewer, larger chunks also mean fewer passes over the ``(V, H)``
weight gradient, which each chunk's ``grad_logits.T @ hidden`` adds into.

The chunking sets the order in which the weight gradient is summed, so a size that
followed the free memory from call to call would make results depend on what else
held memory at that moment: fixed at the first call, a run is bitwise reproducible.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["DEFAULT_CHUNK_BYTES", "MAX_CHUNK_ROWS", "MEMORY_SHARE", "MIN_CHUNK_ROWS", "chunk_rows",
           "chunk_rows_for_memory", "chunked_lm_loss", "default_chunk_rows", "run_chunk_rows"]

#: Budget for one chunk's float32 logits off CUDA (64 MiB), where device memory is not measured.
DEFAULT_CHUNK_BYTES = 64 * 2**20
#: On CUDA: the share of the memory still available to this process that one chunk's buffers may take.
#: The rest is for what runs alongside (the next stage's parameters being uploaded, other microbatches).
MEMORY_SHARE = 1 / 8
#: On CUDA: the bounds of a chunk, in rows (tokens). Powers of two. Past 4096 rows the matmuls gain nothing
#: and the weight gradient is already added into a few times per microbatch; under 32 they are slow.
MIN_CHUNK_ROWS, MAX_CHUNK_ROWS = 32, 4096


def chunk_rows(vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's float32 logits, ``rows * vocab_size * 4``
    bytes, fit in ``chunk_bytes`` (at least one row). Transient memory of the loss is
    a small multiple of that (logits in the compute dtype, the float32 copy, the
    softmax/gradient buffer)."""
    return max(1, chunk_bytes // (vocab_size * 4))


def chunk_rows_for_memory(available_bytes: int, vocab_size: int, compute_dtype: torch.dtype, *,
                          share: float = MEMORY_SHARE, min_rows: int = MIN_CHUNK_ROWS,
                          max_rows: int = MAX_CHUNK_ROWS) -> int:
    """Tokens per chunk when ``available_bytes`` of device memory are left: as many as fit in ``share`` of
    it, clamped to ``[min_rows, max_rows]`` and rounded down to a power of two.

    A row of the chunk holds at once ``vocab_size * (c + 2 m)`` bytes, ``c`` the compute dtype's size and
    ``m`` the softmax's (float32, or float64 for float64 inputs): its logits in the compute dtype, their
    upcast copy and one more buffer of that size (log-sum-exp's ``exp(x - max)`` in the forward, the
    low-precision copy of the logits' gradient in the backward). Rounding to a power of two keeps the
    chunking, and so the order of the weight gradient's sums, the same from call to call while the free
    memory drifts a little (with ample memory it is always ``max_rows``)."""
    math_size = _math_dtype(compute_dtype).itemsize
    row_bytes = vocab_size * (compute_dtype.itemsize + 2 * math_size)
    rows = min(max_rows, max(min_rows, int(max(0, available_bytes) * share) // row_bytes))
    return 1 << (rows.bit_length() - 1)


def default_chunk_rows(device: torch.device, vocab_size: int, compute_dtype: torch.dtype) -> int:
    """Tokens per chunk for a loss computed on ``device``: sized from the memory this process can still
    allocate there on CUDA (free and cached memory, within a per-process memory fraction if one is set),
    a fixed :data:`DEFAULT_CHUNK_BYTES` of float32 logits elsewhere."""
    if device.type != "cuda":
        return chunk_rows(vocab_size)
    from lightning_roundpipe.engine.device import cuda_memory_budget

    return chunk_rows_for_memory(cuda_memory_budget(device, sharing=1), vocab_size, compute_dtype)


_RUN_CHUNK_ROWS: dict[tuple[torch.device, int, torch.dtype], int] = {}
""":func:`run_chunk_rows`' sizes on CUDA, by (device, vocabulary, compute dtype): each the first call's."""


def run_chunk_rows(device: torch.device, vocab_size: int, compute_dtype: torch.dtype) -> int:
    """:func:`default_chunk_rows`, measured on CUDA at the first call for this device, vocabulary and compute
    dtype and the same for the rest of the process (see the module docstring). Safe from several threads:
    the first size stored wins."""
    if device.type != "cuda":
        return default_chunk_rows(device, vocab_size, compute_dtype)  # a fixed size already
    key = (device, vocab_size, compute_dtype)
    rows = _RUN_CHUNK_ROWS.get(key)
    if rows is None:
        rows = _RUN_CHUNK_ROWS.setdefault(key, default_chunk_rows(device, vocab_size, compute_dtype))
    return rows


def _math_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    # Softmax/log-sum-exp in float32 as Hugging Face does (``logits.float()``), but
    # never *lower* the precision of float64 inputs (keeps gradcheck meaningful).
    return torch.promote_types(compute_dtype, torch.float32)


def _logits(h: Tensor, w: Tensor, b: Tensor | None, math_dtype: torch.dtype) -> Tensor:
    out = h @ w.T if b is None else torch.addmm(b, h, w.T)
    return out.to(math_dtype)


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, rows, compute_dtype):
        # hidden (N, H), labels (N,). Matmuls run with autocast off on inputs cast to
        # the dtype chosen by the caller, so the backward reproduces the forward's
        # logits exactly whatever the autocast state of the backward thread.
        dev = hidden.device.type
        mdt = _math_dtype(compute_dtype)
        n = hidden.shape[0]
        loss = hidden.new_empty(n, dtype=mdt)
        lse = hidden.new_empty(n, dtype=mdt)
        with torch.autocast(dev, enabled=False):
            w = weight.to(compute_dtype)
            b = None if bias is None else bias.to(compute_dtype)
            for s in range(0, n, rows):
                e = min(s + rows, n)
                logits = _logits(hidden[s:e].to(compute_dtype), w, b, mdt)
                y = labels[s:e]
                valid = y != ignore_index
                target = logits.gather(1, torch.where(valid, y, 0).unsqueeze(1)).squeeze(1)
                lse[s:e] = torch.logsumexp(logits, dim=1)
                loss[s:e] = torch.where(valid, lse[s:e] - target, 0.0)
                del logits  # free before the next chunk allocates its own
        # Only O(N + params) state is kept: no (N, V) tensor survives the forward.
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.ignore_index, ctx.rows, ctx.compute_dtype = ignore_index, rows, compute_dtype
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cdt, rows = ctx.compute_dtype, ctx.rows
        mdt = _math_dtype(cdt)
        n = hidden.shape[0]
        # Parameter gradients accumulate over chunks, so keep them in >= float32 (also for a weight that
        # is itself in the compute dtype, e.g. bfloat16: it gets its gradient in its own dtype, cast once).
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w: Tensor | None = None  # the first chunk's product, then the sum (see below)
        grad_b = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(cdt)
            b = None if bias is None else bias.to(cdt)
            for s in range(0, n, rows):
                e = min(s + rows, n)
                h = hidden[s:e].to(cdt)
                y = labels[s:e]
                valid = y != ctx.ignore_index
                # softmax = exp(logits - lse), in place on the recomputed logits.
                g = _logits(h, w, b, mdt).sub_(lse[s:e].unsqueeze(1)).exp_()
                # d loss / d logits = softmax - onehot(target); scatter keeps it
                # sync-free (no boolean indexing) and skips ignored rows.
                g.scatter_add_(1, torch.where(valid, y, 0).unsqueeze(1),
                               -valid.to(mdt).unsqueeze(1))
                # where(), not multiply: ignored rows get exactly 0 even if the
                # upstream gradient there is inf/NaN.
                scale = torch.where(valid, grad_loss[s:e].to(mdt), 0.0)
                g.mul_(scale.unsqueeze(1))
                if grad_b is not None:
                    grad_b.add_(g.sum(0))
                gc = g.to(cdt)
                del g
                if grad_h is not None:
                    grad_h[s:e] = gc @ w
                if need_w:
                    if grad_w is None:
                        # The first chunk's product is the sum so far (0 + x = x, exactly): no
                        # zero-filled accumulator. With one chunk and a weight in the compute
                        # dtype it is already the gradient.
                        grad_w = gc.T @ h
                        if e < n:
                            grad_w = grad_w.to(acc_dtype)
                    elif grad_w.dtype == gc.dtype:
                        grad_w.addmm_(gc.T, h)  # no (V, H) temporary
                    else:
                        # Low-precision product, fp32 sum. Costs a (V, H) temporary
                        # in the compute dtype per chunk (CPU has no mixed-dtype addmm):
                        # one per chunk, so chunks are sized large where memory allows.
                        grad_w.add_(gc.T @ h)
                del gc
        if need_w:
            grad_w = (torch.zeros_like(weight) if grad_w is None  # no tokens
                      else grad_w.to(weight.dtype))
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def chunked_lm_loss(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                    ignore_index: int = -100, chunk_bytes: int | None = None) -> Tensor:
    """Per-token cross entropy of logits = hidden @ weight.T (+ bias) against labels, a chunk of tokens at a time.
    hidden: (..., H) ; weight: (V, H) ; labels: (...) int64 with the same leading shape as hidden.
    Returns per-token losses (same leading shape as labels, float32), 0.0 where labels == ignore_index.

    Float64 inputs give float64 losses. Under autocast the matmuls run in the
    autocast dtype (as ``F.linear`` would) and the softmax in float32; a weight (and
    bias) already in that dtype is used as it is and gets its gradient in its own
    dtype (summed over chunks in float32, cast once). Reduce the result yourself,
    e.g. ``loss.sum() / (labels != ignore_index).sum()``.

    ``chunk_bytes`` bounds one chunk's float32 logits; by default
    (:func:`run_chunk_rows`) chunks are sized from the free memory on CUDA at the
    first call, then kept, and hold 64 MiB of float32 logits elsewhere.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be (V, H), got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden last dim must equal weight.shape[1]={weight.shape[1]}, "
                         f"got hidden shape {tuple(hidden.shape)}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden.shape[:-1]="
                         f"{tuple(hidden.shape[:-1])}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    dev = hidden.device.type
    # Like autocast's own casting rule: float64 is never lowered.
    compute_dtype = (torch.get_autocast_dtype(dev)
                     if torch.is_autocast_enabled(dev) and hidden.dtype != torch.float64
                     else hidden.dtype)
    rows = (run_chunk_rows(hidden.device, weight.shape[0], compute_dtype) if chunk_bytes is None
            else chunk_rows(weight.shape[0], chunk_bytes))
    loss = _ChunkedLMLoss.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                labels.reshape(-1).long(), ignore_index, rows, compute_dtype)
    return loss.view(labels.shape)

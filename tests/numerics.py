"""Where the numerical tolerances of the tests come from.

The package must give the results of plain PyTorch running the same microbatches one after another with
gradient accumulation. Floating point makes "the same" precise in three ways, and every numerical equality
in the tests is one of them:

1. **Bitwise**, where the package runs the same kernels on the same data in the same order as the reference
   (one microbatch per batch, the same module run twice, a checkpoint round trip): ``torch.equal``. No
   tolerance; any difference is a real one.

2. **Exact in float64** (the algorithm): the package and the reference both run on a float64 copy of the
   model and data, so rounding is 2**-53 (1.1e-16) per operation. What is left is the different order of
   sums (microbatch gradients accumulated one by one instead of over the whole batch, losses weighted per
   microbatch): at most 1.8e-15 after five training steps of the transparency matrix, a few ulps of values
   of order one. :data:`FLOAT64` allows 1e-12 (relative and absolute): a margin of ~500 over that, and still
   1e5 below float32's rounding, so anything that silently computes in float32 (or drops a microbatch, or
   weighs one wrong) fails it. This holds only where the problem is well conditioned: a parameter whose true
   gradient is zero (a bias just before a BatchNorm) is moved by AdamW along its gradient's rounding noise
   scaled by ``lr / eps``, so two summation orders (a kernel run on one thread or on two) put it ~1e-9 apart
   even in float64. The test models have no such parameter (``tests/models.py``); a test that trains one in
   float64 uses SGD.

3. **Not worse than plain training in float32** (the user's setting): float32 results depend on the CPU's
   kernels (AVX2 and AVX512 sum in different orders), so no constant tolerance is portable; an AdamW update
   divides by ``sqrt(v) + eps`` and turns gradient rounding noise on a parameter whose true gradient is zero
   (a bias just before a BatchNorm) into O(lr) differences. The bound is instead taken from the reference's
   own error on this machine: with ``ref32`` the reference in float32 and ``ref64`` the same reference in
   float64,

       ||ours - ref64|| <= k * ||ref32 - ref64|| + eps * ||ref64||     (per tensor, Euclidean norms)

   * ``k = 4`` (:data:`K`): the package and the reference run the same float32 operations, summed in a
     different order, so their rounding errors are alike in size, and ``k = 1`` would hold on average.
   * ``eps = 4 * float32 eps`` (:data:`EPS32`, ~4.8e-7, relative to the tensor's norm): a floor for when the
     float32 reference happens to round to nearly the float64 value, so that the ratio of the two errors is
     one of two tiny numbers.

   Measured on the fused-path matrix of the transparency tests (both models, 1-3 devices, 1-5 microbatches,
   SGD and AdamW, every parameter, buffer and the losses) with ``ATEN_CPU_CAPABILITY`` avx512, avx2 and
   default, and one OpenMP thread: ``||ours - ref64|| - ||ref32 - ref64||`` never exceeded 0.6 ulp of
   ``||ref64||`` (then with AdamW's amplified biases before BatchNorm in the model), so ``k = 1, eps = 1 ulp`` would already have held;
   ``k = 4, eps = 4 ulps`` leave a margin of 4 in each term. Over all ~10,000 checks of the numerical test
   files, under each of those kernel sets with one and with two threads, the largest share of a bound used
   was 0.32 (float32 checks) and 6e-4 (float64 checks). The errors a bug makes are far above the bounds: a
   microbatch's gradient dropped, or one loss weight 1% too large, fails every check that can see it (the
   float32 checks of the transparency tests by 8x their bound or more; the bound is ~1e-6 relative where the
   reference's float32 error is a few ulps, and a 1% weight moves the losses by ~1e-3).

   Per tensor, not per element: per element the same ratio is one of two random roundings, unbounded where
   the reference rounds luckily. A norm over a tensor averages that out, and a wrong tensor still fails.

To see how much of each bound a run uses on a given CPU, set ``ROUNDPIPE_NUMERICS_LOG`` to a file name: every
check appends a line ``test, what, kind, used`` where ``used`` is the measured difference as a fraction of
what the tolerance allows (1.0 would be the limit).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

EPS32 = 4 * torch.finfo(torch.float32).eps
K = 4.0
FLOAT64 = dict(rtol=1e-12, atol=1e-12)


def _log(what: str, kind: str, used: float) -> None:
    path = os.environ.get("ROUNDPIPE_NUMERICS_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(path, "a") as file:
            file.write(f"{test}\t{what}\t{kind}\t{used:.4g}\n")


def double(module: nn.Module) -> nn.Module:
    """A float64 copy of ``module`` (integer buffers, such as BatchNorm's counter, stay integers)."""
    return copy.deepcopy(module).double()


def to_double(tree: Any) -> Any:
    """``tree`` with every floating-point tensor in float64; ids, masks and labels unchanged."""
    return tree_map(lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return torch.as_tensor(value, dtype=torch.float64)  # Python floats (``loss.item()``), lists of them


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name (a tied parameter once), detached."""
    return {**{n: p.detach() for n, p in module.named_parameters()},
            **{n: b.detach() for n, b in module.named_buffers()}}


def assert_close_to_reference(ours: Any, ref32: Any, ref64: Any, *, k: float = K, eps: float = EPS32,
                              equal_nan: bool = False, what: str = "value") -> None:
    """``||ours - ref64|| <= k * ||ref32 - ref64|| + eps * ||ref64||``: see the module docstring.

    ``ours`` and ``ref32`` are results in the low precision under test, ``ref64`` the reference in float64;
    each a tensor, a float or a list of floats (such as the losses of the steps). Integer tensors (counters)
    must be equal. With ``equal_nan`` NaNs must sit in the same places in all three, and the rest is
    compared."""
    ours, ref32, ref64 = (_as_tensor(v) for v in (ours, ref32, ref64))
    assert ours.shape == ref32.shape == ref64.shape, f"{what}: shapes {ours.shape}, {ref32.shape}, {ref64.shape}"
    if not ours.is_floating_point():
        assert torch.equal(ours, ref32) and torch.equal(ours, ref64.to(ours.dtype)), f"{what}: {ours} != {ref64}"
        return
    ours, ref32, ref64 = ours.double(), ref32.double(), ref64.double()
    if equal_nan:
        nan = ref64.isnan()
        assert torch.equal(ours.isnan(), nan) and torch.equal(ref32.isnan(), nan), f"{what}: NaNs differ"
        ours, ref32, ref64 = ours[~nan], ref32[~nan], ref64[~nan]
    error, reference_error, scale = ((ours - ref64).norm().item(), (ref32 - ref64).norm().item(),
                                     ref64.norm().item())
    bound = k * reference_error + eps * scale
    _log(what, "float32", error / bound if bound else 0.0 if error == 0 else float("inf"))
    assert error <= bound, (
        f"{what}: ||ours - float64 reference|| = {error:.3g} exceeds {k:g} x the float32 reference's own error "
        f"{reference_error:.3g} + {eps:.2g} x ||reference|| {scale:.3g} (= {bound:.3g})")


def assert_float64_equal(ours: Any, ref64: Any, *, equal_nan: bool = False, what: str = "value") -> None:
    """Both computed in float64: equal up to :data:`FLOAT64` (see the module docstring)."""
    ours, ref64 = _as_tensor(ours), _as_tensor(ref64)
    if ours.is_floating_point():
        assert ours.dtype == torch.float64, f"{what}: computed in {ours.dtype}, not float64"
        if ours.shape == ref64.shape:
            allowed = FLOAT64["atol"] + FLOAT64["rtol"] * ref64.double().abs()
            _log(what, "float64", ((ours - ref64).abs() / allowed).nan_to_num(0.0).max().item() if ours.numel() else 0.0)
    torch.testing.assert_close(ours, ref64, **FLOAT64, equal_nan=equal_nan, msg=lambda m: f"{what}: {m}")


def _pairs(ours: Mapping[str, Any], *references: Mapping[str, Any]) -> Iterable[tuple[str, list[Any]]]:
    for reference in references:
        assert set(ours) == set(reference), f"different entries: {sorted(set(ours) ^ set(reference))}"
    for name, value in ours.items():
        yield name, [value, *(reference[name] for reference in references)]


def assert_states_close_to_reference(ours: Mapping[str, Any] | nn.Module, ref32: Mapping[str, Any] | nn.Module,
                                     ref64: Mapping[str, Any] | nn.Module, **kwargs: Any) -> None:
    """:func:`assert_close_to_reference` for every parameter and buffer (modules or name -> tensor maps)."""
    maps = [state(m) if isinstance(m, nn.Module) else m for m in (ours, ref32, ref64)]
    for name, (a, b, c) in _pairs(*maps):
        assert_close_to_reference(a, b, c, what=name, **kwargs)


def assert_states_float64_equal(ours: Mapping[str, Any] | nn.Module, ref64: Mapping[str, Any] | nn.Module,
                                **kwargs: Any) -> None:
    """:func:`assert_float64_equal` for every parameter and buffer (modules or name -> tensor maps)."""
    maps = [state(m) if isinstance(m, nn.Module) else m for m in (ours, ref64)]
    for name, (a, b) in _pairs(*maps):
        assert_float64_equal(a, b, what=name, **kwargs)


def assert_same_optimizer_state(ours: Any, reference: Any) -> None:
    """Bitwise: the first optimizer's state dict of two Lightning trainers (its param groups and every state)."""
    ours_state, reference_state = (trainer.optimizers[0].state_dict() for trainer in (ours, reference))
    assert ours_state["param_groups"] == reference_state["param_groups"]
    assert ours_state["state"].keys() == reference_state["state"].keys()
    for key, entry in ours_state["state"].items():
        assert_states_equal(entry, reference_state["state"][key])


def assert_same_run(ours: nn.Module, reference: nn.Module, ours_trainer: Any, reference_trainer: Any) -> None:
    """Bitwise: two runs of modules that record their training losses in ``losses`` (``ours`` may have resumed: the
    reference's last ones), their weights, and their trainers' first optimizer's state dicts."""
    assert 0 < len(ours.losses) <= len(reference.losses)
    later = reference.losses[len(reference.losses) - len(ours.losses):]
    assert all(torch.equal(a, b) for a, b in zip(ours.losses, later, strict=True))
    assert_states_equal(ours, reference)
    assert_same_optimizer_state(ours_trainer, reference_trainer)


def assert_states_equal(ours: Mapping[str, Any] | nn.Module, reference: Mapping[str, Any] | nn.Module) -> None:
    """Bitwise: for results of the same kernels on the same data in the same order (NaN equals NaN)."""
    maps = [state(m) if isinstance(m, nn.Module) else m for m in (ours, reference)]
    for name, (a, b) in _pairs(*maps):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}")

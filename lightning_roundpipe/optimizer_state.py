"""What an optimizer's state will take in memory, from its class and hyperparameters, before its first step.

Per ``torch.optim`` class, the buffers the size of each parameter and the per-parameter scalars it keeps
(``Adam``/``AdamW``: two buffers plus a scalar step, three with ``amsgrad``; ``SGD``: one buffer with
``momentum``, none without; ...); bitsandbytes' optimizers by their settings (8-bit blockwise moments or float32:
:func:`~lightning_roundpipe.engine.step.eight_bit.state_bytes`); an unknown class is assumed to keep two buffers,
and says so. Used by the pre-flight memory plan (:mod:`~lightning_roundpipe.preflight`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_roundpipe.engine.step import eight_bit
from lightning_roundpipe.engine.step.rounding import ROUNDED


def _scalar_bytes() -> int:
    # torch keeps per-parameter scalars (``step``) as 0-dim tensors of _get_scalar_dtype()
    return 8 if torch.get_default_dtype() == torch.float64 else 4


def _factored_bytes(param: torch.Tensor, element_size: int) -> int:
    """Adafactor's second moment, of ``element_size``-byte elements: a row and a column factor for 2+-dim
    parameters, else full."""
    if param.dim() < 2:
        return param.numel() * element_size
    shape = list(param.shape)
    rows = math.prod(shape[:-1])
    cols = math.prod(shape[:-2] + shape[-1:])
    return (rows + cols) * element_size


# Per torch.optim class: (buffers the size of the parameter, per-parameter scalars, description). The
# buffer count may depend on the group's hyperparameters.
def _rule(name: str, group: dict) -> tuple[float, int, str] | None:
    if name in ("Adam", "AdamW"):
        if group.get("amsgrad"):
            return 3, 1, "exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad) + step"
        return 2, 1, "exp_avg, exp_avg_sq + step"
    if name == "SGD":
        return (1, 0, "momentum_buffer") if group.get("momentum", 0) else (0, 0, "none (no momentum)")
    if name == "RMSprop":
        count = 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
        names = ["square_avg"] + ["momentum_buffer"] * bool(group.get("momentum", 0)) + \
            ["grad_avg"] * bool(group.get("centered"))
        return count, 1, ", ".join(names) + " + step"
    simple = {
        "Adagrad": (1, 1, "sum + step"),
        "Adamax": (2, 1, "exp_avg, exp_inf + step"),
        "NAdam": (2, 2, "exp_avg, exp_avg_sq + step, mu_product"),
        "RAdam": (2, 1, "exp_avg, exp_avg_sq + step"),
        "Adadelta": (2, 1, "square_avg, acc_delta + step"),
        "ASGD": (1, 3, "ax + step, eta, mu"),
        "Rprop": (2, 1, "prev, step_size + step"),
        "Muon": (1, 0, "momentum_buffer"),
        "SparseAdam": (2, 1, "exp_avg, exp_avg_sq + step"),
        "Adafactor": (-1, 1, "row_var and col_var (factored; full variance for 1-dim) + step"),
    }
    return simple.get(name)


def _known_class(optimizer: Any) -> str | None:
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and _rule(cls.__name__, {}) is not None:
            return cls.__name__
    return None


def optimizer_state_bytes(optimizer: Any, widened: bool = False) -> tuple[int, str, bool]:
    """Bytes ``optimizer``'s state will hold once every trainable parameter has stepped, from its class
    and hyperparameters (no step is taken): ``(bytes, description, known)``. Frozen parameters get no
    state. A class not derived from a known ``torch.optim`` one is assumed to keep two buffers per
    parameter (``known=False``). ``widened`` (``stochastic_rounding``): a bfloat16 parameter's state is float32."""
    label = type(optimizer).__name__
    if eight_bit.is_eight_bit(optimizer):
        total, description = eight_bit.state_bytes(optimizer)
        return total, f"{label}: {description}", True
    name = _known_class(optimizer)
    scalar = _scalar_bytes()
    total = 0
    widened_any = False  # some bfloat16 parameter's state counted in float32
    descriptions: list[str] = []
    for group in getattr(optimizer, "param_groups", []):
        rule = _rule(name, group) if name is not None else None
        buffers, scalars, description = rule if rule is not None else (2, 0, "unknown, assumed 2x")
        if description not in descriptions:
            descriptions.append(description)
        for param in group["params"]:
            if not param.requires_grad:
                continue
            widens = widened and param.dtype == ROUNDED  # the dtype stochastic rounding steps in float32
            widened_any = widened_any or widens
            element_size = 4 if widens else param.element_size()
            if buffers < 0:
                total += _factored_bytes(param, element_size)
            else:
                total += int(buffers * param.numel() * element_size)
            total += scalars * scalar
    shown = label if name is None or name == label else f"{label} (as {name})"
    if widened_any:
        descriptions.append("in float32 for the bf16 weights (stochastic_rounding)")
    return total, f"{shown}: {'; '.join(descriptions) or 'no parameters'}", name is not None

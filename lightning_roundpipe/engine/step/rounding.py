"""Stochastic rounding of the host step into bfloat16 parameters (``stochastic_rounding=True``).

A bfloat16 parameter (``precision="bf16-true"``, or a model stored in bfloat16) is its own master and its own
upload copy: 2 host bytes per parameter instead of a float32 master's 4 and its bfloat16 copy's 2. Plain
training steps it in bfloat16, rounding every update to the nearest bfloat16: an update under half a unit in the
last place (0.2 to 0.4% of the weight) is lost whole, so small learning rates stop training. With this option
the host step computes in float32 instead: each parameter of the group being stepped gets a float32 copy, its
gradient is widened, its optimizer state is kept in float32 (bitsandbytes' 8-bit state as it is), the optimizer
steps the copies, and each result is rounded to one of the two bfloat16 values around it, up with probability
equal to its distance from the lower one over their gap. The rounding is unbiased: the expected weight is the
float32 update's, so small updates add up over steps as they do in float32.

The random bits: 16 per element, from a generator seeded by (the engine's seed, the step number, the parameter's
position in the optimizer's param groups), so a run is reproducible, a resumed run draws what the uninterrupted
one drew, every data-parallel process rounds alike, and the user's random streams are not touched. The float32
value's bits plus a uniform 16-bit integer, with the low 16 bits then cleared, is that rounding (for either sign:
the sign bit is apart from the magnitude's); an infinity or NaN stays one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn

from lightning_roundpipe.engine.recompute import mixed_seed

ROUNDED = torch.bfloat16
"""The parameter dtype the option applies to."""
_LOW_BITS = 16  # float32 bits a bfloat16 value does not keep


def stochastic_round(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``values`` (float32) rounded stochastically to bfloat16 (see the module docstring)."""
    if values.dtype != torch.float32:
        raise TypeError(f"stochastic rounding takes float32 values, got {values.dtype}")
    noise = torch.randint(0, 1 << _LOW_BITS, values.shape, dtype=torch.int32, generator=generator,
                          device=values.device)
    bits = values.contiguous().view(torch.int32)
    special = ~torch.isfinite(values)  # infinities and NaN keep their bits: the noise could turn one into another
    rounded = torch.where(special, bits, (bits + noise) & ~((1 << _LOW_BITS) - 1))
    return rounded.view(torch.float32).to(ROUNDED)  # the low bits are zero: the conversion is exact


class StochasticRounding:
    """One optimizer step's rounding: step ``number`` under ``base_seed``, each parameter by its position
    ``positions[id(param)]`` in the optimizer's param groups."""

    def __init__(self, base_seed: int, number: int, positions: Mapping[int, int]) -> None:
        self.base_seed, self.number, self.positions = base_seed, number, positions

    def applies(self, param: nn.Parameter) -> bool:
        return param.dtype == ROUNDED and id(param) in self.positions

    def generator(self, param: nn.Parameter) -> torch.Generator:
        seed = mixed_seed(self.base_seed, self.number, self.positions[id(param)])
        return torch.Generator(param.device).manual_seed(seed)

    @torch.no_grad()
    def write(self, param: nn.Parameter, values: torch.Tensor) -> None:
        """Round the float32 ``values`` the step computed for ``param`` into it."""
        param.copy_(stochastic_round(values, self.generator(param)))


def _rounded(optimizer: torch.optim.Optimizer) -> Iterator[tuple[int, nn.Parameter]]:
    """Each trainable bfloat16 parameter of ``optimizer`` and its position in the param groups (every parameter
    counted, in order: the same in every process and after a resume, and the state dict's key)."""
    params = (param for group in optimizer.param_groups for param in group["params"])
    return ((index, param) for index, param in enumerate(params) if param.dtype == ROUNDED and param.requires_grad)


def optimizer_positions(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """Each trainable bfloat16 parameter's position in ``optimizer``'s param groups, by parameter id."""
    return {id(param): index for index, param in _rounded(optimizer)}


def widen_state(state: dict) -> None:
    """Keep a parameter's floating-point optimizer state in float32 (state made by plain training, or narrowed by
    torch's ``load_state_dict``, which casts state to the parameter's dtype)."""
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
            state[key] = value.float()


def restore_wide_state(optimizer: torch.optim.Optimizer, saved: Mapping[int, Mapping]) -> None:
    """After ``optimizer.load_state_dict``, which casts floating-point state to each parameter's dtype: give the
    rounded (bfloat16) parameters their state as saved (``saved``: the state dict's ``"state"``, by position), so
    a float32 moment resumes exactly."""
    for position, param in _rounded(optimizer):
        entry = saved.get(position)
        state = optimizer.state.get(param)
        if entry is None or state is None:
            continue
        for name, value in entry.items():
            loaded = state.get(name)
            if (isinstance(value, torch.Tensor) and isinstance(loaded, torch.Tensor) and value.dtype == torch.float32
                    and loaded.dtype != value.dtype):
                state[name] = value.to(loaded.device, copy=True)

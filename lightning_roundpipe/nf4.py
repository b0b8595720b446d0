"""A 4-bit frozen base for QLoRA: frozen Linear weights stored, uploaded and checkpointed as NF4.

NF4 is QLoRA's 4-bit data type (Dettmers et al., 2023): a weight is cut into blocks of 64 consecutive elements;
each block keeps its largest magnitude (``absmax``, float32) and each element the index (4 bits, two a byte) of the
nearest of 16 fixed levels in [-1, 1], quantiles of a normal distribution. The weight it stands for is
``level[index] * absmax``. bitsandbytes quantises (:func:`quantize_nf4`); dequantising is the two lines of torch in
:func:`dequantize_nf4`, bitwise bitsandbytes' ``dequantize_4bit`` (tested), so a layer runs the same code on a GPU
and on CPU stand-ins and needs no bitsandbytes to run or to load.

:class:`NF4Linear` replaces a frozen ``nn.Linear``: its weight is two frozen parameters, ``weight_nf4`` (uint8,
half a byte an element) and ``weight_absmax`` (float32, 4 bytes per 64 elements): 0.5625 bytes a weight against 2
for bfloat16 or 4 for float32, on the host, in every upload and in checkpoints. The strategy moves them like any
other frozen parameter. Its forward dequantises the weight in float32 and casts it to the dtype the matmul runs in
(autocast's, else the input's), so under ``bf16-mixed`` it computes exactly what a ``nn.Linear`` holding the
dequantised weight computes. Its bias, if any, stays as it was (trainable or not).

:func:`to_nf4` swaps a model's frozen Linears (a peft LoRA layer's ``base_layer`` included) in place;
:func:`from_nf4` swaps them back, dequantised to the dtype asked for, e.g. to save a checkpoint that loads into the
dense model or to merge the adapters. Loading a dense ``weight`` into an :class:`NF4Linear` (a state dict or
safetensors saved from the dense model) quantises it on the way in.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 64  # elements per absmax, QLoRA's (and bitsandbytes') choice
# The 16 NF4 levels, as bitsandbytes' quantiser emits them (float32); dequantize_nf4 is tested against its own.
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)


def _bitsandbytes_functional() -> Any:
    try:
        import bitsandbytes.functional as functional
    except ImportError as error:
        raise ImportError("quantising to NF4 needs bitsandbytes: pip install 'lightning_roundpipe[low-bit]' "
                          "(running or loading an NF4 layer does not)") from error
    return functional


def quantize_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight``'s NF4 form by bitsandbytes' quantiser: the packed indices (uint8, ``ceil(numel / 2)``: two a
    byte, the first in the high half) and each block's absmax (float32, ``ceil(numel / 64)``)."""
    if not weight.is_floating_point():
        raise TypeError(f"only a floating-point weight quantises to NF4, got {weight.dtype}")
    source = weight.detach()
    if source.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        source = source.float()  # bitsandbytes takes these three; float64's NF4 is its float32's
    packed, state = _bitsandbytes_functional().quantize_4bit(source.contiguous(), blocksize=BLOCK, quant_type="nf4")
    return packed.reshape(-1), state.absmax.float().reshape(-1)


def level_pairs(device: torch.device | str | None = None) -> torch.Tensor:
    """The two levels each byte of packed indices stands for: row ``b`` is ``(level[b >> 4], level[b & 15])``."""
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack((levels[byte >> 4], levels[byte & 15]), dim=1)


def _as_bits(values: torch.Tensor) -> torch.Tensor:
    """float32 values as int32 bits: a buffer ``module.to(dtype)`` does not convert (``bf16-true`` would round
    the levels)."""
    return values.view(torch.int32)


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, pairs: torch.Tensor, numel: int) -> torch.Tensor:
    """The float32 weight (flat, ``numel`` elements) that NF4 ``packed``/``absmax`` stand for: ``level * absmax``
    per element, bitsandbytes' values bit for bit. ``pairs`` is :func:`level_pairs` as int32 bits (one lookup a
    byte: the temporaries are the int32 bytes and the float32 result, 6 bytes a weight, not a long index each)."""
    values = pairs.view(torch.float32)[packed.int()].view(-1)
    blocks = absmax.numel()
    if values.numel() != blocks * BLOCK:  # the last block is partial: pad it, scale, cut
        values = F.pad(values, (0, blocks * BLOCK - values.numel()))
    values = values.view(blocks, BLOCK).mul_(absmax.float()[:, None])
    return values.view(-1)[:numel]


class NF4Linear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is stored as NF4 (see the module docstring).

    ``weight_dtype`` is the dtype the dense weight had: :func:`from_nf4` gives it back in it by default.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 weight_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.weight_dtype = in_features, out_features, weight_dtype
        numel = in_features * out_features
        self.weight_nf4 = nn.Parameter(torch.zeros((numel + 1) // 2, dtype=torch.uint8, device=device),
                                       requires_grad=False)
        self.weight_absmax = nn.Parameter(torch.zeros(-(-numel // BLOCK), dtype=torch.float32, device=device),
                                          requires_grad=False)
        self.bias: nn.Parameter | None = (nn.Parameter(torch.zeros(out_features, dtype=weight_dtype, device=device))
                                          if bias else None)
        # not state: NF4's definition, made again with the module (non-persistent, as rotary tables); int32 bits
        self.register_buffer("nf4_pairs", _as_bits(level_pairs(device)), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> NF4Linear:
        """``linear``'s NF4 twin: its weight quantised, its bias (the same parameter) kept. On the meta device the
        twin is only shaped: RoundPipe gives it the values of ``weights_from`` (the dense ``weight``, quantised as
        it loads) or of the checkpoint it resumes, as it materializes the module."""
        weight = linear.weight
        layer = cls(linear.in_features, linear.out_features, bias=False, weight_dtype=weight.dtype,
                    device=weight.device)
        layer.bias = linear.bias
        layer.train(linear.training)
        if not weight.is_meta:  # on the meta device the values come as RoundPipe materializes it (weights_from)
            layer.set_weight(weight)
        return layer

    @torch.no_grad()
    def refill_levels(self) -> None:
        """Make the (non-persistent) levels table again in place: after the module got memory for it."""
        pairs = self.get_buffer("nf4_pairs")
        pairs.copy_(_as_bits(level_pairs(pairs.device)))

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor) -> None:
        """Quantise ``weight`` (``out_features x in_features``) into this layer."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"a weight of shape {tuple(weight.shape)} does not fit NF4Linear({self.in_features}, "
                             f"{self.out_features})")
        packed, absmax = quantize_nf4(weight)
        self.weight_nf4.copy_(packed)
        self.weight_absmax.copy_(absmax)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight these 4 bits stand for, in ``dtype`` (default: float32, exact)."""
        pairs = self.get_buffer("nf4_pairs")
        flat = dequantize_nf4(self.weight_nf4, self.weight_absmax, pairs, self.in_features * self.out_features)
        return flat.view(self.out_features, self.in_features).to(dtype or torch.float32)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device = input.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else input.dtype
        return F.linear(input, self.dequantized_weight(dtype), self.bias)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        """A state dict of the dense model (``prefix + "weight"``, no NF4 entries) loads quantised on the way in;
        ``state_dict`` itself is left as it is (it may be a read-only mapping of files)."""
        dense_key = prefix + "weight"
        if dense_key in state_dict and prefix + "weight_nf4" not in state_dict:
            dense = state_dict[dense_key]
            if tuple(dense.shape) != (self.out_features, self.in_features):
                raise ValueError(f"{dense_key} has shape {tuple(dense.shape)}; NF4Linear({self.in_features}, "
                                 f"{self.out_features}) expects {(self.out_features, self.in_features)}")
            packed, absmax = quantize_nf4(dense)
            own = {prefix + "weight_nf4": packed, prefix + "weight_absmax": absmax}
            if prefix + "bias" in state_dict:
                own[prefix + "bias"] = state_dict[prefix + "bias"]
            state_dict = own
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight=nf4 (block {BLOCK}, from {self.weight_dtype})")


def _frozen_linears(model: nn.Module, skip: Iterable[str]) -> list[tuple[nn.Module, str, nn.Linear]]:
    """``(parent, attribute, linear)`` for each plain ``nn.Linear`` whose weight is frozen and held by no other
    module (a tied weight is read elsewhere as stored), whose qualified name has no part in ``skip``."""
    skipped = set(skip)
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                holders[id(param)] = holders.get(id(param), 0) + 1
    found = []
    for parent_name, parent in model.named_modules():
        for attribute, child in parent.named_children():
            name = f"{parent_name}.{attribute}" if parent_name else attribute
            if (type(child) is nn.Linear and not child.weight.requires_grad and holders[id(child.weight)] == 1
                    and not skipped.intersection(name.split("."))):
                found.append((parent, attribute, child))
    return found


def to_nf4(model: nn.Module, skip: Iterable[str] = ("lm_head",)) -> int:
    """Swap ``model``'s frozen ``nn.Linear`` layers for :class:`NF4Linear` in place; returns how many.

    Call it after freezing (after ``peft.get_peft_model``, which freezes the base) and before the optimizer is
    made. A Linear is left as it is when its weight is trainable, tied to another module (an LM head sharing the
    embedding), or when a part of its name is in ``skip`` (by default ``lm_head``, as QLoRA keeps it).
    """
    swaps = _frozen_linears(model, skip)
    for parent, attribute, linear in swaps:
        setattr(parent, attribute, NF4Linear.from_linear(linear))
    return len(swaps)


def from_nf4(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Swap every :class:`NF4Linear` of ``model`` back for a frozen ``nn.Linear`` holding its dequantised weight in
    ``dtype`` (default: the dtype it was quantised from); returns how many."""
    swaps = [(parent, attribute, child) for parent in model.modules()
             for attribute, child in parent.named_children() if isinstance(child, NF4Linear)]
    for parent, attribute, layer in swaps:
        weight_dtype = dtype or layer.weight_dtype
        linear = nn.Linear(layer.in_features, layer.out_features, bias=False, device=layer.weight_nf4.device,
                           dtype=weight_dtype)
        with torch.no_grad():
            linear.weight.copy_(layer.dequantized_weight(weight_dtype))
        linear.weight.requires_grad_(False)
        linear.register_parameter("bias", layer.bias)
        setattr(parent, attribute, linear)
    return len(swaps)


def nf4_storage(module: nn.Module) -> tuple[set[int], int]:
    """The ids of ``module``'s NF4 parameters (packed indices and block scales) and how many weights they stand
    for: what the memory plan counts as ``nf4`` bytes and as parameters."""
    layers = [layer for layer in module.modules() if isinstance(layer, NF4Linear)]
    ids = {id(param) for layer in layers for param in (layer.weight_nf4, layer.weight_absmax)}
    return ids, sum(layer.in_features * layer.out_features for layer in layers)


def weight_count(module: nn.Module, frozen_only: bool = False) -> int:
    """``module``'s parameters (each once; ``frozen_only``: those not requiring grad), an NF4 layer's weight counted
    as the weights it stands for, not its bytes (an NF4 weight is always frozen)."""
    nf4_ids, nf4_weights = nf4_storage(module)
    return nf4_weights + sum(param.numel() for param in module.parameters()
                             if id(param) not in nf4_ids and not (frozen_only and param.requires_grad))

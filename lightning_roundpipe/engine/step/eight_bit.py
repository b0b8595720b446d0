"""bitsandbytes' 8-bit optimizers (``AdamW8bit``, ``Lion8bit``, ...) stepped by the host step.

bitsandbytes keeps each parameter's moments blockwise quantised: per block of 256 elements one float32 scale
(``absmax1``, ``absmax2``) and a byte per element (``state1``, ``state2``) indexing a 256-value map (``qmap1``,
``qmap2``, shared by every parameter), so AdamW's state takes about 2.03 bytes per parameter instead of 8; a tensor
under ``min_8bit_size`` elements (4096 by default) keeps float32 moments. On CPU parameters its step dequantises one
tensor's moments, updates them and the parameter in float32, and quantises them again: a parameter's update reads its
own gradient and state alone, so the step may be cut by stage as torch's optimizers are (:func:`per_parameter`), and
its state is ordinary tensors, which the disk tier and checkpoints keep as they are.

Its step finds each parameter's per-parameter settings (``GlobalOptimManager``'s ``override_config`` and
``register_module_override``, with which Hugging Face's Trainer keeps embeddings' moments in 32 bits) by the
parameter's id and by its position in ``param_groups``, and its first step registers the module overrides by
comparing ids. The stand-ins of :func:`~.thread.step_with_groups` have ids and positions of their own, so
:func:`prepare_twin` hands the step's twin the settings of each stand-in's parameter, as the user's optimizer finds
them, after running on the user's optimizer what its own first step would have run.

bitsandbytes is imported by no module here: an optimizer is recognised by its classes' modules and names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

BLOCK = 256
"""Elements per quantisation block (bitsandbytes' blockwise optimizers)."""

MIN_8BIT_SIZE = 4096
"""bitsandbytes' default ``min_8bit_size``: smaller tensors keep float32 moments."""


def _quantised_bytes(count: int) -> int:
    """Bytes of one moment of ``count`` elements kept in 8 bits: a byte an element and a float32 scale per block."""
    return count + 4 * math.ceil(count / BLOCK)


def _bitsandbytes_bases(optimizer: Any) -> set[str]:
    return {cls.__name__ for cls in type(optimizer).__mro__ if cls.__module__.startswith("bitsandbytes.optim")}


def is_eight_bit(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of bitsandbytes' optimizers (8-bit or 32-bit state: they share a step)."""
    return "Optimizer8bit" in _bitsandbytes_bases(optimizer)


def per_parameter(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a class of bitsandbytes' own (not a user's subclass, which may step differently)
    whose update of a parameter reads that parameter's gradient and state alone."""
    return is_eight_bit(optimizer) and type(optimizer).__module__.startswith("bitsandbytes.optim")


def settings_of(optimizer: Any) -> dict[int, dict]:
    """Per parameter id of ``optimizer``, the settings its step overrides for that parameter (``optim_bits``,
    ``min_8bit_size``, ...), found as bitsandbytes' ``get_config`` finds them, with the module overrides its
    first step registers (``check_overrides``) counted already; parameters without any are left out."""
    manager = optimizer.mng
    by_module: dict[int, dict] = {}
    for module, attribute, config in getattr(manager, "module_weight_config_triple", []):
        by_module[id(getattr(module, attribute))] = config
    settings: dict[int, dict] = {}
    for group_index, group in enumerate(optimizer.param_groups):
        for index, param in enumerate(group["params"]):
            merged = {**manager.index2config.get((group_index, index), {}), **by_module.get(id(param), {}),
                      **manager.pid2config.get(id(param), {})}
            if merged:
                settings.setdefault(id(param), merged)
    return settings


class _SettingsOfStandIns:
    """What a twin's ``mng`` answers: each stand-in's settings by its id, no positions, nothing left to register."""

    def __init__(self, pid2config: dict[int, dict]) -> None:
        self.pid2config = pid2config
        self.index2config: dict[tuple[int, int], dict] = {}
        self.module_weight_config_triple: list = []


def prepare_twin(twin: Any, optimizer: Any, owners: Mapping[int, nn.Parameter]) -> None:
    """Make ``twin`` (the step's copy of ``optimizer``, whose parameters are the stand-ins ``owners`` maps to
    the user's parameters, by the stand-ins' ids) find each parameter's settings as ``optimizer`` would.

    The first time, it runs on ``optimizer`` what bitsandbytes' first ``step`` runs (the module overrides
    registered, state on the parameters' device), since the host step never calls ``optimizer.step``."""
    if not optimizer.initialized:
        optimizer.check_overrides()
        optimizer.to_gpu()  # moves state to a parameter's device: nothing for the host's parameters
        optimizer.initialized = True
    for param in owners.values():
        if not param.is_contiguous():
            # its step replaces a non-contiguous parameter's data by a contiguous copy, which a stand-in
            # cannot pass on to the parameter: the update would be lost
            raise ValueError(f"{type(optimizer).__name__} steps a non-contiguous parameter (shape "
                             f"{tuple(param.shape)}, strides {param.stride()}) by replacing its data, which the host "
                             "step cannot do in place; make the parameter contiguous when building the module")
    settings = settings_of(optimizer)
    twin.mng = _SettingsOfStandIns({stand_in: settings[id(param)] for stand_in, param in owners.items()
                                    if id(param) in settings})
    twin.initialized = True


def state_bytes(optimizer: Any) -> tuple[int, str]:
    """Bytes the state of bitsandbytes' ``optimizer`` takes once every trainable parameter has stepped, and how
    it is kept: per parameter, its moments in 8 bits plus a float32 scale per block where its settings say 8
    bits and it has at least ``min_8bit_size`` elements, else in float32 (the shared maps and the step counts,
    Python integers, are not counted)."""
    bases = _bitsandbytes_bases(optimizer)
    moments = 2 if "Optimizer2State" in bases else 1
    if bases & {"AdEMAMix", "AdEMAMix32bit"}:
        moments = 3  # two first moments (fast and slow) and the second
    defaults = vars(optimizer.args) if hasattr(optimizer, "args") else {}
    settings = settings_of(optimizer)
    total, quantised, wide = 0, 0, 0
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            config = {**defaults, **settings.get(id(param), {})}
            count = param.numel()
            if config.get("optim_bits", 32) == 8 and count >= config.get("min_8bit_size", MIN_8BIT_SIZE):
                total += moments * _quantised_bytes(count)
                quantised += count
            else:
                total += moments * 4 * count
                wide += count
            if config.get("max_unorm", 0.0) > 0.0:
                total += 4
    description = f"{moments} moment{'s' * (moments > 1)} per parameter"
    if quantised:
        description += f", 8-bit blockwise for {quantised:,} parameters"
    if wide:
        description += f", float32 for {wide:,} (under min_8bit_size or 32-bit settings)"
    return total, description


def saving_over_adam(optimizer: Any) -> int:
    """The bytes bitsandbytes' ``AdamW8bit`` (``Adam8bit``) would save over ``optimizer``'s state, if it is torch's
    ``AdamW`` or ``Adam`` (groups without ``amsgrad``), else 0: the float32 moments of its trainable float32 tensors
    of at least :data:`MIN_8BIT_SIZE` elements, 8 bytes an element, would take 2 and a float32 scale per block."""
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        return 0
    saved = 0
    seen: set[int] = set()
    for group in optimizer.param_groups:
        if group.get("amsgrad"):
            continue
        for param in group["params"]:
            count = param.numel()
            if (param.requires_grad and param.dtype == torch.float32 and count >= MIN_8BIT_SIZE
                    and id(param) not in seen):
                seen.add(id(param))
                saved += 8 * count - 2 * _quantised_bytes(count)
    return saved

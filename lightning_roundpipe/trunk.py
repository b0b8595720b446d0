"""Which part of a module RoundPipe pipelines: the trunk, found by name, as a Hugging Face causal LM with a
preset, as the base model of any other Hugging Face model (recorded and cut at its layers:
:mod:`~lightning_roundpipe.hf.base_model`), as the ``nn.Sequential`` holding the most parameters, or as the
forward that loops over the largest ``nn.ModuleList`` of blocks or runs several block lists in turn (recorded
with torch.fx and cut at the blocks: :mod:`~lightning_roundpipe.traced`); with none of these, the module's own
forward runs as one stage.

Lives above ``engine`` because it knows the Hugging Face integration (``hf``); it imports no Lightning, so
a plain-PyTorch user of the engine can pick a trunk the way the strategy does.
"""

from __future__ import annotations

import logging
import warnings
from typing import NamedTuple

from torch import nn

from lightning_roundpipe.engine.layers import Trunk, build_trunk, parameter_count
from lightning_roundpipe.engine.options import OptionError
from lightning_roundpipe.engine.pipelined import PipelinedForward
from lightning_roundpipe.hf.base_model import base_model_name
from lightning_roundpipe.hf.causal_lm import CausalLMForward, causal_lm_preset, find_causal_lm
from lightning_roundpipe.traced import TracedForward, build_traced_trunk, find_block_lists, find_blocks

log = logging.getLogger(__name__)

MOSTLY_INSIDE = 0.5
"""Warn when the trunk holds less than this share of the module's parameters."""


class TrunkChoice(NamedTuple):
    """What :func:`build_module_trunk` chose: one place decides the trunk's kind and how its calls reach the
    engine."""

    trunk: Trunk
    driven: nn.Module
    """The module whose ``forward`` the engine takes over while a strategy drives it."""
    forward_patch: type[PipelinedForward]
    """That ``forward``: :class:`PipelinedForward` for an ``nn.Sequential``, :class:`CausalLMForward` for a
    Hugging Face causal LM, :class:`TracedForward` for a recorded forward cut at its blocks."""


def find_trunk(module: nn.Module, pipeline: str | None = None) -> tuple[str, nn.Module]:
    """The submodule to pipeline and its name: ``pipeline``'s, else the first Hugging Face causal LM with a
    preset, else the base model of the first other Hugging Face model (unless a trunk found below holds
    more parameters), else, where several block lists (each an ``nn.ModuleList`` or ``nn.Sequential`` of
    modules of one type) together hold more than the largest ``nn.Sequential``, ``("", module)`` (its forward
    is cut at every block of every list), else the ``nn.Sequential`` holding the most parameters (the
    shallowest on a tie), unless an ``nn.ModuleList`` of blocks holds more (then that list), else
    ``("", module)`` (one stage). A ``pipeline`` naming a Hugging Face model without a preset, or a module
    inside one, means that model's base model."""
    sequentials = {name: m for name, m in module.named_modules() if isinstance(m, nn.Sequential) and name}
    if pipeline is not None:
        try:
            trunk = module.get_submodule(pipeline)
        except AttributeError:
            raise OptionError(  # an option's value: the Hydra app reports it as `strategy.pipeline`
                "pipeline", f"is {pipeline!r}, which names no submodule of {type(module).__name__}; "
                f"its nn.Sequential submodules are {sorted(sequentials) or 'none'}"
            ) from None
        refuse_compiled(pipeline, trunk)
        if find_causal_lm(trunk) is None and not isinstance(trunk, nn.Sequential):
            base = base_model_name(module, pipeline)
            if base is not None:
                return base, module.get_submodule(base)
        return pipeline, trunk
    for name, candidate in module.named_modules():
        if name and find_causal_lm(candidate) is not None:
            refuse_compiled(name, candidate)
            return name, candidate
    blocks = find_blocks(module)
    best = max(sequentials, key=lambda n: (parameter_count(sequentials[n]), -n.count(".")), default=None)
    base = base_model_name(module)
    if base is not None:
        # unless the module's own trunk is larger (a small Hugging Face encoder feeding it, say)
        rivals: list[nn.Module] = [sequentials[best]] if best is not None else []
        if blocks is not None and not blocks.startswith(f"{base}."):
            rivals.append(module.get_submodule(blocks))
        if all(parameter_count(module.get_submodule(base)) >= parameter_count(rival) for rival in rivals):
            refuse_compiled(base, module.get_submodule(base))
            return base, module.get_submodule(base)
    lists = find_block_lists(module)
    if len(lists) > 1 and (best is None or sum(parameter_count(module.get_submodule(n)) for n in lists)
                           > parameter_count(sequentials[best])):
        # several block lists run one after another (a ResNet's stages, an encoder then a decoder): the
        # forward is cut at every block of every list, rather than pipelining the largest list alone
        refuse_compiled(type(module).__name__, module)
        return "", module
    if best is not None and (blocks is None or parameter_count(sequentials[best]) >= parameter_count(
            module.get_submodule(blocks))):
        refuse_compiled(best, sequentials[best])
        return best, sequentials[best]
    name, target = (blocks, module.get_submodule(blocks)) if blocks is not None else ("", module)
    refuse_compiled(name or type(module).__name__, target)
    return name, target


def build_module_trunk(module: nn.Module, pipeline: str | None = None) -> TrunkChoice:
    """The trunk of ``module`` (see :func:`find_trunk`), the module whose ``forward`` the engine takes over
    (the trunk itself, or for a wrapped Hugging Face model, a PEFT model say, the causal LM inside) and that
    forward's patch. Logs the choice; warns when the trunk holds a minority of the parameters."""
    name, target = find_trunk(module, pipeline)
    driven: nn.Module | None = None
    if isinstance(target, nn.Sequential) or find_causal_lm(target) is not None:
        trunk = build_trunk(target, presets=(causal_lm_preset,))
    else:
        trunk, target, name = build_traced_trunk(module, name or None)
        driven = target
        name = name or type(module).__name__
    share = parameter_count(target) / (parameter_count(module) or 1)
    if len(trunk) == 1 and driven is not None:
        log.info(f"RoundPipe found no repeated blocks (an nn.ModuleList of modules of one type) in `{name}`, so "
                 f"nothing was partitioned: its forward runs as a single stage ({share:.0%} of the parameters; on "
                 f"the host: {trunk.describe_parameters()}). Name the trunk with `pipeline=` to pipeline it")
    else:
        log.info(f"RoundPipe pipelines `{name}` ({trunk.source}: {len(trunk)} layers, {share:.0%} of the "
                 f"parameters; on the host: {trunk.describe_parameters()})")
    if share < MOSTLY_INSIDE:
        warnings.warn(
            f"RoundPipe pipelines `{name}`, which holds only {share:.0%} of the parameters; the rest stays on "
            "the host and runs on the main thread. Pass `pipeline=` to choose another trunk.", UserWarning,
            stacklevel=2,
        )
    if driven is not None:
        return TrunkChoice(trunk, driven, TracedForward)
    model = find_causal_lm(target)
    return TrunkChoice(trunk, target, PipelinedForward) if model is None else TrunkChoice(trunk, model, CausalLMForward)


def refuse_compiled(name: str, trunk: nn.Module) -> None:
    """RoundPipe runs every layer on per-device copies, which a ``torch.compile``'d module does not allow."""
    # torch.compile wraps a module in an OptimizedModule whose original sits at `_orig_mod`
    compiled = "_orig_mod" in name.split(".") or any(
        type(module).__name__ == "OptimizedModule" for module in trunk.modules())
    if compiled:
        raise TypeError(
            f"the trunk `{name}` is (or contains) a torch.compile'd module, which RoundPipe does not support: it "
            "runs every layer on per-device copies of it. Pass the trunk uncompiled."
        )

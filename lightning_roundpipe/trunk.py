"""Which part of a module RoundPipe pipelines: the trunk, found by name, as a Hugging Face causal LM, or as
the ``nn.Sequential`` holding the most parameters.

Lives above ``engine`` because it knows the Hugging Face preset (``hf.causal_lm``); it imports no
Lightning, so a plain-PyTorch user of the engine can pick a trunk the way the strategy does.
"""

from __future__ import annotations

import logging
import warnings

from torch import nn

from lightning_roundpipe.engine.layers import Trunk, build_trunk
from lightning_roundpipe.hf.causal_lm import FAMILIES, causal_lm_preset, find_causal_lm

log = logging.getLogger(__name__)

MOSTLY_INSIDE = 0.5
"""Warn when the trunk holds less than this share of the module's parameters."""


def find_trunk(module: nn.Module, pipeline: str | None = None) -> tuple[str, nn.Module]:
    """The submodule to pipeline and its name: ``pipeline``'s, else the first Hugging Face causal LM (a
    preset), else the ``nn.Sequential`` holding the most parameters (the shallowest on a tie)."""
    sequentials = {name: m for name, m in module.named_modules() if isinstance(m, nn.Sequential) and name}
    if pipeline is not None:
        try:
            trunk = module.get_submodule(pipeline)
        except AttributeError:
            raise ValueError(
                f"`pipeline={pipeline!r}` names no submodule of {type(module).__name__}; "
                f"its nn.Sequential submodules are {sorted(sequentials) or 'none'}"
            ) from None
        refuse_compiled(pipeline, trunk)
        if find_causal_lm(trunk) is None and not isinstance(trunk, nn.Sequential):
            raise TypeError(
                f"`pipeline={pipeline!r}` is a {type(trunk).__name__}, not an nn.Sequential: the trunk must be an "
                "nn.Sequential whose children are the layers, or a Hugging Face causal LM "
                f"({', '.join(FAMILIES)})"
            )
        return pipeline, trunk
    for name, candidate in module.named_modules():
        if name and find_causal_lm(candidate) is not None:
            refuse_compiled(name, candidate)
            return name, candidate
    if not sequentials:
        raise ValueError(
            f"{type(module).__name__} has no nn.Sequential submodule or Hugging Face causal LM to pipeline. Put "
            "the model's blocks in an nn.Sequential attribute (e.g. self.net = nn.Sequential(embed, *blocks, "
            "head)) and pass `pipeline='net'` to RoundPipeStrategy if there are several"
        )
    name = max(sequentials, key=lambda n: (parameter_count(sequentials[n]), -n.count(".")))
    refuse_compiled(name, sequentials[name])
    return name, sequentials[name]


def build_module_trunk(module: nn.Module, pipeline: str | None = None) -> tuple[Trunk, nn.Module]:
    """The trunk of ``module`` (see :func:`find_trunk`) and the module whose ``forward`` the engine takes
    over: the trunk itself, or for a wrapped Hugging Face model (a PEFT model, say) the causal LM inside.
    Logs the choice; warns when the trunk holds a minority of the parameters."""
    name, target = find_trunk(module, pipeline)
    trunk = build_trunk(target, presets=(causal_lm_preset,))
    share = parameter_count(target) / (parameter_count(module) or 1)
    log.info(f"RoundPipe pipelines `{name}` ({trunk.source}: {len(trunk)} layers, {share:.0%} of the "
             f"parameters; on the host: {trunk.describe_parameters()})")
    if share < MOSTLY_INSIDE:
        warnings.warn(
            f"RoundPipe pipelines `{name}`, which holds only {share:.0%} of the parameters; the rest stays on "
            "the host and runs on the main thread. Pass `pipeline=` to choose another trunk.", UserWarning,
            stacklevel=2,
        )
    model = find_causal_lm(target)
    return trunk, target if model is None else model


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


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())

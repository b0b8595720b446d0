"""The host step stage by stage: which parameters step together, and when an optimizer may be split.

A sync step used to run whole after the whole backward, and every upload of the next iteration waited
for all of it. Most optimizers update each parameter from its own gradient and state alone, so the step
can be cut into *groups*, one per backward stage of the plan, each stepped once nothing can change its
gradients any more, and each with its own "stepped" event (async: "published"), which the next uploads of
those layers wait for (:func:`upload_waits`) instead of the whole step:

* no whole-gradient consumer (no clipping by norm, no ``on_before_optimizer_step``, no 16-bit inf check):
  a group steps as soon as its gradients are final, while shallower backward stages still run, deepest
  group first (the order gradients become final);
* otherwise every gradient is final before the step starts (the consumer ran on the caller's thread), and
  groups step shallowest first, so the next iteration's first stages start after their own parameters.

A parameter belongs to the group of the shallowest layer holding it (a tied embedding and head steps
with the embedding: its gradient is final only once the embedding's stage has run).

Splitting is exact for every ``torch.optim`` optimizer but LBFGS: they read one parameter's gradient and
state per update (``torch.optim``'s kernels are elementwise, whether per tensor, foreach or fused, so
the tensors stepped beside a parameter do not change its result), and for bitsandbytes' optimizers
(``AdamW8bit``, ...: one tensor at a time, its blocks inside it). An optimizer of another class may
couple parameters (a global norm, a shared trust ratio); it steps whole unless the user declares it safe
(``streaming_step="on"``). Step hooks (``register_step_pre_hook``/``post_hook``, also the global ones)
would run once per group, so an optimizer with hooks steps whole too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import nn

from lightning_roundpipe.engine.device import HostEvent
from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.step import eight_bit
from lightning_roundpipe.planning.partition import Plan, format_layers

StreamingStep = Literal["auto", "on", "off"]
STREAMING_STEPS: tuple[str, ...] = get_args(StreamingStep)


@dataclass
class StepGroup:
    """Parameters of one backward stage that the host step updates together, and the events of that part."""

    layers: range                 #: the backward stage's layers (an empty range: parameters outside the trunk)
    params: list[nn.Parameter]    #: the trunk's trainable parameters it owns (or the optimizer's outside ones)
    readers: frozenset[int]       #: every layer holding one of them: the uploads that read their copies
    ready: HostEvent = field(default_factory=HostEvent)  #: sync: stepped; async: published

    @property
    def label(self) -> str:
        return format_layers(self.layers) if len(self.layers) else "outside the trunk"


def stage_groups(trunk: Trunk, plan: Plan, *, whole: bool = False) -> list[StepGroup]:
    """The trunk's step groups, shallowest first: one per backward stage of ``plan`` (the fused stage's
    layers and ``plan.backward``), or one group of every layer with ``whole``. Each trainable parameter
    goes to the group of the shallowest layer holding it."""
    ranges = [range(0, len(trunk))] if whole else sorted([plan.fused, *plan.backward], key=lambda r: r.start)
    group_of_layer = {layer: index for index, layers in enumerate(ranges) for layer in layers}
    owner: dict[int, int] = {}    # parameter id -> its group
    holders: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for layer, state in enumerate(trunk.states):
        for param in state.params:
            if not param.requires_grad:
                continue
            key = id(param)
            params[key] = param
            holders.setdefault(key, set()).add(layer)
            owner[key] = min(owner.get(key, len(ranges)), group_of_layer[layer])
    groups = [StepGroup(layers, [], frozenset()) for layers in ranges]
    readers: list[set[int]] = [set() for _ in ranges]
    for key, index in owner.items():
        groups[index].params.append(params[key])
        readers[index] |= holders[key]
    for group, layers in zip(groups, readers, strict=True):
        group.readers = frozenset(layers)
    return groups


def upload_waits(groups: Sequence[StepGroup], num_layers: int) -> list[tuple[HostEvent, ...]]:
    """Per layer, the events its next upload waits for: those of the groups owning one of its parameters
    (a layer without trainable parameters waits for nothing)."""
    waits: list[list[HostEvent]] = [[] for _ in range(num_layers)]
    for group in groups:
        for layer in group.readers:
            waits[layer].append(group.ready)
    return [tuple(events) for events in waits]


def coupling(optimizer: torch.optim.Optimizer, mode: str) -> str | None:
    """Why ``optimizer``'s update of a parameter may read other parameters (so it cannot step a subset of them
    alone: by stage, or only the parameters a process owns), or ``None``. ``mode="on"``: the user declared an
    optimizer of another class safe."""
    if isinstance(optimizer, torch.optim.LBFGS):
        return "LBFGS couples every parameter"
    if (mode == "auto" and not type(optimizer).__module__.startswith("torch.optim")
            and not eight_bit.per_parameter(optimizer)):
        return (f"{type(optimizer).__name__} is not a torch.optim optimizer, which may couple parameters; "
                "streaming_step='on' declares it safe")
    return None


def streaming_refusal(optimizer: torch.optim.Optimizer, mode: str) -> str | None:
    """Why ``optimizer`` steps whole under ``streaming_step=mode``, or ``None`` if it steps by stage."""
    if mode == "off":
        return "streaming_step='off'"
    coupled = coupling(optimizer, mode)
    if coupled is not None:
        return coupled
    from torch.optim import optimizer as optimizer_module  # the registry of global step hooks

    hooked = (getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks",
                                                                                None)
              or optimizer_module._global_optimizer_pre_hooks or optimizer_module._global_optimizer_post_hooks)
    if hooked:
        return "it has step hooks, which would run once per stage"
    return None

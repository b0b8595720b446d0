"""Frozen weights at their compute width (``frozen_weights``): a frozen weight only autocast reads, kept on the
host in autocast's dtype alone.

Under ``bf16-mixed`` a float32 Linear or Conv weight travels to the devices as a bfloat16 copy (``transport.py``).
A trainable one needs its float32 master besides: the optimizer updates it. A frozen one's master is read by
nothing the devices compute: autocast casts it to bfloat16 before every use. When its values are bfloat16 values
already (a model loaded from a bfloat16 checkpoint into float32, as Hugging Face ships them) the master holds
nothing the copy does not, so the parameter itself is made the copy: ``param.data`` in bfloat16, 2 host bytes per
parameter instead of 6 (master and copy), and devices upload it as stored. Every computation is bitwise what it
was.

What changes, and what does not:

* the module's state dict (and so a Lightning checkpoint) gives such a weight back in the dtype the module gave it,
  widened exactly; ``load_state_dict`` writes into it, and a value the narrow dtype does not hold makes the
  weight wide again first, so nothing is rounded;
* a weight made trainable during the run (Lightning's ``BaseFinetuning``) is widened before its next use, so the
  optimizer trains it in its own dtype, as plain training does;
* a call outside autocast (an evaluation outside the precision context) widens it on the device;
* when the run ends (:meth:`FrozenWeights.restore`) every weight is widened back: the module is as it was given;
* during the run, code that reads such a weight by itself sees a ``bfloat16`` tensor holding the same values.

Which weights: frozen float32 parameters that every trunk layer reading them uses only as a stock Linear's or
Conv's ``weight`` or ``bias`` (:func:`~lightning_roundpipe.engine.transport.read_low_precision_only`) and that no
module outside the trunk holds (an embedding tied to an LM head reads the weight as stored). ``"auto"`` narrows
those whose values the dtype holds exactly, checked bit for bit; ``"round"`` narrows every one, rounding the rest
(what the devices compute with anyway, but then the state dict gives back the rounded values); ``"as_stored"``
none.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.transport import read_low_precision_only

_SAME_WIDTH_INTEGER = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def holds_exactly(values: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds every element of ``values`` exactly: the round trip through it gives the same bits
    (signed zeros, infinities and NaN payloads included)."""
    bits = _SAME_WIDTH_INTEGER[values.element_size()]
    back = values.detach().to(dtype).to(values.dtype)
    return torch.equal(back.view(bits), values.detach().view(bits))


def registered_outside(model: nn.Module, trunk: Trunk) -> set[int]:
    """Ids of the parameters some module of ``model`` outside the trunk's layers holds."""
    inside = {id(module) for layer in trunk.layers for module in layer.modules()}
    return {id(param) for module in model.modules() if id(module) not in inside
            for param in module._parameters.values() if param is not None}


@dataclass
class FrozenSelection:
    """What ``frozen_weights`` does with a trunk's frozen autocast-only weights."""

    dtype: torch.dtype | None
    narrowed: list[nn.Parameter] = field(default_factory=list)  # kept in ``dtype`` alone
    kept: list[nn.Parameter] = field(default_factory=list)      # "auto": values ``dtype`` does not hold, as stored

    @property
    def saved_bytes(self) -> int:
        """Host bytes narrowing saves: the masters' (the narrow copy each becomes was there already, as its upload
        copy)."""
        return sum(param.numel() * param.element_size() for param in self.narrowed)


def select_frozen(trunk: Trunk, transport: torch.dtype | None, policy: str, outside: set[int],
                  layers: Iterable[int] | None = None) -> FrozenSelection:
    """The frozen weights ``policy`` keeps at the ``transport`` width (none without one, or with ``"as_stored"``);
    ``outside``: ids of parameters modules outside the trunk hold (:func:`registered_outside`); ``layers``: only
    those of these trunk layers. ``"auto"`` reads every candidate once to check it."""
    selection = FrozenSelection(transport)
    if transport is None or policy == "as_stored":
        return selection
    within = None if layers is None else {id(param) for index in layers for param in trunk.states[index].params}
    for param in read_low_precision_only(trunk, transport):
        if param.requires_grad or id(param) in outside or (within is not None and id(param) not in within):
            continue
        if policy == "round" or holds_exactly(param, transport):
            selection.narrowed.append(param)
        else:
            selection.kept.append(param)
    return selection


@dataclass
class _Narrowed:
    param: nn.Parameter
    wide: torch.dtype  # the dtype the module gave it


class FrozenWeights:
    """The weights kept at compute width while the engine runs: narrows them, widens them back, and keeps the
    module's state dict in the module's dtypes meanwhile (hooks on the modules that hold them)."""

    def __init__(self) -> None:
        self._narrowed: dict[int, _Narrowed] = {}
        self._hooks: list[RemovableHandle] = []
        self.module_dtypes: Mapping[int, torch.dtype] = _WideDtypes(self._narrowed)

    def __len__(self) -> int:
        return len(self._narrowed)

    def narrow(self, selection: FrozenSelection, trunk: Trunk) -> None:
        """Make each selected parameter its own narrow copy, layer by layer, collecting each layer's state again
        at once: the trunk's record of a layer keeps its old memory allocated, so the wide weights are freed
        layer by layer (unless something else holds them), never all held beside their narrow copies."""
        dtype = selection.dtype
        if dtype is None or not selection.narrowed:
            return
        chosen = {id(param) for param in selection.narrowed}
        with torch.no_grad():
            for state in list(trunk.states):
                for param in state.params:
                    if id(param) in chosen and id(param) not in self._narrowed:
                        self._narrowed[id(param)] = _Narrowed(param, param.dtype)
                        param.data = param.detach().to(dtype)
                for layer in trunk.changed_layers():
                    trunk.recollect(layer)
        owners = {id(module): module for layer, state in zip(trunk.layers, trunk.states, strict=True)
                  for param, paths in zip(state.params, state.param_paths, strict=True) if id(param) in self._narrowed
                  for module in (layer.get_submodule(where.module_path) for where in paths)}
        for module in owners.values():  # partials: torch marks the hooks it is given, which a bound method refuses
            self._hooks.append(module.register_state_dict_post_hook(functools.partial(self._state_dict_wide)))
            self._hooks.append(module.register_load_state_dict_pre_hook(functools.partial(self._before_load)))

    def _widen(self, params: Iterable[nn.Parameter]) -> None:
        with torch.no_grad():
            for param in params:
                record = self._narrowed.pop(id(param))
                if param.dtype != record.wide:
                    param.data = param.detach().to(record.wide)

    def widen_trainable(self) -> bool:
        """Widen the weights made trainable since they were narrowed (before the call that would train them):
        the optimizer then steps them in their own dtype, as plain training. Whether any was."""
        trainable = [record.param for record in self._narrowed.values() if record.param.requires_grad]
        self._widen(trainable)
        return bool(trainable)

    def restore(self) -> None:
        """Widen every weight back and remove the hooks: the module as it was given (the engine has stopped)."""
        self._widen([record.param for record in list(self._narrowed.values())])
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _state_dict_wide(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        for name, param in module._parameters.items():
            record = self._narrowed.get(id(param))
            value = state_dict.get(prefix + name)
            # ``keep_vars=True`` gives the parameter itself, which the caller wants as it is
            if record is not None and isinstance(value, torch.Tensor) and value is not param:
                state_dict[prefix + name] = value.to(record.wide)

    def _before_load(self, module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *_: Any) -> None:
        """A value the narrow dtype does not hold makes its weight wide again before it is written."""
        for name, param in module._parameters.items():
            record = self._narrowed.get(id(param))
            value = state_dict.get(prefix + name)
            if (record is not None and isinstance(value, torch.Tensor) and value.is_floating_point()
                    and not holds_exactly(value, record.param.dtype)):
                self._widen([record.param])


class _WideDtypes(Mapping[int, torch.dtype]):
    """The dtype the module gave each narrowed parameter, by id (read by the uploads of calls outside autocast)."""

    def __init__(self, narrowed: dict[int, _Narrowed]) -> None:
        self._narrowed = narrowed

    def __getitem__(self, key: int) -> torch.dtype:
        return self._narrowed[key].wide

    def __iter__(self) -> Any:
        return iter(self._narrowed)

    def __len__(self) -> int:
        return len(self._narrowed)

"""Modules built on the meta device, given host memory one module at a time.

``Trainer.init_module(empty_init=True)`` under this strategy builds the module on the meta device (no memory,
no initialisation), as Lightning's FSDP strategy does. At setup :func:`materialize` gives each submodule its host
memory, in module order, and its values:

* from the checkpoint being resumed (``trainer.fit(ckpt_path=...)``): Lightning hands the strategy the
  checkpoint's state dict before setup (memory-mapped by the default checkpoint IO); the strategy keeps it and
  each module copies its own entries when it is materialized (its ``_load_from_state_dict``, as
  ``load_state_dict`` calls it), so the checkpoint's tensors are read module by module and never held twice;
* or from pretrained weights in safetensors files (``weights_from``, ``pretrained.py``), read the same way;
* otherwise from the module's own initialisation: its ``reset_parameters()``, called in module order, draws what
  building it on the CPU would have drawn (for modules whose constructor initialises through it, as torch's do);
  a module without one is refused, naming it. Inside a ``transformers`` model the model's ``_init_weights``
  initialises instead (what ``from_config`` initialises with: the same distributions, not the same draws, since a
  CPU build first draws torch's defaults too; and the only thing that fills the rotary tables, which no file
  holds). A LoRA adapter (``peft``) is initialised as peft's ``reset_lora_parameters`` does for its config's
  ``init_lora_weights`` ``True`` or ``"gaussian"``; one peft computes from the base weights (DoRA, PiSSA, ...)
  with no value from a checkpoint is refused.

An NF4 layer (``nf4.py``) takes its weight from the source only: its own NF4 entries, or the dense model's
``weight``, quantised as it loads; without either it is refused (there is nothing to quantise).

Weights registered at several places (an embedding tied to an LM head) stay one tensor. After each trunk layer is
whole, ``after_layer`` runs (the strategy keeps that layer's frozen weights at compute width then,
``engine/frozen_weights.py``), so a frozen float32 base never exists whole beside its narrow copy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_roundpipe.nf4 import NF4Linear

_META = torch.device("meta")


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(tensor.device == _META for tensor in (*module.parameters(), *module.buffers()))


class MaterializeError(RuntimeError):
    """A module built on the meta device that cannot be given values: say what to change."""


class _Registration:
    """Where a meta tensor is registered: every (module, table, name), and its state-dict keys."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.meta = tensor  # kept alive: the ids of the meta tensors index the tables below until the end
        self.host: torch.Tensor | None = None
        self.places: list[tuple[nn.Module, str, str]] = []  # (owner, "_parameters" or "_buffers", name)
        self.keys: list[str] = []  # its state-dict keys (a non-persistent buffer has none)


def _registrations(module: nn.Module) -> dict[int, _Registration]:
    found: dict[int, _Registration] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for table in ("_parameters", "_buffers"):
            for name, tensor in getattr(owner, table).items():
                if tensor is None or tensor.device != _META:
                    continue
                entry = found.setdefault(id(tensor), _Registration(tensor))
                entry.places.append((owner, table, name))
                if table == "_parameters" or name not in owner._non_persistent_buffers_set:
                    entry.keys.append(f"{prefix}.{name}" if prefix else name)
    return found


def materialize(module: nn.Module, source: Mapping[str, Any] | None = None, *, strict: bool = True,
                layers: Sequence[nn.Module] = (), after_layer: Callable[[int], None] | None = None) -> list[str]:
    """Give every meta tensor of ``module`` host memory and its values (see the module docstring). ``source``: a
    state dict to take the values from (``strict``: its keys must be exactly the module's, as ``load_state_dict``
    requires); ``layers``: the trunk's layers, and ``after_layer(index)`` called once each is whole. Returns the
    state-dict keys of the tensors their modules initialised (none from ``source``)."""
    registered = _registrations(module)
    if not registered:
        return []
    initialisers = _initialisers(module)
    initialised: list[str] = []
    pending_by_layer = [{id(tensor) for tensor in (*layer.parameters(), *layer.buffers()) if id(tensor) in registered}
                        for layer in layers]
    done_layers = [not pending for pending in pending_by_layer]
    metadata = getattr(source, "_metadata", None) if source is not None else None
    for prefix, owner in module.named_modules():
        own = [(table, name, tensor) for table in ("_parameters", "_buffers")
               for name, tensor in getattr(owner, table).items() if tensor is not None and tensor.device == _META]
        if not own:
            continue
        uncovered = [name for table, name, tensor in own
                     if source is None or not any(key in source for key in (*registered[id(tensor)].keys,
                                                                            *_loaded_from(owner, prefix, name)))]
        for _, _, tensor in own:
            _give_memory(registered[id(tensor)])
        if uncovered:
            _initialise(owner, prefix, uncovered, fresh={name for _, name, _ in own},
                        initialiser=initialisers.get(id(owner)))
            initialised += [key for _, name, tensor in own if name in uncovered for key in registered[id(tensor)].keys]
        if source is not None:
            _load_own(owner, prefix, source, metadata)
        for index, pending in enumerate(pending_by_layer):
            pending.difference_update(id(tensor) for _, _, tensor in own)
            if not pending and not done_layers[index]:
                done_layers[index] = True
                if after_layer is not None:
                    after_layer(index)
    if source is not None and strict:
        _check_keys(module, source)
    return initialised


def _loaded_from(owner: nn.Module, prefix: str, name: str) -> tuple[str, ...]:
    """The keys besides its own that ``owner``'s ``_load_from_state_dict`` fills tensor ``name`` from: an NF4 layer's
    weight from the dense model's ``weight``, quantised as it loads."""
    if isinstance(owner, NF4Linear) and name in ("weight_nf4", "weight_absmax"):
        return (f"{prefix}.weight" if prefix else "weight",)
    return ()


def _give_memory(entry: _Registration) -> None:
    """One host tensor for the meta one, at every place it was registered (a tie stays a tie)."""
    meta = entry.meta
    if entry.host is not None:
        return
    host = torch.empty_like(meta, device="cpu")
    if isinstance(meta, nn.Parameter):
        host = nn.Parameter(host, requires_grad=meta.requires_grad)
    for owner, table, name in entry.places:
        getattr(owner, table)[name] = host
    entry.host = host


def _initialisers(module: nn.Module) -> dict[int, Callable[[], None] | str]:
    """Per submodule id, what initialises it instead of its ``reset_parameters``: inside a ``transformers`` model, the
    outermost one's ``_init_weights(submodule)`` (what ``from_config`` initialises with, and the only thing that
    fills the rotary tables); inside a ``peft`` tuner layer, peft's initialisation of a LoRA matrix under its
    config (:func:`_lora_initialiser`), else the refusal to say (an initialisation computed from the base weights)."""
    found: dict[int, Callable[[], None] | str] = {}
    owners = list(module.named_modules())
    configs = _peft_configs(module)
    for prefix, owner in owners:  # adapters first: the transformers model around them does not claim them
        if type(owner).__module__.startswith("peft.tuners.") and hasattr(owner, "base_layer"):
            for name, inner in owner.named_modules():
                if not name.startswith("base_layer"):
                    found[id(inner)] = (_lora_initialiser(owner, name, inner, configs)
                                        or f"{prefix or 'the module'} ({type(owner).__name__}), a peft adapter,")
    for _, owner in owners:  # outer first: an outer model claims the models inside it
        if type(owner).__module__.startswith("transformers.") and callable(getattr(owner, "_init_weights", None)):
            for inner in owner.modules():
                found.setdefault(id(inner), functools.partial(owner._init_weights, inner))
    return found


def _peft_configs(module: nn.Module) -> dict[str, Any]:
    """The LoRA configs of ``module``'s peft models, by adapter name (``PeftModel.peft_config``)."""
    configs: dict[str, Any] = {}
    for owner in module.modules():
        found = getattr(owner, "peft_config", None)
        if isinstance(found, dict):
            configs.update(found)
    return configs


def _lora_initialiser(layer: Any, name: str, inner: nn.Module, configs: dict[str, Any]
                      ) -> Callable[[], None] | None:
    """What peft's ``reset_lora_parameters`` does to the adapter matrix ``inner`` (``lora_A.<adapter>`` or
    ``lora_B.<adapter>`` of the LoRA ``layer``) under the adapter's ``init_lora_weights``: A as ``nn.Linear``
    initialises a weight (``True``) or normal with std ``1 / r`` (``"gaussian"``), B zero. None (refused) for
    everything else: the initialisations computed from the base weights (PiSSA, OLoRA, LoftQ, ...), DoRA's
    magnitudes, embedding adapters, dropout modules with nothing to initialise."""
    kind, _, adapter = name.partition(".")
    config = configs.get(adapter)
    if (kind not in ("lora_A", "lora_B") or config is None or not isinstance(inner, nn.Linear)
            or config.init_lora_weights not in (True, "gaussian") or getattr(config, "use_dora", False)):
        return None
    rank: int = layer.r[adapter]
    return functools.partial(_init_lora_matrix, inner, kind, config.init_lora_weights, rank)


def _init_lora_matrix(linear: nn.Linear, kind: str, init: bool | str, rank: int) -> None:
    """peft's initialisation of one adapter matrix (see :func:`_lora_initialiser`)."""
    if kind == "lora_B":
        for param in linear.parameters(recurse=False):
            nn.init.zeros_(param)
    elif init is True:
        nn.init.kaiming_uniform_(linear.weight, a=math.sqrt(5))
    else:
        nn.init.normal_(linear.weight, std=1 / rank)


def _initialise(owner: nn.Module, prefix: str, uncovered: list[str], fresh: set[str],
                initialiser: Callable[[], None] | str | None = None) -> None:
    """``owner.reset_parameters()`` (or its ``initialiser``: :func:`_initialisers`), keeping the values of its
    tensors another module gave already (a tie: those not in ``fresh``, the ones just given memory, which reset or
    the checkpoint fill)."""
    if isinstance(owner, NF4Linear):  # its weight is quantised values: a source's, never an initialisation
        weights = [name for name in uncovered if name != "nf4_pairs"]
        if weights:
            raise MaterializeError(
                f"{prefix} (NF4Linear) was built on the meta device and nothing gives its {', '.join(weights)} a "
                "value: an NF4 weight holds quantised values, and there are none to quantise. Give it a source: "
                "weights_from (its dense `weight`, quantised as it loads) or a checkpoint holding its NF4 entries")
        owner.refill_levels()
        return
    if isinstance(initialiser, str):
        raise MaterializeError(
            f"{initialiser} was built on the meta device and nothing gives {prefix}'s {', '.join(uncovered)} a "
            "value: peft initialises adapters from the model's config, which RoundPipe does not replay. Resume from "
            "a checkpoint that holds the adapters (trainer.fit(ckpt_path=...)), or build the model in memory "
            "(from_pretrained, then get_peft_model) without empty_init=True or weights_from")
    reset = initialiser if initialiser is not None else getattr(owner, "reset_parameters", None)
    if not callable(reset):
        where = prefix or "the module"
        raise MaterializeError(
            f"{where} ({type(owner).__name__}) was built on the meta device (Trainer.init_module(empty_init=True)) "
            f"and nothing gives {', '.join(uncovered)} a value: resume from a checkpoint that holds them "
            f"(trainer.fit(ckpt_path=...)), give {type(owner).__name__} a reset_parameters() that initialises "
            "them, or build the module without empty_init=True")
    kept = {name: tensor.detach().clone() for table in ("_parameters", "_buffers")
            for name, tensor in getattr(owner, table).items() if tensor is not None and name not in fresh}
    with torch.no_grad():
        reset()
        for table in ("_parameters", "_buffers"):
            for name, tensor in getattr(owner, table).items():
                if name in kept:
                    tensor.copy_(kept[name])


def _load_own(owner: nn.Module, prefix: str, source: Mapping[str, Any], metadata: Any) -> None:
    """``owner``'s own entries of ``source`` (not its children's), as ``load_state_dict`` loads each module."""
    local_metadata = metadata.get(prefix, {}) if metadata is not None else {}
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []
    owner._load_from_state_dict(source, f"{prefix}." if prefix else "", local_metadata, False, missing, unexpected,
                                errors)
    if errors:
        raise MaterializeError(f"loading {prefix or 'the module'} from the checkpoint: " + "; ".join(errors))


def _check_keys(module: nn.Module, source: Mapping[str, Any]) -> None:
    expected = set(module.state_dict(keep_vars=True))
    missing = sorted(expected - set(source))
    unexpected = sorted(set(source) - expected)
    if missing or unexpected:
        raise MaterializeError(f"the checkpoint does not match the module built on the meta device: missing keys "
                               f"{missing[:8]}, unexpected keys {unexpected[:8]} (load it with strict=False, "
                               "Trainer(..., strict_loading=False))")

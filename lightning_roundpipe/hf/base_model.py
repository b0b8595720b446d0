"""Any Hugging Face transformer with a list of layers: its *base model* recorded and cut at the layers.

Outside the three causal-LM presets (:mod:`~lightning_roundpipe.hf.causal_lm`), a ``transformers`` model
(GPT-2, Mistral, Gemma, Phi, BERT, ViT, ...) is a task head around a base model (``model.base_model``:
``GPT2LMHeadModel.transformer``, ``BertForSequenceClassification.bert``) whose forward embeds the input,
builds the masks and loops over an ``nn.ModuleList`` of layers. That forward is what the traced path
(:mod:`~lightning_roundpipe.traced`) records and cuts at the layer calls. The head and its loss stay in the
model's own forward, on the host, on the whole batch's output: the loss is the one Hugging Face computes
under any strategy (a token mean over the batch, not over a microbatch), with no preset to keep in step
with each family. What the pipeline cannot carry between devices is refused here, saying what to change.

Nothing here imports ``transformers``: models are recognized by their class's module.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

# call arguments whose results live in the model's own Python objects (a cache filled layer by layer,
# attention maps or hidden states collected by hooks), which the layers running on other devices never fill
_REFUSED_WHEN_SET = ("output_attentions", "output_hidden_states", "past_key_values", "cache")
_FLEX = "flex_attention"  # its masks are BlockMask objects, not tensors that can move between devices


def is_transformers_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` model (a ``PreTrainedModel``: it has a ``config``)."""
    return type(module).__module__.startswith("transformers.") and hasattr(module, "config")


def base_model_name(module: nn.Module, name: str = "") -> str | None:
    """The name within ``module`` of the base model of the outermost ``transformers`` model on the way
    to ``name`` (``""``: search all of ``module``), or ``None`` where there is none. ``name`` may be the
    task model (``model``), its base model or the layer list (``model.transformer.h``): each means the
    base model, whose forward is the one that loops over the layers; a ``name`` outside the base model (the
    task head) is not a Hugging Face trunk (``None``)."""
    candidates = ([(prefix, module.get_submodule(prefix)) for prefix in _prefixes(name)] if name
                  else list(module.named_modules()))
    for path, candidate in candidates:
        if is_transformers_model(candidate):
            refuse_unsupported_model(path or type(module).__name__, candidate)
            base = getattr(candidate, "base_model", candidate)
            inner = next((n for n, m in candidate.named_modules() if m is base), "")
            found = ".".join(part for part in (path, inner) if part)
            within = not name or name == path or name == found or name.startswith(f"{found}.")
            return found if within else None
    return None


def _prefixes(name: str) -> list[str]:
    """``""``, ``a``, ``a.b``, ``a.b.c`` for ``a.b.c``: the modules on the way to ``name``, outermost first."""
    parts = name.split(".")
    return ["", *(".".join(parts[:depth]) for depth in range(1, len(parts) + 1))]


def refuse_unsupported_model(name: str, model: nn.Module) -> None:
    """Refuse a ``transformers`` model the traced path cannot run, saying why and what to do."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise TypeError(
            f"`{name}` is a {type(model).__name__}, a Hugging Face encoder-decoder model: its decoder reads the "
            "encoder's output at every layer, and RoundPipe pipelines one list of layers of a Hugging Face model. "
            "Train it under another strategy (strategy='auto'), or use a decoder-only or encoder-only model "
            "(GPT-2, Llama, Mistral, BERT, ViT, ...)")
    refuse_flex_attention(model, f"`{name}` ({type(model).__name__})")


def refuse_flex_attention(model: nn.Module, shown: str) -> None:
    """Refuse a model loaded with flex attention (``shown`` names it in the message), for the presets too."""
    if getattr(model.config, "_attn_implementation", None) == _FLEX:
        raise ValueError(
            f"{shown} uses attn_implementation={_FLEX!r}, whose block masks RoundPipe cannot move between devices; "
            "load the model with attn_implementation='sdpa' (or 'eager')")


def prepare_call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments a ``transformers`` base model is recorded and run with under RoundPipe: those given,
    with ``use_cache=False`` where its forward takes it (a KV cache is a Python object the layers fill in
    place, which layers on other devices cannot; training never reads it). Arguments asking for such
    objects are refused. Other models' arguments are returned unchanged."""
    if not is_transformers_model(model):
        return args, kwargs
    shown = type(model).__name__
    if kwargs.get("use_cache"):
        raise ValueError(
            f"under RoundPipe, {shown} runs without a KV cache (use_cache=True was passed, e.g. by generate()). "
            "Pass use_cache=False (or nothing) while training, and generate after trainer.fit returns, when the "
            "model's own forward is back")
    given = sorted(key for key in _REFUSED_WHEN_SET if kwargs.get(key) is not None and kwargs.get(key) is not False)
    if given:
        raise ValueError(
            f"under RoundPipe, {shown} is called with {', '.join(f'{key}=...' for key in given)}: the model "
            "collects those in Python objects that its layers, running on other devices, cannot fill. Leave it "
            "unset while training (or compute it after trainer.fit)")
    if "use_cache" not in inspect.signature(type(model).forward).parameters:
        return args, kwargs  # an encoder (BERT, ViT) has no cache to turn off
    return args, {**kwargs, "use_cache": False}


def draws_functional_dropout(module: nn.Module) -> bool:
    """Whether a module under ``module`` in training mode applies dropout with no dropout module to show
    it: the attention of Llama-style models (Mistral, Gemma, Phi, ...) keeps ``attention_dropout`` as a
    number and calls the functional dropout, which the engine must know of to replay it in recomputation."""
    for child in module.modules():
        rate = child.__dict__.get("attention_dropout")
        if child.training and isinstance(rate, (int, float)) and rate > 0:
            return True
    return False

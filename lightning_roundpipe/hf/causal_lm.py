"""The Hugging Face causal-LM preset: a ``LlamaForCausalLM`` (or Qwen2, Qwen3) pipelined as it is.

The model is cut into its natural layers without changing it:

- an *embedding* layer: token embeddings, plus what every decoder layer reads and nothing
  differentiates (the attention masks, the rotary cos/sin tables, the position ids and the labels),
  computed once per microbatch and carried in a :class:`~lightning_roundpipe.engine.transfer.NoGrad`, so
  backward stages reuse them when they recompute. Building the masks reads no device tensor on the host
  (see :class:`MaskFacts`): what transformers would learn by reading the mask or the position ids on the
  device (is there padding? are sequences packed?) is found on the host before the batch is dispatched;
- one layer per decoder block;
- a *head*: the final norm and either the logits (no labels) or, with labels, each sample's summed
  token loss and token count from :func:`~lightning_roundpipe.hf.lm_loss.chunked_lm_loss`, which never
  holds a whole microbatch's full-vocabulary logits.

The layers are wrappers that hold the model's own modules, outside the model's module tree: its
parameters, ``state_dict`` keys and ``save_pretrained`` stay as they are. A tied embedding and head is
one parameter used by the first and last layers; the trunk sums its two gradients. A ``peft``
``PeftModel`` (LoRA) is seen through: the adapters sit inside the decoder blocks' linear layers.

:class:`CausalLMForward` replaces the model's ``forward`` while the strategy drives it, so
``self.model(input_ids=..., attention_mask=..., labels=...).loss`` in a ``training_step`` runs the
forward, the loss and the backward in the pipeline, per microbatch, each microbatch's token loss
normalized by the whole batch's count of valid tokens.

``transformers`` and ``peft`` are optional: nothing here imports them until a model of theirs is seen.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from lightning_roundpipe.engine.microbatch import token_count
from lightning_roundpipe.engine.pipelined import PipelinedForward
from lightning_roundpipe.engine.transfer import NoGrad
from lightning_roundpipe.hf.base_model import refuse_flex_attention
from lightning_roundpipe.hf.lm_loss import chunked_lm_loss

SUPPORTED_TRANSFORMERS = ("5.0", "5.25")  # [lowest, first unsupported): masks and layer calls change often
FAMILIES = ("llama", "qwen2", "qwen3")    # model_type values whose forward the preset reproduces
IGNORE_INDEX = -100                       # Hugging Face's label for "no loss at this token"


def find_causal_lm(module: nn.Module) -> nn.Module | None:
    """The Hugging Face causal LM that ``module`` is or wraps (a ``PeftModel``), else ``None``.

    Recognized by shape (``config.model_type``, ``model.embed_tokens/layers/norm/rotary_emb``,
    ``lm_head``), so nothing is imported to look. A model of that shape from another family (Mistral,
    Gemma, ...) is not one: its forward may differ from the preset's, so it takes the generic path
    (:mod:`~lightning_roundpipe.hf.base_model`), which runs the model's own code.
    """
    model = _unwrap_peft(module)
    if not _has_causal_lm_shape(model) or getattr(model.config, "model_type", None) not in FAMILIES:
        return None
    check_transformers_version()
    refuse_flex_attention(model, type(model).__name__)
    return model


def _unwrap_peft(module: nn.Module) -> nn.Module:
    if not type(module).__module__.startswith("peft."):
        return module
    config = getattr(module, "active_peft_config", None)
    if config is not None and getattr(config, "is_prompt_learning", False):
        raise ValueError(
            f"RoundPipe pipelines adapter methods that live inside the layers (LoRA and similar); the "
            f"{type(config).__name__} prepends virtual tokens outside them and is not supported"
        )
    get_base_model = getattr(module, "get_base_model", None)
    if get_base_model is not None:  # PeftModel -> the transformers model, with adapters injected
        return get_base_model()
    inner = getattr(module, "model", None)  # a bare LoraModel
    return inner if isinstance(inner, nn.Module) else module


def _has_causal_lm_shape(model: nn.Module) -> bool:
    base = getattr(model, "model", None)
    return (
        type(model).__module__.startswith("transformers.")
        and hasattr(getattr(model, "config", None), "model_type")
        and isinstance(getattr(model, "lm_head", None), nn.Module)
        and isinstance(base, nn.Module)
        and all(isinstance(getattr(base, name, None), nn.Module) for name in ("embed_tokens", "norm", "rotary_emb"))
        and isinstance(getattr(base, "layers", None), nn.ModuleList)
    )


def check_transformers_version() -> None:
    import transformers
    from packaging.version import Version

    lowest, too_new = SUPPORTED_TRANSFORMERS
    version = Version(transformers.__version__)
    if not Version(lowest) <= version < Version(too_new):
        raise RuntimeError(
            f"RoundPipe's Hugging Face preset supports transformers >={lowest},<{too_new} (masks, rotary "
            f"embeddings and decoder-layer calls change between releases); found {transformers.__version__}. "
            f"Install a supported version: pip install 'transformers>={lowest},<{too_new}'"
        )


def causal_lm_preset(module: nn.Module, chunk_bytes: int | None = None) -> list[nn.Module] | None:
    """The layers of a Hugging Face causal LM (see the module docstring), or ``None`` if it is not one."""
    model: Any = find_causal_lm(module)
    if model is None:
        return None
    base: Any = model.model  # a transformers *Model: typed loosely, transformers is optional
    if any(getattr(layer, "gradient_checkpointing", False) for layer in base.layers):
        warnings.warn(
            f"{type(model).__name__} has gradient checkpointing enabled; RoundPipe's backward stages already "
            "recompute, so every block would run its forward three times. Call "
            "model.gradient_checkpointing_disable() before training", stacklevel=3)
    layer_types = getattr(model.config, "layer_types", None)
    blocks = [
        CausalLMBlock(layer, getattr(layer, "attention_type", None)
                      or (layer_types[index] if layer_types else "full_attention"))
        for index, layer in enumerate(base.layers[: model.config.num_hidden_layers])
    ]
    embedding = CausalLMEmbedding(base, sorted({block.attention_type for block in blocks}))
    return [embedding, *blocks, CausalLMHead(base.norm, model.lm_head, chunk_bytes)]


# ---------------------------------------------------------------------------- the masks' host-side facts
class MaskFacts(NamedTuple):
    """What the host knows about a batch's attention mask and position ids, so that transformers' mask
    builders need not read them on the device.

    transformers decides some things about the masks with Python ``if``s on tensor values: with an attention
    mask and ``sdpa``, "no padding, so rely on ``is_causal``" (``fast_all(mask)``); without one but with
    position ids, "packed sequences" (``find_packed_sequence_indices``, then ``.all()``). On an accelerator
    each is a host sync in the compute thread, once per microbatch of the first stage and again in every
    recompute of the embedding. :func:`mask_facts` learns them on the host from the whole batch, before it
    is dispatched; ``None`` is "not known" (the tensor was not on the host): transformers then reads it itself.
    """

    padded: bool | None = None  # the attention mask has a zero (a masked token) somewhere in the batch
    packed: bool | None = None  # the position ids restart within a row (packed sequences, no attention mask)


def mask_facts(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
               ) -> tuple[torch.Tensor | None, MaskFacts]:
    """The attention mask to dispatch (``None`` in place of one without padding) and the :class:`MaskFacts`
    of a batch, read on the host (tensors elsewhere are left for transformers to read).

    A mask of ones is dropped: transformers builds the same masks from ``None`` (the plain causal mask, or
    ``is_causal`` under ``sdpa``). Without padding the position ids are then not packed sequences either,
    as transformers only looks for packing when no attention mask is given. With padding, ``sdpa`` needs
    a mask in every microbatch, as it has for the whole batch outside the pipeline."""
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.device.type != "cpu":
            return attention_mask, MaskFacts()  # a prepared 4-D mask is used as given; a device one is not read
        if bool(attention_mask.all()):
            return None, MaskFacts(padded=False, packed=False)
        return attention_mask, MaskFacts(padded=True, packed=False)
    if position_ids is None:
        return None, MaskFacts(padded=False, packed=False)
    if position_ids.device.type != "cpu":
        return None, MaskFacts(padded=False)
    # transformers' criterion (find_packed_sequence_indices): a position that does not follow the previous one
    return None, MaskFacts(padded=False, packed=bool((position_ids.diff(dim=-1) != 1).any()))


# ---------------------------------------------------------------------------- the layers
class CausalLMEmbedding(nn.Module):
    """Token embeddings, and the per-microbatch values every later layer reads (in a ``NoGrad``).

    ``facts`` (:func:`mask_facts`) spare the mask builders their device reads. Without them the masks are
    still built without any when no position ids are given, else as transformers builds them."""

    def __init__(self, base: Any, attention_types: list[str]) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = base.embed_tokens
        self.rotary_emb: nn.Module = base.rotary_emb
        self.config = base.config
        self.mask_builders = {kind: _mask_builder(kind) for kind in attention_types}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                facts: MaskFacts | None = None):
        facts = facts or MaskFacts()
        hidden = self.embed_tokens(input_ids)
        # transformers reads the position ids (on the device) for packed sequences when no attention mask is
        # given; they matter only if packed, and default ones (an arange) never are
        packed_positions = position_ids if attention_mask is None and facts.packed is not False else None
        masks = {kind: build(self.config, hidden, attention_mask, packed_positions, padded=facts.padded)
                 for kind, build in self.mask_builders.items()}
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        cos, sin = self.rotary_emb(hidden, position_ids)
        return hidden, NoGrad(masks=masks, cos=cos, sin=sin, position_ids=position_ids, labels=labels)


class CausalLMBlock(nn.Module):
    """One decoder block, reading the masks and rotary tables the embedding layer computed."""

    def __init__(self, layer: nn.Module, attention_type: str) -> None:
        super().__init__()
        self.layer = layer
        self.attention_type = attention_type

    @property
    def roundpipe_random(self) -> bool:
        # attention dropout is functional (no nn.Dropout module to detect): declare it for RNG replay
        attention = getattr(self.layer, "self_attn", None)
        return bool(self.layer.training and float(getattr(attention, "attention_dropout", 0.0) or 0.0) > 0)

    def forward(self, state: tuple[torch.Tensor, NoGrad]) -> tuple[torch.Tensor, NoGrad]:
        hidden, context = state
        out = self.layer(hidden, attention_mask=context.masks[self.attention_type],
                         position_ids=context.position_ids, position_embeddings=(context.cos, context.sin))
        return (out[0] if isinstance(out, tuple) else out), context


class CausalLMHead(nn.Module):
    """The final norm, then the logits (no labels) or each sample's (summed token loss, token count).

    ``chunk_bytes``: see :func:`~lightning_roundpipe.hf.lm_loss.chunked_lm_loss` (``None``: sized from the
    device's free memory on CUDA)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, chunk_bytes: int | None = None) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.chunk_bytes = chunk_bytes

    def forward(self, state: tuple[torch.Tensor, NoGrad]):
        hidden, context = state
        hidden = self.norm(hidden)
        if context.labels is None:
            return self.lm_head(hidden)
        labels = context.labels
        if type(self.lm_head) is nn.Linear:
            losses = chunked_lm_loss(hidden, self.lm_head.weight, labels, bias=self.lm_head.bias,
                                     ignore_index=IGNORE_INDEX, chunk_bytes=self.chunk_bytes)
        else:  # an adapted head (LoRA on lm_head): its own forward, full logits
            logits = self.lm_head(hidden).float()
            losses = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX,
                                     reduction="none").view_as(labels)
        valid = labels != IGNORE_INDEX
        return losses.sum(dim=-1), valid.sum(dim=-1).to(losses.dtype)


def _mask_builder(attention_type: str) -> Callable[..., Any]:
    """``build(config, inputs_embeds, attention_mask, position_ids, padded=None)`` for one attention type,
    calling transformers' own mask function with the argument names this release uses.

    ``padded=True`` (the batch's mask has a zero) disallows the ``is_causal`` skip: deciding it would read
    the mask on the device (``fast_all``), and with padding in the batch a mask is what the whole batch
    gets outside the pipeline too."""
    from transformers import masking_utils

    functions = {"full_attention": masking_utils.create_causal_mask,
                 "sliding_attention": masking_utils.create_sliding_window_causal_mask}
    if attention_type not in functions:
        raise ValueError(f"RoundPipe's preset does not know decoder layers of attention type {attention_type!r}; "
                         f"it supports {sorted(functions)}")
    function = functions[attention_type]
    names = set(inspect.signature(function).parameters)

    def build(config: Any, embeds: torch.Tensor, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor | None, padded: bool | None = None) -> Any:
        values = {"config": config, "inputs_embeds": embeds, "input_embeds": embeds,
                  "attention_mask": attention_mask, "cache": None, "past_key_values": None,
                  "position_ids": position_ids,
                  "cache_position": torch.arange(embeds.shape[1], device=embeds.device)}
        if padded and attention_mask is not None:
            values["allow_is_causal_skip"] = False
        return function(**{name: value for name, value in values.items() if name in names})

    return build


# ---------------------------------------------------------------------------- the model's forward
def summed_token_loss(output: tuple[torch.Tensor, torch.Tensor], target: Any) -> torch.Tensor:
    """A microbatch's mean token loss from the head's per-sample (loss sum, token count)."""
    del target  # the head read the labels itself; the engine weighs microbatches by their token counts
    sums, counts = output
    return sums.sum() / counts.sum()


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal shift: position t is scored against the label at t + 1; the last is ignored."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


class CausalLMForward(PipelinedForward):
    """The ``forward`` of a Hugging Face causal LM driven by an engine.

    With ``labels`` and grad mode (a ``training_step``): forward, loss and backward run in the pipeline;
    the returned ``loss`` is detached (its backward has run, scaled as Lightning scales a returned loss).
    With ``labels`` and no grad (validation): the loss, from per-sample sums. Without ``labels``: the
    logits, through the transparent path (differentiable under grad mode). ``logits`` are not returned
    when ``labels`` are given: a whole batch's full-vocabulary logits are what the pipeline avoids.
    """

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                 return_dict: bool | None = None, use_cache: bool | None = None, **unsupported: Any) -> Any:
        input_ids = _refuse_unsupported(input_ids, use_cache, unsupported)
        if position_ids is not None and position_ids.shape[0] == 1 and input_ids.shape[0] > 1:
            position_ids = position_ids.expand(input_ids.shape[0], -1)  # split into microbatches on dim 0
        attention_mask, facts = mask_facts(attention_mask, position_ids)  # on the host, before dispatch
        loss = logits = None
        if labels is None:
            logits = self.engine(input_ids, attention_mask, position_ids, None, facts)
        else:
            shifted = shift_labels(labels)
            inputs = (input_ids, attention_mask, position_ids, shifted, facts)
            if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
                loss = self.engine.forward_backward(inputs, shifted, summed_token_loss,
                                                    loss_weight=token_count(IGNORE_INDEX),
                                                    scale=self.backward_scale())
                self.on_fused_backward()
            else:
                sums, counts = self.engine(*inputs)
                loss = sums.sum() / counts.sum()
        from transformers.modeling_outputs import CausalLMOutputWithPast

        output = CausalLMOutputWithPast(loss=loss, logits=logits)
        return output if return_dict is not False else output.to_tuple()


_IGNORED_WHEN_EMPTY = ("inputs_embeds", "past_key_values", "cache", "cache_position", "output_attentions",
                       "output_hidden_states", "logits_to_keep", "token_type_ids")


def _refuse_unsupported(input_ids: torch.Tensor | None, use_cache: bool | None, unsupported: dict[str, Any]
                        ) -> torch.Tensor:
    """``input_ids``, once the call is one the pipeline supports; else a ValueError saying what to change."""
    if input_ids is None:
        raise ValueError("under RoundPipe, call the model with `input_ids` (inputs_embeds are not supported)")
    if use_cache:
        raise ValueError(
            "under RoundPipe the model runs without a KV cache (use_cache=True was passed, e.g. by generate()). "
            "Generate after trainer.fit returns, when the model's own forward is back, or pass use_cache=False"
        )
    given = sorted(name for name, value in unsupported.items()
                   if not (name in _IGNORED_WHEN_EMPTY and _is_empty(value)))
    if given:
        raise ValueError(
            f"under RoundPipe the model's forward takes input_ids, attention_mask, position_ids and labels; "
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} not supported. Compute that outside the "
            "model call, or train under another strategy"
        )
    return input_ids


def _is_empty(value: Any) -> bool:
    return value is None or value is False or (type(value) is int and value == 0)

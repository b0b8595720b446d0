"""Hugging Face causal LMs (Llama, Qwen3) as a plain LightningModule, optionally with LoRA adapters.

The model is ``transformers.AutoModelForCausalLM.from_config(config)``, randomly initialised (no
download), trained on the app's byte data: token ids are bytes, so ``vocab_size`` is at least 256.
It is built in :meth:`CausalLM.configure_model`, which Lightning calls before the strategy's setup
(``fit``, ``validate``, ...), not in ``__init__``: composing or instantiating an 8B config costs nothing,
and Lightning builds the weights under the strategy's device and precision context.
``transformers`` and ``peft`` are imported there too, so ``lightning_roundpipe.app`` works without them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lightning_roundpipe.app.model import LanguageModelLogging
from lightning_roundpipe.app.optimizers import build_optimizer
from lightning_roundpipe.nf4 import to_nf4

FAMILIES = {"llama": "LlamaConfig", "qwen3": "Qwen3Config"}
BYTES = 256  # the data's token ids; sampling draws from these only, whatever vocab_size is


def _hf(name: str) -> Any:
    """Import ``transformers`` or ``peft``, saying how to install them if missing."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ImportError(f"the Hugging Face model options need {name}: pip install 'lightning_roundpipe[hf]'"
                          ) from error


class CausalLM(LanguageModelLogging):
    """Next-token training of a Hugging Face causal LM held at ``self.model``.

    ``family`` picks the ``transformers`` config class; ``architecture`` holds its fields
    (``hidden_size``, ``num_hidden_layers``, ... and ``rope_theta``). ``lora`` (``r``, ``alpha``,
    ``dropout``, ``target_modules``) wraps the model with ``peft.get_peft_model``: only the adapters
    train, and the optimizer holds state for them only; its ``base="nf4"`` then keeps the frozen base's Linear
    weights (all but the LM head) in 4 bits, as QLoRA does (:func:`lightning_roundpipe.nf4.to_nf4`). ``context``
    is the window :meth:`sample` feeds.
    """

    def __init__(self, family: str = "llama", attn_implementation: str = "sdpa", dtype: str = "float32",
                 lora: dict[str, Any] | None = None, lr: float = 3e-3, weight_decay: float = 0.01,
                 context: int | None = None, optimizer: str = "adamw", **architecture: Any) -> None:
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"`model.family` must be one of {sorted(FAMILIES)}, got {family!r}")
        self.family, self.attn_implementation, self.dtype_name = family, attn_implementation, dtype
        self.lora, self.lr, self.weight_decay, self.context = lora, lr, weight_decay, context
        self.optimizer_name = optimizer
        self.architecture = architecture
        self.model: torch.nn.Module | None = None  # built by configure_model

    def hf_config(self) -> Any:
        """The ``transformers`` config: cheap, allocates no weights."""
        transformers = _hf("transformers")
        architecture = dict(self.architecture)
        rope_theta = architecture.pop("rope_theta", None)
        if rope_theta is not None:
            architecture["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
        # use_cache=False: training and the cache-free sampling loop never read a KV cache, so don't build one
        return getattr(transformers, FAMILIES[self.family])(
            **architecture, dtype=self.dtype_name, attn_implementation=self.attn_implementation, use_cache=False)

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning calls this hook on every fit/validate/test: build once
            return
        transformers = _hf("transformers")
        model = transformers.AutoModelForCausalLM.from_config(self.hf_config())
        if self.lora is not None:
            peft = _hf("peft")
            config = peft.LoraConfig(r=self.lora["r"], lora_alpha=self.lora["alpha"],
                                     lora_dropout=self.lora["dropout"],
                                     target_modules=list(self.lora["target_modules"]), task_type="CAUSAL_LM")
            with warnings.catch_warnings():  # peft reads a property transformers 5 deprecates: not ours to fix
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
                model = peft.get_peft_model(model, config)
            if self.lora.get("base", "as_stored") == "nf4":  # QLoRA: the frozen base's Linears in 4 bits
                to_nf4(model)
        self.model = model

    def _built(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("CausalLM.model is built by configure_model(), which Lightning calls before fit and "
                               "validate; call it first when using the module outside a Trainer")
        return self.model

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, _ = batch  # the datamodule's targets are ids shifted by one; HF shifts `labels` itself
        mask = torch.ones_like(ids)
        loss = self._built()(input_ids=ids, attention_mask=mask, labels=ids).loss
        self.log_training_loss(loss, ids.numel(), ids.shape[0])
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        ids, _ = batch
        loss = self._built()(input_ids=ids, labels=ids).loss
        self.val_loss.update(loss, weight=ids.shape[0] * (ids.shape[1] - 1))  # the positions HF scores

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]  # LoRA's frozen base gets no state
        return build_optimizer(self.optimizer_name, self, trainable, self.lr, self.weight_decay)

    @torch.no_grad()
    def sample(self, prompt: bytes, length: int, temperature: float = 0.8, seed: int = 0) -> bytes:
        """Sample ``length`` bytes after ``prompt`` by calling ``self.model`` on the host, without a KV cache.

        A documented bypass of any pipeline: after ``fit`` the strategy has handed the module back.
        """
        self.configure_model()
        assert self.model is not None
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        generator = torch.Generator(device).manual_seed(seed)
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        for _ in range(length):
            window = ids[:, -self.context:] if self.context else ids
            logits = self.model(input_ids=window, use_cache=False).logits[0, -1, :BYTES].float()
            probabilities = (logits / max(temperature, 1e-5)).softmax(-1)
            ids = torch.cat([ids, torch.multinomial(probabilities, 1, generator=generator)[None]], 1)
        self.model.train(was_training)
        return bytes(ids[0].tolist())

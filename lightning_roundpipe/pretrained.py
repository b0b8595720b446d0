"""Pretrained weights in safetensors files (``weights_from``), read tensor by tensor as a meta-built module is
materialized.

A Hugging Face model directory holds ``model.safetensors``, or shards named by ``model.safetensors.index.json``
(``save_pretrained``'s layout, as ``from_pretrained`` reads it). :class:`SafetensorsWeights` is a read-only mapping
from the module's state-dict keys to those tensors: nothing is read until a key is asked for, and each tensor is
read from its shard (memory-mapped by ``safetensors``) when the module owning it is materialized, so the files are
never whole in memory beside the module (``materialize.py``). The files' keys are the Hugging Face model's own; a
LightningModule holds that model under some attribute (``self.model``), and :func:`weights_prefix` finds the prefix
that makes them the LightningModule's keys.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_roundpipe.materialize import has_meta_tensors
from lightning_roundpipe.nf4 import NF4Linear

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class WeightsError(ValueError):
    """``weights_from`` names nothing this module can read: say what to change."""


def _shards(path: Path) -> dict[str, Path]:
    """Each tensor's name in the files, and the file holding it."""
    from safetensors import safe_open

    if path.is_dir():
        index = path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {key: path / shard for key, shard in weight_map.items()}
        path = path / SINGLE
    if not path.is_file():
        raise WeightsError(f"weights_from={str(path)!r} is neither a .safetensors file nor a directory holding "
                           f"{SINGLE} or {INDEX} (what save_pretrained writes)")
    with safe_open(str(path), framework="pt") as file:
        return dict.fromkeys(file.keys(), path)


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """The tensors of a safetensors file or Hugging Face model directory (see the module docstring) under the keys
    ``prefix + name`` (also found as a peft-wrapped layer's, ``...q_proj.base_layer.weight``); each read when asked
    for."""

    def __init__(self, path: str | Path, prefix: str = "") -> None:
        self.path = Path(path).expanduser()
        self.prefix = prefix
        self._where = _shards(self.path)
        self._open: dict[Path, Any] = {}  # shard -> its safe_open handle, opened on first use

    def _name(self, key: object) -> str | None:
        if not isinstance(key, str) or not key.startswith(self.prefix):
            return None
        name = key[len(self.prefix):].replace(".base_layer.", ".")  # a peft-wrapped layer's own weights
        return name if name in self._where else None

    def __contains__(self, key: object) -> bool:
        return self._name(key) is not None

    def __getitem__(self, key: str) -> torch.Tensor:
        name = self._name(key)
        if name is None:
            raise KeyError(key)
        shard = self._where[name]
        handle = self._open.get(shard)
        if handle is None:
            from safetensors import safe_open

            handle = self._open[shard] = safe_open(str(shard), framework="pt")
        return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return (self.prefix + name for name in self._where)

    def names(self) -> list[str]:
        """The tensors' names in the files."""
        return list(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        """Let go of the open shards."""
        self._open.clear()


def weights_prefix(module: nn.Module) -> str:
    """The attribute path (with a trailing dot) of the outermost ``transformers`` model inside ``module``, whose keys
    the files hold; ``""`` when ``module`` is one, or holds none (the files then hold ``module``'s own keys)."""
    for name, child in module.named_modules():
        if type(child).__module__.startswith("transformers.") and hasattr(child, "config"):
            return f"{name}." if name else ""
    return ""


def pretrained_source(module: nn.Module, path: str) -> SafetensorsWeights:
    """The weights at ``path`` under ``module``'s keys (:func:`weights_prefix`); refused when the files hold tensors the
    module has no place for (another model, or keys under another prefix)."""
    prefix = weights_prefix(module)
    weights = SafetensorsWeights(path, prefix)
    keys = [*module.state_dict(keep_vars=True),  # keys only: it is on meta
            *(f"{name}.weight" for name, layer in module.named_modules() if isinstance(layer, NF4Linear))]
    covered = {weights._name(key) for key in keys}  # an NF4 layer loads the dense weight, quantised
    unexpected = sorted(name for name in weights.names() if name not in covered)
    if unexpected:
        raise WeightsError(
            f"weights_from={path!r} holds {len(unexpected)} tensors this module has no place for, e.g. "
            f"{unexpected[:4]} (looked up as {prefix!r} + the name): they are another model's weights, or the "
            f"module's keys differ from the files' (module keys: {sorted(module.state_dict(keep_vars=True))[:4]})")
    return weights


def source_for(module: nn.Module, path: str, ckpt_path: object) -> SafetensorsWeights | None:
    """Setup's source of values with ``weights_from=path``: none when a checkpoint is being resumed (``ckpt_path``: it
    wins); refused for a module built in memory, whose weights would silently stay what it was built with."""
    if ckpt_path is not None:
        logging.getLogger(__name__).info("RoundPipe: resuming %s; weights_from=%r is not read", ckpt_path, path)
        return None
    if not has_meta_tensors(module):
        raise WeightsError(
            f"weights_from={path!r} is set, but the module was built in memory, not on the meta device, so it would "
            "train from the weights it was built with: build it in configure_model() or under trainer.init_module() "
            "(without empty_init=False), or load the weights yourself and leave weights_from unset")
    return pretrained_source(module, path)


def report(initialised: list[str], source: object, log: logging.Logger) -> None:
    """After materializing from ``weights_from``: warn about the weights the files did not hold (their modules
    initialised them), and let go of the files."""
    if not isinstance(source, SafetensorsWeights):
        return
    if initialised:
        log.warning("RoundPipe: weights_from=%r holds no values for %d weights, which their modules initialised "
                    "instead: %s", str(source.path), len(initialised), ", ".join(initialised[:8]))
    source.close()

"""RoundPipe for PyTorch Lightning: train models larger than one GPU on a ring of stateless devices.

``Trainer(strategy="roundpipe")`` (or ``"roundpipe_async"``) trains an existing LightningModule with
:class:`RoundPipeStrategy`; :class:`RoundPipeEngine` is the plain-PyTorch engine underneath. Importing
the package registers the strategy names with Lightning (right away, or once Lightning is imported).

Names are imported on first use, so ``import lightning_roundpipe`` and the pure command-line tools
(``python -m lightning_roundpipe.schedule``) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_roundpipe import _autoload

_autoload.install()

_EXPORTS = {
    "EngineOptions": "config",
    "LayerCost": "partition",
    "PipelineError": "runtime",
    "Plan": "partition",
    "RoundPipeEngine": "runtime",
    "RoundPipeStrategy": "strategy",
    "pipeline_loss": "pipelined",
    "Trunk": "layers",
    "build_trunk": "layers",
    "is_recomputing": "recompute",
    "sample_count": "microbatch",
    "token_count": "microbatch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_roundpipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_roundpipe.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

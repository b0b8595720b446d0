"""RoundPipe for PyTorch Lightning: train models larger than one GPU on a ring of stateless devices.

The engine (this release): :class:`RoundPipeEngine` trains an ``nn.Sequential`` trunk whose state lives
on the host, cut into forward, fused and backward stages that rotate round-robin over the devices.

Names are imported on first use, so ``import lightning_roundpipe`` and the pure command-line tools
(``python -m lightning_roundpipe.schedule``) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineOptions": "config",
    "LayerCost": "partition",
    "PipelineError": "runtime",
    "Plan": "partition",
    "RoundPipeEngine": "runtime",
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

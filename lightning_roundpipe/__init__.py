"""RoundPipe for PyTorch Lightning: train models larger than one GPU on a ring of stateless devices.

``Trainer(strategy="roundpipe")`` (or ``"roundpipe_async"``) trains an existing LightningModule with
:class:`RoundPipeStrategy`; :class:`RoundPipeEngine` is the plain-PyTorch engine underneath. Importing
the package registers the strategy names with Lightning (right away, or once Lightning is imported).

The package in layers, each importing only the ones below it (``tests/test_imports.py`` checks this):

=================  ============================================================================
top level          the Lightning adapter: ``strategy``, its options, trunk discovery, precision
                   glue, checkpoint IO, the metrics callback, the pre-flight memory plan
``app``            the Hydra application (``roundpipe-train``); imports the adapter
``hf``             Hugging Face causal LMs: the preset and the chunked LM-head loss
``engine``         threads and devices: the engine, workers, stages, host optimizer; no Lightning
``observe``        timelines (recorded by the engine), Chrome traces and Gantt pictures
``planning``       pure standard-library code: partition, schedule, simulator, memory budget
=================  ============================================================================

Names are imported on first use, so ``import lightning_roundpipe`` and the pure command-line tools
(``python -m lightning_roundpipe.planning``) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_roundpipe import _autoload

_autoload.install()

_EXPORTS = {
    "EngineOptions": "engine.options",
    "LayerCost": "planning.partition",
    "NoGrad": "engine.transfer",
    "PipelineError": "engine.errors",
    "Plan": "planning.partition",
    "RoundPipeEngine": "engine.engine",
    "RoundPipeStrategy": "strategy",
    "StrategyOptions": "strategy_options",
    "pipeline_loss": "engine.pipelined",
    "Trunk": "engine.layers",
    "build_trunk": "engine.layers",
    "is_recomputing": "engine.recompute",
    "sample_count": "engine.microbatch",
    "token_count": "engine.microbatch",
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

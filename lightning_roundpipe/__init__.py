"""RoundPipe for PyTorch Lightning: train models larger than one GPU on a ring of stateless devices.

The engine (this release): :class:`RoundPipeEngine` trains an ``nn.Sequential`` trunk whose state lives
on the host, cut into forward, fused and backward stages that rotate round-robin over the devices.
"""

from lightning_roundpipe.config import EngineOptions
from lightning_roundpipe.layers import Trunk, build_trunk
from lightning_roundpipe.microbatch import sample_count, token_count
from lightning_roundpipe.partition import LayerCost, Plan
from lightning_roundpipe.recompute import is_recomputing
from lightning_roundpipe.runtime import PipelineError, RoundPipeEngine

__all__ = [
    "EngineOptions",
    "LayerCost",
    "PipelineError",
    "Plan",
    "RoundPipeEngine",
    "Trunk",
    "build_trunk",
    "is_recomputing",
    "sample_count",
    "token_count",
]

"""The optimizers the app's models offer (``model.optimizer``).

* ``adamw``: ``torch.optim.AdamW``, float32 moments (8 bytes of state per trained parameter);
* ``adamw8bit``: bitsandbytes' ``AdamW8bit`` (the ``low-bit`` extra), the same update with both moments kept
  blockwise in 8 bits (about 2 bytes per parameter; tensors under 4096 elements keep float32 moments). An
  ``nn.Embedding``'s weight keeps float32 moments, as Hugging Face's Trainer sets for its 8-bit optimizers. Its CPU
  step is bitsandbytes' own, so it runs on the host under RoundPipe and on a CPU run alike.

bitsandbytes finds such per-parameter settings in a process-wide manager, by parameter id: :func:`forget_settings`
takes them back when the run ends, so a later model in the same process (a multirun) never meets them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

OPTIMIZERS = ("adamw", "adamw8bit")


def _bitsandbytes() -> Any:
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError("model.optimizer=adamw8bit needs bitsandbytes: pip install 'lightning_roundpipe[low-bit]'"
                          ) from error
    return bitsandbytes


def build_optimizer(name: str, module: nn.Module, params: Iterable[nn.Parameter], lr: float,
                    weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer ``name`` (one of :data:`OPTIMIZERS`) over ``params`` of ``module``."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw8bit":
        bitsandbytes = _bitsandbytes()
        optimizer = bitsandbytes.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        for submodule in module.modules():
            if isinstance(submodule, nn.Embedding):
                manager.override_config(submodule.weight, "optim_bits", 32)
        return optimizer
    raise ValueError(f"`model.optimizer` must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


def forget_settings(name: str, module: nn.Module) -> None:
    """Take back the per-parameter settings :func:`build_optimizer` gave ``module``'s parameters."""
    if name != "adamw8bit":
        return
    manager = _bitsandbytes().optim.GlobalOptimManager.get_instance()
    for param in module.parameters():
        manager.pid2config.pop(id(param), None)

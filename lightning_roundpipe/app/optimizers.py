"""The optimizers the app's models offer (``model.optimizer``).

* ``adamw``: ``torch.optim.AdamW``, float32 moments (8 bytes of state per trained parameter);
* ``adamw8bit``: bitsandbytes' ``AdamW8bit`` (the ``low-bit`` extra), the same update with both moments kept
  blockwise in 8 bits (about 2 bytes per parameter; tensors under 4096 elements keep float32 moments). Its CPU
  step is bitsandbytes' own, so it runs on the host under RoundPipe and on a CPU run alike.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

OPTIMIZERS = ("adamw", "adamw8bit")


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float,
                    weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer ``name`` (one of :data:`OPTIMIZERS`) over ``params``."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw8bit":
        try:
            import bitsandbytes
        except ImportError as error:
            raise ImportError("model.optimizer=adamw8bit needs bitsandbytes: pip install 'lightning_roundpipe[low-bit]'"
                              ) from error
        return bitsandbytes.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"`model.optimizer` must be one of {', '.join(OPTIMIZERS)}, got {name!r}")

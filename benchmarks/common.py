"""What the CPU benchmarks share: quiet logs, so their tables stay readable."""

from __future__ import annotations

import logging
import warnings


def quiet() -> None:
    """Lightning's and our INFO logs off, and the warnings a short benchmark run always triggers."""
    for name in ("lightning", "lightning.pytorch", "lightning_roundpipe"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*validation_step.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")

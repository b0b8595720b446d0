"""``offload="optimizer+masters"`` before the engine starts: each layer's masters into the disk tier's files as soon as
the layer is whole, its transport copy made first.

Moved at start all at once, the masters (4 bytes per parameter) would be whole in memory beside the transport
copies the devices upload (2 bytes) for a moment: a setup peak of 6 bytes per parameter, above the 2-3 of the
steady state. Moved layer by layer, each right after its copy is made, the memory falls from the module as built
(4) to the copies (2) and never rises above where it started; a module built on the meta device and materialized
layer by layer (``materialize.py``, which calls :meth:`RoundPipeEngine.settle` per layer) never holds more than one
layer's masters. The copies made here are the ones :class:`~lightning_roundpipe.engine.transport.UploadSources` would
make at start (the same values: nothing writes the weights between), and it takes them over; the disk tier made
here is the one the started engine keeps. The same parameters move as at start (those that every layer reading them
uploads from a copy: :func:`~lightning_roundpipe.engine.transport.read_low_precision_only`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_roundpipe.engine.device import AbortSignal
from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.step.disk_tier import DiskTier
from lightning_roundpipe.engine.transport import read_low_precision_only


class MasterFiles:
    """The masters of ``trunk`` moved into files under ``directory`` before start (see the module docstring), with
    the ``transport`` copies made on the way."""

    def __init__(self, trunk: Trunk, transport: torch.dtype, directory: str, abort: AbortSignal) -> None:
        self._trunk = trunk
        self._transport = transport
        self._directory = directory
        self._abort = abort
        self.disk: DiskTier | None = None  #: the disk tier, once a master moved; the started engine keeps it
        self.copies: dict[int, torch.Tensor] = {}  #: by parameter id, the transport copies made, for UploadSources

    def move(self, layers: Sequence[int]) -> None:
        """Make the transport copies of ``layers``' movable parameters and move their masters into files (a
        parameter still on the meta device, or moved already, is left)."""
        # found anew each time (a cheap look at module types): materializing gives layers new parameter objects
        movable = {id(param) for param in read_low_precision_only(self._trunk, self._transport)}
        params = list({id(param): param for layer in layers for param in self._trunk.states[layer].params
                       if id(param) in movable and id(param) not in self.copies and not param.is_meta}.values())
        if not params:
            return
        with torch.no_grad():
            for param in params:
                self.copies[id(param)] = param.detach().to(self._transport, copy=True)
        if self.disk is None:
            self.disk = DiskTier(self._directory, self._abort)
        self.disk.adopt_masters(params)
        for layer in self._trunk.changed_layers():  # the same values in other memory
            self._trunk.recollect(layer)

    def written_bytes(self) -> int:
        """The bytes of the files made so far (``offload_dir``'s free space has them already)."""
        return self.disk.master_bytes() if self.disk is not None else 0

    def hand_over(self) -> None:
        """The engine started with :attr:`disk` and :attr:`copies`: this object lets go of both."""
        self.disk, self.copies = None, {}

    def close(self, deadline: float) -> str | None:
        """A start that never came: end the disk tier's I/O thread (the masters stay in their files, which go with
        the last tensor in them). Returns the thread's name if it still runs at ``deadline``."""
        disk, self.disk = self.disk, None
        self.copies = {}
        return disk.close(deadline) if disk is not None else None

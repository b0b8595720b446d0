"""``StreamingCheckpointIO``: the strategy's default way of writing checkpoints, atomic and streamed.

Lightning's ``TorchCheckpointIO`` serializes the whole checkpoint into memory before writing it: a
second, then a third copy of a host-sized training state, on the host that RoundPipe already fills.
Here ``torch.save`` streams into a temporary file beside the target, which is synced to disk and then
renamed over the target. A crash mid-write leaves the previous checkpoint intact, and an exception
removes the temporary file. A local checkpoint is loaded memory-mapped (``torch.load(mmap=True)``): its
tensors are read from the file's pages as they are used instead of into fresh memory, so resuming does not
hold a second copy of the training state (with a sharded optimizer, a process never touches the state other
processes own). Remote paths (``s3://...``) and ``storage_options`` go to the parent's implementation.
:class:`~lightning_roundpipe.strategy.RoundPipeStrategy` installs this plugin only when the user gave none,
in the strategy or as a Trainer plugin.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override


class StreamingCheckpointIO(TorchCheckpointIO):
    """Writes local checkpoints atomically and without an in-memory copy; loads them memory-mapped."""

    @override
    def load_checkpoint(self, path: _PATH, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        target = os.fspath(path)
        if "://" in target or not os.path.isfile(target):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        try:
            return torch.load(target, map_location=map_location, weights_only=weights_only, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):  # only a file torch.save wrote in its legacy format cannot be mapped
                raise
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        target = os.fspath(path)
        if storage_options is not None or "://" in target:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        directory = os.path.dirname(os.path.abspath(target))
        os.makedirs(directory, exist_ok=True)
        temporary = os.path.join(directory, f".roundpipe-{os.getpid()}-{secrets.token_hex(6)}.ckpt.tmp")
        # "x": a new file, never someone else's; its mode is open()'s (0o666 less the umask), which a
        # checkpoint should keep (tempfile.mkstemp would make it owner-only)
        file = open(temporary, "xb")
        try:
            with file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())  # on disk before it replaces the previous checkpoint
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(temporary)
            raise
        _fsync_directory(directory)  # the rename itself survives a power loss


def _fsync_directory(directory: str) -> None:
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass  # some file systems cannot sync a directory; the file itself is synced
    finally:
        os.close(handle)

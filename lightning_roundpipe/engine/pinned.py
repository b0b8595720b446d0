"""Host tensors pinned in place, so host-to-GPU copies of them run at full speed without a staging copy.

``tensor.pin_memory()`` copies into torch's caching host allocator, which rounds every block up to a
power of two: pinning a model that way can nearly double its host memory. Registering the existing
storage with CUDA (``cudaHostRegister``) pins it where it is, at its exact size. When the system refuses
(a locked-memory limit, no CUDA), the tensors stay pageable and the engine warns once: uploads then go
through a staging copy, slower but correct.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch


class PinnedStorages:
    """Registers the storages of host tensors with CUDA; :meth:`release` unregisters them."""

    def __init__(self) -> None:
        self._registered: set[int] = set()  # data pointers of the registered storages
        self.refused: str | None = None

    def pin(self, tensors: Iterable[torch.Tensor]) -> None:
        cudart = torch.cuda.cudart()
        for tensor in tensors:
            storage = tensor.untyped_storage()
            pointer, nbytes = storage.data_ptr(), storage.nbytes()
            if tensor.device.type != "cpu" or nbytes == 0 or pointer in self._registered or tensor.is_pinned():
                continue
            status = cudart.cudaHostRegister(pointer, nbytes, 0)
            if int(status) != 0:
                self.refused = (f"cudaHostRegister refused {nbytes} bytes (error {int(status)}; a locked-memory "
                                "limit? see `ulimit -l`)")
                warnings.warn(
                    f"RoundPipe could not pin host memory: {self.refused}. Uploads use pageable memory, which is "
                    "slower; raise the limit or pass pin_memory=False to silence this.", stacklevel=3)
                return
            self._registered.add(pointer)

    def release(self) -> None:
        if not self._registered:
            return
        cudart = torch.cuda.cudart()
        for pointer in self._registered:
            cudart.cudaHostUnregister(pointer)
        self._registered.clear()

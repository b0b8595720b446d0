"""Host tensors pinned in place, so host-to-GPU copies of them run at full speed without a staging copy.

``tensor.pin_memory()`` copies into torch's caching host allocator, which rounds every block up to a
power of two: pinning a model that way can nearly double its host memory. Registering the existing
storage with CUDA (``cudaHostRegister``, portable to every device's context) pins it where it is, at its
exact size. When the driver refuses (no CUDA, a sandbox without page pinning, a range someone else
registered), the tensors stay pageable and the engine warns once: uploads then go through a staging copy,
slower but correct.

The calls run on a short-lived helper thread. torch's binding does not clear a failed call's error, and
the CUDA runtime keeps it in the calling thread's last-error slot, where the next kernel launched on that
thread would raise it as an unrelated "CUDA error". On the helper thread it ends with the thread.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the current one


def _on_helper_thread(work: Callable[[], T]) -> T:
    """``work()`` on a fresh thread (on the caller's CUDA device), returning its result or raising its error."""
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            outcome["result"] = work()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread below
            outcome["error"] = error

    thread = threading.Thread(target=run, name="roundpipe-pin", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def cuda_error_text(cudart: Any, status: Any) -> str:
    """``"<name> (error <code>)"`` from the runtime's own description when the binding has it."""
    describe = getattr(cudart, "cudaGetErrorString", None)
    text = ""
    if describe is not None:
        try:
            text = str(describe(status))
        except (TypeError, RuntimeError, ValueError):  # an older binding that wants another argument type
            text = ""
    return f"{text} (error {int(status)})" if text else f"error {int(status)}"


class PinnedStorages:
    """Registers the storages of host tensors with CUDA; :meth:`release` unregisters them.

    A registered storage is kept alive until it is unregistered (:meth:`keep_only`, :meth:`release`): a
    module may drop a tensor the engine pinned (a callback assigns a new buffer, ``param.data = ...``), and
    memory freed while registered could be handed out again, still registered, or unmapped under the
    driver's registration."""

    def __init__(self) -> None:
        # data pointer -> the registered storage, held so that its memory stays allocated while registered
        self._registered: dict[int, torch.UntypedStorage] = {}
        self.refused: str | None = None

    def pin(self, tensors: Iterable[torch.Tensor]) -> None:
        todo: dict[int, torch.UntypedStorage] = {}  # pointer -> storage, each storage once
        for tensor in tensors:
            storage = tensor.untyped_storage()
            pointer, nbytes = storage.data_ptr(), storage.nbytes()
            if tensor.device.type != "cpu" or nbytes == 0 or pointer in self._registered or tensor.is_pinned():
                continue
            todo.setdefault(pointer, storage)
        if not todo:
            return

        def register() -> str | None:
            cudart = torch.cuda.cudart()
            for pointer, storage in todo.items():
                nbytes = storage.nbytes()
                status = cudart.cudaHostRegister(pointer, nbytes, HOST_REGISTER_PORTABLE)
                if int(status) != 0:
                    return f"cudaHostRegister refused {nbytes} bytes: {cuda_error_text(cudart, status)}"
                self._registered[pointer] = storage
            return None

        refused = _on_helper_thread(register)
        if refused is not None:
            self.refused = refused
            warnings.warn(
                f"RoundPipe could not pin host memory ({refused}). Uploads use pageable memory, which is slower; "
                "pass pin_memory=False to silence this.", stacklevel=3)

    def keep_only(self, tensors: Iterable[torch.Tensor]) -> None:
        """Unregister the storages that none of ``tensors`` uses any more (then they may be freed)."""
        wanted = {tensor.untyped_storage().data_ptr() for tensor in tensors if tensor.device.type == "cpu"}
        self._unregister([pointer for pointer in self._registered if pointer not in wanted])

    def release(self) -> None:
        self._unregister(list(self._registered))

    def _unregister(self, pointers: list[int]) -> None:
        if not pointers:
            return

        def unregister() -> None:
            cudart = torch.cuda.cudart()
            for pointer in pointers:
                cudart.cudaHostUnregister(pointer)

        try:
            _on_helper_thread(unregister)
        finally:  # the storages go only now, after their registration
            for pointer in pointers:
                self._registered.pop(pointer, None)

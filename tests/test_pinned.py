"""Pinning host weights in place (``engine/pinned.py``) without a GPU: a fake CUDA runtime stands in for torch's
binding, so the calls' thread, flags and the refusal message are checked on CPU."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_roundpipe.engine import pinned
from lightning_roundpipe.engine.pinned import PinnedStorages


class FakeCudart:
    """Records each call's thread; refuses registrations after ``accept`` of them with error 712."""

    def __init__(self, accept: int = 0) -> None:
        self.accept = accept
        self.calls: list[tuple[str, int, int | None, threading.Thread]] = []

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", pointer, flags, threading.current_thread()))
        if self.accept == 0:
            return 712
        self.accept -= 1
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:  # noqa: N802
        self.calls.append(("unregister", pointer, None, threading.current_thread()))
        return 0

    def cudaGetErrorString(self, status: int) -> str:  # noqa: N802
        return {712: "part or all of the requested memory range is already mapped"}[int(status)]


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_a_refused_registration_runs_off_the_main_thread_and_names_the_cuda_error(cudart):
    storages = PinnedStorages()
    with pytest.warns(UserWarning, match=r"could not pin host memory") as caught:
        storages.pin([torch.zeros(64)])
    message = str(caught[0].message)
    assert "already mapped (error 712)" in message and "pin_memory=False" in message
    assert "ulimit" not in message
    assert storages.refused is not None and "256 bytes" in storages.refused
    assert [(kind, flags) for kind, _, flags, _ in cudart.calls] == [("register", pinned.HOST_REGISTER_PORTABLE)]
    # the failed call's sticky last-error belongs to that thread, which is gone
    thread = cudart.calls[0][3]
    assert thread is not threading.main_thread() and not thread.is_alive()


def test_registered_storages_are_unregistered_once_each_off_the_main_thread(cudart):
    cudart.accept = 10
    weight = torch.zeros(4, 4)
    storages = PinnedStorages()
    storages.pin([weight, weight[1], torch.ones(3), torch.empty(0)])  # a view shares its storage; empty is skipped
    assert storages.refused is None
    registered = sorted(pointer for kind, pointer, _, _ in cudart.calls if kind == "register")
    assert len(registered) == 2 and weight.untyped_storage().data_ptr() in registered
    storages.release()
    storages.release()  # twice is harmless
    unregistered = sorted(pointer for kind, pointer, _, _ in cudart.calls if kind == "unregister")
    assert unregistered == registered
    assert all(thread is not threading.main_thread() for *_, thread in cudart.calls)


def test_an_error_inside_the_helper_thread_reaches_the_caller(monkeypatch):
    def broken():
        raise RuntimeError("no CUDA runtime")

    monkeypatch.setattr(torch.cuda, "cudart", broken)
    with pytest.raises(RuntimeError, match="no CUDA runtime"):
        PinnedStorages().pin([torch.zeros(2)])

"""Pinning host weights in place (``engine/pinned.py``) without a GPU: a fake CUDA runtime stands in for torch's
binding, so the calls' thread, flags and the refusal message are checked on CPU."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from lightning_roundpipe.engine import pinned
from lightning_roundpipe.engine.pinned import PAGE_BYTES as PAGE
from lightning_roundpipe.engine.pinned import PinnedStorages


class FakeCudart:
    """Records each call's thread; refuses registrations after ``accept`` of them, and those starting at an
    address of ``refuse``, with error 712. Like the driver, it refuses a range that shares a page with one
    registered (``registered``: start -> bytes)."""

    def __init__(self, accept: int = 0) -> None:
        self.accept = accept
        self.refuse: set[int] = set()
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int, int | None, threading.Thread]] = []

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", pointer, flags, threading.current_thread()))
        first, last = pointer // PAGE, (pointer + nbytes - 1) // PAGE
        if any(first <= (start + size - 1) // PAGE and start // PAGE <= last
               for start, size in self.registered.items()):
            return 712
        if self.accept == 0 or pointer in self.refuse:
            return 712
        self.accept -= 1
        self.registered[pointer] = nbytes
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:  # noqa: N802
        self.calls.append(("unregister", pointer, None, threading.current_thread()))
        return 0 if self.registered.pop(pointer, None) is not None else 713  # cudaErrorHostMemoryNotRegistered

    def kinds(self) -> list[tuple[str, int]]:
        return [(kind, pointer) for kind, pointer, _, _ in self.calls]

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
    pages = Pages(4)
    weight, other = pages.tensor(0, 64), pages.tensor(2 * PAGE + 8, 12)
    storages = PinnedStorages()
    storages.pin([weight, weight[1], other, torch.empty(0)])  # a view shares its storage; empty is skipped
    assert storages.refused is None
    assert sorted(cudart.kinds()) == [("register", pages.at(0)), ("register", pages.at(2 * PAGE))]
    assert cudart.registered == {pages.at(0): PAGE, pages.at(2 * PAGE): PAGE}  # whole pages
    storages.release()
    storages.release()  # twice is harmless
    assert sorted(pointer for kind, pointer in cudart.kinds() if kind == "unregister") == [
        pages.at(0), pages.at(2 * PAGE)]
    assert cudart.registered == {}
    assert all(thread is not threading.main_thread() for *_, thread in cudart.calls)


class Pages:
    """``count`` pages of host memory, page-aligned, on which tests place tensors of their own storages at chosen
    offsets (as the heap places small tensors: several on one page, one across two)."""

    def __init__(self, count: int) -> None:
        self._buffer = bytearray((count + 1) * PAGE)
        address = ctypes.addressof((ctypes.c_char * len(self._buffer)).from_buffer(self._buffer))
        self._skip = -address % PAGE
        self.base = address + self._skip

    def at(self, offset: int) -> int:
        return self.base + offset

    def tensor(self, offset: int, floats: int) -> torch.Tensor:
        """A float32 tensor of ``floats`` elements at ``offset`` bytes from the first page, its own storage."""
        tensor = torch.frombuffer(self._buffer, dtype=torch.float32, count=floats, offset=self._skip + offset)
        assert tensor.untyped_storage().data_ptr() == self.at(offset)
        return tensor


def test_a_refused_range_leaves_only_its_storages_pageable_and_says_how_much(cudart):
    """The driver refuses one range (the second of three): the other two are registered all the same, and the
    warning and the figures say what stayed pageable (bytes and storages), not just the first error."""
    cudart.accept = 10
    pages = Pages(6)
    first, refused, last = pages.tensor(0, 100), pages.tensor(2 * PAGE, 300), pages.tensor(4 * PAGE + 16, 50)
    cudart.refuse = {pages.at(2 * PAGE)}
    storages = PinnedStorages()
    with pytest.warns(UserWarning, match=r"could not pin host memory") as caught:
        storages.pin([first, refused, last])
    assert sorted(cudart.registered) == [pages.at(0), pages.at(4 * PAGE)]
    assert (storages.pageable_bytes, storages.pageable_storages) == (1200, 1)
    assert "1 range(s): 1200 bytes of 1 tensor storage(s) stay pageable" in str(caught[0].message)
    assert "already mapped (error 712)" in storages.refused
    storages.keep_only([first, last])  # the refused tensor is dropped: nothing of what is used stays pageable
    assert (storages.pageable_bytes, storages.pageable_storages) == (0, 0)
    storages.release()
    assert cudart.registered == {}


def test_small_tensors_sharing_a_page_are_registered_once_and_unregistered_with_the_last(cudart):
    """Two small tensors on one page (norm weights, biases): one registration of that page; it stays while
    either is used, and goes with the last. The driver (like the fake) refuses a second registration of a
    page, which is what would have left the second tensor pageable."""
    cudart.accept = 10
    pages = Pages(2)
    norm, bias = pages.tensor(0, 64), pages.tensor(1024, 64)
    storages = PinnedStorages()
    storages.pin([norm, bias])
    assert storages.refused is None and cudart.kinds() == [("register", pages.at(0))]
    storages.keep_only([bias])  # the norm's storage is dropped: the page stays, for the bias
    assert cudart.kinds() == [("register", pages.at(0))] and cudart.registered == {pages.at(0): PAGE}
    storages.keep_only([])
    assert cudart.kinds() == [("register", pages.at(0)), ("unregister", pages.at(0))]
    assert cudart.registered == {}


def test_a_tensor_across_a_registered_page_joins_its_range(cudart):
    """Pinned later (a buffer the module was given anew), a tensor that shares a page with a registered range
    and extends past it: the range is registered again over both, once; a tensor inside it costs no call."""
    cudart.accept = 10
    pages = Pages(4)
    bias = pages.tensor(0, 64)
    storages = PinnedStorages()
    storages.pin([bias])
    inside, across = pages.tensor(512, 8), pages.tensor(PAGE - 128, 64)  # 128 bytes on page 0, the rest on page 1
    storages.pin([inside])
    assert cudart.kinds() == [("register", pages.at(0))]
    storages.pin([across])
    assert cudart.kinds()[1:] == [("unregister", pages.at(0)), ("register", pages.at(0))]
    assert cudart.registered == {pages.at(0): 2 * PAGE} and storages.registered_ranges == 1
    storages.keep_only([across, bias])  # the range is what these two touch: nothing to do
    assert len(cudart.calls) == 3
    storages.keep_only([bias])  # only page 0 is used now: registered again over it
    assert cudart.kinds()[3:] == [("unregister", pages.at(0)), ("register", pages.at(0))]
    assert cudart.registered == {pages.at(0): PAGE}
    storages.release()
    assert cudart.registered == {}


def test_an_error_inside_the_helper_thread_reaches_the_caller(monkeypatch):
    def broken():
        raise RuntimeError("no CUDA runtime")

    monkeypatch.setattr(torch.cuda, "cudart", broken)
    with pytest.raises(RuntimeError, match="no CUDA runtime"):
        PinnedStorages().pin([torch.zeros(2)])

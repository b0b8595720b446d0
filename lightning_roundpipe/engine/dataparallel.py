"""Data parallel over rings: one engine per process, gradients averaged across processes before each step.

Every process runs its own ring on its own share of the data; the host gradients of a step are averaged over
the processes (``torch.distributed``, gloo on host tensors) before the optimizer sees them, so every process
takes the same step from the same weights, as ``DistributedDataParallel`` does. The strategy creates the
process groups (Lightning's launchers and cluster environments start the processes); this module only uses
them:

* ``gradients``: the group the averaging runs on, created for it alone, so that it never interleaves with
  the collectives Lightning runs on the default group (``sync_dist`` logging, checkpoint broadcasts);
* ``control``: the group small agreements run on from the caller's thread (the plan every ring uses), in the
  order the caller reaches them, which is the same on every process.

Averaging (:meth:`DataParallel.average_gradients`): the parameters are taken in a fixed order (the
optimizer's), packed into flat buckets of at most ``bucket_bytes`` per dtype, summed with ``all_reduce`` and
divided by the world size. A parameter no process has a gradient for keeps ``grad=None`` (so weight decay and
momentum leave it alone, as in plain training); one that only some processes have a gradient for counts zero
on the others. Which is which travels first, as one small ``all_reduce`` (MAX) of a mask. The averaged
gradients are new tensors: a gradient a queued step still reads is never changed in place. Every wait is
bounded by ``timeout`` seconds and names the collective, so a lost process makes the others fail, not hang.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BUCKET_BYTES = 64 * 2**20
"""Largest flat buffer one ``all_reduce`` sums: gloo reaches its bandwidth from about 16 MiB and holds a
copy of the bucket while it works (``benchmarks/scaleout.py`` measures it)."""


class DataParallelError(RuntimeError):
    """A collective across the data-parallel processes failed or timed out (a process was lost or stopped)."""


@dataclass
class DataParallel:
    """The processes training one model together and the groups the engine talks to them on."""

    world_size: int
    rank: int
    gradients: Any = None    #: process group of the gradient averaging (``None``: the default group)
    control: Any = None      #: process group of agreements from the caller's thread (``None``: the default group)
    timeout: float = 600.0   #: seconds any collective may take before the run fails
    bucket_bytes: int = BUCKET_BYTES

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank {self.rank} of {self.world_size}")
        if self.timeout <= 0 or self.bucket_bytes < 1:
            raise ValueError(f"need timeout > 0 and bucket_bytes >= 1, got {self.timeout}, {self.bucket_bytes}")

    def _wait(self, work: Any, what: str) -> None:
        try:
            completed = work.wait(timedelta(seconds=self.timeout))
        except Exception as error:  # gloo raises when a peer's connection closes
            raise DataParallelError(
                f"process {self.rank} of {self.world_size}: {what} failed: {type(error).__name__}: {error}. "
                "Another training process stopped or was lost; its own error says why") from error
        if completed is False:
            raise DataParallelError(
                f"process {self.rank} of {self.world_size}: {what} did not complete in {self.timeout:.0f} s "
                "(wait_timeout): another training process stopped or is stuck")

    def _all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> None:
        self._wait(dist.all_reduce(tensor, op=op, group=self.gradients, async_op=True), what)

    def average_gradients(self, params: Sequence[nn.Parameter]) -> None:
        """Replace each ``param.grad`` by the mean over the processes (see the module docstring). Every process
        must call it with the same parameters in the same order, for every optimizer step."""
        if self.world_size == 1:
            return
        touched = torch.tensor([param.grad is not None for param in params], dtype=torch.uint8)
        self._all_reduce(touched, dist.ReduceOp.MAX, "agreeing which parameters have gradients")
        reduced = [param for param, flag in zip(params, touched.tolist(), strict=True) if flag]
        for bucket in _buckets(reduced, self.bucket_bytes):
            flat = torch.cat([_flat_grad(param) for param in bucket])
            self._all_reduce(flat, dist.ReduceOp.SUM, f"averaging a gradient bucket of {flat.numel():,} elements")
            flat.div_(self.world_size)
            offset = 0
            for param in bucket:
                param.grad = flat[offset:offset + param.numel()].view_as(param)
                offset += param.numel()

    def agree(self, value: Any) -> Any:
        """Process 0's ``value`` on every process (a plan, say): call it on the caller's thread, at the same
        point on every process."""
        if self.world_size == 1:
            return value
        holder = [value]
        try:
            dist.broadcast_object_list(holder, src=dist.get_global_rank(self.control, 0)
                                       if self.control is not None else 0, group=self.control)
        except Exception as error:
            raise DataParallelError(
                f"process {self.rank} of {self.world_size}: agreeing on {type(value).__name__} failed: "
                f"{type(error).__name__}: {error}") from error
        return holder[0]


def _flat_grad(param: nn.Parameter) -> torch.Tensor:
    """The parameter's gradient as a flat tensor in its own dtype, zeros where this process has none."""
    grad = param.grad
    if grad is None:
        return torch.zeros(param.numel(), dtype=param.dtype)
    return grad.detach().reshape(-1).to(param.dtype)


def _buckets(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive runs of ``params`` of one dtype and at most ``bucket_bytes`` (a larger parameter alone)."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if not buckets or buckets[-1][0].dtype != param.dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(param)
        size += nbytes
    return buckets

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

Averaging (:class:`Averaging`): the engine sends each step group's gradients as soon as they are final,
deepest first, so the communication overlaps the backward stages still running; the parameters of a part are
packed into flat buckets of at most ``bucket_bytes`` per dtype, summed with ``all_reduce`` and divided by the
world size. A parameter no process has a gradient for keeps ``grad=None`` (so weight decay and momentum leave
it alone, as in plain training); one that only some processes have a gradient for counts zero on the others.
Which is which travels in each bucket, one flag per parameter after its gradients. The averaged gradients are new
tensors: a gradient a queued step still reads is never changed in place. Every wait is bounded by ``timeout``
seconds and names the collective, so a lost process makes the others fail, not hang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
    #: the dtype gradients travel and are summed in (``torch.bfloat16`` halves the traffic of float32 ones, at
    #: bfloat16's precision for the sum); ``None``: each parameter's own
    reduce_dtype: torch.dtype | None = None
    sent_bytes: int = field(default=0, init=False)  #: gradient bytes this process has sent to be summed so far

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank {self.rank} of {self.world_size}")
        if self.timeout <= 0 or self.bucket_bytes < 1:
            raise ValueError(f"need timeout > 0 and bucket_bytes >= 1, got {self.timeout}, {self.bucket_bytes}")

    def _peers(self) -> str:
        """The other processes, for messages: ``"process 1"`` with two, else ``"one of processes 0, 2, 3"``."""
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        return f"process {others[0]}" if len(others) == 1 else f"one of processes {', '.join(map(str, others))}"

    def _wait(self, work: Any, what: str) -> None:
        try:
            completed = work.wait(timedelta(seconds=self.timeout))
        except Exception as error:  # gloo raises when a peer's connection closes
            raise DataParallelError(
                f"process {self.rank} of {self.world_size}: {what} failed, so {self._peers()} stopped or was "
                f"lost (another training process; its own error says why): {type(error).__name__}: {error}"
            ) from error
        if completed is False:
            raise DataParallelError(
                f"process {self.rank} of {self.world_size}: {what} did not complete in {self.timeout:.0f} s "
                f"(wait_timeout): {self._peers()} stopped or is stuck (another training process)")

    def _all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> None:
        self._wait(dist.all_reduce(tensor, op=op, group=self.gradients, async_op=True), what)

    def average_gradients(self, params: Sequence[nn.Parameter]) -> None:
        """Replace each ``param.grad`` by the mean over the processes (see the module docstring), all at once.
        Every process must call it with the same parameters in the same order, for every optimizer step."""
        if self.world_size > 1:
            self.start(params).finish()

    def start(self, params: Sequence[nn.Parameter]) -> Averaging:
        """Begin averaging the gradients of ``params`` (those that require gradients, in this order; the same
        on every process): :meth:`Averaging.send` parts whose gradients are final while the rest of the
        backward runs, then :meth:`Averaging.finish`."""
        return Averaging(self, [param for param in params if param.requires_grad])

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


class Averaging:
    """One step's gradient averaging in flight (:meth:`DataParallel.start`).

    :meth:`send` packs the given parameters' gradients (zeros where this process has none) into buckets, each
    followed by one flag per parameter (1 where this process has a gradient), and starts their ``all_reduce``
    without waiting, so the communication runs while later backward stages still compute; :meth:`receive`
    waits for what was sent and returns the means (none for a parameter whose flags sum to 0: no process had a
    gradient, and plain training leaves it alone). The collectives are issued in the order of the calls, which
    every process makes alike, from one thread at a time. :meth:`finish` is the caller's-thread form: send
    what is left, receive everything and put the means in ``param.grad``."""

    def __init__(self, data_parallel: DataParallel, params: Sequence[nn.Parameter]) -> None:
        self._data_parallel = data_parallel
        self._params = list(params)
        self._known = {id(param) for param in self._params}
        self._sent: set[int] = set()
        self._in_flight: dict[int, tuple[Any, torch.Tensor, list[nn.Parameter]]] = {}  # by parameter id

    def send(self, params: Sequence[nn.Parameter], grads: Mapping[int, torch.Tensor] | None = None) -> None:
        """Start averaging ``params`` (those given to :meth:`DataParallel.start`, in a fixed order), whose final
        gradients are ``grads[id(param)]`` (``None``: ``param.grad``, on the caller's thread), left untouched
        until :meth:`receive`."""
        chosen = [param for param in params if id(param) in self._known and id(param) not in self._sent]
        self._sent.update(id(param) for param in chosen)
        data_parallel = self._data_parallel
        for bucket in _buckets(chosen, data_parallel.bucket_bytes):
            held = [param.grad if grads is None else grads.get(id(param)) for param in bucket]
            dtype = data_parallel.reduce_dtype or bucket[0].dtype
            pieces = [torch.zeros(param.numel(), dtype=dtype) if grad is None else grad.detach().reshape(-1).to(dtype)
                      for param, grad in zip(bucket, held, strict=True)]
            flags = torch.tensor([grad is not None for grad in held], dtype=dtype)
            flat = torch.cat([*pieces, flags])
            work = None
            if data_parallel.world_size > 1:
                work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=data_parallel.gradients, async_op=True)
                data_parallel.sent_bytes += flat.numel() * flat.element_size()
            for param in bucket:
                self._in_flight[id(param)] = (work, flat, bucket)

    def receive(self, params: Sequence[nn.Parameter]) -> dict[int, torch.Tensor]:
        """Wait for the buckets holding ``params`` (all sent) and return their means by parameter id, leaving
        out the parameters no process had a gradient for. The means are new tensors."""
        means: dict[int, torch.Tensor] = {}
        data_parallel = self._data_parallel
        for param in params:
            entry = self._in_flight.get(id(param))
            if entry is None:
                continue
            work, flat, bucket = entry
            if work is not None:
                data_parallel._wait(work, f"averaging a gradient bucket of {flat.numel() - len(bucket):,} elements")
            values = flat[:-len(bucket)].to(bucket[0].dtype)  # a bucket's parameters share a dtype
            if data_parallel.world_size > 1:
                values = values.div_(data_parallel.world_size)
            offset = 0
            for member, flag in zip(bucket, flat[-len(bucket):].tolist(), strict=True):
                if flag > 0:
                    means[id(member)] = values[offset:offset + member.numel()].view_as(member)
                offset += member.numel()
                self._in_flight.pop(id(member), None)
        return means

    def finish(self) -> None:
        """On the caller's thread: send the parameters not sent yet, then put each mean in ``param.grad``
        (``None`` where no process had a gradient)."""
        self.send([param for param in self._params if id(param) not in self._sent])
        pending = [param for param in self._params if id(param) in self._in_flight]
        means = self.receive(pending)
        for param in pending:
            param.grad = means.get(id(param))


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

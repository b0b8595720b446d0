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
deepest first, so the communication overlaps the backward stages still running. It has two drivers, one per
thread a step's gradients can be final on: ``StepQueue.average`` (``step/caller.py``) on the caller's thread, when
a hook must see the averaged gradients in ``param.grad`` before the step, and ``QueuedStep`` (``step/queued.py``)
on the optimizer thread otherwise, each group averaged just before it steps. The parameters of a part are
packed into flat buckets of at most ``bucket_bytes`` per dtype, summed with ``all_reduce`` and divided by the
world size. A parameter no process has a gradient for keeps ``grad=None`` (so weight decay and momentum leave
it alone, as in plain training); one that only some processes have a gradient for counts zero on the others.
Which is which travels in each bucket, one flag per parameter after its gradients. The averaged gradients are new
tensors: a gradient a queued step still reads is never changed in place. Every wait is bounded by ``timeout``
seconds and names the collective, so a lost process makes the others fail, not hang.

Sharded optimizer (``shard_optimizer``, ZeRO-1): each parameter is *owned* by one process (whole parameters,
the largest first to the process owning the fewest elements so far, as ``ZeroRedundancyOptimizer`` assigns
them; the same on every process, whatever the plan), which alone keeps its optimizer state and steps it; the
owners then broadcast the updated weights (:meth:`DataParallel.start_broadcast`, on the ``weights`` group).
The gradients are still averaged whole on every process, so clipping, hooks and logging see the full mean.
A checkpoint gathers the state on process 0 (:meth:`DataParallel.gather_optimizer_state`); a process that
loads one keeps only what it owns (:meth:`DataParallel.drop_unowned_state`), so any world size resumes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from lightning_roundpipe.engine.errors import DataParallelError

BUCKET_BYTES = 64 * 2**20
"""Largest flat buffer one ``all_reduce`` sums: gloo reaches its bandwidth from about 16 MiB and holds a
copy of the bucket while it works (``benchmarks/scaleout.py`` measures it)."""


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
    #: each process keeps the optimizer state of the parameters it owns only and broadcasts them once stepped
    shard_optimizer: bool = False
    weights: Any = None      #: process group of those broadcasts, from the optimizer thread (``None``: default)
    sent_bytes: int = field(default=0, init=False)  #: gradient bytes this process has sent to be summed so far
    broadcast_bytes: int = field(default=0, init=False)  #: sharded: bytes of updated weights this process sent
    _owners_cache: tuple[tuple[int, ...], dict[int, int]] | None = field(default=None, init=False, repr=False)

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

    def start(self, params: Sequence[nn.Parameter]) -> Averaging:
        """Begin averaging the gradients of ``params`` (those that require gradients, in this order; the same
        on every process): :meth:`Averaging.send` parts whose gradients are final while the rest of the
        backward runs, then :meth:`Averaging.finish`."""
        return Averaging(self, [param for param in params if param.requires_grad])

    @property
    def averaging(self) -> bool:
        """Whether a step's gradients are averaged over several processes (``DataParallel(1, 0)``, one process
        alone, is the identity: the engine's default)."""
        return self.world_size > 1

    @property
    def sharded(self) -> bool:
        """Whether the optimizer state is split over several processes."""
        return self.shard_optimizer and self.averaging

    def owners(self, params: Sequence[nn.Parameter]) -> dict[int, int]:
        """The process owning each of ``params`` (an optimizer's, in its order), by parameter id: the largest
        first (ties in order) to the process owning the fewest elements so far (the lowest rank among equals).
        Depends only on the parameters' order and sizes, so every process computes the same."""
        key = tuple(id(param) for param in params)
        if self._owners_cache is not None and self._owners_cache[0] == key:
            return self._owners_cache[1]
        loads = [0] * self.world_size
        owners: dict[int, int] = {}
        for param in sorted(params, key=lambda param: -param.numel()):  # sorted() is stable
            if id(param) in owners:
                continue
            rank = min(range(self.world_size), key=lambda rank: loads[rank])
            owners[id(param)] = rank
            loads[rank] += param.numel()
        self._owners_cache = (key, owners)
        return owners

    def owned(self, params: Sequence[nn.Parameter]) -> set[int]:
        """The ids of ``params`` this process steps: those it owns when sharded, else all."""
        if not self.sharded:
            return {id(param) for param in params}
        return {key for key, rank in self.owners(params).items() if rank == self.rank}

    def start_broadcast(self, params: Sequence[nn.Parameter], owners: Mapping[int, int]) -> Broadcast:
        """Begin copying each of ``params`` (the same list on every process) from its owner to the other
        processes, once the owners have stepped them: per owner, flat buckets of one dtype broadcast on the
        ``weights`` group, without waiting; :meth:`Broadcast.finish` waits and writes the others' weights. Call
        it from one thread, in the same order on every process."""
        pending = []
        if self.sharded:
            for owner in range(self.world_size):
                mine = owner == self.rank
                for bucket in _buckets([param for param in params if owners[id(param)] == owner], self.bucket_bytes):
                    flat = (torch.cat([param.detach().reshape(-1) for param in bucket]) if mine
                            else torch.empty(sum(param.numel() for param in bucket), dtype=bucket[0].dtype))
                    work = dist.broadcast(flat, src=_global_rank(self.weights, owner), group=self.weights,
                                          async_op=True)
                    pending.append((work, flat, bucket if not mine else []))
                    self.broadcast_bytes += flat.nbytes if mine else 0
        return Broadcast(self, pending)

    def drop_unowned_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget the optimizer state of the parameters other processes own (after loading a full checkpoint)."""
        if not self.sharded:
            return
        params = [param for group in optimizer.param_groups for param in group["params"]]
        owned = self.owned(params)
        for param in params:
            if id(param) not in owned:
                optimizer.state.pop(param, None)

    def gather_optimizer_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``optimizer.state_dict()`` of every process merged (each holds the state of what it owns): the full
        state on process 0, this process's own elsewhere. On the caller's thread, on every process alike.

        The layout (which entries, their shapes and dtypes, and the plain values) travels as one small object;
        then each tensor on its own, point to point to process 0, which so holds the state once plus one tensor
        in transit, never a pickled copy of it all."""
        if not self.sharded:
            return state_dict
        mine: dict[int, dict[str, Any]] = state_dict["state"]
        layout = {index: {key: _TensorLayout(tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor)
                          else value for key, value in entry.items()} for index, entry in mine.items()}
        layouts: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        try:
            dist.gather_object(layout, layouts, dst=_global_rank(self.control, 0), group=self.control)
        except Exception as error:
            raise DataParallelError(
                f"process {self.rank} of {self.world_size}: gathering the sharded optimizer state failed, so "
                f"{self._peers()} stopped or was lost: {type(error).__name__}: {error}") from error
        what = "sending the sharded optimizer state to process 0"
        if layouts is None:  # the same order as process 0 receives in: by parameter index, then key
            for _, entry in sorted(mine.items()):
                for value in entry.values():
                    if isinstance(value, torch.Tensor):
                        self._wait(dist.isend(value.contiguous(), dst=_global_rank(self.control, 0),
                                              group=self.control), what)
            return state_dict
        merged = dict(mine)
        for rank in range(1, self.world_size):
            source = _global_rank(self.control, rank)
            for index, entry in sorted(layouts[rank].items()):
                received = {}
                for key, value in entry.items():
                    if isinstance(value, _TensorLayout):
                        tensor = torch.empty(value.shape, dtype=value.dtype)
                        self._wait(dist.irecv(tensor, src=source, group=self.control),
                                   f"receiving the sharded optimizer state of process {rank}")
                        value = tensor
                    received[key] = value
                merged[index] = received
        return {**state_dict, "state": dict(sorted(merged.items()))}

    def agree(self, value: Any) -> Any:
        """Process 0's ``value`` on every process (a plan, say): call it on the caller's thread, at the same
        point on every process."""
        if not self.averaging:
            return value
        holder = [value]
        try:
            dist.broadcast_object_list(holder, src=_global_rank(self.control, 0), group=self.control)
        except Exception as error:
            raise DataParallelError(
                f"process {self.rank} of {self.world_size}: agreeing on {type(value).__name__} failed: "
                f"{type(error).__name__}: {error}") from error
        return holder[0]


class Broadcast:
    """Updated weights on their way from their owners (:meth:`DataParallel.start_broadcast`)."""

    def __init__(self, data_parallel: DataParallel, pending: list[tuple[Any, torch.Tensor, list[nn.Parameter]]]):
        self._data_parallel = data_parallel
        self._pending = pending  # per bucket: the collective, its buffer, the parameters this process receives

    def finish(self) -> None:
        """Wait for every bucket and write the received weights into their parameters."""
        pending, self._pending = self._pending, []
        for work, flat, received in pending:
            self._data_parallel._wait(work, f"broadcasting {flat.numel():,} updated weights of their owner")
            offset = 0
            for param in received:
                param.detach().copy_(flat[offset:offset + param.numel()].view_as(param))
                offset += param.numel()


class _TensorLayout(NamedTuple):
    """A tensor of the optimizer state, described: what process 0 allocates to receive it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


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
            if data_parallel.averaging:
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
            if data_parallel.averaging:
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


def _global_rank(group: Any, rank: int) -> int:
    """The global rank of process ``rank`` of ``group`` (``None``: the default group, where they are the same)."""
    return rank if group is None else dist.get_global_rank(group, rank)


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

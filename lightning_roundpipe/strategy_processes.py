"""The processes of a RoundPipe run and the devices each drives: :class:`RingProcessStrategy`, the
``ParallelStrategy`` that :class:`~lightning_roundpipe.strategy.RoundPipeStrategy` builds on.

By default one process (rank 0, world size 1, no launcher, no process group) drives every device of the
Trainer as one ring. With ``rings_per_node * num_nodes > 1`` the processes train data parallel, one ring
each, launched and ranked as Lightning's ``DDPStrategy`` does it: Lightning's ``_SubprocessScriptLauncher``
starts the node's other processes unless the cluster environment started them (torchrun, SLURM); process
``local_rank`` drives its share ``devices // rings_per_node`` of the node's devices; the processes join a
gloo process group in ``setup_environment`` (the gradients are host tensors), and the engine averages each
step's gradients on a group of its own (:mod:`lightning_roundpipe.engine.dataparallel`). Lightning's
collectives (``sync_dist`` logging, checkpoint callbacks) run on the default group.

Why a base class of our own, rather than a ``DDPStrategy`` subclass or a helper object the strategy
delegates to: each was sketched against Lightning 2.6.6 and measured on what left ``strategy.py`` (ranks,
launcher, collectives, set-up, the initial weights' agreement; what moved after, the sharded optimizer state
and the checks in ``setup_environment``, is the same in each), in lines of the class bodies and private names
of Lightning's used:

* this base class: 226 lines, 7 private names; the strategy keeps nothing of the plumbing, and each
  Lightning hook is an override where it is written;
* a helper object: 215 lines, plus one delegating override per Lightning hook left in the strategy (15
  hooks, 67 lines), the same 7 private names, and ``ParallelStrategy``'s own rank and ``all_gather``
  implementations reached through the strategy (``ParallelStrategy.global_rank.fget(strategy)``);
* a ``DDPStrategy`` subclass, as ``DeepSpeedStrategy`` is: 171 lines and 5 private names
  (``set_world_ranks``, ``distributed_sampler_kwargs``, the collectives and most of
  ``setup_distributed`` inherited). Less code, but wrong for one process, RoundPipe's default: Lightning
  counts every ``DDPStrategy`` as distributed before asking the strategy
  (``AcceleratorConnector.is_distributed``), so a one-process run would get a ``DistributedSampler`` (another
  data order than Lightning's default strategy with ``shuffle=True``) and lose the batch-size finder, which
  refuses distributed runs; and ``DDPStrategy.setup_environment`` sets up the root device (the
  host, which a CUDA accelerator refuses) and a process group even for one process, so it is overridden whole
  anyway.

Lightning's private APIs that the process plumbing needs are all here, mirroring Lightning 2.6.6's
``strategies/ddp.py``: ``_SubprocessScriptLauncher`` and the ``_configure_launcher`` hook that sets
``_launcher``, ``_init_dist_connection``, ``_set_num_threads_if_needed``, ``_sync_ddp_if_available``
(``reduce``), ``_sync_module_states`` (:meth:`RingProcessStrategy.agree_initial_weights`), and
``ParallelStrategy._layer_sync`` (``sync_batchnorm=True``, refused).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

# Lightning 2.6.6's private APIs, as its strategies/ddp.py uses them: review on each Lightning upgrade
from lightning.fabric.utilities.distributed import (
    _init_dist_connection,
    _set_num_threads_if_needed,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn
from typing_extensions import override

from lightning_roundpipe.engine.dataparallel import DataParallel
from lightning_roundpipe.engine.options import EngineOptions, OptionError
from lightning_roundpipe.strategy_options import StrategyOptions

log = logging.getLogger(__name__)


class RingProcessStrategy(ParallelStrategy):
    """A ``ParallelStrategy`` with one process per ring: ranks, launcher, collectives, the process group, the
    devices of this process's ring, and a sharded optimizer's state.

    The subclass sets ``options`` and ``engine_options`` in its ``__init__``; the host is its root device, so
    ``setup_environment`` sets up this process's first ring device instead.
    """

    options: StrategyOptions
    engine_options: EngineOptions

    def __init__(self, **parallel_strategy: Any) -> None:
        super().__init__(cluster_environment=None, **parallel_strategy)
        self.num_nodes = 1  # Lightning sets this from Trainer(num_nodes=...)
        self.ring_devices: list[torch.device] = []  #: this process's ring (set up by setup_environment)
        #: the processes training together (set up by setup_environment when there are several)
        self.data_parallel: DataParallel | None = None

    @property
    def num_processes(self) -> int:
        """Processes on each node: ``rings_per_node``."""
        return self.options.rings_per_node

    @property
    def _several_processes(self) -> bool:
        """Whether the run is configured for more than one process (``rings_per_node * num_nodes > 1``)."""
        return self.num_processes * self.num_nodes > 1

    # one process: rank 0 of 1 whatever the environment says, as before there were several
    @property
    @override
    def global_rank(self) -> int:
        return super().global_rank if self._several_processes else 0

    @property
    @override
    def local_rank(self) -> int:
        return super().local_rank if self._several_processes else 0

    @property
    @override
    def node_rank(self) -> int:
        return super().node_rank if self._several_processes else 0

    @property
    @override
    def world_size(self) -> int:
        return super().world_size if self._several_processes else 1

    @property
    def is_distributed(self) -> bool:
        """Lightning injects its ``DistributedSampler`` and reduces ``sync_dist`` logs when this is true."""
        return self.world_size > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # one shard per process (ring), not per device as ParallelStrategy's default would have it
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """``DDPStrategy``'s ranks, one process per ring: global rank ``node_rank * rings_per_node +
        local_rank`` of ``num_nodes * rings_per_node``. Lightning calls this when it builds the Trainer."""
        if not self._several_processes or self.cluster_environment is None:
            return
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # some environments ignore the setters (torchrun's, SLURM's): read the rank back through the getter
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # the decorator keeps the rank

    @override
    def _configure_launcher(self) -> None:
        # Lightning calls this after set_world_ranks: the settings are checked here, when the Trainer is built
        self._check_processes()
        environment = self.cluster_environment
        if self._several_processes and environment is not None and not environment.creates_processes_externally:
            # one process per ring on this node; the launcher checks nothing more for Lightning's own environment
            self._launcher = _SubprocessScriptLauncher(environment, self.num_processes, self.num_nodes)

    def _check_processes(self) -> None:
        """Refuse devices the node's rings cannot share, and a world started by someone else (torchrun, SLURM)
        that is not ``rings_per_node`` processes on each of ``num_nodes`` nodes, in our words: Lightning's own
        check would name ``devices``, which here counts devices, not processes."""
        devices, rings = len(self.parallel_devices or [torch.device("cpu")]), self.num_processes
        if devices % rings:
            raise OptionError("rings_per_node", f"must divide the Trainer's devices per node: devices={devices} with "
                                                f"rings_per_node={rings} leaves {devices % rings} device(s) over. "
                                                f"Each process drives devices // rings_per_node devices: set devices "
                                                f"to a multiple of {rings}, or rings_per_node to a divisor of "
                                                f"{devices}")
        environment = self.cluster_environment
        if environment is None or not environment.creates_processes_externally:
            return
        expected, started = rings * self.num_nodes, environment.world_size()
        local, node = environment.local_rank(), environment.node_rank()
        misplaced = self._several_processes and not (0 <= local < rings and 0 <= node < self.num_nodes)
        if started != expected or misplaced:
            raise ValueError(
                f"RoundPipe runs one process per ring, rings_per_node={rings} on each of num_nodes={self.num_nodes} "
                f"node(s): {expected} in all; but {type(environment).__name__} started {started} "
                f"(this one: local rank {local} on node {node}). Start rings_per_node processes per node "
                f"(torchrun --nnodes {self.num_nodes} --nproc-per-node {rings}; SLURM --nodes={self.num_nodes} "
                f"--ntasks-per-node={rings}), or set the strategy's rings_per_node and Trainer(num_nodes=...) to "
                f"what was started. Trainer(devices={devices}) stays the number of devices per node, which the "
                "node's processes share"
            )

    # ------------------------------------------------------------------ Lightning's collectives
    def _collective(self) -> bool:
        """Whether Lightning's collectives go to the other processes (else they are the identity, as in one)."""
        return self.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()

    @override
    def barrier(self, name: str | None = None) -> None:
        if self._collective():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._collective():
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src, group=torch.distributed.group.WORLD)
        return holder[0]

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        if not self._collective():
            return tensor
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        # gloo has no AVG for every dtype: Lightning's helper sums, then divides by the world size
        if isinstance(tensor, torch.Tensor) and self._collective():
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not self._collective():
            return decision
        return super().reduce_boolean_decision(decision, all=all)

    # ------------------------------------------------------------------ set-up
    @override
    def setup_environment(self) -> None:
        # not ParallelStrategy's: the host is the root device, which a CUDA accelerator would refuse to set up; the
        # accelerator sets up this process's first ring device instead (current device, its memory statistics)
        if self._layer_sync is not None:
            raise ValueError(
                "Trainer(sync_batchnorm=True) synchronizes BatchNorm statistics across processes inside each forward, "
                "which RoundPipe's rings do not do: set sync_batchnorm=False (BatchNorm sees each microbatch, as in "
                "gradient accumulation, on each process's own data; deferred_batchnorm=True updates its running "
                "statistics from the ring's whole batch)"
            )
        unsupported = sorted({device.type for device in self.parallel_devices or []} - {"cpu", "cuda"})
        if unsupported:
            raise ValueError(
                f"RoundPipe drives CUDA GPUs (accelerator='gpu') and simulated CPU devices (accelerator='cpu'), not "
                f"{unsupported[0]!r} devices"
            )
        self._check_processes()
        self.ring_devices = self._ring_of_this_process()
        assert self.accelerator is not None
        self.accelerator.setup_device(self.ring_devices[0])
        self.data_parallel = None
        if self._several_processes:
            self.setup_distributed()
        elif self.options.shard_optimizer or self.options.reduce_dtype != "auto":
            log.info("RoundPipe: shard_optimizer and reduce_dtype act between several processes; this run has one "
                     "(rings_per_node * num_nodes = 1), so they change nothing")

    def _ring_of_this_process(self) -> list[torch.device]:
        """This process's share of the node's devices, then ``ring`` within it."""
        devices = self.parallel_devices or [torch.device("cpu")]
        if self._several_processes:
            share = len(devices) // self.num_processes
            mine = devices[self.local_rank * share:(self.local_rank + 1) * share]
            return [mine[index] for index in self.options.ring_members(
                share, whose="each process's share (devices // rings_per_node) of the Trainer's devices:")]
        if self.options.ring is not None:
            self.parallel_devices = [devices[index] for index in self.options.ring_members(len(devices))]
        return list(self.parallel_devices or [torch.device("cpu")])

    def setup_distributed(self) -> None:
        """``DDPStrategy``'s set-up on gloo (the gradients are host tensors): ranks, the default process group
        (Lightning's collectives and the engine's agreements), then a group of its own for the gradients,
        created in the same order on every process."""
        reset_seed()
        self.set_world_ranks()
        # as Lightning's launcher does in each process it starts (torchrun sets OMP_NUM_THREADS itself)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        seconds = self.engine_options.wait_timeout
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, "gloo", timeout=timedelta(seconds=seconds))
        if torch.distributed.get_world_size() != self.world_size:
            raise RuntimeError(
                f"torch.distributed was already initialized with {torch.distributed.get_world_size()} processes, "
                f"but RoundPipe runs {self.world_size} (rings_per_node={self.num_processes} x "
                f"num_nodes={self.num_nodes})"
            )
        gradients = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
        # the sharded optimizer's broadcasts come from the optimizer thread while the caller's thread may average
        # the next step's gradients (async mode): a group of their own
        weights = (torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
                   if self.options.shard_optimizer else None)
        reduce_dtype = None if self.options.reduce_dtype == "auto" else getattr(torch, self.options.reduce_dtype)
        self.data_parallel = DataParallel(self.world_size, self.global_rank, gradients=gradients, timeout=seconds,
                                          reduce_dtype=reduce_dtype, shard_optimizer=self.options.shard_optimizer,
                                          weights=weights)

    def agree_initial_weights(self, module: nn.Module) -> None:
        """Make every process start from process 0's weights: compare a fingerprint of each parameter and buffer
        (its sum and norm) across the processes, and broadcast from process 0 only if one differs (a broadcast
        of a large model costs about as much as a step's gradient averaging)."""
        mine = _fingerprint(module)
        everyone: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(everyone, mine)
        differing = sum(1 for theirs in everyone if theirs != everyone[0])
        if differing:
            if self.is_global_zero:
                log.info(f"RoundPipe: the initial weights of {differing} of {self.world_size} processes differ from "
                         "process 0's; broadcasting process 0's (seed_everything before building the module spares "
                         "this)")
            _sync_module_states(module)

    # ------------------------------------------------------------------ a sharded optimizer's state
    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        # Lightning asks every process (before save_checkpoint): a sharded state is gathered whole on process 0
        state = super().optimizer_state(optimizer)
        if self.data_parallel is not None and self.world_size > 1:
            state = self.data_parallel.gather_optimizer_state(state)
        return state

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # a checkpoint holds the whole state (any world size wrote it); a sharded process keeps what it owns
        super().load_optimizer_state_dict(checkpoint)
        if self.data_parallel is not None and self.world_size > 1:
            for optimizer in self.optimizers:
                self.data_parallel.drop_unowned_state(optimizer)


def _fingerprint(module: nn.Module) -> list[tuple[str, float, float]]:
    """Per parameter and buffer: its name, sum and Euclidean norm in float64 (cheap; equal weights give equal
    fingerprints on every process, and different ones practically never do)."""
    prints = []
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            values = torch.view_as_real(tensor.detach()) if tensor.is_complex() else tensor.detach()
            if not values.is_floating_point():
                values = values.to(torch.float64)  # integer and boolean buffers (counters, masks): small
            prints.append((name, float(values.sum(dtype=torch.float64)),
                           float(torch.linalg.vector_norm(values, dtype=torch.float64))))
    return prints

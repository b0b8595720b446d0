"""The ring's threads: what ``RoundPipeEngine.start`` makes and ``RoundPipeEngine.close`` stops.

:class:`Ring` holds one :class:`~lightning_roundpipe.engine.device.Device` (its stream threads) and one
:class:`~lightning_roundpipe.engine.worker.Worker` per ring member, the
:class:`~lightning_roundpipe.engine.stage.StageRunner` they share, the optimizer thread, the gradient summing
threads, the upload sources and the timeline. They are made together, when the engine starts, because they start
threads or must see the weights and the seed of that moment; :meth:`Ring.stop` ends them with bounded waits.
Before that, :func:`ring_devices` and :func:`initial_plan` say what the ring is made of and the first plan for it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_roundpipe.engine.device import AbortSignal, Device, cuda_memory_budget, memory_advice, with_index
from lightning_roundpipe.engine.feedback import Measurements
from lightning_roundpipe.engine.figures import PipelineFigures
from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.options import EngineOptions
from lightning_roundpipe.engine.stage import StageRunner
from lightning_roundpipe.engine.step.disk_tier import DiskTier
from lightning_roundpipe.engine.step.summing import GradSummer
from lightning_roundpipe.engine.step.thread import HostOptimizer
from lightning_roundpipe.engine.transport import UploadSources
from lightning_roundpipe.engine.worker import Worker
from lightning_roundpipe.observe.trace import Timeline
from lightning_roundpipe.planning.partition import Planner, costs_from_bytes, stage_memory_budget, workspace_reserve


@dataclass
class Ring:
    """The threads of a started engine and what they share (see the module docstring)."""

    timeline: Timeline
    devices: list[Device]
    sources: UploadSources  # what devices upload: published and low-precision copies
    runner: StageRunner
    measurements: Measurements  # what the download threads measure for the planner
    workers: list[Worker]
    optimizer: HostOptimizer
    figures: PipelineFigures
    summers: list[GradSummer]  # per device: sums its jobs' downloaded gradients into their windows
    disk: DiskTier | None  # offload: the optimizer state's files and their I/O thread

    @staticmethod
    def start(trunk: Trunk, torch_devices: list[torch.device], options: EngineOptions, abort: AbortSignal, *,
              budget: int | None, base_seed: int, transport: torch.dtype | None, num_microbatches: int,
              measure_times: bool, module_dtypes: Mapping[int, torch.dtype] | None = None,
              disk: DiskTier | None = None, copies: Mapping[int, torch.Tensor] | None = None) -> Ring:
        """Make the devices (their stream threads start), the stage runner, the measurements, a worker per device,
        the optimizer thread and, with ``offload``, the disk tier's I/O thread. ``module_dtypes``: the module's
        dtypes of the weights kept at compute width (``frozen_weights.py``). ``disk`` and ``copies``: the disk tier
        and the transport copies made before start (``master_files.py``), taken over."""
        timeline = Timeline(options.record_timeline)
        advice = memory_advice(recompute=options.recompute, num_stages=options.num_stages, num_layers=len(trunk),
                               num_microbatches=num_microbatches)
        devices = [Device(index, device, abort, budget=budget, jitter=options.jitter, pin_memory=options.pin_memory,
                          stress=options.stress, memory_advice=advice)
                   for index, device in enumerate(torch_devices)]
        sources = UploadSources(trunk, async_step=options.async_step, transport=transport, module_dtypes=module_dtypes,
                                copies=copies)
        measurements = Measurements(timeline, len(trunk), len(devices), measure=not options.freeze_plan,
                                    measure_times=measure_times)
        runner = StageRunner(trunk, len(devices), options.recompute, timeline, base_seed, sources,
                             measure_times=measurements.measure_times, deferred_batchnorm=options.deferred_batchnorm)
        summers = [GradSummer(device.index, abort) for device in devices]
        workers = [Worker(runner, measurements, device, abort, summer) for device, summer in zip(devices, summers,
                                                                                                 strict=True)]
        optimizer = HostOptimizer(abort, timeline)
        if disk is None and options.offload_dir and options.offload != "none":
            disk = DiskTier(options.offload_dir, abort)
        return Ring(timeline, devices, sources, runner, measurements, workers, optimizer,
                    PipelineFigures(devices, optimizer, timeline, disk), summers, disk)

    @property
    def has_cuda(self) -> bool:
        return any(device.is_cuda for device in self.devices)

    def stop(self, abort: AbortSignal, timeout: float) -> bool:
        """Stop every thread; returns whether all ended (else a ``RuntimeWarning`` names those still running).

        The optimizer thread is given ``timeout`` for its step; one still running then is the engine's failure
        (the module's weights may be mid-update), set on ``abort``. Then the abort flag wakes every waiter, and
        the other threads get ``timeout`` in all to finish the operation they are running. A thread still inside
        an operation then (a layer that does not return, say) is left to end by itself once it returns; it runs
        nothing else."""
        optimizer = self.optimizer
        stuck = [optimizer.close(timeout)]
        if stuck[0] is not None:  # the module's weights may be mid-update: never a silent success
            abort.fail(TimeoutError(
                f"{stuck[0]} has not finished {optimizer.running or 'its task'} within "
                f"`wait_timeout={timeout:g}` s while the engine closed; the module's weights may be mid-update. "
                "Raise `wait_timeout` if a single optimizer step really takes that long."))
        abort.abort()
        deadline = time.monotonic() + timeout
        for device in self.devices:
            device.stop()  # every stream at once: a stuck one must not hold up the others' ends
        stuck += [worker.close(deadline) for worker in self.workers]
        for device in self.devices:
            stuck += device.join(deadline)
        stuck += [summer.close(deadline) for summer in self.summers]  # after the download threads that feed them
        if self.disk is not None:  # after the optimizer thread, the one that asks it for work
            stuck.append(self.disk.close(deadline))
        still_running = [name for name in stuck if name is not None]
        if still_running:
            warnings.warn(
                f"RoundPipe closed its engine but {len(still_running)} thread(s) are still inside an operation that "
                f"has not returned within `wait_timeout={timeout:g}` s: {', '.join(still_running)}. They run nothing "
                "else and end by themselves once it returns (a layer, loss or optimizer step that never returns "
                "keeps its thread for good).",
                RuntimeWarning, stacklevel=3,  # where the engine was closed
            )
        return not still_running

    def release_staging(self) -> None:
        """Unregister the gradient staging buffers: only after :meth:`stop` and :meth:`wait_gpus_idle` both said
        yes, as for the other pinned memory (a thread or a GPU copy may still write into them otherwise)."""
        for worker in self.workers:
            worker.operations.grad_staging.release()

    def wait_gpus_idle(self, timeout: float) -> bool:
        """After :meth:`stop`: whether every ring GPU has run the work its streams were given within ``timeout``
        (a copy from pinned memory may still run after an abort); a ``RuntimeWarning`` otherwise."""
        deadline = time.monotonic() + timeout
        busy = [device.index for device in self.devices if not device.wait_idle(deadline)]
        if busy:
            warnings.warn(
                f"RoundPipe closed its engine but ring member(s) {busy} still had GPU work running after "
                f"`wait_timeout={timeout:g}` s (or a CUDA error); the host memory pinned for uploads stays "
                "registered, as a copy may still read it.", RuntimeWarning, stacklevel=3)
        return not busy


def ring_devices(devices: int | Sequence[torch.device | str]) -> list[torch.device]:
    """The ring's devices: ``devices`` CPU stand-ins for a number, else the devices given."""
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"`devices` must be at least 1, got {devices}")
        devices = [torch.device("cpu")] * devices
    if not devices:
        raise ValueError("`devices` is empty; give at least one device")
    return [torch.device(device) for device in devices]


def initial_plan(trunk: Trunk, torch_devices: list[torch.device], options: EngineOptions,
                 layer_device_bytes: list[tuple[int, int]]) -> tuple[int | None, Planner]:
    """The per-device memory budget (``device_memory_limit_bytes``, else from what the GPUs have free; ``None``:
    unbounded) and the planner, with a first plan from the layers' sizes: stages get the budget less a reserve
    for the microbatch activations in flight."""
    on_gpu = any(device.type == "cuda" for device in torch_devices)
    budget = options.device_memory_limit_bytes
    if budget is None and on_gpu:
        budget = cuda_budget(torch_devices)
    stage_budget = stage_memory_budget(budget, workspace_reserve("cuda" if on_gpu else "cpu"))
    planner = Planner(options.num_stages, len(trunk), len(torch_devices), memory_budget=stage_budget,
                      hysteresis=options.replan_hysteresis, frozen=options.freeze_plan)
    planner.initial(costs_from_bytes([params for params, _ in layer_device_bytes],
                                     [grads for _, grads in layer_device_bytes]))
    return budget, planner


def cuda_budget(torch_devices: list[torch.device]) -> int:
    """The per-ring-member budget from what the GPUs have free; members sharing a GPU split it."""
    budgets = []
    gpus = [with_index(device) for device in torch_devices if device.type == "cuda"]  # "cuda" is "cuda:0" there
    for device in gpus:
        budgets.append(cuda_memory_budget(device, gpus.count(device)))
    return min(budgets)

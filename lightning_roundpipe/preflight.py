"""Pre-flight memory plan: what training will hold on the host and on each device, checked at setup.

RoundPipe keeps all training state in host memory, so a run that does not fit should fail at setup with
a message, not minutes later with the kernel's OOM killer. :func:`plan_memory` adds up, from the model,
the engine's plan and the optimizers (before their first step), what the host will hold:

* **parameters and buffers** as stored (their dtypes): already allocated when the strategy sets up;
* **gradients**: one ``param.grad`` per trainable parameter, in its dtype (training only); in async mode
  the next iteration's gradients gather in a second window while the step reads the current ones. When nothing
  reads them whole (``StrategyOptions.keep_gradients``), only those in flight: the step groups being summed or
  stepped; the plan names what keeps them whole otherwise;
* **optimizer state**, estimated per optimizer class from its hyperparameters (``Adam``/``AdamW``: two
  buffers in the parameter's dtype plus a scalar step, three with ``amsgrad``; ``SGD``: one buffer with
  ``momentum``, none without; other ``torch.optim`` classes likewise; an unknown class is assumed to keep
  two buffers, and the plan says so);
* **async's published weights**: the trainable trunk parameters once more;
* **simulated device copies**: CPU devices live in host memory, each holding its running and its
  prefetched stage;
* **stage-boundary activations** are *not* estimated: they depend on the batch, which setup has not seen.
  The plan says how many layer inputs a training batch keeps on the host and reports the headroom left
  for them;
* **checkpoint saves** add nothing: ``StreamingCheckpointIO`` streams ``torch.save`` into the file;
* **gradient staging**: each device downloads a job's gradients into one of its two reused host buffers, each
  as large as the largest stage's gradients (training only).

Data parallel (``rings_per_node`` processes per node, each with its own ring of devices): every process holds
all of the above for itself, so the node needs ``processes_per_node`` times one process's host bytes, while
each process reads the same limits, the node's. With the optimizer state sharded (``shard_optimizer=True``:
each of the ``optimizer_shards`` processes keeps the state of whole parameters, about 1/``optimizer_shards``
of them), one process's optimizer state is estimated as that fraction of the total; everything else stays
whole in every process. The device side is per device and does not change.

What the machine allows (:func:`lightning_roundpipe.hostmem.read_host_limits`): ``MemAvailable`` and the cgroup
limit of this process (v2 ``memory.max`` minus ``memory.current``, v1 ``memory.limit_in_bytes`` minus
``memory.usage_in_bytes``; reclaimable inactive file cache is not counted as used), whichever is smaller,
and, on CUDA devices, the host tensors uploads read (registered with CUDA in place, so never paged out: a
warning when they exceed half of what is available; ``RLIMIT_MEMLOCK`` does not apply, as the driver pins
the pages itself, not through ``mlock``). The new allocations of all the node's processes must fit in what
is available now. (When resuming with ``ckpt_path``, Lightning has loaded the checkpoint before the strategy
sets up, so the figure is lower than it will be once the checkpoint is restored and freed: the check is
pessimistic then.)

Device side: each device holds the stage it runs and the one it prefetches, every layer of a training
stage with its gradients; with ``device_memory_limit`` set, a layer must fit in the planner's stage
budget (:func:`check_layers`, run before the planner), and twice the largest stage in the limit. On a GPU
the limit also holds a fixed reserve for kernel workspaces (``partition.CUDA_WORKSPACE_RESERVE``), shown
in the table. What a stage's compute keeps for backward depends on the batch: the engine measures it and
its planner sizes stages with it (``engine/activations.py``).

Everything here reads sizes and hyperparameters only: nothing proportional to the model is allocated.

The host optimizer (training with ``host_optimizer`` given): each optimizer's step is timed once on at most
4M scratch parameters in a throwaway optimizer of its class and hyperparameters
(:func:`lightning_roundpipe.engine.step.kernels.measure_step`, a few tenths of a second at most; the user's
optimizer and its state are only read). The plan logs ns per parameter and the extrapolated seconds per
step for the trainable parameters, and what torch's fused kernel would take where ``host_optimizer="fused"``
would use it: sync mode waits for the host step every iteration, so a user sees when it is the bottleneck.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from lightning_roundpipe.disk_plan import disk_tier_advice, free_bytes, in_flight_state_bytes, largest_step_group_bytes
from lightning_roundpipe.engine.frozen_weights import FrozenSelection
from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.step import eight_bit
from lightning_roundpipe.engine.step.disk_tier import PAGE
from lightning_roundpipe.engine.step.kernels import SCRATCH_ELEMENTS, StepFigure, measure_step
from lightning_roundpipe.engine.transfer import nbytes_of, tensors_nbytes
from lightning_roundpipe.engine.transport import (
    GRAD_STAGING_BUFFERS,
    layer_sizes,
    read_low_precision_only,
    upload_copy_bytes,
)
from lightning_roundpipe.hostmem import HostLimits, format_bytes, read_host_limits
from lightning_roundpipe.memory_plan import MemoryPlan, Problem
from lightning_roundpipe.nf4 import nf4_storage, weight_count
from lightning_roundpipe.optimizer_state import optimizer_state_bytes
from lightning_roundpipe.planning.partition import (
    ACTIVATION_RESERVE,
    Plan,
    format_layers,
    stage_memory_budget,
    workspace_reserve,
)

if TYPE_CHECKING:
    from lightning_roundpipe.engine.engine import RoundPipeEngine

__all__ = [
    "DeviceMemoryError", "DiskSpaceError", "HostMemoryError", "MemoryPlan", "PreflightError", "Problem",
    "check_layers", "enforce", "enforce_layers", "optimizer_state_bytes", "plan_for", "plan_memory",
]

log = logging.getLogger(__name__)


class PreflightError(MemoryError):
    """The pre-flight memory plan does not fit; raised at setup, before any thread starts."""


class HostMemoryError(PreflightError):
    """The host cannot hold the training state."""


class DeviceMemoryError(PreflightError):
    """A layer or stage cannot fit in ``device_memory_limit``."""


class DiskSpaceError(PreflightError):
    """``offload_dir`` has no room for what the disk tier keeps there (``offload``)."""


# ---------------------------------------------------------------------------------------------- device side
def _layer_needs(trunk: Trunk, transport: torch.dtype | None) -> list[tuple[int, int]]:
    """Per layer, its bytes on a device: parameters and buffers, and gradients (Linear and Conv weights in
    the ``transport`` dtype, see ``engine/transport.py``)."""
    return layer_sizes(trunk, transport)


def _largest_gradient_stage(needs: Sequence[tuple[int, int]], plan: Plan) -> int:
    """The gradient bytes of the plan's largest stage with gradients (fused or backward): what one of a device's
    gradient staging buffers grows to (``engine/transport.py``, ``GradStaging``)."""
    return max(sum(needs[layer][1] for layer in stage) for stage in (plan.fused, *plan.backward))


def _smallest_limit_for(need: int, workspace: int = 0) -> int:
    """The smallest ``device_memory_limit`` whose stage budget holds ``need`` bytes in half of it."""
    limit = max(1, math.ceil(2 * need / (1.0 - ACTIVATION_RESERVE)) + workspace)
    while (stage_memory_budget(limit, workspace) or 0) / 2 < need:
        limit += 1
    return limit


def check_layers(trunk: Trunk, device_memory_limit: int | None, device_type: str = "cpu",
                 transport: torch.dtype | None = None) -> str | None:
    """A message if some layer cannot fit on a device under ``device_memory_limit``, else ``None``.

    A layer is never split, and every layer runs in a backward or the fused stage with its gradients, so
    ``parameters + buffers + gradients`` of one layer must fit in half the planner's stage budget (the
    other half holds the prefetched stage), which on a GPU leaves out the workspace reserve. Run before
    the planner, which would fail on the same layer with a terser message."""
    workspace = workspace_reserve(device_type)
    budget = stage_memory_budget(device_memory_limit, workspace)
    if budget is None:
        return None
    cap = budget / 2
    needs = _layer_needs(trunk, transport)
    worst = max(range(len(trunk)), key=lambda i: sum(needs[i]))
    weights, grads = needs[worst]
    if weights + grads <= cap:
        return None
    assert device_memory_limit is not None
    return (
        f"RoundPipe pre-flight: layer {worst} ({type(trunk.layers[worst]).__name__}) needs "
        f"{format_bytes(weights + grads)} on a device (parameters and buffers {format_bytes(weights)} + "
        f"gradients {format_bytes(grads)}), but with device_memory_limit={format_bytes(device_memory_limit)} "
        f"({device_memory_limit:,} bytes) a stage may use at most {format_bytes(int(cap))}: "
        + (f"{format_bytes(workspace)} of the limit is kept for kernel workspaces, a quarter of the rest for "
           "activations" if workspace else "a quarter of the limit is kept for activations")
        + " and the rest is split between the running stage and the prefetched "
        f"one. The layer is short by {format_bytes(weights + grads - int(cap))}. Raise `device_memory_limit` "
        f"to at least {format_bytes(_smallest_limit_for(weights + grads, workspace))}. More devices or stages do not "
        "help (a layer is never split across stages), and neither does `recompute` (it saves activations, "
        "not weights): split the layer into smaller layers (more children of the nn.Sequential), freeze some "
        "of its parameters (frozen ones have no gradient), or store it in a smaller dtype "
        "(precision='bf16-true')."
    )


def _stage_sizes(needs: Sequence[tuple[int, int]], stages: Iterable[range], with_grads: bool) -> list[int]:
    sizes = []
    for stage in stages:
        total = 0
        for index in stage:
            weights, grads = needs[index]
            total += weights + (grads if with_grads else 0)
        sizes.append(total)
    return sizes


def _heaviest_window(sizes: Sequence[int], width: int) -> int:
    """The largest sum of ``width`` consecutive jobs of a schedule that repeats ``sizes``."""
    if not sizes:
        return 0
    return max(sum(sizes[(start + k) % len(sizes)] for k in range(width)) for start in range(len(sizes)))


def plan_memory(module: nn.Module, trunk: Trunk, plan: Plan, optimizers: Sequence[Any], *,
                devices: Sequence[torch.device], async_step: bool = False, recompute: str = "stage",
                device_memory_limit: int | None = None, pin_memory: bool = True, training: bool = True,
                trainer_fn: str | None = None, limits: HostLimits | None = None,
                host_optimizer: str | None = None, transport: torch.dtype | None = None,
                processes_per_node: int = 1, optimizer_shards: int = 1, world_size: int = 1,
                gradients_kept_for: str | None = "param.grad", offload: str = "none",
                offload_dir: str | None = None, disk_written: int = 0, frozen: FrozenSelection | None = None,
                frozen_weights: str = "auto", stochastic_rounding: bool = False,
                rounds_possible: bool = False) -> MemoryPlan:
    """The memory plan of training ``module`` (the whole LightningModule; ``trunk`` is its pipelined part)
    with ``plan`` on ``devices`` and ``optimizers`` (not yet stepped). ``training=False`` (validate, test,
    predict) counts no gradients and no optimizer state. ``limits`` defaults to :func:`read_host_limits`.
    ``host_optimizer`` (the engine option) times each optimizer's host step (``plan.host_steps``) when
    training and the plan fits; ``None``: not measured. ``transport``: the dtype Linear and Conv weights travel
    in (``engine/transport.py``), for the host copies and the device sizes.

    Data parallel: ``processes_per_node`` processes on this node (``rings_per_node``) each hold this plan's
    host state, so the node's limits are checked against that many times one process's new allocations.
    ``optimizer_shards``: the processes the optimizer state is split over (the world size with
    ``shard_optimizer``, else 1); one process's share is estimated as ``1/optimizer_shards`` of the state
    (it keeps whole parameters' state, so its share is about that). ``world_size``: the processes of the whole
    run, for advice (sharding the optimizer state helps once there are several, on any nodes).
    ``gradients_kept_for``: what keeps the whole model's gradients through a step (the strategy's
    ``whole_gradients_reader``); ``None``: each step group's exist only while in flight, counted as the gradients
    outside the trunk plus (devices + 1) times the largest stage's (capped at the whole). ``offload``,
    ``offload_dir``: the engine options; the state in files is in memory only for the step groups in flight
    (:func:`~lightning_roundpipe.disk_plan.in_flight_state_bytes`), and ``offload_dir`` must have room for it (and
    the masters; ``disk_written``: the bytes the engine moved there before start, which count as free). ``frozen``:
    the frozen weights the engine will keep at compute width
    (``RoundPipeEngine.frozen_selection``) under the ``frozen_weights`` option: their masters are freed at start
    (each becomes its own upload copy). ``stochastic_rounding``: the state of bfloat16 parameters is float32.
    ``rounds_possible``: with gradients in flight, ``round_size="auto"`` may dispatch in rounds, which keep every
    step group's gradients until the last round; the plan says what that would add."""
    _check_process_counts(processes_per_node=processes_per_node, optimizer_shards=optimizer_shards,
                          world_size=world_size)
    limits = read_host_limits() if limits is None else limits
    host = _host_figures(module, trunk, optimizers, training, async_step, stochastic_rounding)
    rounds_may_add = 0
    if training and gradients_kept_for is None:
        whole_gradients = host.gradient_bytes
        host = host._replace(next_gradient_bytes=0, gradient_bytes=_in_flight_gradient_bytes(
            module, trunk, plan, len(devices), whole_gradients))
        if rounds_possible:
            rounds_may_add = whole_gradients - host.gradient_bytes
    # the host copies uploads read instead of the masters: async's published copy, the low-precision copies
    upload_copies, upload_reads = upload_copy_bytes(trunk, async_step=async_step, transport=transport)
    sync_copies = upload_copy_bytes(trunk, async_step=False, transport=transport)[0]
    device_type = devices[0].type if devices else "cpu"
    needs = _layer_needs(trunk, transport)
    stages = _stage_footprint(needs, plan, training, len(devices))
    layer_totals = [sum(need) for need in needs]
    worst_layer = max(range(len(trunk)), key=lambda i: layer_totals[i])
    staging = GRAD_STAGING_BUFFERS * len(devices) * _largest_gradient_stage(needs, plan) if training else 0
    state_share = -(-host.optimizer_bytes // optimizer_shards)  # this process's share, rounded up
    in_flight_state = in_flight_state_bytes(trunk, plan, state_share) if training else 0
    narrowed = {id(param) for param in frozen.narrowed} if frozen is not None else set()
    movable_masters = (tensors_nbytes(param for param in read_low_precision_only(trunk, transport)
                                      # what the tier moves: a page or more, of masters not freed at start
                                      if nbytes_of(param) >= PAGE and id(param) not in narrowed)
                       if training and transport is not None else 0)
    disk_state = state_share if training and offload != "none" else 0
    disk_masters = movable_masters if offload == "optimizer+masters" else 0
    memory_plan = MemoryPlan(
        trainer_fn=trainer_fn or ("fit" if training else "evaluate"), num_devices=len(devices),
        device_type=device_type, async_step=async_step, recompute=recompute,
        parameter_bytes=sum(host.by_dtype.values()), parameter_bytes_by_dtype=host.by_dtype,
        buffer_bytes=host.buffer_bytes, gradient_bytes=host.gradient_bytes,
        next_gradient_bytes=host.next_gradient_bytes,
        optimizer_state_bytes=in_flight_state if disk_state else state_share,
        optimizer_notes=host.notes, optimizer_state_assumed=host.assumed, upload_copy_bytes=upload_copies,
        eight_bit_saving_bytes=0 if disk_state else -(-host.eight_bit_saving // optimizer_shards),
        device_copy_bytes=stages.resident_copies if device_type == "cpu" else 0, activation_bytes=None,
        activation_layers=_activation_layers(plan, len(trunk), training, recompute), checkpoint_save_bytes=0,
        # pinned: what uploads read (copies, masters uploaded as stored, buffers), and the gradient staging buffers
        limits=limits, pinned_bytes=upload_reads + staging if device_type == "cuda" and pin_memory else 0,
        device_memory_limit=device_memory_limit,
        stage_budget=stage_memory_budget(device_memory_limit, workspace_reserve(device_type)),
        workspace_bytes=workspace_reserve(device_type), largest_stages=stages.largest,
        device_stage_bytes=2 * max(size for _, size in stages.largest.values()),
        largest_layer=(worst_layer, layer_totals[worst_layer]),
        transport=None if transport is None else str(transport).removeprefix("torch."),
        async_only_copy_bytes=upload_copies - sync_copies,
        processes_per_node=processes_per_node, optimizer_shards=optimizer_shards, world_size=world_size,
        unsharded_optimizer_state_bytes=host.optimizer_bytes, staging_bytes=staging,
        gradients_kept_for=gradients_kept_for if training else None, rounds_may_add_bytes=rounds_may_add,
        offload=offload, offload_dir=offload_dir, disk_state_bytes=disk_state, disk_master_bytes=disk_masters,
        disk_free_bytes=_free_for_tier(offload_dir, disk_written) if offload != "none" else None,
        state_in_flight_bytes=in_flight_state, movable_master_bytes=movable_masters,
        frozen_freed_bytes=frozen.saved_bytes if frozen is not None else 0, frozen_narrowed=len(narrowed),
        frozen_kept_bytes=tensors_nbytes(frozen.kept) if frozen is not None else 0,
        frozen_kept=len(frozen.kept) if frozen is not None else 0, frozen_weights=frozen_weights,
        parameter_count=weight_count(module),
    )
    if training and host_optimizer is not None:
        # the scratch fits the node's headroom (each of its processes measures its own); a plan that does not fit
        # is still measured, on the smallest scratch, for its advice (the disk bandwidth that keeps pace)
        headroom = memory_plan.headroom
        memory_plan.host_steps = _measure_host_steps(
            optimizers, host_optimizer, None if headroom is None else headroom // processes_per_node,
            short=headroom is not None and headroom < 0)
    _judge(memory_plan, trunk, transport)
    return memory_plan


def plan_for(engine: RoundPipeEngine, module: nn.Module, optimizers: Sequence[Any], trainer_fn: str,
             processes_per_node: int = 1, gradients_kept_for: str | None = "param.grad") -> MemoryPlan:
    """:func:`plan_memory` of ``module`` as ``engine`` (planned, not yet started) runs it: the engine's trunk,
    plan, devices, options, device budget and data-parallel group (its world size, and whether the optimizer
    state is sharded over it). ``trainer_fn``: Lightning's ``TrainerFn`` (or its value); ``"fit"`` trains
    (``optimizers`` are counted and timed), anything else evaluates. ``processes_per_node``: the processes on
    this node (``rings_per_node``); ``gradients_kept_for``: see :func:`plan_memory`."""
    trainer_fn = str(getattr(trainer_fn, "value", trainer_fn))  # "fit", not "TrainerFn.FITTING"
    options, data_parallel = engine.options, engine.data_parallel
    world_size = 1 if data_parallel is None else data_parallel.world_size
    sharded = data_parallel is not None and data_parallel.shard_optimizer
    training = trainer_fn == "fit"
    rounds_possible = False  # whether "auto" may dispatch in rounds, which keep every group's gradients
    if gradients_kept_for is None and not options.async_step:
        if isinstance(options.round_size, int):
            gradients_kept_for = (f"round_size={options.round_size} (a round's sums wait for the last round, when "
                                  "the batch has more microbatches than that)")
        elif options.round_size == "auto" and options.auto_may_use_rounds:
            rounds_possible = True
    return plan_memory(
        module, engine.trunk, engine.plan, optimizers if training else [], devices=engine.torch_devices,
        async_step=options.async_step, recompute=options.recompute, device_memory_limit=engine.device_budget,
        pin_memory=options.pin_memory, training=training, trainer_fn=trainer_fn,
        host_optimizer=options.host_optimizer, transport=engine.transport, processes_per_node=processes_per_node,
        optimizer_shards=world_size if sharded else 1, world_size=world_size, gradients_kept_for=gradients_kept_for,
        offload=options.offload, offload_dir=options.offload_dir, frozen=engine.frozen_selection(),
        disk_written=engine.master_files.written_bytes() if engine.master_files is not None else 0,
        frozen_weights=options.frozen_weights, stochastic_rounding=options.stochastic_rounding,
        rounds_possible=rounds_possible)


def _free_for_tier(offload_dir: str | None, written: int) -> int | None:
    free = free_bytes(offload_dir)
    return None if free is None else free + written


def _check_process_counts(**counts: int) -> None:
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}")


def _in_flight_gradient_bytes(module: nn.Module, trunk: Trunk, plan: Plan, num_devices: int, whole: int) -> int:
    """Host gradient bytes when each step group's exist only while in flight (``keep_gradients``): those outside
    the trunk (computed by autograd on the main thread, until the step), plus a job's on every device being summed
    and a group's being stepped, each at most the largest stage's (summed in the parameters' dtype on the host);
    never more than ``whole``."""
    inside = {id(param) for param in trunk.trainable_parameters()}
    outside = tensors_nbytes(p for p in module.parameters() if p.requires_grad and id(p) not in inside)
    return min(whole, outside + (num_devices + 1) * largest_step_group_bytes(trunk, plan))


class _HostFigures(NamedTuple):
    """What one process's host holds of the model and its training state, before upload copies."""

    by_dtype: dict[str, int]  # parameter bytes per dtype name
    buffer_bytes: int
    gradient_bytes: int
    next_gradient_bytes: int  # async: the next iteration's gradients while a step reads param.grad
    optimizer_bytes: int      # every parameter's optimizer state (unsharded)
    notes: list[str]          # what each optimizer's state holds
    assumed: bool             # some optimizer class is unknown: 2 buffers per parameter assumed
    eight_bit_saving: int     # what bitsandbytes' 8-bit moments would save over torch's Adam/AdamW (unsharded)


def _host_figures(module: nn.Module, trunk: Trunk, optimizers: Sequence[Any], training: bool,
                  async_step: bool, stochastic_rounding: bool = False) -> _HostFigures:
    """Parameters by dtype, buffers, and, when ``training``, gradients and optimizer state (no step is taken)."""
    params = list(module.parameters())  # each once, tied weights too
    nf4_ids, _ = nf4_storage(module)
    by_dtype: dict[str, int] = {}
    for param in params:
        name = "nf4" if id(param) in nf4_ids else str(param.dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + nbytes_of(param)
    gradient_bytes = next_gradient_bytes = optimizer_bytes = eight_bit_saving = 0
    notes: list[str] = []
    assumed = False
    if training:
        gradient_bytes = tensors_nbytes(p for p in params if p.requires_grad)
        if async_step:  # the step reads window k in param.grad while iteration k+1 fills the next window
            next_gradient_bytes = tensors_nbytes(trunk.trainable_parameters())
        for optimizer in optimizers:
            nbytes, description, known = optimizer_state_bytes(optimizer, widened=stochastic_rounding)
            optimizer_bytes += nbytes
            notes.append(description)
            assumed = assumed or not known
            eight_bit_saving += eight_bit.saving_over_adam(optimizer)
    return _HostFigures(by_dtype, tensors_nbytes(module.buffers()), gradient_bytes, next_gradient_bytes,
                        optimizer_bytes, notes, assumed, eight_bit_saving)


def _activation_layers(plan: Plan, num_layers: int, training: bool, recompute: str) -> list[int]:
    """The layers whose inputs a training batch keeps on the host until backward (none when not training)."""
    if not training:
        return []
    if recompute == "layer":
        return list(range(num_layers))
    return sorted({stage.start for stage in plan.backward} | {plan.fused.start})


def _measure_host_steps(optimizers: Sequence[Any], host_optimizer: str, headroom: int | None,
                        short: bool = False) -> list[StepFigure]:
    """:func:`~lightning_roundpipe.engine.step.kernels.measure_step` for each optimizer, on fewer scratch
    parameters when the plan leaves little headroom (none at all when it leaves under 16 MB). ``short``: the plan
    does not fit (it will not train): measured on the smallest scratch (100,000 parameters, 4 MB), for advice."""
    # the scratch holds a parameter, its gradient and up to three state buffers, 8 bytes each at most
    elements = SCRATCH_ELEMENTS if headroom is None else min(SCRATCH_ELEMENTS, headroom // (4 * 5 * 8))
    if short:
        elements = _SMALLEST_SCRATCH
    elif elements < _SMALLEST_SCRATCH:
        return []
    return [measure_step(optimizer, host_optimizer, max_elements=elements) for optimizer in optimizers]


_SMALLEST_SCRATCH = 100_000  # parameters: a step any smaller is too short to time


class _StageFootprint(NamedTuple):
    largest: dict[str, tuple[range, int]]  # stage kind -> (its layers, its bytes), the largest of the kind
    resident_copies: int                   # the most bytes of stage copies the devices hold at once


def _stage_footprint(needs: Sequence[tuple[int, int]], plan: Plan, training: bool,
                     num_devices: int) -> _StageFootprint:
    """Stage sizes on a device (training stages with their gradients; ``needs`` per layer, see
    :func:`_layer_needs`): the largest of each kind, and what all devices hold at once."""
    forward_sizes = _stage_sizes(needs, plan.forward, with_grads=False)
    fused_size = _stage_sizes(needs, [plan.fused], with_grads=training)[0]
    backward_sizes = _stage_sizes(needs, plan.backward, with_grads=True) if training else []
    largest: dict[str, tuple[range, int]] = {}
    for kind, stages, sizes in (("forward", plan.forward, forward_sizes), ("fused", (plan.fused,), [fused_size]),
                                ("backward", plan.backward, backward_sizes)):
        if sizes:
            best = max(range(len(sizes)), key=lambda i: sizes[i])
            largest[kind] = (stages[best], sizes[best])
    # each device holds at most its running and its prefetched stage, consecutive jobs of the ring, so the
    # heaviest 2N consecutive jobs bound them all
    schedules = [forward_sizes + [fused_size] + backward_sizes]
    if training:  # the transparent path runs the fused layers forward, then as the first backward stage
        schedules.append(forward_sizes + _stage_sizes(needs, [plan.fused], with_grads=False) + [fused_size]
                         + backward_sizes)
    return _StageFootprint(largest, max(_heaviest_window(sizes, 2 * num_devices) for sizes in schedules))


def _judge(plan: MemoryPlan, trunk: Trunk, transport: torch.dtype | None) -> None:
    """Fill ``plan.problems`` (refused) and ``plan.warnings`` (logged)."""
    layer_problem = check_layers(trunk, plan.device_memory_limit, plan.device_type, transport)
    if layer_problem is not None:
        plan.problems.append(Problem("device", layer_problem))
    elif (plan.device_memory_limit is not None
          and plan.device_stage_bytes + plan.workspace_bytes > plan.device_memory_limit):
        kind, (layers, nbytes) = max(plan.largest_stages.items(), key=lambda item: item[1][1])
        plan.problems.append(Problem(
            "device",
            f"RoundPipe pre-flight: the largest stage ({kind}, layers {format_layers(layers)}) needs "
            f"{format_bytes(nbytes)} "
            f"on a device, and a device holds two stages (the running one and the prefetched one): "
            f"{format_bytes(plan.device_stage_bytes)}"
            + (f", and {format_bytes(plan.workspace_bytes)} of kernel workspaces" if plan.workspace_bytes else "")
            + f", over device_memory_limit={format_bytes(plan.device_memory_limit)} by "
            f"{format_bytes(plan.device_stage_bytes + plan.workspace_bytes - plan.device_memory_limit)}. "
            "Use smaller stages (`num_stages='auto'` or a larger chunk count instead of an explicit Plan) or "
            "raise `device_memory_limit`.",
        ))
    if plan.shortfall > 0:
        plan.problems.append(Problem("host", _host_message(plan)))
    on_disk = plan.disk_state_bytes + plan.disk_master_bytes
    if plan.disk_free_bytes is not None and on_disk > plan.disk_free_bytes:
        plan.problems.append(Problem(
            "disk", f"RoundPipe pre-flight: offload={plan.offload!r} keeps {format_bytes(on_disk)} in files in "
                    f"{plan.offload_dir} (optimizer state {format_bytes(plan.disk_state_bytes)}, masters "
                    f"{format_bytes(plan.disk_master_bytes)}), which has {format_bytes(plan.disk_free_bytes)} free: "
                    "free space there or set offload_dir to a larger disk."))
    if plan.optimizer_state_assumed:
        plan.warnings.append(
            "RoundPipe pre-flight: the optimizer state of " + ", ".join(
                note.split(":")[0] for note in plan.optimizer_notes if "unknown, assumed 2x" in note)
            + " is unknown; the plan assumes two buffers the size of each trainable parameter")
    available = plan.limits.mem_available
    processes = plan.processes_per_node
    pinned = processes * plan.pinned_bytes  # every process on the node pins its own
    if pinned and available is not None and pinned > available // 2:
        # pinned pages cannot be reclaimed or swapped: the rest of the machine has that much less to work with
        plan.warnings.append(
            f"RoundPipe pre-flight: pin_memory=True pins {format_bytes(pinned)} of host weights and buffers"
            + (f" ({processes} processes on this node, {format_bytes(plan.pinned_bytes)} each)" if processes > 1
               else "")
            + f", over half of MemAvailable ({format_bytes(available)}); the kernel cannot reclaim pinned "
            "pages. Pass pin_memory=False if the host runs short (uploads then go through a staging copy)"
            + (", or use fewer rings_per_node" if processes > 1 else "") + "."
        )


def _host_message(plan: MemoryPlan) -> str:
    available = plan.host_available
    assert available is not None
    items = plan.new_items()
    largest = f"; the largest is {items[0][0]}: {format_bytes(items[0][1])}" if items else ""
    where = plan.limits.cgroup.describe() if plan.limits.cgroup_binds and plan.limits.cgroup else "MemAvailable"
    processes = plan.processes_per_node
    advice = []
    if processes > 1:
        advice.append(f"fewer rings_per_node: each of the {processes} processes on this node holds its own copy of "
                      f"the training state, so the node needs {processes} x {format_bytes(plan.new_bytes)} "
                      "(one ring per node over all of its devices holds it once)")
    world = plan.shard_world
    if world > 1:
        state = plan.optimizer_state_bytes
        advice.append(f"shard_optimizer=True, which splits the optimizer state ({format_bytes(state)} in each "
                      "process) over all the processes, each keeping about 1/world size of it: at least "
                      f"{format_bytes(processes * state * (world - 1) // world)} less on this node")
    advice += disk_tier_advice(plan)
    if plan.frozen_kept:
        advice.append(f"frozen_weights='round', which keeps {plan.frozen_kept} frozen weights in {plan.transport} "
                      f"alone ({format_bytes(plan.frozen_kept_bytes)} of float32 masters less in each process; "
                      f"{plan.transport} does not hold their values exactly, so the state dict would give them "
                      "back rounded, as autocast computes with them anyway)")
    if plan.eight_bit_saving_bytes:
        saving = format_bytes(plan.eight_bit_saving_bytes)
        advice.append(f"bitsandbytes' AdamW8bit (pip install 'lightning_roundpipe[low-bit]') in configure_optimizers, "
                      f"whose moments take about a quarter of AdamW's: about {saving} less in each process (a "
                      "measured, small change in the results, and a host step about 20x slower per parameter on "
                      "CPU: README, 8-bit optimizer state)")
    if plan.optimizer_state_bytes:
        advice.append("an optimizer with less state (SGD without momentum keeps none; Adam/AdamW keep two "
                      "copies of every trainable parameter)")
    if plan.gradient_bytes:
        advice.append("freeze what you do not train (LoRA): frozen parameters get no gradient and no optimizer "
                      "state")
    if any(dtype == "float32" for dtype in plan.parameter_bytes_by_dtype):
        advice.append("store the weights in bfloat16 (precision='bf16-true'), which halves parameters, gradients "
                      "and optimizer state")
    if plan.async_step:
        advice.append(f"async_step=False, which drops the published copy ({format_bytes(plan.async_only_copy_bytes)}) "
                      f"and the next iteration's gradients ({format_bytes(plan.next_gradient_bytes)})")
    if plan.device_copy_bytes:
        advice.append(f"fewer simulated devices or smaller stages (their copies take "
                      f"{format_bytes(plan.device_copy_bytes)})")
    if plan.limits.cgroup_binds:
        advice.append("a higher memory limit for the container (cgroup)")
    advice.append("preflight='warn' to try anyway")
    if processes > 1:
        allocate = (f"{format_bytes(plan.node_new_bytes)} more on this node: {processes} processes "
                    f"(rings_per_node={processes}), each allocating {format_bytes(plan.new_bytes)}{largest}")
        resident = f"{format_bytes(plan.resident_bytes)} in each process"
    else:
        allocate, resident = f"{format_bytes(plan.new_bytes)} more{largest}", format_bytes(plan.resident_bytes)
    sharded = (f" The optimizer state is sharded over {plan.optimizer_shards} processes: about "
               f"1/{plan.optimizer_shards} of {format_bytes(plan.unsharded_optimizer_state_bytes)} in each."
               if plan._sharded else "")
    return (
        f"RoundPipe pre-flight: the host cannot hold the training state. Training will allocate "
        f"{allocate}; the host has {format_bytes(available)} available "
        f"({where}), short by {format_bytes(plan.shortfall)} (before stage-boundary activations, which "
        f"are not counted). The parameters and buffers ({resident}) are already "
        f"allocated.{sharded} Options: " + "; ".join(advice) + "."
    )


def enforce_layers(trunk: Trunk, device_memory_limit: int | None, mode: str, device_type: str = "cpu",
                   transport: torch.dtype | None = None) -> None:
    """Act on :func:`check_layers` as ``mode`` says (the ``preflight`` option): run before the planner."""
    if mode == "off":
        return
    problem = check_layers(trunk, device_memory_limit, device_type, transport)
    if problem is not None:
        _refuse_or_warn(problem, mode, DeviceMemoryError)


def enforce(plan: MemoryPlan, mode: str, logger: logging.Logger | None = None) -> None:
    """Log the plan (INFO) and act on its problems: ``"refuse"`` raises, ``"warn"`` warns, ``"off"`` does
    nothing at all (not even the log)."""
    if mode == "off":
        return
    logger = logger or log
    logger.info(plan.table())
    for message in plan.warnings:
        logger.warning(message)
    if not plan.problems:
        return
    kinds = {problem.kind for problem in plan.problems}
    only = kinds.pop() if len(kinds) == 1 else "host"  # several kinds at once: the host error names them all
    error = {"device": DeviceMemoryError, "disk": DiskSpaceError}.get(only, HostMemoryError)
    _refuse_or_warn("\n".join(problem.message for problem in plan.problems), mode, error, details=plan.table())


def _refuse_or_warn(message: str, mode: str, error: type[PreflightError], details: str = "") -> None:
    """The ``preflight`` policy for a problem: ``"refuse"`` raises ``error``, ``"warn"`` warns."""
    if mode == "refuse":
        raise error(message + ("\n" + details if details else ""))
    # stacklevel 3: the line that called enforce or enforce_layers (the strategy's setup)
    warnings.warn(message + " (preflight='warn': continuing)", UserWarning, stacklevel=3)

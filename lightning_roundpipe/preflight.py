"""Pre-flight memory plan: what training will hold on the host and on each device, checked at setup.

RoundPipe keeps all training state in host memory, so a run that does not fit should fail at setup with
a message, not minutes later with the kernel's OOM killer. :func:`plan_memory` adds up, from the model,
the engine's plan and the optimizers (before their first step), what the host will hold:

* **parameters and buffers** as stored (their dtypes): already allocated when the strategy sets up;
* **gradients**: one ``param.grad`` per trainable parameter, in its dtype (training only); in async mode
  the next iteration's gradients gather in a second window while the step reads the current ones;
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
* **checkpoint saves** add nothing: ``StreamingCheckpointIO`` streams ``torch.save`` into the file.

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
(:func:`lightning_roundpipe.engine.host_step.measure_step`, a few tenths of a second at most; the user's
optimizer and its state are only read). The plan logs ns per parameter and the extrapolated seconds per
step for the trainable parameters, and what torch's fused kernel would take where ``host_optimizer="fused"``
would use it: sync mode waits for the host step every iteration, so a user sees when it is the bottleneck.
"""

from __future__ import annotations

import logging
import math
import textwrap
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from lightning_roundpipe.engine.host_step import SCRATCH_ELEMENTS, StepFigure, measure_step
from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.transfer import nbytes_of, tensors_nbytes
from lightning_roundpipe.engine.transport import layer_sizes, upload_copy_bytes
from lightning_roundpipe.hostmem import HostLimits, format_bytes, read_host_limits
from lightning_roundpipe.planning.partition import (
    ACTIVATION_RESERVE,
    Plan,
    format_layers,
    stage_memory_budget,
    workspace_reserve,
)

__all__ = [
    "DeviceMemoryError", "HostMemoryError", "MemoryPlan", "PreflightError", "Problem", "check_layers", "enforce",
    "enforce_layers", "optimizer_state_bytes", "plan_memory",
]

log = logging.getLogger(__name__)


class PreflightError(MemoryError):
    """The pre-flight memory plan does not fit; raised at setup, before any thread starts."""


class HostMemoryError(PreflightError):
    """The host cannot hold the training state."""


class DeviceMemoryError(PreflightError):
    """A layer or stage cannot fit in ``device_memory_limit``."""


# ---------------------------------------------------------------------------------------------- optimizers
def _scalar_bytes() -> int:
    # torch keeps per-parameter scalars (``step``) as 0-dim tensors of _get_scalar_dtype()
    return 8 if torch.get_default_dtype() == torch.float64 else 4


def _factored_bytes(param: torch.Tensor) -> int:
    """Adafactor's second moment: a row and a column factor for 2+-dim parameters, else full."""
    if param.dim() < 2:
        return nbytes_of(param)
    shape = list(param.shape)
    rows = math.prod(shape[:-1])
    cols = math.prod(shape[:-2] + shape[-1:])
    return (rows + cols) * param.element_size()


# Per torch.optim class: (buffers the size of the parameter, per-parameter scalars, description). The
# buffer count may depend on the group's hyperparameters.
def _rule(name: str, group: dict) -> tuple[float, int, str] | None:
    if name in ("Adam", "AdamW"):
        if group.get("amsgrad"):
            return 3, 1, "exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad) + step"
        return 2, 1, "exp_avg, exp_avg_sq + step"
    if name == "SGD":
        return (1, 0, "momentum_buffer") if group.get("momentum", 0) else (0, 0, "none (no momentum)")
    if name == "RMSprop":
        count = 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
        names = ["square_avg"] + ["momentum_buffer"] * bool(group.get("momentum", 0)) + \
            ["grad_avg"] * bool(group.get("centered"))
        return count, 1, ", ".join(names) + " + step"
    simple = {
        "Adagrad": (1, 1, "sum + step"),
        "Adamax": (2, 1, "exp_avg, exp_inf + step"),
        "NAdam": (2, 2, "exp_avg, exp_avg_sq + step, mu_product"),
        "RAdam": (2, 1, "exp_avg, exp_avg_sq + step"),
        "Adadelta": (2, 1, "square_avg, acc_delta + step"),
        "ASGD": (1, 3, "ax + step, eta, mu"),
        "Rprop": (2, 1, "prev, step_size + step"),
        "Muon": (1, 0, "momentum_buffer"),
        "SparseAdam": (2, 1, "exp_avg, exp_avg_sq + step"),
        "Adafactor": (-1, 1, "row_var and col_var (factored; full variance for 1-dim) + step"),
    }
    return simple.get(name)


def _known_class(optimizer: Any) -> str | None:
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and _rule(cls.__name__, {}) is not None:
            return cls.__name__
    return None


def optimizer_state_bytes(optimizer: Any) -> tuple[int, str, bool]:
    """Bytes ``optimizer``'s state will hold once every trainable parameter has stepped, from its class
    and hyperparameters (no step is taken): ``(bytes, description, known)``. Frozen parameters get no
    state. A class not derived from a known ``torch.optim`` one is assumed to keep two buffers per
    parameter (``known=False``)."""
    name = _known_class(optimizer)
    label = type(optimizer).__name__
    scalar = _scalar_bytes()
    total = 0
    descriptions: list[str] = []
    for group in getattr(optimizer, "param_groups", []):
        rule = _rule(name, group) if name is not None else None
        buffers, scalars, description = rule if rule is not None else (2, 0, "unknown, assumed 2x")
        if description not in descriptions:
            descriptions.append(description)
        for param in group["params"]:
            if not param.requires_grad:
                continue
            if buffers < 0:
                total += _factored_bytes(param)
            else:
                total += int(buffers * nbytes_of(param))
            total += scalars * scalar
    shown = label if name is None or name == label else f"{label} (as {name})"
    return total, f"{shown}: {'; '.join(descriptions) or 'no parameters'}", name is not None


# ---------------------------------------------------------------------------------------------- device side
def _layer_needs(trunk: Trunk, transport: torch.dtype | None) -> list[tuple[int, int]]:
    """Per layer, its bytes on a device: parameters and buffers, and gradients (Linear and Conv weights in
    the ``transport`` dtype, see ``engine/transport.py``)."""
    return layer_sizes(trunk, transport)


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


# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Problem:
    """Something that does not fit: ``kind`` says where, ``message`` what, by how much, and what to change."""

    kind: Literal["device", "host"]
    message: str


@dataclass
class MemoryPlan:
    """The pre-flight figures, in bytes. The host figures are one process's; ``node_new_bytes`` (theirs
    times ``processes_per_node``) must fit in ``host_available``, the node's."""

    trainer_fn: str
    num_devices: int
    device_type: str
    async_step: bool
    recompute: str
    # host: already allocated at setup
    parameter_bytes: int
    parameter_bytes_by_dtype: dict[str, int]
    buffer_bytes: int
    # host: allocated once training runs
    gradient_bytes: int
    next_gradient_bytes: int          # async: the next iteration's gradients while a step reads param.grad
    optimizer_state_bytes: int
    optimizer_notes: list[str]
    optimizer_state_assumed: bool     # some optimizer class is unknown: 2 buffers per parameter assumed
    upload_copy_bytes: int            # host copies uploads read: async's published copy, low-precision copies
    device_copy_bytes: int            # CPU devices: their stage copies live in host memory
    activation_bytes: int | None      # None: not estimated at setup (depends on the batch)
    activation_layers: list[int]      # layers whose inputs a training batch keeps on the host until backward
    checkpoint_save_bytes: int        # 0: saves stream into the file
    # the machine
    limits: HostLimits
    pinned_bytes: int                 # CUDA devices with pin_memory: what the engine registers (0 on CPU devices)
    # device side (per device)
    device_memory_limit: int | None
    stage_budget: int | None          # what the planner lets two stages use
    largest_stages: dict[str, tuple[range, int]]  # stage kind -> (its layers, its bytes), the largest
    device_stage_bytes: int           # two stages: the running one and the prefetched one (2 x largest)
    largest_layer: tuple[int, int]    # (layer index, parameters + buffers + gradients)
    problems: list[Problem] = field(default_factory=list)  # any refuses
    warnings: list[str] = field(default_factory=list)
    workspace_bytes: int = 0          # per device, kept for kernel workspaces (GPUs: partition.CUDA_WORKSPACE_RESERVE)
    host_steps: list[StepFigure] = field(default_factory=list)  # the measured host optimizer step, per optimizer
    transport: str | None = None      # the dtype Linear and Conv weights travel in; None: as stored
    async_only_copy_bytes: int = 0    # what of upload_copy_bytes only async mode keeps
    # data parallel: the host figures above are one process's; the node holds processes_per_node of them
    processes_per_node: int = 1       # processes on this node each holding this host state (rings_per_node)
    optimizer_shards: int = 1         # processes the optimizer state is split over (shard_optimizer); 1: whole
    world_size: int = 1               # processes in the whole run (on every node)
    unsharded_optimizer_state_bytes: int = 0  # the state of all parameters; optimizer_state_bytes: this process's

    @property
    def resident_bytes(self) -> int:
        """Parameters and buffers: allocated before setup, already outside ``host_available``."""
        return self.parameter_bytes + self.buffer_bytes

    @property
    def new_bytes(self) -> int:
        """What training will allocate on the host beyond what it holds at setup (activations excluded
        unless estimated)."""
        return (self.gradient_bytes + self.next_gradient_bytes + self.optimizer_state_bytes + self.upload_copy_bytes
                + self.device_copy_bytes + (self.activation_bytes or 0) + self.checkpoint_save_bytes)

    @property
    def host_total_bytes(self) -> int:
        """One process's host bytes: parameters, buffers and what training allocates."""
        return self.resident_bytes + self.new_bytes

    @property
    def node_new_bytes(self) -> int:
        """What the node's processes will allocate together: ``new_bytes`` each."""
        return self.processes_per_node * self.new_bytes

    @property
    def node_total_bytes(self) -> int:
        return self.processes_per_node * self.host_total_bytes

    @property
    def host_available(self) -> int | None:
        return self.limits.available

    @property
    def headroom(self) -> int | None:
        """What is left on the node, after the plan of all its processes, for activations, batches and
        everything else."""
        available = self.host_available
        return None if available is None else available - self.node_new_bytes

    @property
    def shortfall(self) -> int:
        headroom = self.headroom
        return 0 if headroom is None or headroom >= 0 else -headroom

    @property
    def fits(self) -> bool:
        return not self.problems

    def new_items(self) -> list[tuple[str, int]]:
        """The host allocations still to come, largest first."""
        optimizer = "optimizer state"
        notes = self._optimizer_notes()
        if notes:
            optimizer += f" ({'; '.join(notes)})"
        items = [("gradients", self.gradient_bytes), ("next iteration's gradients (async)", self.next_gradient_bytes),
                 (optimizer, self.optimizer_state_bytes), ("upload copies", self.upload_copy_bytes),
                 ("simulated device copies", self.device_copy_bytes)]
        return sorted([item for item in items if item[1] > 0], key=lambda item: -item[1])

    def rows(self) -> list[tuple[str, str, str]]:
        """The table: (item, bytes, note)."""
        return [*self._host_rows(), *self._device_rows()]

    def _host_rows(self) -> list[tuple[str, str, str]]:
        dtypes = ", ".join(f"{dtype} {format_bytes(n)}" for dtype, n in sorted(self.parameter_bytes_by_dtype.items()))
        training = self.trainer_fn == "fit"
        processes = self.processes_per_node
        rows = [
            (f"host (each of {processes} processes on this node)" if processes > 1 else "host", "", ""),
            ("parameters", format_bytes(self.parameter_bytes), f"allocated; {dtypes or 'none'}"),
            ("buffers", format_bytes(self.buffer_bytes), "allocated"),
            ("gradients", "+" + format_bytes(self.gradient_bytes),
             "param.grad of trainable parameters, in their dtype" if training else "none: not training"),
        ]
        if self.next_gradient_bytes:
            rows.append(("next iteration's gradients", "+" + format_bytes(self.next_gradient_bytes),
                         "async: gather while the step reads param.grad"))
        optimizer_notes = self._optimizer_notes()
        rows.append(("optimizer state", "+" + format_bytes(self.optimizer_state_bytes),
                     "; ".join(optimizer_notes) if optimizer_notes
                     else ("no optimizer" if training else "none: not training")))
        rows.append(("upload copies", "+" + format_bytes(self.upload_copy_bytes), self._upload_copies_note()))
        rows.append(("device copies", "+" + format_bytes(self.device_copy_bytes),
                     f"CPU devices live in host memory: {self.num_devices} x (running + prefetched stage)"
                     if self.device_type == "cpu" else "none: device memory"))
        rows.append(self._activation_row(training))
        rows.append(("checkpoint save", "+" + format_bytes(self.checkpoint_save_bytes),
                     "streamed to the file by torch.save: no in-memory copy"))
        rows.append(("to allocate", format_bytes(self.new_bytes),
                     f"host total with parameters and buffers {format_bytes(self.host_total_bytes)}"))
        if processes > 1:
            rows.append(("to allocate on this node", format_bytes(self.node_new_bytes),
                         f"{processes} processes on this node (rings_per_node={processes}), each holding all of the "
                         f"above: {processes} x {format_bytes(self.new_bytes)}; host total with parameters and "
                         f"buffers {format_bytes(self.node_total_bytes)}"))
        available, headroom = self.host_available, self.headroom
        rows.append(("available", "unknown" if available is None else format_bytes(available),
                     self.limits.describe()))
        rows.append(("headroom", "unknown" if headroom is None else
                     "-" + format_bytes(-headroom) if headroom < 0 else format_bytes(headroom),
                     "for activations, batches and everything else"
                     + (f" of the {processes} processes" if processes > 1 else "")))
        if self.device_type == "cpu":
            pinned = "not used on CPU devices"
        else:  # the driver pins the pages itself: RLIMIT_MEMLOCK does not count them
            pinned = "what uploads read (weights or their copies) and buffers, registered in place; not reclaimable"
            if processes > 1 and self.pinned_bytes:
                pinned = f"each process; {format_bytes(processes * self.pinned_bytes)} on this node: " + pinned
        rows.append(("pinned memory", format_bytes(self.pinned_bytes), pinned))
        return rows

    @property
    def _sharded(self) -> bool:
        return self.optimizer_shards > 1 and self.unsharded_optimizer_state_bytes > 0

    def _optimizer_notes(self) -> list[str]:
        """What the optimizer state holds, per optimizer, after how it is sharded."""
        if not self._sharded:
            return list(self.optimizer_notes)
        shards = self.optimizer_shards
        return [f"sharded over {shards} processes (shard_optimizer): about 1/{shards} each of "
                f"{format_bytes(self.unsharded_optimizer_state_bytes)}, whole parameters per process",
                *self.optimizer_notes]

    def _upload_copies_note(self) -> str:
        low = f"Linear/Conv weights in {self.transport}" if self.transport else ""
        if self.async_step:
            return "async: the published copy of the trainable trunk weights" + (f" ({low})" if low else "")
        return f"{low}, cast once per step (transport_dtype)" if low else "none: sync step, weights uploaded as stored"

    def _activation_row(self, training: bool) -> tuple[str, str, str]:
        if self.activation_bytes is not None:
            return ("stage-boundary activations", "+" + format_bytes(self.activation_bytes), "estimated")
        kept = self.activation_layers
        which = (f"layer{'s' * (len(kept) > 1)} {', '.join(map(str, kept))}" if len(kept) <= 8
                 else f"{len(kept)} layers")
        if 0 in kept:
            which += " (layer 0's is the batch itself)"
        note = (f"not estimated at setup (depends on the batch): a training batch keeps the inputs of "
                f"{which} on the host until backward" if training
                else "not estimated at setup (depends on the batch); none kept for backward")
        return ("stage-boundary activations", "?", note)

    def _device_rows(self) -> list[tuple[str, str, str]]:
        rows = [(f"device (each of {self.num_devices})", "", "")]
        for kind, (layers, nbytes) in self.largest_stages.items():
            rows.append((f"largest {kind} stage" if kind != "fused" else "fused stage", format_bytes(nbytes),
                         f"layers {format_layers(layers)}"))
        if self.device_memory_limit is None:
            limit_note = "device_memory_limit: none, not checked"
        else:
            limit_note = (f"device_memory_limit {format_bytes(self.device_memory_limit)}; the planner keeps two "
                          f"stages within {format_bytes(self.stage_budget)}")
        rows.append(("running + prefetched stage", format_bytes(self.device_stage_bytes), limit_note))
        index, nbytes = self.largest_layer
        rows.append((f"largest layer ({index})", format_bytes(nbytes), "parameters, buffers and gradients"))
        if self.workspace_bytes:
            rows.append(("kernel workspaces", format_bytes(self.workspace_bytes),
                         "cuBLAS workspaces and the streams' memory pools, reserved before any stage"))
        return rows

    def table(self) -> str:
        rows = self.rows()
        width = max(len(item) for item, _, _ in rows)
        amount = max(len(value) for _, value, _ in rows)
        lines = [f"RoundPipe memory plan ({self.trainer_fn}; {self.num_devices} {self.device_type} device(s); "
                 f"{'async' if self.async_step else 'sync'} step; recompute={self.recompute})"]
        for item, value, note in rows:
            if not value and not note:
                lines.append(f"  {item}")
            else:
                lines.append(f"    {item:<{width}}  {value:>{amount}}  {note}".rstrip())
        for figure in self.host_steps:
            lines.append(textwrap.fill(figure.describe(), width=120, initial_indent="  ", subsequent_indent="    "))
        return "\n".join(lines)


def plan_memory(module: nn.Module, trunk: Trunk, plan: Plan, optimizers: Sequence[Any], *,
                devices: Sequence[torch.device], async_step: bool = False, recompute: str = "stage",
                device_memory_limit: int | None = None, pin_memory: bool = True, training: bool = True,
                trainer_fn: str | None = None, limits: HostLimits | None = None,
                host_optimizer: str | None = None, transport: torch.dtype | None = None,
                processes_per_node: int = 1, optimizer_shards: int = 1, world_size: int = 1) -> MemoryPlan:
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
    run, for advice (sharding the optimizer state helps once there are several, on any nodes)."""
    for name, value in (("processes_per_node", processes_per_node), ("optimizer_shards", optimizer_shards),
                        ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
    limits = read_host_limits() if limits is None else limits
    params = list(module.parameters())  # each once, tied weights too
    by_dtype: dict[str, int] = {}
    for param in params:
        name = str(param.dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + nbytes_of(param)
    buffer_bytes = tensors_nbytes(module.buffers())
    trunk_trainable = trunk.trainable_parameters()
    trunk_trainable_bytes = tensors_nbytes(trunk_trainable)

    gradient_bytes = next_gradient_bytes = optimizer_bytes = 0
    notes: list[str] = []
    assumed = False
    if training:
        gradient_bytes = tensors_nbytes(p for p in params if p.requires_grad)
        if async_step:  # the step reads window k in param.grad while iteration k+1 fills the next window
            next_gradient_bytes = trunk_trainable_bytes
        for optimizer in optimizers:
            nbytes, description, known = optimizer_state_bytes(optimizer)
            optimizer_bytes += nbytes
            notes.append(description)
            assumed = assumed or not known
    # the host copies uploads read instead of the masters: async's published copy, the low-precision copies
    upload_copies, upload_reads = upload_copy_bytes(trunk, async_step=async_step, transport=transport)
    sync_copies = upload_copy_bytes(trunk, async_step=False, transport=transport)[0]

    device_type = devices[0].type if devices else "cpu"
    needs = _layer_needs(trunk, transport)
    stages = _stage_footprint(needs, plan, training, len(devices))
    resident_copies = stages.resident_copies
    device_copies = resident_copies if device_type == "cpu" else 0
    # what the engine's start() registers: what uploads read (copies, masters uploaded as stored, buffers)
    pinned = upload_reads if device_type == "cuda" and pin_memory else 0

    if not training:
        activation_layers: list[int] = []
    elif recompute == "layer":
        activation_layers = list(range(len(trunk)))
    else:
        activation_layers = sorted({stage.start for stage in plan.backward} | {plan.fused.start})
    layer_totals = [sum(need) for need in needs]
    worst_layer = max(range(len(trunk)), key=lambda i: layer_totals[i])

    memory_plan = MemoryPlan(
        trainer_fn=trainer_fn or ("fit" if training else "evaluate"), num_devices=len(devices),
        device_type=device_type, async_step=async_step, recompute=recompute,
        parameter_bytes=sum(by_dtype.values()), parameter_bytes_by_dtype=by_dtype, buffer_bytes=buffer_bytes,
        gradient_bytes=gradient_bytes, next_gradient_bytes=next_gradient_bytes,
        optimizer_state_bytes=-(-optimizer_bytes // optimizer_shards),  # this process's share, rounded up
        optimizer_notes=notes, optimizer_state_assumed=assumed, upload_copy_bytes=upload_copies,
        device_copy_bytes=device_copies, activation_bytes=None, activation_layers=activation_layers,
        checkpoint_save_bytes=0, limits=limits, pinned_bytes=pinned, device_memory_limit=device_memory_limit,
        stage_budget=stage_memory_budget(device_memory_limit, workspace_reserve(device_type)),
        workspace_bytes=workspace_reserve(device_type), largest_stages=stages.largest,
        device_stage_bytes=2 * max(size for _, size in stages.largest.values()),
        largest_layer=(worst_layer, layer_totals[worst_layer]),
        transport=None if transport is None else str(transport).removeprefix("torch."),
        async_only_copy_bytes=upload_copies - sync_copies,
        processes_per_node=processes_per_node, optimizer_shards=optimizer_shards, world_size=world_size,
        unsharded_optimizer_state_bytes=optimizer_bytes,
    )
    _judge(memory_plan, trunk, transport)
    if training and host_optimizer is not None and memory_plan.fits:
        headroom = memory_plan.headroom  # the node's: each of its processes measures its own scratch
        memory_plan.host_steps = _measure_host_steps(
            optimizers, host_optimizer, None if headroom is None else headroom // processes_per_node)
    return memory_plan


def _measure_host_steps(optimizers: Sequence[Any], host_optimizer: str, headroom: int | None) -> list[StepFigure]:
    """:func:`~lightning_roundpipe.engine.host_step.measure_step` for each optimizer, on fewer scratch
    parameters when the host is short of memory (none at all when it has under 16 MB to spare)."""
    # the scratch holds a parameter, its gradient and up to three state buffers, 8 bytes each at most
    elements = SCRATCH_ELEMENTS if headroom is None else min(SCRATCH_ELEMENTS, headroom // (4 * 5 * 8))
    if elements < 100_000:
        return []
    return [measure_step(optimizer, host_optimizer, max_elements=elements) for optimizer in optimizers]


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
    world = max(plan.world_size, processes)
    if world > 1 and plan.optimizer_shards == 1 and plan.optimizer_state_bytes:
        state = plan.optimizer_state_bytes
        advice.append(f"shard_optimizer=True, which splits the optimizer state ({format_bytes(state)} in each "
                      "process) over all the processes, each keeping about 1/world size of it: at least "
                      f"{format_bytes(processes * state * (world - 1) // world)} less on this node")
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
    error = DeviceMemoryError if {problem.kind for problem in plan.problems} == {"device"} else HostMemoryError
    _refuse_or_warn("\n".join(problem.message for problem in plan.problems), mode, error, details=plan.table())


def _refuse_or_warn(message: str, mode: str, error: type[PreflightError], details: str = "") -> None:
    """The ``preflight`` policy for a problem: ``"refuse"`` raises ``error``, ``"warn"`` warns."""
    if mode == "refuse":
        raise error(message + ("\n" + details if details else ""))
    # stacklevel 3: the line that called enforce or enforce_layers (the strategy's setup)
    warnings.warn(message + " (preflight='warn': continuing)", UserWarning, stacklevel=3)

"""The pre-flight memory plan's figures (:class:`MemoryPlan`) and the table it logs; the pre-flight
(:mod:`~lightning_roundpipe.preflight`) fills them in and judges them.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Literal

from lightning_roundpipe.engine.step.kernels import StepFigure
from lightning_roundpipe.engine.transport import GRAD_STAGING_BUFFERS
from lightning_roundpipe.hostmem import HostLimits, format_bytes
from lightning_roundpipe.planning.partition import format_layers


@dataclass(frozen=True)
class Problem:
    """Something that does not fit: ``kind`` says where, ``message`` what, by how much, and what to change."""

    kind: Literal["device", "host", "disk"]
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
    staging_bytes: int = 0            # gradients on their way into the step: the download buffers of every device
    gradients_kept_for: str | None = "param.grad"  # what keeps the whole model's gradients; None: only in flight
    # round_size="auto" in sync mode may dispatch in rounds, which keep every step group's gradients until the last
    # round: the bytes that would add to those in flight (0: it cannot)
    rounds_may_add_bytes: int = 0
    # the disk tier (offload): what goes to offload_dir, and what it has free (None: not known)
    offload: str = "none"
    offload_dir: str | None = None
    eight_bit_saving_bytes: int = 0   # what bitsandbytes' 8-bit moments would save over torch's Adam/AdamW here
    disk_state_bytes: int = 0         # this process's optimizer state in files (optimizer_state_bytes: in memory)
    disk_master_bytes: int = 0        # masters in files (offload="optimizer+masters"), freed from memory at start
    disk_free_bytes: int | None = None
    # what the disk tier would leave in memory: the optimizer state of the groups in flight, and the masters it
    # could move (those devices upload from a low-precision copy); for the advice of a plan that does not fit
    state_in_flight_bytes: int = 0
    movable_master_bytes: int = 0
    # frozen_weights: frozen weights kept in the transport dtype alone (each its own upload copy), whose float32
    # masters are freed when the engine starts; and those kept as stored because that dtype does not hold them
    frozen_freed_bytes: int = 0
    frozen_narrowed: int = 0          # how many such weights
    frozen_kept_bytes: int = 0
    frozen_kept: int = 0
    frozen_weights: str = "auto"
    parameter_count: int = 0          # the module's parameters (each once): the per-parameter row's divisor

    @property
    def resident_bytes(self) -> int:
        """Parameters and buffers: allocated before setup, already outside ``host_available``."""
        return self.parameter_bytes + self.buffer_bytes

    @property
    def new_bytes(self) -> int:
        """What training will allocate on the host beyond what it holds at setup (activations excluded
        unless estimated)."""
        return (self.gradient_bytes + self.next_gradient_bytes + self.optimizer_state_bytes + self.upload_copy_bytes
                + self.device_copy_bytes + (self.activation_bytes or 0) + self.checkpoint_save_bytes
                + self.staging_bytes - self.frozen_freed_bytes)

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
                 ("simulated device copies", self.device_copy_bytes), ("gradient staging", self.staging_bytes)]
        return sorted([item for item in items if item[1] > 0], key=lambda item: -item[1])

    def _gradients_note(self, training: bool) -> str:
        if not training:
            return "none: not training"
        if self.gradients_kept_for is None:
            note = (f"only in flight: the step groups being summed or stepped, about {self.num_devices + 1} of the "
                    "largest (nothing reads them whole; keep_gradients='always' keeps them)")
            if self.rounds_may_add_bytes:
                note += (f"; if round_size='auto' dispatches in rounds, up to {format_bytes(self.rounds_may_add_bytes)}"
                         " more (a round's sums wait for the last round: round_size='whole' bounds them)")
            return note
        return f"every trainable parameter's, in its dtype, kept whole for {self.gradients_kept_for}"

    def rows(self) -> list[tuple[str, str, str]]:
        """The table: (item, bytes, note)."""
        return [*self._host_rows(), *self._device_rows()]

    def _host_rows(self) -> list[tuple[str, str, str]]:
        dtypes = ", ".join(f"{dtype} {format_bytes(n)}" + (" (frozen 4-bit weights, a float32 scale per 64)"
                                                            if dtype == "nf4" else "")
                           for dtype, n in sorted(self.parameter_bytes_by_dtype.items()))
        training = self.trainer_fn == "fit"
        processes = self.processes_per_node
        rows = [
            (f"host (each of {processes} processes on this node)" if processes > 1 else "host", "", ""),
            ("parameters", format_bytes(self.parameter_bytes), f"allocated; {dtypes or 'none'}"),
            ("buffers", format_bytes(self.buffer_bytes), "allocated"),
            ("gradients", "+" + format_bytes(self.gradient_bytes), self._gradients_note(training)),
        ]
        if self.next_gradient_bytes:
            rows.append(("next iteration's gradients", "+" + format_bytes(self.next_gradient_bytes),
                         "async: gather while the step reads param.grad"))
        optimizer_notes = self._optimizer_notes()
        if self.disk_state_bytes:
            optimizer_notes = [f"in memory only for the step groups in flight; {format_bytes(self.disk_state_bytes)} "
                               f"in files in {self.offload_dir}", *optimizer_notes]
        rows.append(("optimizer state", "+" + format_bytes(self.optimizer_state_bytes),
                     "; ".join(optimizer_notes) if optimizer_notes
                     else ("no optimizer" if training else "none: not training")))
        if self.offload != "none":
            free = "" if self.disk_free_bytes is None else f", {format_bytes(self.disk_free_bytes)} free there"
            rows.append(("disk tier", format_bytes(self.disk_state_bytes + self.disk_master_bytes),
                         f"offload={self.offload!r} in {self.offload_dir}: optimizer state "
                         f"{format_bytes(self.disk_state_bytes)}, masters {format_bytes(self.disk_master_bytes)} "
                         f"(out of host memory once the engine starts){free}; each step reads and writes them at most "
                         f"once: {self.disk_pace(self.disk_state_bytes + self.disk_master_bytes)}"))
        rows.append(("upload copies", "+" + format_bytes(self.upload_copy_bytes), self._upload_copies_note()))
        if self.frozen_freed_bytes or self.frozen_kept:
            rows.append(self._frozen_row())
        if self.staging_bytes:
            rows.append(("gradient staging", "+" + format_bytes(self.staging_bytes),
                         f"{self.num_devices} device(s) x {GRAD_STAGING_BUFFERS} download buffers x the largest "
                         "stage's gradients"))
        rows.append(("device copies", "+" + format_bytes(self.device_copy_bytes),
                     f"CPU devices live in host memory: {self.num_devices} x (running + prefetched stage)"
                     if self.device_type == "cpu" else "none: device memory"))
        rows.append(self._activation_row(training))
        rows.append(("checkpoint save", "+" + format_bytes(self.checkpoint_save_bytes),
                     "streamed to the file by torch.save: no in-memory copy"))
        rows.append(("to allocate", format_bytes(self.new_bytes),
                     f"host total with parameters and buffers {format_bytes(self.host_total_bytes)}"))
        if self.parameter_count:
            rows.append(self._per_parameter_row())
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
    def shard_world(self) -> int:
        """The processes ``shard_optimizer=True`` would split this process's optimizer state over; 1 where it would
        not help (one process, no state, or sharded already)."""
        world = max(self.world_size, self.processes_per_node)
        return world if world > 1 and self.optimizer_shards == 1 and self.optimizer_state_bytes else 1

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

    def _per_parameter_row(self) -> tuple[str, str, str]:
        """The host total and the disk tier per parameter, by category (what the log's reader compares with the
        README's table of what fits)."""
        count = self.parameter_count
        weights = self.parameter_bytes - self.frozen_freed_bytes + self.upload_copy_bytes
        host = [("weights and their upload copies", weights), ("gradients", self.gradient_bytes
                                                                + self.next_gradient_bytes + self.staging_bytes),
                ("optimizer state", self.optimizer_state_bytes),
                ("buffers and device copies", self.buffer_bytes + self.device_copy_bytes),
                ("activations and checkpoint", (self.activation_bytes or 0) + self.checkpoint_save_bytes)]
        note = "host: " + ", ".join(f"{name} {nbytes / count:.2f}" for name, nbytes in host if nbytes)
        if self.offload != "none":
            note += (f"; disk: optimizer state {self.disk_state_bytes / count:.2f}, masters "
                     f"{self.disk_master_bytes / count:.2f}")
        processes = self.processes_per_node
        if processes > 1:
            note += f"; this node, {processes} processes: {self.node_total_bytes / count:.2f}"
        if self._sharded:
            note += (f"; the optimizer state is sharded over {self.optimizer_shards} processes (unsharded "
                     f"{self.unsharded_optimizer_state_bytes / count:.2f})")
        elif self.shard_world > 1:
            note += (f"; shard_optimizer=True would make the optimizer state about "
                     f"{self.optimizer_state_bytes / self.shard_world / count:.2f} per process")
        return ("per parameter", f"{self.host_total_bytes / count:.2f} B", note + " (activations not counted)")

    def disk_pace(self, per_step: int) -> str:
        """The disk bandwidth that moves ``per_step`` bytes each way within the host step measured at setup (the
        step then never waits for the disk: the tier reads each group's state while the groups before it step),
        or within one second when the step was not measured."""
        seconds = sum(figure.step_seconds or 0.0 for figure in self.host_steps)
        if seconds <= 0:
            return f"{format_bytes(per_step)}/s each way to hide it behind a one-second step"
        return (f"{format_bytes(int(per_step / seconds))}/s each way keeps pace with the host step measured at "
                f"setup (~{seconds:.2g} s); a slower disk makes the step wait")

    def _frozen_row(self) -> tuple[str, str, str]:
        notes = []
        if self.frozen_narrowed:
            notes.append(f"{self.frozen_narrowed} frozen weights kept in {self.transport} alone, each its own upload "
                         f"copy (frozen_weights={self.frozen_weights!r}): their masters are freed at start")
        if self.frozen_kept:
            notes.append(f"{self.frozen_kept} ({format_bytes(self.frozen_kept_bytes)}) kept as stored: "
                         f"{self.transport} does not hold their values exactly (frozen_weights='round' rounds them, "
                         "which autocast does anyway, and saves 4 bytes per parameter)")
        return ("frozen weights", "-" + format_bytes(self.frozen_freed_bytes), "; ".join(notes))

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

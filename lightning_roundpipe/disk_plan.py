"""The disk tier in the pre-flight plan (``offload``): what it keeps in memory, what its directory has free, and
what it would take off a host that cannot hold the training state, at what cost per step.
"""

from __future__ import annotations

import os

from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.step.disk_tier import QUEUED_WRITES
from lightning_roundpipe.engine.step.queued import READ_AHEAD
from lightning_roundpipe.engine.transfer import tensors_nbytes
from lightning_roundpipe.hostmem import format_bytes
from lightning_roundpipe.memory_plan import MemoryPlan
from lightning_roundpipe.planning.partition import Plan


def in_flight_state_bytes(trunk: Trunk, plan: Plan, whole: int) -> int:
    """The optimizer state in memory with the disk tier: the step groups read ahead, the one stepping and the
    writes queued (``disk_tier.QUEUED_WRITES``, ``queued.READ_AHEAD``), each at most the largest group's share of
    ``whole`` (by trainable bytes); never more than ``whole``."""
    trainable = tensors_nbytes(trunk.trainable_parameters())
    if not trainable:
        return whole
    return min(whole, (READ_AHEAD + 1 + QUEUED_WRITES) * whole * largest_step_group_bytes(trunk, plan) // trainable)


def free_bytes(directory: str | None) -> int | None:
    """What ``directory`` (or the nearest existing parent) has free for this user, or ``None``."""
    path = directory
    while path and not os.path.isdir(path):
        path = os.path.dirname(path.rstrip("/")) or None
    try:
        stat = os.statvfs(path or ".")
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def largest_step_group_bytes(trunk: Trunk, plan: Plan) -> int:
    """The trainable parameter bytes of the plan's largest stage with gradients (fused or backward): of the step
    groups a streamed step is cut into, the largest."""
    return max(tensors_nbytes({id(param): param for layer in stage for param in trunk.states[layer].params
                               if param.requires_grad}.values())
               for stage in (plan.fused, *plan.backward))


def disk_tier_advice(plan: MemoryPlan) -> list[str]:
    """What the disk tier would take off this node, whether that makes the plan fit, and what it costs a step."""
    whole_state = plan.disk_state_bytes or plan.optimizer_state_bytes  # this process's, wherever it is
    saved_state = whole_state - plan.state_in_flight_bytes if plan.offload == "none" else 0
    saved_masters = plan.movable_master_bytes if plan.offload != "optimizer+masters" else 0
    options = []
    if saved_state > 0:
        options.append(("optimizer", saved_state, whole_state))
    if saved_masters > 0:
        options.append(("optimizer+masters", saved_state + saved_masters, whole_state + plan.movable_master_bytes))
    advice = []
    for offload, saved, per_step in options:
        enough = plan.processes_per_node * saved >= plan.shortfall
        advice.append(f"offload={offload!r} with offload_dir on a local disk: about {format_bytes(saved)} less in "
                      f"each process ({'enough' if enough else 'not enough alone'}), for {format_bytes(per_step)} "
                      f"read and written there per step ({plan.disk_pace(per_step)})")
    return advice

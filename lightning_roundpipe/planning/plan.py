"""The planner's vocabulary: what a layer costs (:class:`LayerCost`, first estimated from byte counts by
:func:`costs_from_bytes`) and a partition of the layers into stages (:class:`Plan`).

Pure module (standard library only). The search that chooses a plan is :mod:`.search`; the planner that
holds one between iterations, :mod:`.partition`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs, per microbatch.

    ``forward`` is the forward time; ``backward`` the backward time *excluding* recomputation, so a
    recomputing backward stage costs ``forward + backward`` per layer and the fused stage (never
    recomputed) costs ``forward + backward`` too. ``param_bytes`` is what uploading the layer costs
    in device memory; ``grad_bytes`` the extra bytes its trainable parameters' gradients take in a
    backward stage; ``activation_bytes`` what its compute keeps for backward per microbatch in a fused or
    backward stage (saved activations, autocast's weight copies), which the stage holds on top (summed over
    its layers: with ``recompute="layer"`` that is an upper bound).
    """

    forward: float
    backward: float
    param_bytes: int = 0
    grad_bytes: int = 0
    activation_bytes: int = 0


@dataclass(frozen=True)
class Plan:
    """A partition of ``num_layers`` layers into stages.

    ``forward`` covers layers ``[0, fused.start)`` in ascending order; ``fused`` is the deepest run
    of layers ``[fused.start, num_layers)``, run forward, loss and backward back to back; ``backward``
    covers ``[0, fused.start)`` listed deep to shallow (``backward[0]`` ends at ``fused.start``).
    A plan whose fused stage holds every layer has no forward and no backward stages.
    """

    forward: tuple[range, ...]
    fused: range
    backward: tuple[range, ...]

    @property
    def num_layers(self) -> int:
        return self.fused.stop

    @property
    def num_stages(self) -> int:
        """Stage jobs per training iteration: forward stages, the fused stage, backward stages."""
        return len(self.forward) + 1 + len(self.backward)

    def validate(self, num_layers: int) -> None:
        """Raise ``ValueError`` unless the plan covers ``num_layers`` layers exactly, in order."""
        if self.fused.stop != num_layers or self.fused.step != 1 or len(self.fused) == 0:
            raise ValueError(
                f"the fused stage must be a non-empty run of the deepest layers ending at layer "
                f"{num_layers}, got {self.fused}"
            )
        _check_cover(self.forward, self.fused.start, "forward")
        _check_cover(tuple(reversed(self.backward)), self.fused.start, "backward")

    @staticmethod
    def from_sizes(forward: list[int] | tuple[int, ...], fused: int, backward: list[int] | tuple[int, ...]) -> Plan:
        """Build a plan from layers per stage: ``forward`` shallow to deep, ``backward`` deep to shallow."""
        fwd: list[range] = []
        start = 0
        for size in forward:
            fwd.append(range(start, start + size))
            start += size
        fused_range = range(start, start + fused)
        bwd: list[range] = []
        stop = start
        for size in backward:
            bwd.append(range(stop - size, stop))
            stop -= size
        plan = Plan(tuple(fwd), fused_range, tuple(bwd))
        plan.validate(start + fused)
        return plan

    def sizes(self) -> dict[str, Any]:
        """Layers per stage as plain values (for checkpoints): ``Plan.from_sizes(**plan.sizes()) == plan``."""
        return {"forward": [len(stage) for stage in self.forward], "fused": len(self.fused),
                "backward": [len(stage) for stage in self.backward]}


def format_layers(layers: range) -> str:
    """A run of layers as people read it, inclusive: ``[3-5]``, ``[7]``, or ``[]`` when empty."""
    if len(layers) == 0:
        return "[]"
    return f"[{layers.start}]" if len(layers) == 1 else f"[{layers.start}-{layers.stop - 1}]"


def _check_cover(stages: tuple[range, ...], end: int, what: str) -> None:
    position, broken = walk_runs(stages, 0)
    if broken is not None:
        stage = stages[broken]
        raise ValueError(
            f"{what} stages must be non-empty contiguous runs covering layers [0, {end}) in order; "
            f"stage {stage} starts at {stage.start}, expected {position}"
        )
    if position != end:
        raise ValueError(f"{what} stages cover layers [0, {position}), expected [0, {end})")


def walk_runs(runs: Sequence[range], start: int, *, downward: bool = False) -> tuple[int, int | None]:
    """Follow ``runs`` of layers from ``start``, each non-empty and contiguous and starting where the one before
    stopped (``downward``: stopping where the one before started). Returns the position reached and the index
    of the first run that breaks the chain (``None``: none does, and the position is where the last one ends)."""
    position = start
    for index, run in enumerate(runs):
        if len(run) == 0 or run.step != 1 or (run.stop if downward else run.start) != position:
            return position, index
        position = run.start if downward else run.stop
    return position, None


def costs_from_bytes(
    param_bytes: Sequence[int], grad_bytes: Sequence[int] | None = None, backward_ratio: float = 2.0
) -> list[LayerCost]:
    """First cost estimate, before anything is measured: time proportional to size.

    ``forward = param_bytes`` (in "byte" time units) and ``backward = backward_ratio * forward``, so a
    recomputing backward stage costs ``(1 + backward_ratio)`` times its forward. A layer with no
    parameters is not free: it gets 1% of the mean layer size (1 if every layer has 0 bytes).
    ``grad_bytes=None`` means every parameter is trainable with a gradient as large as itself.
    """
    if grad_bytes is None:
        grad_bytes = param_bytes
    if len(grad_bytes) != len(param_bytes):
        raise ValueError(f"got {len(param_bytes)} param_bytes but {len(grad_bytes)} grad_bytes")
    if backward_ratio < 0 or any(b < 0 for b in (*param_bytes, *grad_bytes)):
        raise ValueError("byte counts and backward_ratio must be non-negative")
    mean = sum(param_bytes) / len(param_bytes) if param_bytes else 0.0
    floor = 0.01 * mean if mean > 0 else 1.0
    out = []
    for p, g in zip(param_bytes, grad_bytes, strict=True):
        forward = float(p) if p > 0 else floor
        out.append(LayerCost(forward, backward_ratio * forward, int(p), int(g)))
    return out


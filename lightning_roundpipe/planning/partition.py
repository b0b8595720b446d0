"""Stage partitions: the :class:`Planner` holds the plan in use between iterations and re-plans from measured
costs; the import path of the planning vocabulary, the search and the device memory budget.

Pure module (no torch, no threads). What it builds on, each in a module of its own:

* :mod:`.plan`: what a layer costs (:class:`LayerCost`, :func:`costs_from_bytes`) and a partition
  (:class:`Plan`, :func:`format_layers`);
* :mod:`.search`: the balanced partitions, for a chosen forward stage count (:func:`plan_chunks`) or with
  the counts chosen too (:func:`plan_auto`), and how a plan is judged (:func:`predicted_cost`,
  :func:`plan_fits`);
* :mod:`.device_budget`: what of a device's memory the stages may use (:func:`stage_memory_budget`).
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from lightning_roundpipe.planning.device_budget import (
    ACTIVATION_RESERVE,
    CUDA_WORKSPACE_RESERVE,
    autocast_copy_bytes,
    stage_memory_budget,
    workspace_reserve,
)
from lightning_roundpipe.planning.plan import LayerCost, Plan, costs_from_bytes, format_layers
from lightning_roundpipe.planning.search import _check_num_stages, plan_auto, plan_chunks, plan_fits, predicted_cost

__all__ = [
    "ACTIVATION_RESERVE", "CUDA_WORKSPACE_RESERVE", "LayerCost", "Plan", "Planner", "autocast_copy_bytes",
    "costs_from_bytes", "format_layers", "plan_auto", "plan_chunks", "plan_fits", "predicted_cost",
    "stage_memory_budget", "workspace_reserve",
]


class Planner:
    """Holds the current plan between iterations and re-plans from measured costs.

    ``mode``: ``"auto"`` (:func:`plan_auto`), an int (:func:`plan_chunks` with that many forward
    stages, re-balanced on replan) or an explicit :class:`Plan` (used as is, never changed).

    Times: the plan follows a measurement only once it can be trusted, or it would flap with noise. An
    observation is one optimizer step's per-layer times (the engine measures them in device time, see
    ``engine/timing.py``). The first ``warmup`` observations are discarded: they include one-off warm-up
    (allocator growth, kernel selection and autotuning, caches). The rest are smoothed per layer by an
    exponential moving average (``smoothing`` is the weight of the past), bias-corrected like Adam's
    moments so early estimates are not pulled toward zero. A new plan is considered only once the last
    ``settle`` observations agree, each within ``tolerance`` of their mean (the relative L1 distance of the
    per-layer ``forward + backward`` times, so a layer weighs by its share of the work), and adopted only
    if it is better by ``hysteresis``.

    Jobs: ``mode="auto"`` also weighs each job's fixed cost (:func:`plan_auto`'s ``job_cost``, in seconds like
    the measured times): ``job_cost`` until a step reports one (``observe(..., job_cost=...)``, from the stage
    runner's ``StepTimes.job_cost``: how long a job's hand-offs and binding keep its device from computing),
    then the smoothed reports, like the times. It applies to measured times only: first estimates are in
    other units.

    Bytes: parameter and gradient bytes come from :meth:`initial`; what each layer's compute keeps for
    backward from :meth:`observe_activations`. A plan that no longer fits memory is replaced at once:
    memory is a hard limit, not a matter of trust.
    """

    MOST_SKIPPED = 31  # replans skipped at most between two searches once settled (see replan)

    def __init__(
        self,
        mode: Literal["auto"] | int | Plan,
        num_layers: int,
        num_devices: int,
        *,
        memory_budget: int | None = None,
        hysteresis: float = 0.1,
        frozen: bool = False,
        smoothing: float = 0.9,
        warmup: int = 1,
        settle: int = 2,
        tolerance: float = 0.25,
        job_cost: float = 0.0,
    ) -> None:
        if num_layers < 1 or num_devices < 1:
            raise ValueError(f"need num_layers >= 1 and num_devices >= 1, got {num_layers}, {num_devices}")
        if not 0 <= smoothing < 1 or hysteresis < 0:
            raise ValueError(f"need 0 <= smoothing < 1 and hysteresis >= 0, got {smoothing}, {hysteresis}")
        if warmup < 0 or settle < 1 or tolerance < 0:
            raise ValueError(f"need warmup >= 0, settle >= 1 and tolerance >= 0, got {warmup}, {settle}, {tolerance}")
        if not (math.isfinite(job_cost) and job_cost >= 0):
            raise ValueError(f"job_cost must be finite and >= 0, got {job_cost}")
        if isinstance(mode, Plan):
            try:
                mode.validate(num_layers)
            except ValueError as err:
                raise ValueError(
                    f"`num_stages` is an explicit plan that does not fit the model's {num_layers} "
                    f"layers: {err}"
                ) from None
        elif mode != "auto":
            _check_num_stages(mode, num_layers)
        self.mode, self.num_layers, self.num_devices = mode, num_layers, num_devices
        self.memory_budget, self.hysteresis, self.frozen, self.smoothing = memory_budget, hysteresis, frozen, smoothing
        self.warmup, self.settle, self.tolerance = warmup, settle, tolerance
        self._plan: Plan | None = mode if isinstance(mode, Plan) else None
        self._initial: list[LayerCost] | None = None
        self._bytes: list[tuple[int, int]] | None = None
        self._activations = [0] * num_layers       # per layer: bytes its compute keeps for backward
        self._measured_activations: set[int] = set()  # layers whose figure is measured (an estimate no longer counts)
        self.activations_observed = False  # observe_activations has been called (an estimate, or measurements)
        self._ema: list[tuple[float, float]] = []
        self._recent: deque[list[float]] = deque(maxlen=settle)  # the last observations' per-layer fwd+bwd times
        self._seen = 0  # observations, the discarded warm-up included
        self._job_cost = job_cost  # until a job cost is observed
        self._job_ema = 0.0        # smoothed observed job costs (biased toward 0 like _ema), and their count
        self._jobs_seen = 0
        # once settled, each search that keeps the plan doubles the replans skipped before the next one
        self._searches_kept = 0
        self._replans_to_skip = 0

    def _make(self, costs: Sequence[LayerCost], job_cost: float = 0.0) -> Plan:
        if isinstance(self.mode, Plan):
            return self.mode
        if self.mode == "auto":
            return plan_auto(costs, num_devices=self.num_devices, memory_budget=self.memory_budget, job_cost=job_cost)
        return plan_chunks(costs, self.mode, memory_budget=self.memory_budget)

    def _check_len(self, costs: Sequence[LayerCost]) -> None:
        if len(costs) != self.num_layers:
            raise ValueError(f"got costs for {len(costs)} layers, the model has {self.num_layers}")

    def initial(self, costs: Sequence[LayerCost]) -> Plan:
        """Plan from first estimates (usually :func:`costs_from_bytes`) and remember the byte counts."""
        self._check_len(costs)
        self._initial = list(costs)
        self._bytes = [(c.param_bytes, c.grad_bytes) for c in costs]
        self._plan = self._make(costs)
        return self._plan

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            raise RuntimeError("Planner.initial() must be called before the plan is read")
        return self._plan

    def adopt(self, plan: Plan) -> None:
        """Use ``plan`` from now on (another process's, so that every ring runs the same plan)."""
        plan.validate(self.num_layers)
        self._plan = plan

    def observe(self, measured: Sequence[LayerCost], *, job_cost: float | None = None) -> None:
        """Fold one step's measured per-layer times, and the fixed cost of its jobs if measured (seconds per
        job, see the class docstring), into the smoothed estimates (the first ``warmup`` are discarded)."""
        self._check_len(measured)
        if job_cost is not None and not (math.isfinite(job_cost) and job_cost >= 0):
            raise ValueError(f"job_cost must be finite and >= 0, got {job_cost}")
        self._seen += 1
        if self._seen <= self.warmup:
            return
        a = self.smoothing
        if job_cost is not None:
            self._job_ema = a * self._job_ema + (1 - a) * job_cost
            self._jobs_seen += 1
        if not self._ema:
            self._ema = [(0.0, 0.0)] * self.num_layers
        self._ema = [(a * f + (1 - a) * m.forward, a * b + (1 - a) * m.backward)
                     for (f, b), m in zip(self._ema, measured, strict=True)]
        self._recent.append([m.forward + m.backward for m in measured])

    @property
    def settled(self) -> bool:
        """The last ``settle`` observations after warm-up agree: each within ``tolerance`` of their mean."""
        if len(self._recent) < self.settle:
            return False
        mean = [sum(times) / len(times) for times in zip(*self._recent, strict=True)]
        total = sum(mean)
        return all(sum(abs(x - m) for x, m in zip(times, mean, strict=True)) <= self.tolerance * total
                   for times in self._recent)

    @property
    def estimate(self) -> list[LayerCost] | None:
        """The bias-corrected smoothed costs, or ``None`` before the first post-warm-up observation."""
        if not self._ema or self._bytes is None:
            return None
        norm = 1 - self.smoothing ** (self._seen - self.warmup)
        return [LayerCost(f / norm, b / norm, p, g, act) for (f, b), (p, g), act
                in zip(self._ema, self._bytes, self._activations, strict=True)]

    @property
    def job_cost(self) -> float:
        """The fixed cost per job the plan weighs (seconds): the bias-corrected smoothed observations, else
        the ``job_cost`` given."""
        if not self._jobs_seen:
            return self._job_cost
        return self._job_ema / (1 - self.smoothing ** self._jobs_seen)

    def _costs_job(self) -> tuple[list[LayerCost] | None, float]:
        """The costs to plan with (the smoothed measurements, else the first estimates) and the job cost that
        goes with them (none with the first estimates: they are not in seconds)."""
        estimate = self.estimate
        if estimate is not None:
            return estimate, self.job_cost
        return self._initial_costs(), 0.0

    @property
    def activation_bytes(self) -> list[int]:
        """Per layer, what its compute keeps for backward per microbatch, as far as known (0: nothing yet)."""
        return list(self._activations)

    def observe_activations(self, per_layer: Mapping[int, int], *, measured: bool = True) -> bool:
        """Learn what layers' compute keeps for backward per microbatch (``layer -> bytes``): an estimate
        (``measured=False``: :func:`autocast_copy_bytes` before anything ran, say), or a measurement, which
        replaces the layer's estimate and then only grows (the largest batch so far). If the current plan no
        longer fits the memory budget, one that does is adopted at once (warm-up, settling and hysteresis do
        not apply to memory); when none does, the plan stays and the device accounting reports the shortfall
        if it happens. Returns whether the plan changed."""
        self.activations_observed = True
        for layer, nbytes in per_layer.items():
            if measured:
                known = self._activations[layer] if layer in self._measured_activations else 0
                self._activations[layer] = max(known, nbytes)
                self._measured_activations.add(layer)
            elif layer not in self._measured_activations:
                self._activations[layer] = max(self._activations[layer], nbytes)
        costs, job_cost = self._costs_job()
        if self.frozen or isinstance(self.mode, Plan) or self._plan is None or costs is None:
            return False
        if plan_fits(self._plan, costs, self.memory_budget):
            return False
        try:
            candidate = self._make(costs, job_cost)
        except ValueError:  # no plan fits: a layer alone is over half the budget
            return False
        changed, self._plan = candidate != self._plan, candidate
        return changed

    def fused_graphs_fit(self, num_microbatches: int) -> bool:
        """Whether the fused stage may keep the forward graphs of ``num_microbatches`` microbatches on a device
        from a transparent call's forward to its backward, instead of recomputing them: always without a memory
        budget; with one, once what every fused layer keeps for backward is measured and its parameters,
        gradients and that many microbatches' activations fit in half the budget (the other half holds the
        next stage's prefetch, as for any stage)."""
        if self.memory_budget is None:
            return True
        fused = self.plan.fused
        if self._bytes is None or not all(layer in self._measured_activations for layer in fused):
            return False
        need = sum(self._bytes[layer][0] + self._bytes[layer][1] + num_microbatches * self._activations[layer]
                   for layer in fused)
        return need <= self.memory_budget / 2

    def _initial_costs(self) -> list[LayerCost] | None:
        """The first estimates, with what is known of the activations."""
        if self._initial is None:
            return None
        return [LayerCost(c.forward, c.backward, c.param_bytes, c.grad_bytes, act)
                for c, act in zip(self._initial, self._activations, strict=True)]

    def replan(self) -> bool:
        """Between iterations only: adopt a plan built from the smoothed costs if its
        :func:`predicted_cost` beats the current plan's (under the same costs) by more than
        ``hysteresis`` (a fraction), so noise does not make the partition flap. Returns whether the
        plan changed. Nothing changes before the measured times have settled (see the class docstring).

        A search costs milliseconds of host time, and settled costs move slowly: each search in a row that
        keeps the plan makes the next one wait twice as many replans (1, 3, 7, ... at most
        :attr:`MOST_SKIPPED`); a change, or costs that no longer agree, search at once again."""
        costs = self.estimate
        if self.frozen or isinstance(self.mode, Plan) or costs is None or self._plan is None or not self.settled:
            self._searches_kept = self._replans_to_skip = 0
            return False
        if self._replans_to_skip > 0:
            self._replans_to_skip -= 1
            return False
        job_cost = self.job_cost
        try:
            candidate = self._make(costs, job_cost)
        except ValueError:  # no plan fits memory with these activations: keep the current one
            candidate = self._plan
        if candidate != self._plan:
            now = predicted_cost(self._plan, costs, self.num_devices, job_cost)
            if predicted_cost(candidate, costs, self.num_devices, job_cost) < now * (1 - self.hysteresis):
                self._plan = candidate
                self._searches_kept = 0
                return True
        self._searches_kept += 1
        self._replans_to_skip = min(2 ** self._searches_kept - 1, self.MOST_SKIPPED)
        return False

    def state_dict(self) -> dict[str, Any]:
        """The plan in use and what the planner has learned, as plain values (a checkpoint loads them with
        ``torch.load(weights_only=True)``), for :meth:`load_state_dict`."""
        return {
            "mode": _mode_key(self.mode), "num_layers": self.num_layers, "num_devices": self.num_devices,
            "plan": self.plan.sizes(),
            "activations": list(self._activations), "measured_activations": sorted(self._measured_activations),
            "activations_observed": self.activations_observed,
            "ema": [list(pair) for pair in self._ema], "recent": [list(times) for times in self._recent],
            "seen": self._seen, "job_ema": self._job_ema, "jobs_seen": self._jobs_seen,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> bool:
        """Continue from :meth:`state_dict`: its plan (unless the plan is explicit) and what it learned.
        Returns whether it was taken: a state made for another layer count, device count or ``mode`` is not,
        and the current plan stays. A restored plan that does not fit this planner's memory budget is
        replaced at once, as in :meth:`observe_activations` (unless frozen)."""
        if (state.get("num_layers"), state.get("num_devices"), state.get("mode")) != (
                self.num_layers, self.num_devices, _mode_key(self.mode)):
            return False
        self._activations = [int(value) for value in state["activations"]]
        self._measured_activations = {int(layer) for layer in state["measured_activations"]}
        self.activations_observed = bool(state["activations_observed"])
        self._ema = [(float(forward), float(backward)) for forward, backward in state["ema"]]
        self._recent = deque(([float(x) for x in times] for times in state["recent"]), maxlen=self.settle)
        self._seen = int(state["seen"])
        # a checkpoint from before job costs were measured has none: this planner's stands
        self._job_ema = float(state.get("job_ema", 0.0))
        self._jobs_seen = int(state.get("jobs_seen", 0))
        if isinstance(self.mode, Plan):
            return True
        self._plan = Plan.from_sizes(**state["plan"])
        self._plan.validate(self.num_layers)
        costs, job_cost = self._costs_job()
        if not self.frozen and costs is not None and not plan_fits(self._plan, costs, self.memory_budget):
            with contextlib.suppress(ValueError):  # no plan fits: keep it, the device accounting reports it
                self._plan = self._make(costs, job_cost)
        return True


def _mode_key(mode: Literal["auto"] | int | Plan) -> str | int:
    """The planner's ``mode`` as a plain value: an explicit plan is ``"plan"``."""
    return "plan" if isinstance(mode, Plan) else mode


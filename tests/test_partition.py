"""Partition tables: every expected plan below is worked out by hand in the comment next to it."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from lightning_roundpipe.planning.partition import (
    LayerCost,
    Plan,
    Planner,
    costs_from_bytes,
    plan_auto,
    plan_chunks,
    predicted_cost,
)

PAPER = Path(__file__).resolve().parents[1] / "lightning_roundpipe" / "observe" / "paper_profiles.json"


def sizes(plan: Plan) -> tuple[list[int], int, list[int]]:
    return [len(r) for r in plan.forward], len(plan.fused), [len(r) for r in plan.backward]


def uniform(n: int, f: float = 1.0, b: float = 2.0, head: tuple[float, float] = (2.0, 2.0), nbytes: int = 0) -> list[LayerCost]:
    """``n`` trunk layers plus a head, each layer ``nbytes`` of parameters and as many of gradients."""
    return [LayerCost(f, b, nbytes, nbytes)] * n + [LayerCost(*head, nbytes, nbytes)]


# --- costs_from_bytes ------------------------------------------------------------------------


def test_costs_from_bytes() -> None:
    # mean of [100, 0, 300] = 133.3 -> the parameter-free layer costs 1% of it = 1.333.
    costs = costs_from_bytes([100, 0, 300], backward_ratio=2.0)
    assert [c.forward for c in costs] == pytest.approx([100, 4 / 3, 300])
    assert [c.backward for c in costs] == pytest.approx([200, 8 / 3, 600])
    assert [(c.param_bytes, c.grad_bytes) for c in costs] == [(100, 100), (0, 0), (300, 300)]
    assert costs_from_bytes([8], [0], backward_ratio=1.0) == [LayerCost(8.0, 8.0, 8, 0)]
    assert costs_from_bytes([0, 0]) == [LayerCost(1.0, 2.0, 0, 0)] * 2
    with pytest.raises(ValueError, match="got 2 param_bytes but 1 grad_bytes"):
        costs_from_bytes([1, 2], [1])


# --- plan_chunks -----------------------------------------------------------------------------


def test_plan_chunks_hand_table() -> None:
    # Trunk forward [1,2,3,4,5] (backward 2x), head (2, 4). Two forward stages: the best split is
    # [1,2,3 | 4,5] (max 9; [1,2,3,4 | 5] gives 10). W = max(9, head 6, layer 4's 5+10=15) = 15.
    # Backward fwd+bwd = 3,6,9,12,15: the fewest stages within 15 are 4 (greedy: [0,1]=9, [2], [3],
    # [4]). Balanced at 4, the largest stage is 15 either way; cutting from layer 0, the first stage
    # takes its share 45/4 = 11.25: [0,1] = 9 (adding layer 2 gives 18), then one layer a stage.
    costs = [LayerCost(x, 2 * x) for x in (1, 2, 3, 4, 5)] + [LayerCost(2, 4)]
    assert plan_chunks(costs, 2) == Plan.from_sizes([3, 2], 1, [1, 1, 1, 2])
    # One stage: forward is the whole trunk (15); W = 15 -> same backward packing.
    assert plan_chunks(costs, 1) == Plan.from_sizes([5], 1, [1, 1, 1, 2])
    # Five stages: one layer each; W = 15 again.
    assert plan_chunks(costs, 5) == Plan.from_sizes([1] * 5, 1, [1, 1, 1, 2])


def test_plan_chunks_asymmetric() -> None:
    # The docs' example: 12 layers with forward 1, backward 2; four forward stages of 3 (cost 3),
    # W = 3, so a backward stage (fwd+bwd 3 per layer) holds one layer: 1/3 of a forward stage.
    plan = plan_chunks(uniform(12, head=(1.0, 2.0)), 4)
    assert plan == Plan.from_sizes([3, 3, 3, 3], 1, [1] * 12)
    # With a cheaper backward (1:0.5), a backward stage holds 2 layers: 3 / (1 + 0.5).
    assert sizes(plan_chunks(uniform(12, 1.0, 0.5, head=(1.0, 0.5)), 4)) == ([3] * 4, 1, [2] * 6)


def test_plan_chunks_forces_exact_count() -> None:
    # Trunk [10, 1, 1, 1]: the optimum bound is 10; greedy alone would use 2 stages, but 3 are asked.
    # Layer 0 must be alone (10 + 1 > 10); the rest, 3 in 2 stages: share 3/2 = 1.5 -> [1], [2,3].
    costs = [LayerCost(x, 0.0) for x in (10, 1, 1, 1)] + [LayerCost(1, 0)]
    assert sizes(plan_chunks(costs, 3))[0] == [1, 1, 2]


def test_plan_chunks_is_an_exact_min_max_split() -> None:
    # Oracle: brute force over every way to cut the trunk into k stages.
    rng = random.Random(0)
    for _ in range(40):
        m, k = rng.randint(2, 8), 0
        k = rng.randint(1, m)
        fwd = [rng.choice([1.0, 2.0, 3.0, 5.0, 8.0]) for _ in range(m)]
        costs = [LayerCost(x, 2 * x) for x in fwd] + [LayerCost(1, 1)]
        best = min(
            max(sum(fwd[a:b]) for a, b in zip((0, *cuts), (*cuts, m), strict=True))
            for cuts in itertools.combinations(range(1, m), k - 1)
        )
        plan = plan_chunks(costs, k)
        assert len(plan.forward) == k
        assert max(sum(fwd[i] for i in r) for r in plan.forward) == best
        # Backward (fwd+bwd = 3x): the fewest stages within W = max(best, 3 * heaviest layer, head 2),
        # and, at that count, the smallest possible largest stage.
        both = [3 * x for x in fwd]
        w = max(best, max(both), 2.0)
        count, total = 1, 0.0
        for x in both:
            if total + x > w:
                count, total = count + 1, 0.0
            total += x
        assert len(plan.backward) == count
        best_b = min(
            max(sum(both[a:b]) for a, b in zip((0, *cuts), (*cuts, m), strict=True))
            for cuts in itertools.combinations(range(1, m), count - 1)
        )
        assert max(sum(both[i] for i in r) for r in plan.backward) == best_b


def test_plan_chunks_memory() -> None:
    # 6 trunk layers of 10 param + 10 grad bytes, budget 100 -> 50 bytes a stage. One forward stage
    # would need 60 > 50 bytes; two are enough. Backward stages are capped at 2 layers (40 bytes).
    costs = uniform(6, 1.0, 0.0, head=(1.0, 0.0), nbytes=10)
    with pytest.raises(ValueError, match=r"num_stages=1 is too few: the memory budget needs at least 2 forward stages"):
        plan_chunks(costs, 1, memory_budget=100)
    # Two stages of 3 (time 3); W = 3 allows 3 layers a backward stage but memory allows 2.
    assert plan_chunks(costs, 2, memory_budget=100) == Plan.from_sizes([3, 3], 1, [2, 2, 2])
    assert plan_chunks(costs, 2) == Plan.from_sizes([3, 3], 1, [3, 3])


@pytest.mark.parametrize(
    ("layers", "k", "forward", "backward"),
    [
        (32, 6, [5, 5, 5, 5, 6, 6], [2] * 16),
        (28, 4, [7, 7, 7, 7], [2] * 14),
        (10, 4, [2, 2, 3, 3], [1] * 10),
        (7, 3, [2, 2, 3], [1] * 7),
        (5, 5, [1] * 5, [1] * 5),
    ],
)
def test_plan_chunks_balanced_sizes(layers: int, k: int, forward: list[int], backward: list[int]) -> None:
    # Equal layers (forward 1, backward 2, head 1 + 2): k forward stages of floor/ceil(layers / k)
    # layers, the larger ones deep (each stage takes floor(layers left / stages left) from layer 0:
    # 32 in 6 -> 5 (32/6), 5 (27/5), 5 (22/4), 5 (17/3), 6 (12/2), 6). W = max(largest forward
    # stage, 3): a backward stage (3 a layer) holds 2 layers when W is 6 or 7, else 1.
    assert plan_chunks(uniform(layers, head=(1.0, 2.0)), k) == Plan.from_sizes(forward, 1, backward)


def test_plan_chunks_backward_balanced() -> None:
    # 7 trunk layers (fwd+bwd 3 each), one forward stage (7) -> W = 7: backward stages of 2 layers
    # (6), so 4 stages. Greedy from layer 0 would give 2,2,2 and a leftover 1 at the deep end
    # (listed first). Balanced: the first stage takes its share 21/4 = 5.25 -> 1 layer; then
    # 18/3 = 6 -> 2, 2, 2. Deep to shallow: the single layer comes last (the shallowest stage).
    assert plan_chunks(uniform(7, head=(1.0, 2.0)), 1) == Plan.from_sizes([7], 1, [2, 2, 2, 1])


def test_plan_chunks_balance_respects_memory() -> None:
    # 6 trunk layers of time 1 (no backward), parameter bytes 30,30,5,5,5,5 (no gradients), budget
    # 100 -> 50 a stage. Time alone would split [3, 3], but [0,1,2] needs 65 bytes and any stage
    # holding layers 0 and 1 needs 60: the only 2-stage split is [0 | 1..5] (30 | 50 bytes), time
    # max 5. W = 5; backward (same times and bytes): also 2 stages, the same split, listed deep first.
    costs = [LayerCost(1.0, 0.0, b, 0) for b in (30, 30, 5, 5, 5, 5)] + [LayerCost(1.0, 0.0, 1, 0)]
    assert plan_chunks(costs, 2, memory_budget=100) == Plan.from_sizes([1, 5], 1, [5, 1])
    assert plan_chunks(costs, 2) == Plan.from_sizes([3, 3], 1, [3, 3])


@pytest.mark.parametrize("bad", [0, -1, 5, 2.0, True, "3"])
def test_plan_chunks_num_stages_errors(bad: object) -> None:
    costs = uniform(4)  # 5 layers: 1 to 4 forward stages
    with pytest.raises(ValueError, match=rf"num_stages={bad!r} is out of range: a model of 5 layers .* has 1 to 4 forward stages; set `num_stages`"):
        plan_chunks(costs, bad)  # type: ignore[arg-type]


def test_single_layer_is_fused_only() -> None:
    one = [LayerCost(1, 2)]
    assert plan_chunks(one, 3) == plan_auto(one, num_devices=4) == Plan((), range(0, 1), ())


# --- plan_auto -------------------------------------------------------------------------------


def test_plan_auto_hand_table() -> None:
    # 6 trunk layers (fwd 1, fwd+bwd 3) + head (fwd 2, fwd+bwd 4). Wmax = 4; threshold 1.1 leaves
    # one candidate, W = 4: fused = head (adding layer 5 gives 7); forward 4 a stage -> 2 stages
    # (greedy would pack [2, 4]), balanced [3, 3]; backward one layer a stage (3+3 > 4) -> 6. 9 stages.
    costs = uniform(6)
    assert plan_auto(costs, num_devices=4) == Plan.from_sizes([3, 3], 1, [1] * 6)
    # Threshold 2 -> candidates 4..8. Stage counts per W (fused | fwd | bwd):
    #   W=4: 1|2|6 = 9    W=5: 1|2|6 = 9    W=6: 1|1|3 = 5
    #   W=7: fused takes layer 5 too (4+3=7): 1|1|3 = 5     W=8: 5
    # 4 devices: costs 36, 45, 30, 35, 40 -> W=6.  10 devices: 40, 50, 60, 70, 80 -> W=4.
    assert plan_auto(costs, num_devices=4, upper_threshold=2.0) == Plan.from_sizes([6], 1, [2, 2, 2])
    assert plan_auto(costs, num_devices=10, upper_threshold=2.0) == Plan.from_sizes([3, 3], 1, [1] * 6)


def test_plan_auto_memory_cap() -> None:
    # As above with 10 + 10 bytes a layer, budget 100 -> 50 a stage: forward stages hold <= 5
    # layers, backward <= 2. W=4: 36 (unchanged). W=6: forward [1, 5] -> 6 stages, 36.
    # W=7: fused [5, 6] (40 bytes), forward [5], backward 3 stages (2 layers each at most) -> 5
    # stages, 35: best. Backward balanced over layers 0..4 (3 each): the first stage's share is
    # 15/3 = 5 -> [0] alone; then 12/2 = 6 -> [1,2], [3,4]. Deep to shallow: 2, 2, 1.
    costs = uniform(6, nbytes=10)
    plan = plan_auto(costs, num_devices=4, upper_threshold=2.0, memory_budget=100)
    assert plan == Plan.from_sizes([5], 2, [2, 2, 1])


def test_plan_auto_memory_error() -> None:
    costs = uniform(3, nbytes=10)[:-1] + [LayerCost(2, 2, 30, 10)]
    msg = (
        r"layer 3 needs 40 bytes on a device \(parameters \+ gradients\) but a stage may use at most "
        r"35 bytes, half of the memory budget of 70 bytes .*; raise `device_memory_limit`"
    )
    with pytest.raises(ValueError, match=msg):
        plan_auto(costs, num_devices=2, memory_budget=70)
    with pytest.raises(ValueError, match=msg):
        plan_chunks(costs, 2, memory_budget=70)


def paper_costs(model: dict) -> list[LayerCost]:
    return [LayerCost(model["fwd"], model["bwd"])] * model["layers"] + [
        LayerCost(model["lm_head_fwd"], model["lm_head_bwd"])
    ]


def test_plan_auto_paper_profiles() -> None:
    sim = json.loads(PAPER.read_text())["simulation"]
    got = {name: plan_auto(paper_costs(m), num_devices=8) for name, m in sim["models"].items()}
    counts = {name: p.num_stages for name, p in got.items()}
    paper = {n: sum(len(s.split(",")) for s in p.split("|")) for n, p in sim["paper_partitions_fwd_bwd_layers_per_stage"].items()}
    # The published planner's stage counts (reference note B.4): 15 and 23, by hand:
    # 1.7B: Wmax = head 65.77; W = 3 layers' fwd+bwd = 69.78 -> forward at most 9 a stage (66.9):
    # 4 stages for 28 layers; fused = head; backward at most 3 a stage: 10 stages -> 15. Greedy
    # packing gave [1,9,9,9] | 1 | [1,3x9]; balanced, 28 layers in 4 stages are 7 each, and 28 in 10
    # are 2 (28/10) , 2 (26/9), then 3 (24/8) x 8 from layer 0, i.e. deep to shallow 3x8, 2, 2:
    # the paper's partition 7,7,7,7 | 0,3x8,2,2 (its fused "0" is our head layer).
    assert got["Qwen3-1.7B"] == Plan.from_sizes([7, 7, 7, 7], 1, [3] * 8 + [2, 2])
    # 8B: W = 2 layers' fwd+bwd = 119.42 -> forward at most 6 a stage: 6 stages for 32 layers
    # (greedy [2,6,6,6,6,6]), balanced from layer 0: 32/6 -> 5, 27/5 -> 5, 22/4 -> 5, 17/3 -> 5,
    # 12/2 = 6, 6; backward 2 a stage: 16. The paper's 5,5,5,5,6,6 | 0,2x16. 23 stages.
    assert got["Llama3-8B"] == Plan.from_sizes([5, 5, 5, 5, 6, 6], 1, [2] * 16)
    # The others were already even: 20B [6]*4 | [1]*24, 32B [4]*16 | [1]*64, 235B [2]*47 | [1]*94.
    assert [sizes(got[n]) for n in ("GPT-OSS-20B", "Qwen3-32B", "Qwen3-235B")] == [
        ([6] * 4, 1, [1] * 24),
        ([4] * 16, 1, [1] * 64),
        ([2] * 47, 1, [1] * 94),
    ]
    # 20B: W = head 130.56, forward 6 a stage (129.87) -> 4 + 1 + 24 = 29 (paper 30: [4,5,5,5,5]).
    # 32B: W = head 163.22, forward 4 a stage -> 16 + 1 + 64 = 81 (paper 87: mostly 3 a stage,
    #      presumably from measured per-layer times that differ from this uniform profile).
    # 235B: W = one layer's fwd+bwd 101.39, forward 2 a stage -> 47 + 1 + 94 = 142 (paper 142).
    assert counts == {"Qwen3-1.7B": 15, "Llama3-8B": 23, "GPT-OSS-20B": 29, "Qwen3-32B": 81, "Qwen3-235B": 142}
    for name in counts:  # within 10% of the paper's partitions
        assert abs(counts[name] - paper[name]) <= 0.1 * paper[name]


# --- Planner ---------------------------------------------------------------------------------


def five(last: float) -> list[LayerCost]:
    """5 trunk layers of forward 1 (no backward) except the deepest one, plus a head of 0.5 + 0.5."""
    return [LayerCost(1, 0)] * 4 + [LayerCost(last, 0), LayerCost(0.5, 0.5)]


# Two forward stages, 1 device. All ones: bound 3; balanced from layer 0, the first stage takes its
# share 5/2 = 2.5 -> [0,1 | 2,3,4]. W = 3 -> backward (fwd+bwd 1 a layer) also 2 stages, the same
# split, listed deep first: [2,3,4], [0,1]. 5 stages.
START = Plan.from_sizes([2, 3], 1, [3, 2])


def test_planner_hysteresis() -> None:
    planner = Planner(2, 6, 1)
    assert planner.initial(five(1.0)) == START
    planner.observe(five(100.0))  # warm-up, discarded
    assert planner.replan() is False
    # Layer 4 -> 1.2: the best split is now [0,1,2 | 3,4] (3 | 2.2; the rest must fit in one stage
    # of 3, so the cut is at 3), backward likewise; predicted 5 * 3 = 15 against the current plan's
    # 5 * 3.2 = 16 (its stages [2,3,4]): 6.25% better, under the 10% hysteresis.
    planner.observe(five(1.2))
    planner.observe(five(1.2))  # two agreeing observations: settled
    assert planner.estimate == five(1.2)
    assert predicted_cost(START, five(1.2), 1) == pytest.approx(16.0)
    assert planner.replan() is False and planner.plan == START
    # With 5% hysteresis the same change is adopted.
    eager = Planner(2, 6, 1, hysteresis=0.05)
    eager.initial(five(1.0))
    eager.observe(five(1.0))
    eager.observe(five(1.2))
    eager.observe(five(1.2))
    assert eager.replan() is True and sizes(eager.plan)[0] == [3, 2]


def test_settled_replans_search_ever_less_often_while_the_plan_holds(monkeypatch) -> None:
    planner = Planner(2, 6, 1)
    planner.initial(five(1.0))
    for _ in range(3):  # the warm-up, then two agreeing observations: settled
        planner.observe(five(1.0))
    search, searches = planner._make, []
    monkeypatch.setattr(planner, "_make", lambda *args: searches.append(None) or search(*args))
    searched_at = []
    for replan in range(1, 25):
        before = len(searches)
        assert planner.replan() is False and planner.plan == START
        if len(searches) > before:
            searched_at.append(replan)
    assert searched_at == [1, 3, 7, 15]  # 0, 1, 3, 7 replans skipped after each search that kept the plan
    planner.observe(five(10.0))  # the costs no longer agree (no search), then agree again: searched at once
    before = len(searches)
    assert planner.replan() is False and len(searches) == before
    planner.observe(five(10.0))
    planner.replan()
    assert len(searches) == before + 1


def test_planner_large_change_replans() -> None:
    # Layer 4 -> 3: current plan's stage [2,3,4] costs 5 -> 25. Candidate: split bound 4 (either
    # [0,1,2 | 3,4] or [0..3 | 4]); the first stage's share is 7/2 = 3.5 -> [0,1,2 | 3,4]. W = 4,
    # backward (the same times) 2 stages, the same split (greedy would pack [0..3], [4]) -> 5
    # stages, 5 * 4 = 20: 20% better.
    planner = Planner(2, 6, 1)
    planner.initial(five(1.0))
    planner.observe(five(1.0))
    planner.observe(five(3.0))
    assert planner.replan() is False  # one observation after the warm-up: not settled yet
    planner.observe(five(3.0))
    assert planner.replan() is True
    assert planner.plan == Plan.from_sizes([3, 2], 1, [2, 3])
    assert planner.replan() is False  # nothing new: stays put


def test_planner_smoothing_is_bias_corrected() -> None:
    planner = Planner("auto", 6, 1)
    planner.initial(five(1.0))
    for x in (50.0, 10.0, 20.0):  # 50 is the warm-up
        planner.observe(five(x))
    # (0.9 * 0.1 * 10 + 0.1 * 20) / (1 - 0.9^2) = 2.9 / 0.19
    assert planner.estimate is not None
    assert planner.estimate[4].forward == pytest.approx(2.9 / 0.19)
    assert planner.estimate[0].forward == pytest.approx(1.0)


def test_planner_frozen_and_explicit() -> None:
    frozen = Planner(2, 6, 1, frozen=True)
    frozen.initial(five(1.0))
    frozen.observe(five(1.0))
    frozen.observe(five(3.0))
    frozen.observe(five(3.0))
    assert frozen.replan() is False and frozen.plan == START

    explicit = Plan.from_sizes([4, 1], 1, [5])
    planner = Planner(explicit, 6, 1)
    assert planner.plan == explicit and planner.initial(five(1.0)) == explicit
    planner.observe(five(1.0))
    planner.observe(five(9.0))
    planner.observe(five(9.0))
    assert planner.replan() is False and planner.plan == explicit


def test_planner_errors() -> None:
    with pytest.raises(ValueError, match=r"`num_stages` is an explicit plan that does not fit the model's 7 layers"):
        Planner(START, 7, 2)
    with pytest.raises(ValueError, match=r"num_stages=6 is out of range: a model of 6 layers .* has 1 to 5"):
        Planner(6, 6, 2)
    with pytest.raises(RuntimeError, match=r"initial\(\) must be called"):
        _ = Planner("auto", 6, 2).plan
    with pytest.raises(ValueError, match="got costs for 5 layers, the model has 6"):
        Planner("auto", 6, 2).initial(five(1.0)[:5])

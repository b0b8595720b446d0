"""Schedule builders, validator messages, the ASCII grid and the CLI."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from lightning_roundpipe.planning.cli import main
from lightning_roundpipe.planning.partition import Plan
from lightning_roundpipe.planning.schedule import (
    Job,
    StageKind,
    backward_jobs,
    format_grid,
    forward_jobs,
    training_jobs,
    training_rounds,
    validate,
    validate_rounds,
)

# 12 layers: forward [0-2] [3-5] [6-8] [9-10], fused [11], backward [10] [9] ... [0].
PLAN = Plan.from_sizes([3, 3, 3, 2], 1, [1] * 11)


def test_training_jobs_ring_and_dependencies():
    jobs = training_jobs(PLAN, 3, 4, first_index=7)
    assert [j.label for j in jobs] == ["F0", "F1", "F2", "F3", "L"] + [f"B{b}" for b in range(11)]
    assert [j.index for j in jobs] == list(range(7, 23))
    assert [j.device for j in jobs] == [i % 3 for i in range(7, 23)]  # continues the ring from 7
    assert jobs[0].depends_on == ()
    assert all(j.depends_on == (j.index - 1,) for j in jobs[1:])
    assert jobs[4].kind is StageKind.FUSED and jobs[4].layers == range(11, 12) and jobs[4].stage == 0
    assert jobs[5].layers == range(10, 11) and jobs[-1].layers == range(0, 1)
    assert {j.num_microbatches for j in jobs} == {4}
    validate(jobs, 12, 3)


def test_training_rounds():
    tiny = Plan.from_sizes([1], 1, [1])  # F0 | L | B0
    jobs = training_rounds(tiny, 2, 5, 2, first_index=3)
    # rounds of 2, 2, 1 microbatches; ring positions 3..11 continue across rounds (devices 1 0 1 0 ...)
    assert [(j.label, j.index, j.device, j.first_microbatch, j.num_microbatches) for j in jobs] == [
        ("F0", 3, 1, 0, 2), ("L", 4, 0, 0, 2), ("B0", 5, 1, 0, 2),
        ("F0", 6, 0, 2, 2), ("L", 7, 1, 2, 2), ("B0", 8, 0, 2, 2),
        ("F0", 9, 1, 4, 1), ("L", 10, 0, 4, 1), ("B0", 11, 1, 4, 1),
    ]
    # each round's first job consumes the caller's data; the others the job before, in the same round
    assert [j.depends_on for j in jobs] == [(), (3,), (4,), (), (6,), (7,), (), (9,), (10,)]
    assert jobs[4].microbatches == range(2, 4) and jobs[8].microbatches == range(4, 5)
    validate_rounds(jobs, 2, 2)
    validate(jobs[3:6], 2, 2)  # one round is one training call
    # A round of all microbatches is the whole-job call; validate_rounds accepts that too.
    assert training_rounds(tiny, 2, 5, 5) == training_jobs(tiny, 2, 5)
    assert training_jobs(tiny, 2, 5)[0].microbatches == range(5)
    validate_rounds(training_jobs(PLAN, 3, 4), 12, 3)
    assert training_jobs(tiny, 2, 3, 1, first_microbatch=4)[2] == Job(3, 1, StageKind.BACKWARD, 0, range(0, 1), 3,
                                                                       (2,), 4)
    with pytest.raises(ValueError, match="round_size must be >= 1, got 0"):
        training_rounds(tiny, 2, 5, 0)
    with pytest.raises(ValueError, match="first_microbatch must be >= 0, got -1"):
        training_jobs(tiny, 2, 5, first_microbatch=-1)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda j: j[3:], r"round 0 starts at microbatch 2, expected 0: rounds cover the batch in order"),
        (lambda j: j[:3] + j[6:], r"round 1 starts at microbatch 4, expected 2"),
        (lambda j: j[:3] + [dataclasses.replace(x, index=x.index + 1, device=(x.index + 1) % 2) for x in j[3:]],
         r"round 1 starts at ring position 4, expected 3: the ring counter continues"),
        (lambda j: [dataclasses.replace(x, num_microbatches=1) for x in j[:3]]
         + [dataclasses.replace(x, first_microbatch=1) for x in j[3:]],
         r"round 1 has 2 microbatches, expected 1: all rounds but the last have the first round's size"),
        (lambda j: j[:3] + [dataclasses.replace(x, first_microbatch=3) for x in j[3:6]] + j[6:],
         r"round 1 starts at microbatch 3, expected 2"),
        (lambda j: j[:1] + j[3:], r"round 0 runs F0: a round is a whole training call"),
        (lambda j: j[:4] + [dataclasses.replace(j[4], depends_on=(1,))] + j[5:],
         r"job L \(index 4\) depends on \(1,\), expected \(3,\)"),
        (lambda j: [], r"a schedule needs at least one job, got none"),
    ],
)
def test_validate_rounds_messages(mutate, message):
    with pytest.raises(ValueError, match=message):
        validate_rounds(mutate(training_rounds(Plan.from_sizes([1], 1, [1]), 2, 5, 2)), 2, 2)


def test_transparent_path_jobs():
    fwd = forward_jobs(PLAN, 2, 3)
    assert [(j.label, j.layers) for j in fwd][-2:] == [("F3", range(9, 11)), ("F4", range(11, 12))]
    assert all(j.kind is StageKind.FORWARD for j in fwd)
    bwd = backward_jobs(PLAN, 2, 3, first_index=len(fwd))
    assert [(j.label, j.layers) for j in bwd][:2] == [("B0", range(11, 12)), ("B1", range(10, 11))]
    assert bwd[0].depends_on == () and bwd[0].index == 5 and bwd[0].device == 1
    assert bwd[1].depends_on == (5,)
    validate(fwd, 12, 2)
    validate(bwd, 12, 2)
    # A plan that is only the fused stage: one job each way.
    solo = Plan((), range(0, 3), ())
    assert [j.label for j in training_jobs(solo, 2, 1)] == ["L"]
    validate(training_jobs(solo, 2, 1), 3, 2)
    validate(backward_jobs(solo, 2, 1), 3, 2)


def test_builders_reject_bad_arguments():
    with pytest.raises(ValueError, match="num_devices must be >= 1, got 0"):
        training_jobs(PLAN, 0, 2)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1, got 0"):
        forward_jobs(PLAN, 2, 0)


def _replace(jobs: list[Job], k: int, **changes) -> list[Job]:
    out = list(jobs)
    out[k] = dataclasses.replace(out[k], **changes)
    return out


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda j: _replace(j, 2, device=1), r"job F2 \(index 2\) is on device 1, but the ring puts it on device 0 \(index % 2\)"),
        (lambda j: _replace(j, 3, index=9), r"job F3 has index 9, expected 3: a call's jobs take consecutive ring positions"),
        (lambda j: _replace(j, 1, num_microbatches=0), r"job F1 has num_microbatches=0, expected >= 1"),
        (lambda j: _replace(j, 1, num_microbatches=3), r"job F1 has 3 microbatches but job F0 has 2: one call splits its batch once"),
        (lambda j: _replace(j, 1, first_microbatch=2), r"job F1 starts at microbatch 2 but job F0 at 0: the jobs of one call \(or round\) run the same microbatches"),
        (lambda j: _replace(j, 2, depends_on=(5,)), r"job F2 \(index 2\) depends on \(5,\): dependencies must point to earlier jobs"),
        (lambda j: _replace(j, 2, depends_on=(0,)), r"job F2 \(index 2\) depends on \(0,\), expected \(1,\): each job consumes the previous job in the data flow"),
        (lambda j: _replace(j, 0, depends_on=(-1,)), r"job F0 \(index 0\) depends on \(-1,\), expected \(\): each job"),
        (lambda j: _replace(j, 1, stage=2), r"job at index 1 is F2, expected stage 1 of its kind"),
        (lambda j: _replace(j, 1, layers=range(4, 6)), r"forward job F1 holds layers \[4-5\], expected a run starting at layer 3: forward stages \(and the fused stage\) cover"),
        (lambda j: _replace(j, 4, layers=range(11, 13)), r"forward jobs cover layers \[0, 13\), expected \[0, 12\)"),
        (lambda j: _replace(j, 6, layers=range(8, 9)), r"backward job B1 holds layers \[8\], expected a run ending at layer 9: backward stages cover the layers deep to shallow from layer 10"),
        (lambda j: _replace(j, 15, layers=range(1, 1)), r"backward job B10 holds layers \[\], expected a run ending at layer 0"),
        (lambda j: _replace(j, 4, kind=StageKind.BACKWARD), r"jobs run F0 F1 F2 F3 B0 B0 B1 .*; a call is forward stages, then the fused stage"),
        (lambda j: j[:15], r"backward jobs cover layers \[1, 11\), expected \[0, 11\)"),
        (lambda j: [], r"a schedule needs at least one job, got none"),
    ],
)
def test_validate_messages(mutate, message):
    with pytest.raises(ValueError, match=message):
        validate(mutate(training_jobs(PLAN, 2, 2)), 12, 2)


def test_validate_other_shapes():
    with pytest.raises(ValueError, match="num_devices must be >= 1, got 0"):
        validate(training_jobs(PLAN, 2, 2), 12, 0)
    # Forward then backward without the fused stage that joins them.
    fwd = forward_jobs(PLAN, 2, 2)[:-1]
    bwd = backward_jobs(PLAN, 2, 2, first_index=len(fwd) - 1)[1:]
    mixed = fwd + [dataclasses.replace(j, stage=j.stage - 1) for j in bwd]
    with pytest.raises(ValueError, match=r"jobs run F0 F1 F2 F3 B0 .*or backward stages only"):
        validate(mixed, 12, 2)
    # A backward call must start at the deepest layer.
    with pytest.raises(ValueError, match=r"backward job B0 holds layers \[11\], expected a run ending at layer 12"):
        validate(backward_jobs(PLAN, 2, 2), 13, 2)
    # The first job of a call consumes the caller's data, not a job.
    with pytest.raises(ValueError, match=r"job B1 \(index 1\) depends on \(0,\), expected \(\)"):
        validate(backward_jobs(PLAN, 2, 2)[1:], 12, 2)


def test_format_grid_by_hand():
    plan = Plan.from_sizes([1, 1], 1, [1, 1])
    grid = format_grid(training_jobs(plan, 2, 2), 2)
    # Unit cost per microbatch. L.0 waits for F1.0 (ends at 2), B0.0 for L.0 (3), B1.0 for B0.0 (4).
    assert grid.splitlines() == [
        "t      0    1    2    3    4    5",
        "dev0  |F0.0|F0.1|L.0 |L.1 |B1.0|B1.1|",
        "dev1  |    |F1.0|F1.1|B0.0|B0.1|    |",
    ]
    # Longer jobs span several columns, continued with '='.
    cost = {StageKind.FORWARD: 1.0, StageKind.FUSED: 2.0, StageKind.BACKWARD: 2.0}
    grid = format_grid(training_jobs(plan, 2, 1), 2, cost=lambda j: cost[j.kind])
    assert grid.splitlines()[1:] == [
        "dev0  |F0.0|    |L.0 |=== |    |    |B1.0|====|",
        "dev1  |    |F1.0|    |    |B0.0|====|    |    |",
    ]
    assert format_grid([], 2) == "(no jobs)"


def test_cli_prints_plan_and_grid(capsys):
    assert main(["--layers", "12", "--devices", "2", "--microbatches", "3", "--plan", "3,3,3,2|1|" + ",".join(["1"] * 11)]) == 0
    out = capsys.readouterr().out
    assert "forward  (4): [0-2] [3-5] [6-8] [9-10]" in out
    assert "fused    (1): [11]" in out
    assert "training call: 16 jobs on 2 devices, 3 microbatches each" in out
    assert "dev1  |     |F1.0 |F1.1 |F1.2 |" in out
    assert main(["--layers", "12", "--devices", "2", "--stages", "4", "--path", "backward"]) == 0
    assert "backward call: 12 jobs on 2 devices, 3 microbatches each" in capsys.readouterr().out
    assert main(["--layers", "12", "--devices", "4"]) == 0  # plan_auto, equal per-layer costs
    assert "training call:" in capsys.readouterr().out


def test_cli_errors(capsys):
    with pytest.raises(SystemExit) as err:
        main(["--layers", "12", "--devices", "2", "--plan", "3,3|1"])
    assert err.value.code == 2
    assert "--plan '3,3|1' is not 'forward sizes|fused size|backward sizes (deep to shallow)'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--layers", "12", "--devices", "2", "--plan", "3,3,3|1|2,2,2,2"])
    assert "backward stages must be non-empty contiguous runs covering layers [0, 9)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--layers", "0", "--devices", "2"])
    assert "--layers and --devices must be >= 1, got 0 and 2" in capsys.readouterr().err


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as err:
        main(["--help"])
    assert err.value.code == 0
    assert "ring schedule" in capsys.readouterr().out


def test_cli_runs_as_module():
    # One real `python -m` run; the package and the pure planning modules import no torch.
    done = subprocess.run(
        [sys.executable, "-m", "lightning_roundpipe.planning", "--layers", "6", "--devices", "2", "--microbatches", "2"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("forward  (")
    assert "dev0  |F0.0|" in done.stdout

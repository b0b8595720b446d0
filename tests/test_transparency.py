"""The engine's results equal plain PyTorch running the same microbatches one after another.

Two checks per case (see ``tests/numerics.py`` for where their tolerances come from):

* ``f64``: the engine runs a float64 copy of the model and must equal the float64 reference to 1e-12. This
  checks the algorithm (schedule, accumulation, loss weights, BatchNorm statistics, optimizer timing), with
  and without ``jitter`` (random delays that shake how the threads interleave).
* ``f32``: the engine runs the model as given, in float32, and may differ from the float64 reference by at
  most 4 times what the float32 reference itself differs by (plus 4 ulps of the tensor's norm): nothing is
  numerically worse than plain training, on whatever kernels this CPU has. Steady only: jitter changes the
  timing, not the arithmetic, and the float64 check covers it.

The cases are covering designs, not full products (``tests/designs.py``): every pair of levels of any two
factors (model, devices, microbatches, recompute grain, optimizer, check) is in at least one case, which
:func:`test_each_design_holds_every_pair_of_levels` checks, plus a few cases that matter on their own. The
references come from ``tests/references.py``, once per distinct input (model, microbatch sizes, optimizer,
dtype): the devices, the grain and jitter are the engine's business and never change the reference.
"""

from __future__ import annotations

import pytest
import torch

from lightning_roundpipe import EngineOptions, RoundPipeEngine
from tests.designs import missing_pairs
from tests.models import make_optimizer, split_sizes, transparency_case
from tests.numerics import (
    assert_close_to_reference,
    assert_float64_equal,
    assert_states_close_to_reference,
    assert_states_float64_equal,
    double,
)
from tests.references import case_batches, delayed_reference, sync_reference, transparent_reference

STEPS = 5
CHECKS = {"f64-steady": ("float64", 0.0), "f64-jitter": ("float64", 0.002), "f32": ("float32", 0.0)}
"""A check's name -> the precision the engine runs in and its jitter (seconds)."""
MODELS = ["bn", "gpt"]
OPTIMIZERS = ["sgd", "adamw"]


def _case(model_name: str, devices: int, microbatches: int, recompute: str, optimizer_kind: str,
          check: str) -> pytest.param:
    """A case of the fused-path design, named by its values: ``bn-3dev-5mb-layer-adamw-f32``."""
    return pytest.param(model_name, devices, microbatches, recompute, optimizer_kind, check,
                        id=f"{model_name}-{devices}dev-{microbatches}mb-{recompute}-{optimizer_kind}-{check}")


# ---------------------------------------------------------------------------------------------- the fused path
SYNC_FACTORS = {"model_name": MODELS, "devices": [1, 2, 3], "microbatches": [1, 2, 4, 5],
                "recompute": ["stage", "layer"], "optimizer_kind": OPTIMIZERS, "check": list(CHECKS)}
SYNC_PAIRWISE = [  # 12 = 4 microbatch counts x 3 device counts, each once; every other pair at least once
    _case("bn", 1, 1, "stage", "sgd", "f64-steady"),
    _case("gpt", 2, 1, "stage", "sgd", "f64-jitter"),
    _case("bn", 3, 1, "layer", "adamw", "f32"),
    _case("bn", 1, 2, "layer", "adamw", "f64-jitter"),
    _case("gpt", 2, 2, "layer", "adamw", "f32"),
    _case("gpt", 3, 2, "stage", "sgd", "f64-steady"),
    _case("gpt", 1, 4, "layer", "adamw", "f32"),
    _case("bn", 2, 4, "stage", "adamw", "f64-steady"),
    _case("bn", 3, 4, "layer", "sgd", "f64-jitter"),
    _case("gpt", 1, 5, "layer", "sgd", "f64-steady"),
    _case("bn", 2, 5, "layer", "adamw", "f64-jitter"),
    _case("bn", 3, 5, "stage", "sgd", "f32"),
]
SYNC_CASES = [
    *SYNC_PAIRWISE,
    # the most interleaving: 3 devices, 5 uneven microbatches (7 samples: 2, 2, 1, 1, 1), every layer a
    # recompute group, jitter; the tied embedding and head get contributions from two stages
    _case("gpt", 3, 5, "layer", "adamw", "f64-jitter"),
    # float32 AdamW on BatchNorm at the most interleaving: AdamW divides by sqrt(v) + eps, so it scales up
    # whatever rounding noise the gradients carry (tests/numerics.py)
    _case("bn", 3, 5, "layer", "adamw", "f32"),
]


def _dtypes(precision: str) -> list[torch.dtype]:
    """The references a check compares against: float64 alone, or float32 and float64 (the float32 bound)."""
    return [torch.float64] if precision == "float64" else [torch.float32, torch.float64]


def _assert_equals_reference(precision: str, losses: list[torch.Tensor], model, references) -> None:
    """``references`` maps a dtype to the reference's ``(state, losses)`` computed in it."""
    ours = torch.stack([loss.detach().reshape(()) for loss in losses])
    if precision == "float64":
        state64, losses64 = references[torch.float64]
        assert_float64_equal(ours, losses64, what="losses")
        assert_states_float64_equal(model, state64)
    else:
        (state32, losses32), (state64, losses64) = references[torch.float32], references[torch.float64]
        assert_close_to_reference(ours, losses32, losses64, what="losses")
        assert_states_close_to_reference(model, state32, state64)


def _in(precision: str, model):
    return double(model) if precision == "float64" else model


def _fused_run(model_name: str, precision: str, devices: int, options: EngineOptions, optimizer_kind: str):
    """The case's model (in ``precision``) trained by ``forward_backward`` + ``step``; returns it and the losses."""
    model, _, _, loss_fn, weight_fn = transparency_case(model_name)
    model = _in(precision, model)
    optimizer = make_optimizer(optimizer_kind, model.parameters())
    kwargs = {} if weight_fn is None else {"loss_weight": weight_fn}
    losses = []
    with RoundPipeEngine(model, devices, options) as engine:
        for inputs, target in case_batches(model_name, STEPS, next(model.parameters()).dtype):
            losses.append(engine.forward_backward(inputs, target, loss_fn, **kwargs))
            engine.step(optimizer)
        engine.synchronize()
    return model, losses


@pytest.mark.parametrize(list(SYNC_FACTORS), SYNC_CASES)
def test_sync_fused_path_equals_plain_pytorch(model_name, devices, microbatches, recompute, optimizer_kind, check):
    precision, jitter = CHECKS[check]
    sizes = split_sizes(transparency_case(model_name)[2], microbatches)
    references = {dtype: sync_reference(model_name, sizes, optimizer_kind, dtype, STEPS)
                  for dtype in _dtypes(precision)}
    options = EngineOptions(num_microbatches=microbatches, recompute=recompute, num_stages=2, jitter=jitter)
    model, losses = _fused_run(model_name, precision, devices, options, optimizer_kind)
    _assert_equals_reference(precision, losses, model, references)


# ---------------------------------------------------------------------------------------------- the transparent path
LAYOUTS = [(1, 1, "stage"), (2, 4, "layer"), (3, 5, "stage")]
"""``(devices, microbatches, recompute)``: one device with one microbatch, and two pipelined layouts."""
TRANSPARENT_FACTORS = {"model_name": MODELS, "layout": LAYOUTS, "check": list(CHECKS)}
TRANSPARENT_CASES = [  # 9 = 3 layouts x 3 checks, each once; both models with each layout and each check
    pytest.param("gpt", LAYOUTS[0], "f64-steady", id="gpt-1dev-1mb-stage-f64-steady"),
    pytest.param("bn", LAYOUTS[0], "f64-jitter", id="bn-1dev-1mb-stage-f64-jitter"),
    pytest.param("gpt", LAYOUTS[0], "f32", id="gpt-1dev-1mb-stage-f32"),
    pytest.param("gpt", LAYOUTS[1], "f64-jitter", id="gpt-2dev-4mb-layer-f64-jitter"),
    pytest.param("bn", LAYOUTS[1], "f32", id="bn-2dev-4mb-layer-f32"),
    pytest.param("gpt", LAYOUTS[1], "f64-steady", id="gpt-2dev-4mb-layer-f64-steady"),
    pytest.param("gpt", LAYOUTS[2], "f32", id="gpt-3dev-5mb-stage-f32"),
    pytest.param("bn", LAYOUTS[2], "f64-steady", id="bn-3dev-5mb-stage-f64-steady"),
    pytest.param("bn", LAYOUTS[2], "f64-jitter", id="bn-3dev-5mb-stage-f64-jitter"),
]


@pytest.mark.parametrize(list(TRANSPARENT_FACTORS), TRANSPARENT_CASES)
def test_transparent_path_equals_plain_pytorch(model_name, layout, check):
    """Calling the trunk and then ``loss.backward()`` gives the whole-batch gradients."""
    (devices, microbatches, recompute), (precision, jitter) = layout, CHECKS[check]
    model, _, samples, loss_fn, _ = transparency_case(model_name)
    sizes = split_sizes(samples, microbatches)
    references = {dtype: transparent_reference(model_name, sizes, dtype, STEPS) for dtype in _dtypes(precision)}
    model = _in(precision, model)
    optimizer = make_optimizer("sgd", model.parameters())
    options = EngineOptions(num_microbatches=microbatches, recompute=recompute, num_stages="auto", jitter=jitter)
    losses = []
    with RoundPipeEngine(model, devices, options) as engine:
        for inputs, target in case_batches(model_name, STEPS, next(model.parameters()).dtype):
            loss = loss_fn(engine(inputs), target)
            loss.backward()
            engine.step(optimizer)
            losses.append(loss)
        engine.synchronize()
    _assert_equals_reference(precision, losses, model, references)


# ---------------------------------------------------------------------------------------------- async_step
ASYNC_LAYOUTS = [(1, 2, "stage"), (2, 3, "layer"), (3, 4, "stage")]
"""``(devices, microbatches, recompute)``."""
ASYNC_FACTORS = {"model_name": MODELS, "optimizer_kind": OPTIMIZERS, "layout": ASYNC_LAYOUTS,
                 "check": list(CHECKS)}
ASYNC_CASES = [  # 9 = 3 layouts x 3 checks, each once; every model, optimizer, layout and check pair
    pytest.param("gpt", "adamw", ASYNC_LAYOUTS[0], "f64-steady", id="gpt-adamw-1dev-2mb-stage-f64-steady"),
    pytest.param("bn", "adamw", ASYNC_LAYOUTS[0], "f64-jitter", id="bn-adamw-1dev-2mb-stage-f64-jitter"),
    pytest.param("gpt", "sgd", ASYNC_LAYOUTS[0], "f32", id="gpt-sgd-1dev-2mb-stage-f32"),
    pytest.param("bn", "sgd", ASYNC_LAYOUTS[1], "f64-jitter", id="bn-sgd-2dev-3mb-layer-f64-jitter"),
    pytest.param("gpt", "sgd", ASYNC_LAYOUTS[1], "f32", id="gpt-sgd-2dev-3mb-layer-f32"),
    pytest.param("bn", "adamw", ASYNC_LAYOUTS[1], "f64-steady", id="bn-adamw-2dev-3mb-layer-f64-steady"),
    pytest.param("bn", "adamw", ASYNC_LAYOUTS[2], "f32", id="bn-adamw-3dev-4mb-stage-f32"),
    pytest.param("bn", "sgd", ASYNC_LAYOUTS[2], "f64-steady", id="bn-sgd-3dev-4mb-stage-f64-steady"),
    pytest.param("gpt", "adamw", ASYNC_LAYOUTS[2], "f64-jitter", id="gpt-adamw-3dev-4mb-stage-f64-jitter"),
]


@pytest.mark.parametrize(list(ASYNC_FACTORS), ASYNC_CASES)
def test_async_equals_one_step_delayed_reference(model_name, optimizer_kind, layout, check):
    (devices, microbatches, recompute), (precision, jitter) = layout, CHECKS[check]
    sizes = split_sizes(transparency_case(model_name)[2], microbatches)
    references = {dtype: delayed_reference(model_name, sizes, optimizer_kind, dtype, STEPS)
                  for dtype in _dtypes(precision)}
    options = EngineOptions(num_microbatches=microbatches, recompute=recompute, num_stages=2, async_step=True,
                            jitter=jitter)
    model, losses = _fused_run(model_name, precision, devices, options, optimizer_kind)
    _assert_equals_reference(precision, losses, model, references)


# ---------------------------------------------------------------------------------------------- the designs
@pytest.mark.parametrize("cases, factors", [(SYNC_PAIRWISE, SYNC_FACTORS), (TRANSPARENT_CASES, TRANSPARENT_FACTORS),
                                            (ASYNC_CASES, ASYNC_FACTORS)], ids=["sync", "transparent", "async"])
def test_each_design_holds_every_pair_of_levels(cases, factors):
    assert missing_pairs(cases, factors) == []
    ids = [case.id for case in cases]
    assert len(set(ids)) == len(ids), "two cases with one id"


def test_a_design_that_loses_a_case_loses_a_pair():
    """The check can see a lost case: the sync design is minimal (4 microbatch counts x 3 device counts are
    12 pairs, one per case), so without any one of its cases some pair is missing."""
    for index in range(len(SYNC_PAIRWISE)):
        assert missing_pairs(SYNC_PAIRWISE[:index] + SYNC_PAIRWISE[index + 1:], SYNC_FACTORS)
    assert missing_pairs([("bn", 9)], {"model_name": MODELS, "devices": [1]}) == [
        "case ('bn', 9): devices=9 is not one of [1]", "model_name='bn', devices=1", "model_name='gpt', devices=1"]

"""Engine behaviour beyond plain equality: randomness, thread state, optimizer contract, errors."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_roundpipe import EngineOptions, PipelineError, Plan, RoundPipeEngine, is_recomputing
from lightning_roundpipe.engine.microbatch import microbatch_sizes
from lightning_roundpipe.engine.transfer import NoGrad
from tests.models import (
    SharedLog,
    async_reference,
    bn_batch,
    bn_model,
    clone,
    gpt_batch,
    gpt_loss,
    make_optimizer,
    reference_microbatch_step,
    tiny_gpt,
)
from tests.numerics import (
    assert_close_to_reference,
    assert_float64_equal,
    assert_states_close_to_reference,
    assert_states_equal,
    assert_states_float64_equal,
    double,
    state,
)

# Tolerances (tests/numerics.py): "bitwise" where the engine runs the same kernels on the same data in the
# same order as the reference (one microbatch); otherwise float32 results within 4x the float32 reference's
# own distance from a float64 run of the same reference, and float64 runs equal to 1e-12.


def _assert_one_step_matches_plain_pytorch(model: nn.Module, x: torch.Tensor, devices: int,
                                           options: EngineOptions) -> None:
    """One fused-path SGD step (lr 0.1) on two equal microbatches equals plain PyTorch accumulating the same
    two microbatches: the loss and every parameter, in float64 (the engine on a float64 copy: the algorithm)
    and in float32 (not further from the float64 result than plain PyTorch in float32 is)."""
    y = torch.randint(0, 2, (x.shape[0],))
    half = x.shape[0] // 2
    results = {}
    for name, make in (("ref32", clone), ("ref64", double)):
        reference = make(model)
        inputs = x if name == "ref32" else x.double()
        loss = reference_microbatch_step(reference, inputs, y, F.cross_entropy, [1.0, 1.0], [half, half])
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
        results[name] = (loss, state(reference))
    for name, engine_model, inputs in (("ours64", double(model), x.double()), ("ours32", model, x)):
        with RoundPipeEngine(engine_model, devices, options) as engine:
            loss = engine.forward_backward(inputs, y, F.cross_entropy)
            engine.step(torch.optim.SGD(engine_model.parameters(), lr=0.1))
            engine.synchronize()
        results[name] = (loss, state(engine_model))
    assert_float64_equal(results["ours64"][0], results["ref64"][0], what="float64 loss")
    assert_states_float64_equal(results["ours64"][1], results["ref64"][1])
    assert_close_to_reference(results["ours32"][0], results["ref32"][0], results["ref64"][0], what="loss")
    assert_states_close_to_reference(results["ours32"][1], results["ref32"][1], results["ref64"][1])


def _train_dropout_gpt(devices: int, recompute: str, steps: int = 3) -> list[torch.Tensor]:
    model = tiny_gpt(dropout=0.2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = EngineOptions(num_microbatches=4, recompute=recompute, num_stages=2, seed=1234, jitter=0.001)
    with RoundPipeEngine(model, devices, options) as engine:
        for step in range(steps):
            ids, target = gpt_batch(9, seed=step)
            engine.forward_backward(ids, target, gpt_loss)
            engine.step(optimizer)
        engine.synchronize()
    return [p.detach().clone() for p in model.parameters()]


def test_dropout_is_bitwise_identical_for_any_device_count():
    reference = _train_dropout_gpt(1, "stage")
    untrained = [p.detach() for p in tiny_gpt(dropout=0.2).parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(reference, untrained, strict=True)), "training changed nothing"
    for devices, recompute in [(2, "stage"), (3, "stage"), (3, "layer")]:
        trained = _train_dropout_gpt(devices, recompute)
        for expected, actual in zip(reference, trained, strict=True):
            assert torch.equal(expected, actual), f"devices={devices}, recompute={recompute} differ"


class MaskRecorder(nn.Module):
    """Dropout that records each mask it draws, with whether it ran as a recompute."""

    def __init__(self, log: SharedLog) -> None:
        super().__init__()
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.dropout(x, 0.5, self.training)
        self.log.append((is_recomputing(), x.detach().sum().item(), (y == 0).clone()))
        return y


MaskRecorder.roundpipe_random = True  # tells the engine the layer draws random numbers


@pytest.mark.parametrize("recompute", ["stage", "layer"])
def test_recomputation_replays_the_forward_dropout_masks(recompute):
    log = SharedLog()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 32), MaskRecorder(log), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=3, recompute=recompute, num_stages=2)) as engine:
        x, y = torch.randn(6, 5), torch.randint(0, 2, (6,))
        engine.forward_backward(x, y, F.cross_entropy)
        engine.step(torch.optim.SGD(model.parameters(), lr=0.1))
        engine.synchronize()
    forward = {key: mask for recomputed, key, mask in log if not recomputed}
    replayed = {key: mask for recomputed, key, mask in log if recomputed}
    assert len(forward) == 3 and forward.keys() == replayed.keys()
    for key, mask in forward.items():
        assert 0 < mask.sum() < mask.numel()
        assert torch.equal(mask, replayed[key])
    assert not torch.equal(*list(forward.values())[:2]), "microbatches must get different masks"


def _timeline_run(devices: int, microbatches: int, limit: int | None = None, stages: int | str = 3):
    model = tiny_gpt(blocks=4)
    options = EngineOptions(num_microbatches=microbatches, num_stages=stages, record_timeline=True, jitter=0.001,
                            device_memory_limit=limit, freeze_plan=True)
    with RoundPipeEngine(model, devices, options) as engine:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            ids, target = gpt_batch(8, seed=step)
            engine.forward_backward(ids, target, gpt_loss)
            engine.step(optimizer)
        engine.synchronize()
        return engine, engine.events()


def test_timeline_follows_the_ring_and_the_dependencies():
    devices, microbatches = 3, 4
    engine, events = _timeline_run(devices, microbatches)
    compute = [e for e in events if e.kind in ("forward", "fused", "backward")]
    stages_per_call = engine.plan.num_stages
    assert len(compute) == 2 * stages_per_call * microbatches
    # ring: job j runs on device j mod N, and the ring counter continues into the second iteration
    assert {e.job for e in compute} == set(range(2 * stages_per_call))
    assert all(e.device == e.job % devices for e in compute)
    # each device runs its jobs in ring order, microbatches 0..M-1 within a job
    for device in range(devices):
        order = [(e.job, e.microbatch) for e in sorted((e for e in compute if e.device == device),
                                                       key=lambda e: e.start)]
        assert order == sorted(order)
    # microbatch m of a job starts after microbatch m of the job it consumes has finished
    by_key = {(e.job, e.microbatch): e for e in compute}
    for (job, microbatch), event in by_key.items():
        if job % stages_per_call != 0:
            assert event.start >= by_key[(job - 1, microbatch)].end
    labels = [by_key[(j, 0)].label for j in range(stages_per_call)]
    plan = engine.plan
    assert labels == [f"F{i}" for i in range(len(plan.forward))] + ["L"] + [f"B{i}" for i in range(len(plan.backward))]


def test_a_device_holds_at_most_two_stages_and_stays_within_its_budget():
    model_bytes = sum(p.numel() * p.element_size() for p in tiny_gpt(blocks=4).parameters())
    # the whole model with its gradients would need twice the model, and the accounting also holds the stage
    # boundaries and what a backward stage's recompute keeps for backward (as large as a block's weights here)
    limit = model_bytes * 2
    engine, events = _timeline_run(2, 3, limit=limit, stages="auto")
    assert max(engine.peak_resident_stages()) == 2  # prefetch happened, and never a third stage
    assert all(0 < peak <= limit for peak in engine.peak_resident_bytes())
    assert len(engine.plan.backward) >= 2


def test_too_small_a_memory_budget_names_the_option():
    with pytest.raises(ValueError, match="device_memory_limit"):
        RoundPipeEngine(tiny_gpt(), 2, EngineOptions(device_memory_limit="4KiB"))


def test_caller_thread_state_reaches_the_workers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, 3))
    reference, reference64 = clone(model).eval(), double(model).eval()
    x = torch.randn(6, 4)
    with torch.no_grad():  # the engine runs microbatches of 3 rows, the references all 6 at once
        expected32, expected64 = reference(x), reference64(x.double())
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=1)) as engine:
        model.eval()
        with torch.no_grad():
            assert_close_to_reference(engine(x), expected32, expected64, what="no_grad output")
        with torch.inference_mode():
            out = engine(x)
            assert out.is_inference()
            assert_close_to_reference(out, expected32, expected64, what="inference_mode output")
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert engine(x).dtype == torch.bfloat16
        with torch.no_grad():
            assert not engine(x).requires_grad
        model.train()
        assert engine(x).requires_grad


def test_frozen_parameters_get_no_gradient_and_no_optimizer_state():
    model = bn_model()
    reference = clone(model)
    for m in (model, reference):
        m[0].weight.requires_grad_(False)
    frozen_before = model[0].weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=1, num_stages=2)) as engine:
        for step in range(3):
            x, y = bn_batch(8, step)
            engine.forward_backward(x, y, F.cross_entropy)
            engine.step(optimizer)
            F.cross_entropy(reference(x), y).backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        engine.synchronize()
    assert torch.equal(model[0].weight, frozen_before)
    assert model[0].weight.grad is None and len(optimizer.state[model[0].weight]) == 0
    # one microbatch: the engine runs the reference's kernels on the same data in the same order, bitwise
    assert_states_equal(model, reference)


def test_hyperparameters_are_read_when_the_step_is_queued():
    model, reference = bn_model(), bn_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    written = threading.Event()

    def after_the_write(*_) -> None:  # the step runs on its thread once the write below has happened
        written.wait(timeout=30)  # the timeout only guards against a hang

    optimizer.register_step_pre_hook(after_the_write)
    x, y = bn_batch(8, 0)
    with RoundPipeEngine(model, 1, EngineOptions(num_microbatches=1, num_stages=1)) as engine:
        engine.forward_backward(x, y, F.cross_entropy)
        engine.step(optimizer)
        for group in optimizer.param_groups:
            group["lr"] = 0.0  # a scheduler's write after step(): must apply to the next step only
        written.set()
        engine.synchronize()
    F.cross_entropy(reference(x), y).backward()
    reference_optimizer.step()
    assert_states_equal(model, reference)  # one microbatch: the same kernels on the same data, bitwise


def test_before_step_sees_final_gradients_and_can_skip_the_update():
    model = bn_model()
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=2)) as engine:
        x, y = bn_batch(8, 0)
        engine.forward_backward(x, y, F.cross_entropy)
        engine.step(torch.optim.SGD(model.parameters(), lr=0.1),
                    before_step=lambda: seen.append([p.grad.clone() for p in model.parameters()]) or False)
        engine.synchronize()
    references = {dtype: bn_model().to(dtype) for dtype in (torch.float32, torch.float64)}
    for dtype, reference in references.items():
        F.cross_entropy(torch.cat([reference(a) for a in x.to(dtype).split(4)]), y).backward()
    # skipped: weights unchanged, gradients cleared; the hook saw the whole-batch gradients
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
    for index, (grad, ref32, ref64) in enumerate(zip(seen[0], references[torch.float32].parameters(),
                                                     references[torch.float64].parameters(), strict=True)):
        assert_close_to_reference(grad, ref32.grad, ref64.grad, what=f"gradient of parameter {index}")


def test_a_forward_whose_backward_never_comes_releases_what_it_held():
    model = bn_model()
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=2)) as engine:
        out = engine(bn_batch(8, 0)[0])
        call = weakref.ref(out.grad_fn.call)
        engine.synchronize()  # streams drop a job's closures only once they have run them
        del out
        gc.collect()
        assert call() is None
        engine.step(torch.optim.SGD(model.parameters(), lr=0.1))  # the window is not waiting for it
        engine.synchronize()


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_an_output_lives_as_long_as_the_caller_keeps_it(microbatches, grad):
    """Freed by reference counting alone once the caller lets it go, as a plain module's output is: one
    microbatch's output is returned uncopied, and autograd's graph of it keeps the call."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    gc.disable()
    try:
        with RoundPipeEngine(model, 1, EngineOptions(num_microbatches=microbatches)) as engine:
            for _ in range(2):
                with torch.set_grad_enabled(grad):
                    out = engine(torch.randn(4, 4))
                if grad:
                    out.sum().backward()
                    engine.step(torch.optim.SGD(model.parameters(), lr=0.1))
                engine.synchronize()
                output = weakref.ref(out)
                del out
                assert output() is None
    finally:
        gc.enable()


def test_uneven_splits_and_short_batches():
    assert microbatch_sizes(10, 4) == [3, 3, 2, 2]
    assert microbatch_sizes(11, 5) == [3, 2, 2, 2, 2]
    assert microbatch_sizes(3, 5) == [1, 1, 1]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    reference, reference64 = clone(model), double(model)
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=5)) as engine:
        with pytest.warns(UserWarning, match="smaller than `num_microbatches=5`") as record:
            out = engine(torch.randn(3, 3))
            engine(torch.randn(2, 3))
        assert len(record) == 1
        x = torch.randn(3, 3)
        # three microbatches of one row against the three rows at once
        assert_close_to_reference(engine(x), reference(x), reference64(x.double()), what="output")
        assert out.shape == (3, 2)


def test_layer_error_names_stage_and_layer_and_stops_every_thread(roundpipe_threads):
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), Boom(), nn.Linear(3, 2))
    engine = RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=2)).start()
    with pytest.raises(PipelineError, match=r"trunk layer 2 raised ValueError in stage F\d") as caught:
        engine.forward_backward(torch.randn(4, 3), torch.randint(0, 2, (4,)), F.cross_entropy)
    assert isinstance(caught.value.__cause__, ValueError)
    assert roundpipe_threads() == []
    with pytest.raises(RuntimeError, match="closed"):
        engine(torch.randn(4, 3))


def test_loss_function_errors_are_reported(roundpipe_threads):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    with RoundPipeEngine(model, 1, EngineOptions(num_microbatches=1)) as engine:
        with pytest.raises(PipelineError, match="loss function must return a scalar"):
            engine.forward_backward(torch.randn(4, 3), torch.zeros(4, 2), lambda out, target: out - target)
    assert roundpipe_threads() == []


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_unsupported_autograd_uses_are_refused():
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2)) as engine:
        x = torch.randn(4, 3, requires_grad=True)
        with pytest.raises(RuntimeError, match=r"supports only `.backward\(\)`"):
            torch.autograd.grad(engine(x).sum(), [x])
        with pytest.raises(RuntimeError, match="double backward"):
            engine(x).sum().backward(create_graph=True)


def test_input_gradients_flow_through_the_transparent_path():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 1))
    reference, reference64 = clone(model), double(model)
    x = torch.randn(6, 3, requires_grad=True)
    x_ref, x_ref64 = x.detach().clone().requires_grad_(True), x.detach().double().requires_grad_(True)
    with RoundPipeEngine(model, 3, EngineOptions(num_microbatches=3, num_stages=2, recompute="layer")) as engine:
        (engine(x) ** 2).sum().backward()
        (reference(x_ref) ** 2).sum().backward()
        (reference64(x_ref64) ** 2).sum().backward()
        engine.step(torch.optim.SGD(model.parameters(), lr=0.0))
    assert_close_to_reference(x.grad, x_ref.grad, x_ref64.grad, what="input gradient")


def test_dict_and_tuple_outputs_between_layers():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            return {"h": self.a(x), "g": self.b(x), "tag": "pair"}

    class Join(nn.Module):
        def forward(self, d):
            assert d["tag"] == "pair"
            return (d["h"] * d["g"], 2.0)

    class Use(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Linear(3, 2)

        def forward(self, pair):
            return self.c(pair[0]) * pair[1]

    torch.manual_seed(0)
    _assert_one_step_matches_plain_pytorch(nn.Sequential(Pair(), Join(), Use()), torch.randn(6, 3), 2,
                                           EngineOptions(num_microbatches=2, num_stages=2))


def test_no_grad_values_travel_with_the_activations_but_are_never_differentiated():
    seen_requires_grad: list[bool] = []

    class Start(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x):
            scale = torch.linspace(0.5, 1.5, 3).expand(x.shape[0], 3)  # per sample, float, not a parameter
            return self.a(x), NoGrad(scale=scale, note="kept")

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = nn.Linear(3, 3)

        def forward(self, state):
            h, context = state
            seen_requires_grad.append(context.scale.requires_grad)
            assert context.note == "kept"
            return self.b(h) * context.scale, context

    class End(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Linear(3, 2)

        def forward(self, state):
            return self.c(state[0] + state[1].scale)

    torch.manual_seed(0)
    _assert_one_step_matches_plain_pytorch(nn.Sequential(Start(), Scale(), Scale(), End()), torch.randn(6, 3), 2,
                                           EngineOptions(num_microbatches=2, num_stages=3))
    assert seen_requires_grad and not any(seen_requires_grad)  # backward stages never made it a leaf


@pytest.mark.parametrize(
    "build, error, pattern",
    [
        (lambda: RoundPipeEngine(nn.Sequential()), ValueError, "has no layers"),
        (lambda: RoundPipeEngine(nn.Linear(2, 2)), TypeError, "must be an nn.Sequential"),
        (lambda: EngineOptions(num_microbatches=0), ValueError, "`num_microbatches` must be a positive int"),
        (lambda: EngineOptions(recompute="block"), ValueError, "`recompute` must be 'stage' or 'layer'"),
        (lambda: EngineOptions(num_stages="many"), ValueError, "`num_stages` must be 'auto'"),
        (lambda: EngineOptions(device_memory_limit="lots"), ValueError, "`device_memory_limit` must be"),
        (lambda: RoundPipeEngine(nn.Sequential(nn.Linear(2, 2)), devices=0), ValueError, "`devices` must be"),
    ],
)
def test_bad_configuration_is_refused_clearly(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


def test_bad_inputs_and_outputs_are_refused_clearly():
    class Scalar(nn.Module):
        def forward(self, x):
            return x.sum()

    for microbatches in (2, 1):  # one microbatch's output is not concatenated, yet refused alike
        with RoundPipeEngine(nn.Sequential(nn.Linear(2, 2), Scalar()), 1,
                             EngineOptions(num_microbatches=microbatches)) as engine:
            with torch.no_grad(), pytest.raises(ValueError, match="0-dim tensor, which cannot be merged"):
                engine(torch.randn(4, 2))
    with RoundPipeEngine(nn.Sequential(nn.Bilinear(2, 2, 1)), 1, EngineOptions(num_microbatches=2)) as engine:
        with pytest.raises(ValueError, match=r"different sizes on dim 0 \(\[4, 3\]\)"):
            engine(torch.randn(4, 2), torch.randn(3, 2))
        with pytest.raises(ValueError, match="batch is empty"):
            engine(torch.randn(0, 2), torch.randn(0, 2))


def test_async_refuses_parameters_outside_the_trunk():
    model = nn.Sequential(nn.Linear(2, 2))
    extra = nn.Parameter(torch.zeros(2))
    with RoundPipeEngine(model, 1, EngineOptions(async_step=True, num_microbatches=1)) as engine:
        engine.forward_backward(torch.randn(2, 2), torch.randint(0, 2, (2,)), F.cross_entropy)
        with pytest.raises(ValueError, match="async_step=True needs every trainable parameter"):
            engine.step(torch.optim.SGD([*model.parameters(), extra], lr=0.1))


def test_two_engines_share_nothing_and_close_cleanly(roundpipe_threads):
    first = RoundPipeEngine(bn_model(), 2, EngineOptions(num_microbatches=2)).start()
    second = RoundPipeEngine(bn_model(), 1, EngineOptions(num_microbatches=2)).start()
    x, y = bn_batch(4, 0)
    first.forward_backward(x, y, F.cross_entropy)
    second.forward_backward(x, y, F.cross_entropy)
    first.close(), second.close(), first.close()
    assert roundpipe_threads() == []


def test_async_with_a_before_step_hook_still_follows_the_one_step_delayed_formula():
    """The hook path publishes gradients on the main thread while the previous step may still be running with
    the gradients it was handed; neither may change the other's."""
    steps = 5
    model = bn_model()
    sizes = [4, 4]
    batches = [bn_batch(8, step) for step in range(steps)]
    expected = {dtype: async_reference(model if dtype == torch.float32 else double(model),
                                       [(x.to(dtype), y) for x, y in batches], F.cross_entropy, sizes, "sgd")[0]
                for dtype in (torch.float32, torch.float64)}
    optimizer = make_optimizer("sgd", model.parameters())
    optimizer.register_step_pre_hook(lambda *_: time.sleep(0.05))  # a slow host step
    calls = []
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=2, async_step=True)) as engine:
        for step, (x, y) in enumerate(batches):
            engine.forward_backward(x, y, F.cross_entropy)
            engine.step(optimizer, before_step=lambda step=step: calls.append(step))
        engine.synchronize()
    assert calls == list(range(steps))
    assert_states_close_to_reference(model, expected[torch.float32], expected[torch.float64])


def test_an_exception_in_user_code_stops_the_engine_cleanly(roundpipe_threads):
    model = bn_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(KeyError):
        with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2)) as engine:
            x, y = bn_batch(8, 0)
            engine.forward_backward(x, y, F.cross_entropy)
            raise KeyError("user code failed before the step")
    assert roundpipe_threads() == []
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_the_plan_adapts_to_measured_times_between_steps_unless_frozen():
    """Byte estimates call the parameter-free slow layer cheap; measured times move stage boundaries."""

    class Slow(nn.Module):
        def forward(self, x):
            time.sleep(0.03)  # dominates any other layer even on a loaded machine
            return x

    def train(freeze: bool):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(5)], Slow(), nn.Linear(16, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        plans = []
        options = EngineOptions(num_microbatches=2, num_stages="auto", freeze_plan=freeze)
        with RoundPipeEngine(model, 2, options) as engine:
            # a step's times reach the planner once its last job has finished (often at the next step); the first
            # is warm-up, and the plan moves once two more agree: 7 steps leave a margin
            for step in range(7):
                plans.append(engine.plan)
                x, y = bn_batch(8, step)
                engine.forward_backward(torch.cat([x, x, x[:, :4]], 1), y % 2, F.cross_entropy)
                engine.step(optimizer)
            engine.synchronize()
        return plans

    adaptive, frozen = train(False), train(True)
    assert all(plan == frozen[0] for plan in frozen)
    # the first plan comes from bytes; once measured, the sleeping layer dominates every stage bound
    # (W >= its time), so fewer, larger stages cost no more and the planner adopts them
    assert adaptive[0] == frozen[0] and adaptive[-1] != adaptive[0]
    assert adaptive[-1].num_stages < adaptive[0].num_stages


def test_trunk_parameters_missing_from_the_optimizer_are_reported_once():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
    with RoundPipeEngine(model, 1, EngineOptions(num_microbatches=1)) as engine:
        with pytest.warns(UserWarning, match="2 trainable trunk parameters are not in the optimizer") as record:
            for _ in range(2):
                engine.forward_backward(torch.randn(4, 3), torch.randint(0, 2, (4,)), F.cross_entropy)
                engine.step(optimizer)
        assert len(record) == 1


def test_a_microbatch_whose_targets_are_all_ignored_counts_for_nothing():
    model = tiny_gpt()
    reference = clone(model)
    ids, target = gpt_batch(4, seed=0)
    target[2:] = -100  # the second microbatch has no target to learn from
    from lightning_roundpipe import token_count

    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=2)) as engine:
        loss = engine.forward_backward(ids, target, gpt_loss, loss_weight=token_count())
        engine.step(torch.optim.SGD(model.parameters(), lr=0.1))
        engine.synchronize()
    expected = gpt_loss(reference(ids[:2]), target[:2])
    expected.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    # only the first microbatch counts, with weight 1: the reference's kernels on the same data, bitwise
    assert torch.equal(loss, expected.detach())
    assert_states_equal(model, reference)


def test_target_and_input_sizes_must_agree():
    with RoundPipeEngine(nn.Sequential(nn.Linear(2, 2)), 1, EngineOptions(num_microbatches=2)) as engine:
        with pytest.raises(ValueError, match="the target has 3 samples on dim 0 but the inputs have 4"):
            engine.forward_backward(torch.randn(4, 2), torch.zeros(3, dtype=torch.long), F.cross_entropy)


@pytest.mark.parametrize("recompute", ["stage", "layer"])
def test_layers_that_work_in_place_on_their_input(recompute):
    """In-place activations are common (ReLU(inplace=True)); they must not corrupt kept checkpoints nor
    trip autograd on a stage's input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True),
                          nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    plan = Plan.from_sizes([1, 1, 1, 1, 1, 1], 1, [1, 1, 1, 1, 1, 1])  # every activation starts a stage
    _assert_one_step_matches_plain_pytorch(model, torch.randn(6, 4), 2,
                                           EngineOptions(num_microbatches=2, num_stages=plan, recompute=recompute))


class AddOneInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1.0)


def test_in_place_layers_inside_a_forward_stage_keep_the_checkpoints():
    """Layer 2 starts a backward stage but sits inside a forward stage, where it modifies its input in
    place: the kept checkpoint must be the input as it was, or the recompute sees it shifted twice."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), AddOneInPlace(), nn.Linear(8, 8), nn.Linear(8, 2))
    plan = Plan.from_sizes([4], 1, [2, 2])
    _assert_one_step_matches_plain_pytorch(model, torch.randn(6, 4), 1,
                                           EngineOptions(num_microbatches=2, num_stages=plan))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the embedding's inputs are ids
def test_async_overlaps_the_next_iteration_with_this_ones_backward_and_step():
    """With one-step staleness the next iteration's first forward stage need not wait for the current
    iteration's last backward stage or its step. Shown by order, not by timing: the first iteration's last
    backward stage (it holds layer 0) does not finish until the second iteration's first forward stage has
    run layer 0. An engine that made that forward wait for the backward or the step would never start it;
    the hook's wait would time out (30 s, only a guard against hanging) and the test fail."""
    microbatches = 3
    model = tiny_gpt(blocks=4)
    forwards, backwards, waited = [], [], []
    next_iteration_started = threading.Event()

    def count_forward(module, inputs, output):  # hooks run in the device replicas, sharing these lists
        if not is_recomputing():
            forwards.append(None)
            if len(forwards) > microbatches:  # the first iteration runs layer 0 once per microbatch
                next_iteration_started.set()

    def hold_the_first_backward(module, grad_output):
        backwards.append(None)
        if len(backwards) == 1:
            waited.append(next_iteration_started.wait(timeout=30))

    model[0].register_forward_hook(count_forward)
    model[0].register_full_backward_pre_hook(hold_the_first_backward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = EngineOptions(num_microbatches=microbatches, num_stages=2, async_step=True, record_timeline=True,
                            freeze_plan=True)
    with RoundPipeEngine(model, 2, options) as engine:
        for step in range(3):
            ids, target = gpt_batch(6, seed=step)
            engine.forward_backward(ids, target, gpt_loss)
            engine.step(optimizer)
        engine.synchronize()
        events, jobs_per_iteration = engine.events(), engine.plan.num_stages
    assert waited == [True], "the next iteration's forward waited for this iteration's backward"
    # the timeline agrees: the next iteration's first forward started before this iteration's last backward
    # stage and its optimizer step ended (both come after the wait above, in causal order)
    compute = [e for e in events if e.kind in ("forward", "fused", "backward")]
    # the first step runs stage by stage ("step 1 [a-b]" per part): it ends with its last part
    first_step_end = max(e.end for e in events if e.kind == "optimizer" and e.label.split()[:2] == ["step", "1"])
    last_backward_end = max(e.end for e in compute if e.job == jobs_per_iteration - 1)
    next_forward_start = min(e.start for e in compute if e.job == jobs_per_iteration)
    assert next_forward_start < last_backward_end
    assert next_forward_start < first_step_end


def test_sync_steps_run_on_the_optimizer_thread():
    model = bn_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    threads = []
    optimizer.register_step_pre_hook(lambda *_: threads.append(threading.current_thread().name))
    with RoundPipeEngine(model, 1, EngineOptions(num_microbatches=2)) as engine:
        x, y = bn_batch(8, 0)
        engine.forward_backward(x, y, F.cross_entropy)
        engine.step(optimizer)
        engine.synchronize()
    assert threads == ["roundpipe-optimizer"]


def test_calls_before_start_say_the_engine_is_not_started(roundpipe_threads):
    engine = RoundPipeEngine(nn.Sequential(nn.Linear(2, 2)), 2, EngineOptions(num_microbatches=2))
    calls = {"events": engine.events, "pipeline_metrics": engine.pipeline_metrics,
             "peak_resident_bytes": engine.peak_resident_bytes, "peak_resident_stages": engine.peak_resident_stages,
             "timeline": lambda: engine.timeline, "a call": lambda: engine(torch.zeros(2, 2))}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=r"^the engine is not started.*call start\(\)"):
            call()
            pytest.fail(f"{name} ran on an engine that is not started")
    assert engine.devices == [] and not engine.failed and engine.unreported_failure is None
    engine.close()  # nothing to stop yet
    with engine:
        assert engine.peak_resident_bytes() == [0, 0] and engine.peak_resident_stages() == [0, 0]
        engine(torch.zeros(4, 2))  # one layer: one job, the ring's first on device 0
        assert engine.peak_resident_stages() == [1, 0]
    assert roundpipe_threads() == []


def test_closing_right_after_a_no_grad_call_keeps_its_batchnorm_statistics(roundpipe_threads):
    """A no-grad call returns once its outputs have arrived; its jobs may still be copying the BatchNorm
    statistics back into the module. Closing at once must let them land (it once dropped them now and then).
    Reference: plain PyTorch running the same microbatches one after another."""
    x, _ = bn_batch(8, 0)
    reference = bn_model()
    with torch.no_grad():
        for chunk in x.split(microbatch_sizes(8, 2)):
            reference(chunk)
    jitter = EngineOptions(num_microbatches=2, jitter=2e-3, stress=True)  # late copy-backs, as on a GPU
    for _ in range(20):
        model = bn_model()
        engine = RoundPipeEngine(model, 2, jitter).start()
        with torch.no_grad():
            engine(x)
        engine.close()
        assert_states_equal(model, reference)
    assert roundpipe_threads() == []

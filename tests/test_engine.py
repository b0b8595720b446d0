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
    bn_batch,
    bn_model,
    clone,
    gpt_batch,
    gpt_loss,
    make_optimizer,
    reference_microbatch_step,
    tiny_gpt,
)


def _roundpipe_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("roundpipe-")]


def _assert_one_step_matches_plain_pytorch(model: nn.Module, x: torch.Tensor, devices: int,
                                           options: EngineOptions) -> None:
    """One fused-path SGD step (lr 0.1) on two equal microbatches equals plain PyTorch accumulating the same
    two microbatches: the loss and every parameter."""
    reference = clone(model)
    y = torch.randint(0, 2, (x.shape[0],))
    with RoundPipeEngine(model, devices, options) as engine:
        loss = engine.forward_backward(x, y, F.cross_entropy)
        engine.step(torch.optim.SGD(model.parameters(), lr=0.1))
        engine.synchronize()
    half = x.shape[0] // 2
    expected = reference_microbatch_step(reference, x, y, F.cross_entropy, [1.0, 1.0], [half, half])
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    torch.testing.assert_close(loss.item(), expected, rtol=1e-6, atol=1e-7)
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, ref, rtol=1e-5, atol=1e-7)


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
    assert any(not torch.equal(a, b) for a, b in zip(reference, untrained)), "training changed nothing"
    for devices, recompute in [(2, "stage"), (3, "stage"), (3, "layer")]:
        trained = _train_dropout_gpt(devices, recompute)
        for expected, actual in zip(reference, trained):
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
    limit = model_bytes * 3 // 2  # the whole model with its gradients would need twice the model
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
    reference = clone(model)
    x = torch.randn(6, 4)
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=1)) as engine:
        model.eval(), reference.eval()
        with torch.no_grad():
            torch.testing.assert_close(engine(x), reference(x), rtol=1e-6, atol=1e-7)
        with torch.inference_mode():
            out = engine(x)
            assert out.is_inference()
            torch.testing.assert_close(out, reference(x), rtol=1e-6, atol=1e-7)
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
    for param, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected, rtol=1e-4, atol=1e-6)


def test_hyperparameters_are_read_when_the_step_is_queued():
    model, reference = bn_model(), bn_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    optimizer.register_step_pre_hook(lambda *_: time.sleep(0.2))  # the step runs late, on its thread
    x, y = bn_batch(8, 0)
    with RoundPipeEngine(model, 1, EngineOptions(num_microbatches=1, num_stages=1)) as engine:
        engine.forward_backward(x, y, F.cross_entropy)
        engine.step(optimizer)
        for group in optimizer.param_groups:
            group["lr"] = 0.0  # a scheduler's write after step(): must apply to the next step only
        engine.synchronize()
    F.cross_entropy(reference(x), y).backward()
    reference_optimizer.step()
    for param, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected, rtol=1e-6, atol=1e-7)


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
    reference = bn_model()
    F.cross_entropy(torch.cat([reference(a) for a in x.split(4)]), y).backward()
    # skipped: weights unchanged, gradients cleared; the hook saw the whole-batch gradients
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    for grad, param in zip(seen[0], reference.parameters()):
        torch.testing.assert_close(grad, param.grad, rtol=1e-5, atol=1e-7)


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


def test_uneven_splits_and_short_batches():
    assert microbatch_sizes(10, 4) == [3, 3, 2, 2]
    assert microbatch_sizes(11, 5) == [3, 2, 2, 2, 2]
    assert microbatch_sizes(3, 5) == [1, 1, 1]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = clone(model)
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=5)) as engine:
        with pytest.warns(UserWarning, match="smaller than `num_microbatches=5`") as record:
            out = engine(torch.randn(3, 3))
            engine(torch.randn(2, 3))
        assert len(record) == 1
        x = torch.randn(3, 3)
        torch.testing.assert_close(engine(x), reference(x), rtol=1e-6, atol=1e-7)
        assert out.shape == (3, 2)


def test_layer_error_names_stage_and_layer_and_stops_every_thread():
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), Boom(), nn.Linear(3, 2))
    engine = RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=2)).start()
    with pytest.raises(PipelineError, match=r"trunk layer 2 raised ValueError in stage F\d") as caught:
        engine.forward_backward(torch.randn(4, 3), torch.randint(0, 2, (4,)), F.cross_entropy)
    assert isinstance(caught.value.__cause__, ValueError)
    assert _roundpipe_threads() == []
    with pytest.raises(RuntimeError, match="closed"):
        engine(torch.randn(4, 3))


def test_loss_function_errors_are_reported():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    with RoundPipeEngine(model, 1, EngineOptions(num_microbatches=1)) as engine:
        with pytest.raises(PipelineError, match="loss function must return a scalar"):
            engine.forward_backward(torch.randn(4, 3), torch.zeros(4, 2), lambda out, target: out - target)
    assert _roundpipe_threads() == []


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
    reference = clone(model)
    x = torch.randn(6, 3, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    with RoundPipeEngine(model, 3, EngineOptions(num_microbatches=3, num_stages=2, recompute="layer")) as engine:
        (engine(x) ** 2).sum().backward()
        (reference(x_ref) ** 2).sum().backward()
        engine.step(torch.optim.SGD(model.parameters(), lr=0.0))
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-7)


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

    with RoundPipeEngine(nn.Sequential(nn.Linear(2, 2), Scalar()), 1, EngineOptions(num_microbatches=2)) as engine:
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


def test_two_engines_share_nothing_and_close_cleanly():
    first = RoundPipeEngine(bn_model(), 2, EngineOptions(num_microbatches=2)).start()
    second = RoundPipeEngine(bn_model(), 1, EngineOptions(num_microbatches=2)).start()
    x, y = bn_batch(4, 0)
    first.forward_backward(x, y, F.cross_entropy)
    second.forward_backward(x, y, F.cross_entropy)
    first.close(), second.close(), first.close()
    assert _roundpipe_threads() == []


def test_async_with_a_before_step_hook_still_follows_the_one_step_delayed_formula():
    """The hook path publishes gradients on the main thread; it must wait for the previous step, which
    clears ``param.grad`` when it ends, or this iteration's gradients would be wiped."""
    from tests.test_transparency import STEPS, _async_reference

    model = bn_model()
    sizes = [4, 4]
    masters, _, _ = _async_reference(model, bn_batch, 8, F.cross_entropy, "bn", sizes, "sgd")
    optimizer = make_optimizer("sgd", model.parameters())
    optimizer.register_step_pre_hook(lambda *_: time.sleep(0.05))  # a slow host step
    calls = []
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2, num_stages=2, async_step=True)) as engine:
        for step in range(STEPS):
            x, y = bn_batch(8, step)
            engine.forward_backward(x, y, F.cross_entropy)
            engine.step(optimizer, before_step=lambda: calls.append(step))
        engine.synchronize()
    assert calls == list(range(STEPS))
    for param, master in zip(model.parameters(), masters):
        torch.testing.assert_close(param, master.detach(), rtol=1e-5, atol=1e-7)


def test_an_exception_in_user_code_stops_the_engine_cleanly():
    model = bn_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(KeyError):
        with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=2)) as engine:
            x, y = bn_batch(8, 0)
            engine.forward_backward(x, y, F.cross_entropy)
            raise KeyError("user code failed before the step")
    assert _roundpipe_threads() == []
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


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
            for step in range(4):
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
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-7)
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, ref, rtol=1e-5, atol=1e-7)


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
    iteration's last backward stage or its step: the timeline shows them overlapping."""
    model = tiny_gpt(blocks=4)
    model[0].register_full_backward_pre_hook(lambda *_: time.sleep(0.05))  # a slow last backward stage
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.register_step_pre_hook(lambda *_: time.sleep(0.2))  # a host step worth hiding
    options = EngineOptions(num_microbatches=3, num_stages=2, async_step=True, record_timeline=True,
                            freeze_plan=True)
    with RoundPipeEngine(model, 2, options) as engine:
        for step in range(3):
            ids, target = gpt_batch(6, seed=step)
            engine.forward_backward(ids, target, gpt_loss)
            engine.step(optimizer)
        engine.synchronize()
        events, jobs_per_iteration = engine.events(), engine.plan.num_stages
    compute = [e for e in events if e.kind in ("forward", "fused", "backward")]
    steps = sorted((e for e in events if e.kind == "optimizer"), key=lambda e: e.start)
    last_backward_end = max(e.end for e in compute if e.job == jobs_per_iteration - 1)
    next_forward_start = min(e.start for e in compute if e.job == jobs_per_iteration)
    assert next_forward_start < last_backward_end
    assert next_forward_start < steps[0].end


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

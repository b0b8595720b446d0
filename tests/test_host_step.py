"""The host optimizer's fused path (``host_optimizer="fused"``): which groups it takes, what it computes, and
that the user's optimizer stays as built.

Every comparison is with an independent reference: a plain torch optimizer, built with ``fused`` and
``foreach`` unset (torch's default path on CPU), stepping a clone of the model on the same data.

Tolerance. The fused CPU kernels of torch 2.13 are not bitwise the default path for Adam, AdamW and SGD
with momentum (``benchmarks/host_optimizer.py``: about 0.01% of the elements differ after five steps, by
about one ulp), so those cases use the float32 rule of ``tests/numerics.py``: no further from a float64
run of the reference than 4x the float32 reference's own distance from it (plus 4 ulps of the tensor's
norm); a float64 engine run equals a float64 plain run to 1e-12. SGD without momentum is bitwise the
default path (which is why ``host_optimizer="exact"`` uses it), and the tests say so with ``torch.equal``.
The engine runs one microbatch (the same kernels as the reference), so the optimizer is the only
difference.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_roundpipe import EngineOptions, RoundPipeEngine
from lightning_roundpipe.engine.options import OptionError
from lightning_roundpipe.engine.step.kernels import fused_refusal, kernel_of, use_fused
from lightning_roundpipe.engine.step.thread import snapshot_param_groups
from tests.models import bn_batch, bn_model, clone
from tests.numerics import assert_states_close_to_reference, assert_states_equal, assert_states_float64_equal, double

STEPS = 4
FUSED_OPS = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_")

OPTIMIZERS = {  # name: (factory, bitwise the default path when fused)
    "adamw": (lambda p, **kw: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01, **kw), False),
    "adam_amsgrad_l2": (lambda p, **kw: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01, amsgrad=True, **kw), False),
    "sgd_nesterov": (lambda p, **kw: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3,
                                                     **kw), False),
    "sgd_momentum_dampening": (lambda p, **kw: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, **kw),
                               False),
    "sgd_plain": (lambda p, **kw: torch.optim.SGD(p, lr=0.05, weight_decay=0.01, **kw), True),
}


@pytest.fixture
def fused_calls(monkeypatch) -> list[str]:
    """The names of torch's fused optimizer ops, once per parameter they step (from any thread): a step cut by
    stage calls the kernel once per part, so the per-parameter count is what a step's coverage shows."""
    calls: list[str] = []
    for name in FUSED_OPS:
        original = getattr(torch, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.extend([_name] * len(args[0]))  # the first argument: the parameters stepped
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch, name, counted)
    return calls


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _plain(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = STEPS, first: int = 0) -> None:
    for step in range(first, first + steps):
        x, y = bn_batch(8, step)
        F.cross_entropy(model(x.to(next(model.parameters()).dtype)), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _engine(model: nn.Module, optimizer: torch.optim.Optimizer, host_optimizer: str = "fused",
            steps: int = STEPS, first: int = 0) -> None:
    options = EngineOptions(num_microbatches=1, num_stages=2, host_optimizer=host_optimizer)  # type: ignore[arg-type]
    with RoundPipeEngine(model, 2, options) as engine:
        for step in range(first, first + steps):
            x, y = bn_batch(8, step)
            engine.forward_backward(x.to(next(model.parameters()).dtype), y, F.cross_entropy)
            engine.step(optimizer)
        engine.synchronize()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_fused_path_matches_plain_torch_default_steps(name, fused_calls):
    make, bitwise = OPTIMIZERS[name]
    model = bn_model()
    ref32, ref64 = clone(model), double(model)
    _plain(ref32, make(ref32.parameters()))
    _plain(ref64, make(ref64.parameters()))
    assert not fused_calls, "the references run torch's default path"
    _engine(model, make(model.parameters()))
    params = len(list(model.parameters()))
    assert len(fused_calls) == STEPS * params, "every step ran the fused kernel on every parameter"
    if bitwise:
        assert_states_equal(model, ref32)
    else:
        assert_states_close_to_reference(model, ref32, ref64)
    # float64 parameters take the fused path too. On a model without BatchNorm: the bias before one has a
    # true gradient of zero, whose rounding noise Adam scales up to O(lr), so there a 1e-16 difference in
    # one step becomes 1e-11 in the next
    ours64, plain64 = double(_mlp()), double(_mlp())
    _engine(ours64, make(ours64.parameters()))
    _plain(plain64, make(plain64.parameters()))
    assert_states_float64_equal(ours64, plain64)


def test_the_tolerance_fails_a_step_one_percent_off():
    make, _ = OPTIMIZERS["adamw"]
    model = bn_model()
    ref32, ref64 = clone(model), double(model)
    _plain(ref32, make(ref32.parameters()))
    _plain(ref64, make(ref64.parameters()))
    _engine(model, torch.optim.AdamW(model.parameters(), lr=1.01e-2, weight_decay=0.01))
    with pytest.raises(AssertionError, match="exceeds"):
        assert_states_close_to_reference(model, ref32, ref64)


def test_fused_and_default_are_not_bitwise_for_adamw():
    """Why ``"exact"`` is the default: the fused kernel rounds differently (if torch ever makes it bitwise,
    this fails, and the engine could switch by itself)."""
    make, _ = OPTIMIZERS["adamw"]
    ours, reference = bn_model(), bn_model()
    _engine(ours, make(ours.parameters()))
    _plain(reference, make(reference.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(ours.parameters(), reference.parameters(), strict=True))


@pytest.mark.parametrize("name", ["adamw", "adam_amsgrad_l2", "sgd_nesterov"])
def test_exact_mode_leaves_what_is_not_bitwise_as_built(name, fused_calls):
    make, _ = OPTIMIZERS[name]
    model, reference = bn_model(), bn_model()
    _engine(model, make(model.parameters()), host_optimizer="exact")
    _plain(reference, make(reference.parameters()))
    assert not fused_calls
    assert_states_equal(model, reference)


@pytest.mark.parametrize("kwargs", [dict(weight_decay=0.01), dict(maximize=True, dampening=0.5), {}])
def test_exact_mode_fuses_sgd_without_momentum_bitwise(kwargs, fused_calls):
    model, reference = bn_model(), bn_model()
    _engine(model, torch.optim.SGD(model.parameters(), lr=0.05, **kwargs), host_optimizer="exact")
    _plain(reference, torch.optim.SGD(reference.parameters(), lr=0.05, **kwargs))
    assert fused_calls == ["_fused_sgd_"] * (STEPS * len(list(model.parameters())))
    assert_states_equal(model, reference)


@pytest.mark.parametrize("mode", ["fused", "exact"])
@pytest.mark.parametrize("name", ["adamw", "sgd_plain"])
@pytest.mark.parametrize("chosen", [{"foreach": True}, {"fused": False}, {"foreach": False}])
def test_an_optimizer_that_chose_its_kernel_is_left_alone(chosen, name, mode, fused_calls):
    make, _ = OPTIMIZERS[name]
    model, reference = bn_model(), bn_model()
    _engine(model, make(model.parameters(), **chosen), host_optimizer=mode)
    _plain(reference, make(reference.parameters(), **chosen))
    assert not fused_calls
    assert_states_equal(model, reference)  # the same kernels, bitwise


def test_a_subclass_is_left_alone(fused_calls):
    class MyAdamW(torch.optim.AdamW):
        pass

    model, reference = bn_model(), bn_model()
    _engine(model, MyAdamW(model.parameters(), lr=1e-2))
    _plain(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    assert not fused_calls
    assert_states_equal(model, reference)


def _layout(optimizer: torch.optim.Optimizer) -> tuple:
    """An optimizer's groups (without params) and the dtype, device and shape of every state tensor."""
    state = optimizer.state_dict()
    groups = [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]
    tensors = {(index, key): (value.dtype, value.device, tuple(value.shape))
               for index, entry in state["state"].items() for key, value in entry.items()}
    return groups, tensors


@pytest.mark.parametrize("name", ["adamw", "sgd_nesterov"])
def test_the_users_optimizer_keeps_its_groups_and_state_layout(name):
    make, _ = OPTIMIZERS[name]
    model, reference = bn_model(), bn_model()
    optimizer, plain = make(model.parameters()), make(reference.parameters())
    before = copy.deepcopy(optimizer.param_groups[0])
    _engine(model, optimizer)
    _plain(reference, plain)
    assert optimizer.param_groups[0]["fused"] is None and optimizer.param_groups[0]["foreach"] is None
    assert {k: v for k, v in optimizer.param_groups[0].items() if k != "params"} == {
        k: v for k, v in before.items() if k != "params"}
    assert _layout(optimizer) == _layout(plain)  # the state is what plain training makes
    if name == "adamw":
        steps = [entry["step"] for entry in optimizer.state_dict()["state"].values()]
        assert all(torch.equal(step, torch.tensor(float(STEPS))) for step in steps)


@pytest.mark.parametrize("name", ["adamw", "sgd_nesterov"])
def test_state_carries_over_between_the_paths_both_ways(name):
    """A checkpoint of plain training resumes on the fused path, and the fused path's resumes under plain
    torch: both stay within the float32 rule of four plain steps and four more."""
    make, _ = OPTIMIZERS[name]
    model = bn_model()
    ref32, ref64 = clone(model), double(model)
    for reference in (ref32, ref64):
        optimizer = make(reference.parameters())
        _plain(reference, optimizer)
        _plain(reference, optimizer, first=STEPS)
    # plain first, then fused from its state
    plain_first = clone(model)
    optimizer = make(plain_first.parameters())
    _plain(plain_first, optimizer)
    resumed = make(plain_first.parameters())
    resumed.load_state_dict(optimizer.state_dict())
    _engine(plain_first, resumed, first=STEPS)
    assert_states_close_to_reference(plain_first, ref32, ref64)
    # fused first, then plain torch from its state_dict
    fused_first = clone(model)
    optimizer = make(fused_first.parameters())
    _engine(fused_first, optimizer)
    resumed = make(fused_first.parameters())
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    _plain(fused_first, resumed, first=STEPS)
    assert_states_close_to_reference(fused_first, ref32, ref64)


# ---------------------------------------------------------------------------- which groups
def _groups(optimizer: torch.optim.Optimizer, mode: str = "fused") -> list[dict]:
    return use_fused(optimizer, snapshot_param_groups(optimizer), mode)


def test_use_fused_sets_fused_in_the_copies_only():
    params = [nn.Parameter(torch.randn(3))]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    groups = _groups(optimizer)
    assert groups[0]["fused"] is True and optimizer.param_groups[0]["fused"] is None
    assert _groups(optimizer, "exact")[0]["fused"] is None  # AdamW's fused kernel is not bitwise
    assert kernel_of(optimizer, "fused") == "fused" and kernel_of(optimizer, "exact") == "default"
    sgd = torch.optim.SGD(params, lr=0.1, weight_decay=0.01)
    assert _groups(sgd, "exact")[0]["fused"] is True and sgd.param_groups[0]["fused"] is None
    assert kernel_of(sgd, "exact") == "fused"
    assert kernel_of(torch.optim.SGD(params, lr=0.1, momentum=0.9), "exact") == "default"


def test_exact_mode_fuses_sgd_only_on_the_kernel_sets_measured(monkeypatch):
    sgd = torch.optim.SGD([nn.Parameter(torch.randn(3))], lr=0.1)
    assert fused_refusal(sgd, sgd.param_groups[0], "exact") is None
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SVE256")
    assert "SVE256" in (fused_refusal(sgd, sgd.param_groups[0], "exact") or "")
    assert fused_refusal(sgd, sgd.param_groups[0], "fused") is None


@pytest.mark.parametrize("make, reason", [
    (lambda p: torch.optim.AdamW(p, foreach=True), "chose its kernel"),
    (lambda p: torch.optim.SGD(p, fused=False), "chose its kernel"),
    (lambda p: torch.optim.SGD(p, foreach=True), "chose its kernel"),
    (lambda p: torch.optim.Adam(p, differentiable=True), "differentiable"),
    (lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-3)), "tensor"),
    (lambda p: torch.optim.RMSprop(p), "not torch.optim.Adam"),
    (lambda p: type("Sub", (torch.optim.SGD,), {})(p, lr=0.1), "not torch.optim.Adam"),
])
def test_groups_the_fused_path_must_leave_alone(make, reason):
    optimizer = make([nn.Parameter(torch.randn(3))])
    assert reason in (fused_refusal(optimizer, optimizer.param_groups[0], "fused") or "")
    for mode in ("fused", "exact"):
        assert fused_refusal(optimizer, optimizer.param_groups[0], mode) is not None
        assert not _groups(optimizer, mode)[0].get("fused")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_stay_on_the_default_path(dtype):
    for optimizer, mode in ((torch.optim.AdamW([nn.Parameter(torch.randn(3, dtype=dtype))]), "fused"),
                            (torch.optim.SGD([nn.Parameter(torch.randn(3, dtype=dtype))], lr=0.1), "exact")):
        assert "parameter" in (fused_refusal(optimizer, optimizer.param_groups[0], mode) or "")
        assert _groups(optimizer, mode)[0]["fused"] is None


def test_sgd_with_some_momentum_buffers_made_stays_on_the_default_path():
    """torch's fused SGD starts a group's momentum only when no buffer exists yet: a group where some
    parameters have one and others not (a parameter that got its first gradient later) would fail."""
    first, later = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    optimizer = torch.optim.SGD([first, later], lr=0.1, momentum=0.9)
    first.grad = torch.ones(3)
    optimizer.step()
    later.grad = torch.ones(3)
    assert _groups(optimizer)[0]["fused"] is None
    later_optimizer = torch.optim.SGD([first, later], lr=0.1, momentum=0.9)
    assert _groups(later_optimizer)[0]["fused"] is True  # none made yet: the fused step starts them all


def test_a_bad_host_optimizer_value_is_refused():
    with pytest.raises(OptionError, match="host_optimizer"):
        EngineOptions(host_optimizer="fast")  # type: ignore[arg-type]

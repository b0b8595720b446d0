"""The pre-flight memory plan: its figures against hand-computed ones, the machine's limits, refusals."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re
import threading
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_roundpipe  # noqa: F401 - registers the strategy names
from lightning_roundpipe import RoundPipeStrategy, hostmem, preflight
from lightning_roundpipe.engine.dataparallel import DataParallel
from lightning_roundpipe.engine.engine import RoundPipeEngine
from lightning_roundpipe.engine.layers import build_trunk
from lightning_roundpipe.engine.options import EngineOptions
from lightning_roundpipe.hostmem import (
    CgroupMemory,
    HostLimits,
    format_bytes,
    read_cgroup_memory,
    read_cgroup_v1,
    read_cgroup_v2,
    read_mem_available,
)
from lightning_roundpipe.planning.partition import Plan
from lightning_roundpipe.preflight import DeviceMemoryError, HostMemoryError, plan_memory

PLENTY = HostLimits(mem_available=2**40)

pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("roundpipe-")]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 3))


def _plan(model: nn.Module, optimizers, devices: int = 2, *, trunk_module: nn.Module | None = None, **kwargs):
    trunk = build_trunk(trunk_module if trunk_module is not None else model)
    engine = RoundPipeEngine(trunk, devices)  # plans only: no thread starts before start()
    kwargs.setdefault("limits", PLENTY)
    return plan_memory(model, trunk, engine.plan, optimizers, devices=engine.torch_devices, **kwargs)


def _measured_state_bytes(make_optimizer, model: nn.Module) -> int:
    """Bytes of the optimizer state after one real step on a copy of the model."""
    params = list(model.parameters())
    optimizer = make_optimizer(params)
    for param in params:
        if param.requires_grad:
            param.grad = torch.ones_like(param)
    optimizer.step()
    for param in params:
        param.grad = None
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


OPTIMIZERS = {
    # name: (factory, buffers the size of each trainable parameter, 0-dim float32 scalars per parameter)
    "adamw": (lambda p: torch.optim.AdamW(p, lr=1e-3), 2, 1),
    "adam_amsgrad": (lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True), 3, 1),
    "sgd_momentum": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1, 0),
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.1), 0, 0),
    "rmsprop_centered": (lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.5, centered=True), 3, 1),
    "nadam": (lambda p: torch.optim.NAdam(p, lr=0.1), 2, 2),
    "adagrad": (lambda p: torch.optim.Adagrad(p, lr=0.1), 1, 1),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_parameter_gradient_and_optimizer_bytes_equal_hand_computed(name):
    factory, buffers, scalars = OPTIMIZERS[name]
    model = _model()
    params = list(model.parameters())
    param_bytes = _nbytes(params)
    plan = _plan(model, [factory(params)])
    assert plan.parameter_bytes == param_bytes == plan.parameter_bytes_by_dtype["float32"]
    assert plan.gradient_bytes == param_bytes
    assert plan.optimizer_state_bytes == buffers * param_bytes + 4 * scalars * len(params)
    # and equal to what the optimizer really allocates on its first step
    assert plan.optimizer_state_bytes == _measured_state_bytes(factory, _model())
    assert plan.upload_copy_bytes == plan.next_gradient_bytes == 0  # sync, no transport
    assert not plan.optimizer_state_assumed and plan.fits


def test_factored_adafactor_state_equals_measured():
    model = _model()
    plan = _plan(model, [torch.optim.Adafactor(model.parameters(), lr=1e-2)])
    assert plan.optimizer_state_bytes == _measured_state_bytes(lambda p: torch.optim.Adafactor(p, lr=1e-2), _model())
    assert plan.optimizer_state_bytes < _nbytes(model.parameters())  # factored: much smaller than one copy


def test_frozen_parameters_get_no_gradient_or_state_and_dtypes_are_as_stored():
    model = _model()
    model[0].requires_grad_(False)
    model[2].to(torch.bfloat16).requires_grad_(False)  # a frozen base weight stored in bf16 (LoRA-like)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen16 = list(model[2].parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # frozen ones included in the groups
    plan = _plan(model, [optimizer])
    assert plan.parameter_bytes_by_dtype["bfloat16"] == _nbytes(frozen16) == 2 * 32 * 33
    assert plan.parameter_bytes == _nbytes(model.parameters())
    assert plan.gradient_bytes == _nbytes(trainable)
    assert plan.optimizer_state_bytes == 2 * _nbytes(trainable) + 4 * len(trainable)
    assert plan.optimizer_state_bytes == _measured_state_bytes(lambda p: torch.optim.AdamW(p, lr=1e-3), model)


def test_async_adds_the_published_copy_and_the_next_gradients_of_trunk_parameters_only():
    class Module(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()
            self.extra = nn.Linear(4, 4)   # trainable, outside the trunk: no published copy
            self.net[0].requires_grad_(False)

    module = Module()
    trunk_trainable = [p for p in module.net.parameters() if p.requires_grad]
    sgd = torch.optim.SGD(module.parameters(), lr=0.1)
    sync = _plan(module, [sgd], trunk_module=module.net)
    plan = _plan(module, [sgd], trunk_module=module.net, async_step=True)
    assert sync.upload_copy_bytes == 0
    assert plan.upload_copy_bytes == _nbytes(trunk_trainable)
    assert plan.next_gradient_bytes == _nbytes(trunk_trainable)
    assert plan.gradient_bytes == sync.gradient_bytes == _nbytes(p for p in module.parameters() if p.requires_grad)
    assert plan.new_bytes - sync.new_bytes == 2 * _nbytes(trunk_trainable)


def test_an_unknown_optimizer_is_assumed_to_keep_two_copies_and_named():
    class Lion(torch.optim.Optimizer):
        def __init__(self, params) -> None:
            super().__init__(params, {"lr": 1e-4})

    model = _model()
    plan = _plan(model, [Lion(model.parameters())])
    assert plan.optimizer_state_bytes == 2 * _nbytes(model.parameters())
    assert plan.optimizer_state_assumed
    assert any("Lion" in w and "unknown" in w for w in plan.warnings)
    assert "Lion: unknown, assumed 2x" in plan.table()


def test_a_subclass_of_a_known_optimizer_is_estimated_as_its_base():
    class MyAdamW(torch.optim.AdamW):
        pass

    model = _model()
    plan = _plan(model, [MyAdamW(model.parameters(), lr=1e-3)])
    assert plan.optimizer_state_bytes == 2 * _nbytes(model.parameters()) + 4 * len(list(model.parameters()))
    assert "MyAdamW (as AdamW)" in plan.optimizer_notes[0] and not plan.optimizer_state_assumed


def test_cpu_device_copies_are_bounded_by_two_stages_per_device():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    layer = _nbytes(model[0].parameters())
    one = _plan(model, [], devices=1)
    two = _plan(model, [], devices=2)
    # each device holds its running and its prefetched stage, at most every layer with its gradients (one
    # device: the whole trunk fused, one stage)
    assert 0 < one.device_copy_bytes <= 2 * (2 * 8 * layer)
    assert 0 < two.device_copy_bytes <= 2 * 2 * (2 * 8 * layer)
    for plan in (one, two):
        assert plan.device_stage_bytes == 2 * max(size for _, size in plan.largest_stages.values())


def test_a_model_far_larger_than_the_host_is_planned_without_allocating_it():
    with torch.device("meta"):  # 4 x 2 GiB of float32 weights, never allocated
        model = nn.Sequential(*[nn.Linear(2**15, 2**14, bias=False) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = _plan(model, [optimizer], limits=HostLimits(mem_available=16 * 2**30))
    assert plan.parameter_bytes == 8 * 2**30
    assert plan.new_bytes >= 3 * 8 * 2**30          # gradients and two AdamW buffers at least
    assert plan.shortfall == plan.new_bytes - 16 * 2**30
    assert [problem.kind for problem in plan.problems] == ["host"]


# ------------------------------------------------------------------------------------------ the machine
def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_meminfo_parser(tmp_path):
    meminfo = tmp_path / "meminfo"
    _write(meminfo, "MemTotal:       32000000 kB\nMemFree:  100 kB\nMemAvailable:   23466944 kB\n")
    assert read_mem_available(str(meminfo)) == 23466944 * 1024
    _write(meminfo, "MemTotal:       32000000 kB\n")
    assert read_mem_available(str(meminfo)) is None
    assert read_mem_available(str(tmp_path / "missing")) is None


def test_cgroup_v2_parser_with_a_limit_and_with_max(tmp_path):
    _write(tmp_path / "memory.max", "8589934592\n")
    _write(tmp_path / "memory.current", "3221225472\n")
    _write(tmp_path / "memory.stat", "anon 2147483648\nfile 1073741824\ninactive_file 536870912\n")
    entry = read_cgroup_v2(str(tmp_path))
    assert entry == CgroupMemory(2, 8 * 2**30, 3 * 2**30, 2**29, str(tmp_path))
    assert entry.available == 8 * 2**30 - (3 * 2**30 - 2**29)  # inactive file cache is reclaimable
    _write(tmp_path / "memory.max", "max\n")
    unlimited = read_cgroup_v2(str(tmp_path))
    assert unlimited.limit is None and unlimited.available is None
    assert read_cgroup_v2(str(tmp_path / "nowhere")) is None


def test_cgroup_v2_takes_the_tightest_of_the_process_cgroup_and_its_ancestors(tmp_path):
    root = tmp_path / "cgroup"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(root / "memory.current", "999999999999\n")        # the root cgroup has no memory.max
    _write(root / "kube" / "memory.max", str(4 * 2**30))      # the pod: 4 GiB, 1 GiB used
    _write(root / "kube" / "memory.current", str(2**30))
    _write(root / "kube" / "job" / "memory.max", "max")       # the container: no limit of its own
    _write(root / "kube" / "job" / "memory.current", str(2**29))
    proc = tmp_path / "self_cgroup"
    _write(proc, "0::/kube/job\n")
    entry = read_cgroup_memory(str(root), str(proc))
    assert entry.limit == 4 * 2**30 and entry.available == 3 * 2**30
    assert entry.path == str(root / "kube")
    _write(root / "kube" / "job" / "memory.max", str(2**30))  # now the container is tighter
    assert read_cgroup_memory(str(root), str(proc)).available == 2**30 - 2**29
    _write(proc, "0::/not/here\n")                            # a namespace root: read root itself
    assert read_cgroup_memory(str(root), str(proc)).limit is None


def test_cgroup_v1_parser_unlimited_limited_and_hierarchical(tmp_path):
    memory = tmp_path / "cgroup" / "memory"
    _write(memory / "memory.limit_in_bytes", "9223372036854771712\n")   # v1's "unlimited"
    _write(memory / "memory.usage_in_bytes", "1508524032\n")
    _write(memory / "memory.stat", "cache 100\ninactive_file 0\nhierarchical_memory_limit 9223372036854771712\n"
                                   "total_inactive_file 755593216\n")
    entry = read_cgroup_v1(str(memory))
    assert entry.version == 1 and entry.limit is None and entry.available is None
    assert entry.usage == 1508524032 and entry.reclaimable == 755593216
    _write(memory / "memory.limit_in_bytes", str(2 * 2**30))
    assert read_cgroup_v1(str(memory)).available == 2 * 2**30 - (1508524032 - 755593216)
    _write(memory / "memory.stat", f"hierarchical_memory_limit {2**30}\ntotal_inactive_file 0\n")
    assert read_cgroup_v1(str(memory)).limit == 2**30  # a parent's tighter limit
    # found from /proc/self/cgroup, falling back to the mount's root when the path is not visible
    proc = tmp_path / "self_cgroup"
    _write(proc, "9:name=systemd:/\n4:memory:/process_api/abc\n0::/\n")
    assert read_cgroup_memory(str(tmp_path / "cgroup"), str(proc)).path == str(memory)
    _write(memory / "process_api" / "abc" / "memory.usage_in_bytes", "5\n")
    _write(memory / "process_api" / "abc" / "memory.limit_in_bytes", "105\n")
    found = read_cgroup_memory(str(tmp_path / "cgroup"), str(proc))
    assert (found.limit, found.available) == (105, 100)


def test_host_limits_take_the_smaller_of_meminfo_and_cgroup():
    cgroup = CgroupMemory(2, 10 * 2**30, 8 * 2**30)
    assert HostLimits(mem_available=5 * 2**30, cgroup=cgroup).available == 2 * 2**30
    assert HostLimits(mem_available=2**30, cgroup=cgroup).available == 2**30
    assert HostLimits(mem_available=2**30, cgroup=CgroupMemory(2, None, 5)).available == 2**30
    assert HostLimits().available is None
    assert HostLimits(mem_available=5 * 2**30, cgroup=cgroup).cgroup_binds


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads Linux's /proc/meminfo")
def test_the_real_machine_is_read():
    with open("/proc/meminfo") as file:
        kib = next(int(line.split()[1]) for line in file if line.startswith("MemAvailable:"))
    limits = hostmem.read_host_limits()
    # in bytes (the file says kB); memory use moves between the two reads, but not by half
    assert limits.mem_available is not None and 0.5 < limits.mem_available / (kib * 1024) < 2
    assert limits.available is not None and 0 <= limits.available <= limits.mem_available


def test_pinned_weights_ignore_memlock_and_warn_only_when_over_half_of_memavailable():
    """The driver pins registered pages itself (not through mlock), so RLIMIT_MEMLOCK refuses nothing; what the
    engine registers (every trunk weight and buffer, the gradient download buffers) is reported, with a warning
    when it nears MemAvailable."""
    model = _model()
    trunk = build_trunk(model)
    plan = RoundPipeEngine(trunk, 2).plan
    cuda = [torch.device("cuda", 0), torch.device("cuda", 1)]
    registered = _nbytes(trunk.parameters()) + sum(b.numel() * b.element_size() for s in trunk.states for b in s.buffers)
    tight_memlock = plan_memory(model, trunk, plan, [], devices=cuda, limits=HostLimits(mem_available=2**40, memlock=64))
    assert tight_memlock.fits and not tight_memlock.warnings and tight_memlock.device_copy_bytes == 0
    registered += _staging_bytes(tight_memlock, model)  # and the gradient download buffers
    assert tight_memlock.pinned_bytes == registered > 64
    assert "RLIMIT_MEMLOCK" not in tight_memlock.table()
    short = plan_memory(model, trunk, plan, [], devices=cuda, limits=HostLimits(mem_available=registered))
    assert any("over half of MemAvailable" in w and "pin_memory=False" in w for w in short.warnings), short.warnings
    unpinned = plan_memory(model, trunk, plan, [], devices=cuda, limits=HostLimits(mem_available=registered), pin_memory=False)
    assert unpinned.pinned_bytes == 0 and not any("MemAvailable" in w for w in unpinned.warnings)
    cpu = plan_memory(model, trunk, plan, [], devices=[torch.device("cpu")] * 2, limits=PLENTY)
    assert cpu.fits and cpu.pinned_bytes == 0 and "not used on CPU devices" in cpu.table()


# ------------------------------------------------------------------------------------------ through Lightning
class Classifier(pl.LightningModule):
    def __init__(self, optimizer: str = "adamw", width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.optimizer_name = optimizer
        self.net = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                 nn.Linear(width, 3))
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(16, 6, generator=generator),
                                    torch.randint(0, 3, (16,), generator=generator)), batch_size=8)


def _trainer(strategy, **kwargs) -> pl.Trainer:
    kwargs.setdefault("max_steps", 2)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, limit_val_batches=0,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _fake_host(monkeypatch, available: int | None, cgroup: CgroupMemory | None = None) -> list[int]:
    calls = []

    def fake() -> HostLimits:
        calls.append(1)
        return HostLimits(mem_available=available, cgroup=cgroup, memlock=None)

    monkeypatch.setattr(preflight, "read_host_limits", fake)
    return calls


def _staging_bytes(plan, trunk: nn.Sequential) -> int:
    """Each device downloads gradients into 2 buffers as large as the largest stage's gradients (fused or backward;
    every parameter trainable, as stored)."""
    stages = [layers for kind, (layers, _) in plan.largest_stages.items() if kind != "forward"]
    return plan.num_devices * 2 * max(sum(_nbytes(trunk[layer].parameters()) for layer in layers) for layers in stages)


def _expected_new_bytes(module: Classifier, strategy: RoundPipeStrategy) -> int:
    params = list(module.parameters())
    adamw = 2 * _nbytes(params) + 4 * len(params)
    staging = _staging_bytes(strategy.memory_plan, module.net)
    return _nbytes(params) + adamw + strategy.memory_plan.device_copy_bytes + staging


def test_fit_logs_the_plan_when_it_fits(monkeypatch, caplog):
    module, strategy = _fit_with_plenty_of_host(monkeypatch, caplog)
    plan = strategy.memory_plan
    assert plan is not None and plan.fits and plan.trainer_fn == "fit"
    params = list(module.parameters())
    assert plan.parameter_bytes == plan.gradient_bytes == _nbytes(params)
    assert plan.optimizer_state_bytes == 2 * _nbytes(params) + 4 * len(params)
    assert plan.new_bytes == _expected_new_bytes(module, strategy)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("RoundPipe memory plan")]
    assert len(logged) == 1
    for item in ("parameters", "gradients", "optimizer state", "AdamW", "upload copies", "headroom",
                 "stage-boundary activations", "checkpoint save", "running + prefetched stage", "largest layer"):
        assert item in logged[0]
    assert format_bytes(_nbytes(params)) in logged[0]
    assert module.steps == 2


def test_fit_refuses_before_training_when_the_host_is_short(monkeypatch):
    _fake_host(monkeypatch, 2**40)
    probe = RoundPipeStrategy(num_microbatches=2)
    _trainer(probe, max_steps=1).fit(Classifier(), _loader())
    need = probe.memory_plan.new_bytes
    available = need - 1000
    _fake_host(monkeypatch, available)
    module = Classifier()
    before = [p.detach().clone() for p in module.parameters()]
    strategy = RoundPipeStrategy(num_microbatches=2)
    with pytest.raises(HostMemoryError) as caught:
        _trainer(strategy).fit(module, _loader())
    message = str(caught.value)
    assert isinstance(caught.value, MemoryError)
    assert f"short by {format_bytes(1000)}" in message
    params = list(module.parameters())
    items = {"gradients": _nbytes(params), "optimizer state (AdamW": 2 * _nbytes(params) + 4 * len(params),
             "simulated device copies": probe.memory_plan.device_copy_bytes}
    largest = max(items, key=items.get)
    assert f"the largest is {largest}" in message and format_bytes(items[largest]) in message
    assert f"{format_bytes(available)} available (MemAvailable)" in message
    for option in ("SGD without momentum", "freeze", "bf16-true", "fewer simulated devices", "preflight='warn'"):
        assert option in message
    assert module.steps == 0                                  # refused before training started
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    assert strategy.engine is None and _threads() == []        # no engine thread ever started
    assert "forward" not in module.net.__dict__


def test_a_tight_cgroup_is_named(monkeypatch):
    _fake_host(monkeypatch, 2**40, cgroup=CgroupMemory(2, 2**30, 2**30 - 2048))
    with pytest.raises(HostMemoryError, match=r"cgroup v2 memory\.max 1\.0 GiB .*container"):
        _trainer(RoundPipeStrategy(num_microbatches=2)).fit(Classifier(), _loader())
    assert _threads() == []


def test_async_refusal_suggests_the_sync_step(monkeypatch):
    _fake_host(monkeypatch, 10)
    with pytest.raises(HostMemoryError, match="async_step=False, which drops the published copy"):
        _trainer(RoundPipeStrategy(num_microbatches=2, async_step=True)).fit(Classifier(), _loader())
    assert _threads() == []


def test_warn_mode_warns_and_trains(monkeypatch):
    _fake_host(monkeypatch, 10)
    module = Classifier()
    strategy = RoundPipeStrategy(num_microbatches=2, preflight="warn")
    with pytest.warns(UserWarning, match="the host cannot hold the training state.*preflight='warn': continuing"):
        _trainer(strategy).fit(module, _loader())
    assert module.steps == 2 and not strategy.memory_plan.fits and strategy.memory_plan.shortfall > 0


def test_off_mode_is_silent(monkeypatch, caplog):
    calls = _fake_host(monkeypatch, 10)
    module = Classifier()
    strategy = RoundPipeStrategy(num_microbatches=2, preflight="off")
    with caplog.at_level(logging.INFO, logger="lightning_roundpipe"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(strategy).fit(module, _loader())
    assert module.steps == 2 and strategy.memory_plan is None and calls == []
    assert not any("memory plan" in r.getMessage() or "pre-flight" in r.getMessage() for r in caplog.records)
    assert not any("pre-flight" in str(w.message) for w in caught)


def test_an_invalid_mode_is_refused():
    with pytest.raises(ValueError, match="`preflight` must be one of 'refuse', 'warn', 'off', got 'strict'"):
        RoundPipeStrategy(preflight="strict")


def test_validate_plans_no_gradients_or_optimizer_state(monkeypatch):
    _fake_host(monkeypatch, 2**40)
    module = Classifier()
    strategy = RoundPipeStrategy(num_microbatches=2)
    _trainer(strategy).validate(module, _loader())
    plan = strategy.memory_plan
    assert plan.trainer_fn == "validate" and plan.gradient_bytes == plan.optimizer_state_bytes == 0
    assert plan.parameter_bytes == _nbytes(module.parameters()) and plan.activation_layers == []
    assert "backward" not in plan.largest_stages


# ------------------------------------------------------------------------------------------ device side
def test_a_layer_larger_than_the_device_budget_is_refused_naming_it(monkeypatch):
    _fake_host(monkeypatch, 2**40)
    module = Classifier(width=64)
    big = module.net[2]                                   # Linear(64, 64): the largest layer
    need = 2 * _nbytes(big.parameters())                  # parameters + gradients
    limit = 20_000                                        # stages get 15,000 bytes, 7,500 each; need 33,280
    strategy = RoundPipeStrategy(num_microbatches=2, device_memory_limit=limit)
    with pytest.raises(DeviceMemoryError) as caught:
        _trainer(strategy).fit(module, _loader())
    message = str(caught.value)
    assert f"layer 2 (Linear) needs {format_bytes(need)}" in message
    assert f"device_memory_limit={format_bytes(limit)}" in message
    assert f"short by {format_bytes(need - 7500)}" in message
    minimum = preflight._smallest_limit_for(need)
    assert int(minimum * 0.75) / 2 >= need > int((minimum - 1) * 0.75) / 2
    assert f"at least {format_bytes(minimum)}" in message
    for advice in ("More devices or stages do not help", "`recompute`", "split the layer", "freeze"):
        assert advice in message
    assert module.steps == 0 and strategy.engine is None and _threads() == []


def test_warn_mode_lets_the_planner_refuse_an_oversized_layer(monkeypatch):
    _fake_host(monkeypatch, 2**40)
    strategy = RoundPipeStrategy(num_microbatches=2, device_memory_limit=20_000, preflight="warn")
    with pytest.warns(UserWarning, match="layer 2"), pytest.raises(ValueError, match="layer 2 needs"):
        _trainer(strategy).fit(Classifier(width=64), _loader())
    assert _threads() == []


def test_an_explicit_plan_whose_two_stages_exceed_the_limit_is_refused():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    layer = _nbytes(model[0].parameters())
    trunk = build_trunk(model)
    explicit = Plan.from_sizes([4, 1], 1, [4, 1])           # backward stage of 4 layers with gradients
    limit = 12 * layer                                       # every layer fits; 2 x 8 layers' bytes do not
    plan = plan_memory(model, trunk, explicit, [], devices=[torch.device("cpu")] * 2, device_memory_limit=limit,
                       limits=PLENTY)
    assert plan.largest_stages["backward"] == (range(1, 5), 8 * layer)
    assert plan.device_stage_bytes == 16 * layer and [problem.kind for problem in plan.problems] == ["device"]
    assert "largest stage (backward, layers [1-4])" in plan.problems[0].message
    assert f"by {format_bytes(4 * layer)}" in plan.problems[0].message
    with pytest.raises(DeviceMemoryError):
        preflight.enforce(plan, "refuse")
    auto = RoundPipeEngine(trunk, 2, lightning_roundpipe.EngineOptions(device_memory_limit=limit)).plan
    assert plan_memory(model, trunk, auto, [], devices=[torch.device("cpu")] * 2, device_memory_limit=limit,
                       limits=PLENTY).fits


# ---------------------------------------------------------------------------- the host optimizer step
def _one_line(text: str) -> str:
    return " ".join(text.split())  # the plan wraps the host optimizer's sentences


def _logged_plan(caplog) -> str:
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("RoundPipe memory plan")]
    assert len(logged) == 1
    return _one_line(logged[0])


def _fit_with_plenty_of_host(monkeypatch, caplog) -> tuple[Classifier, RoundPipeStrategy]:
    _fake_host(monkeypatch, 2**40)
    module = Classifier()
    strategy = RoundPipeStrategy(num_microbatches=2)
    with caplog.at_level(logging.INFO, logger="lightning_roundpipe"):
        _trainer(strategy).fit(module, _loader())
    return module, strategy


def test_fit_logs_the_measured_host_optimizer_step_and_the_fused_alternative(monkeypatch, caplog):
    module, strategy = _fit_with_plenty_of_host(monkeypatch, caplog)
    assert strategy.memory_plan is not None
    (figure,) = strategy.memory_plan.host_steps
    count = sum(p.numel() for p in module.parameters())
    assert (figure.optimizer, figure.kernel, figure.params, figure.sample) == ("AdamW", "default", count, count)
    assert figure.threads == torch.get_num_threads()
    assert figure.seconds_per_param and figure.seconds_per_param > 0
    assert figure.fused_seconds_per_param and figure.fused_seconds_per_param > 0
    logged = _logged_plan(caplog)
    assert "host optimizer step: AdamW (torch's per-tensor loop): ~" in logged
    assert f"per step for {count:,} trainable parameters (measured at setup on {count:,} scratch parameters" in logged
    assert "host_optimizer='fused' (torch's fused kernel, equal within float rounding, not bitwise) would take" \
        in logged
    assert module.steps == 2


def test_with_host_optimizer_fused_the_plan_times_the_fused_kernel(monkeypatch, caplog):
    _fake_host(monkeypatch, 2**40)
    strategy = RoundPipeStrategy(num_microbatches=2, host_optimizer="fused")
    with caplog.at_level(logging.INFO, logger="lightning_roundpipe"):
        _trainer(strategy, max_steps=1).fit(Classifier(), _loader())
    assert strategy.memory_plan is not None
    (figure,) = strategy.memory_plan.host_steps
    assert figure.kernel == "fused" and figure.fused_seconds_per_param is None
    logged = _logged_plan(caplog)
    assert "host optimizer step: AdamW (fused kernel): ~" in logged and "would take" not in logged


def test_sgd_without_momentum_is_timed_on_the_fused_kernel_exact_mode_gives_it():
    model = _model()
    (figure,) = _plan(model, [torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.01)],
                      host_optimizer="exact").host_steps
    assert figure.kernel == "fused" and figure.fused_seconds_per_param is None
    (figure,) = _plan(model, [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)],
                      host_optimizer="exact").host_steps
    assert figure.kernel == "default" and figure.fused_seconds_per_param is not None


def test_measuring_the_host_step_leaves_the_users_optimizer_untouched():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, amsgrad=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    torch.nn.functional.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3)).backward()
    optimizer.step()
    scheduler.step()
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    members = [list(map(id, group["params"])) for group in optimizer.param_groups]
    saved = copy.deepcopy(optimizer.state_dict())
    weights = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    attributes = dict(optimizer.__dict__)

    plan = _plan(model, [optimizer], host_optimizer="exact")

    (figure,) = plan.host_steps
    assert figure.seconds_per_param and figure.fused_seconds_per_param
    assert [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups] == groups
    assert [list(map(id, group["params"])) for group in optimizer.param_groups] == members
    state = optimizer.state_dict()
    assert state["param_groups"] == saved["param_groups"]
    assert state["state"].keys() == saved["state"].keys()
    for index, entry in saved["state"].items():
        assert entry.keys() == state["state"][index].keys()
        for key, value in entry.items():
            assert torch.equal(state["state"][index][key], value), (index, key)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights, strict=True))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert optimizer.__dict__.keys() == attributes.keys() and optimizer.step is attributes.get("step", optimizer.step)


def test_an_optimizer_it_cannot_build_is_reported_not_measured():
    class NeedsMore(torch.optim.SGD):
        def __init__(self, params, schedule):  # an argument no param group holds
            super().__init__(params, lr=0.1)

    model = _model()
    plan = _plan(model, [NeedsMore(model.parameters(), schedule=[1, 2])], host_optimizer="exact")
    (figure,) = plan.host_steps
    assert figure.seconds_per_param is None and "TypeError" in figure.problem
    assert "host optimizer step: NeedsMore (its own step): not measured (a scratch NeedsMore failed" in \
        _one_line(plan.table())


def test_the_host_step_is_measured_only_when_asked_for_training_with_room():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert _plan(model, [optimizer]).host_steps == []                                  # not asked
    assert _plan(model, [optimizer], host_optimizer="exact", training=False).host_steps == []
    needed = _plan(model, [optimizer]).new_bytes
    tight = HostLimits(mem_available=needed + 2**20)  # fits, with 1 MiB to spare: no room for a scratch
    assert _plan(model, [optimizer], host_optimizer="exact", limits=tight).host_steps == []
    assert "host optimizer" not in _plan(model, [optimizer]).table()


def test_the_plan_gives_the_host_bytes_per_parameter_by_category():
    """``_model()``: 1,443 float32 parameters in 8 tensors, AdamW (two float32 buffers each, and a 4-byte step count
    per tensor), no transport dtype: the weights 4 B/param, the optimizer state 8 + 32/1,443."""
    model = _model()
    plan = _plan(model, [torch.optim.AdamW(model.parameters())])
    (row,) = [row for row in plan.rows() if row[0] == "per parameter"]
    assert row[1] == f"{plan.host_total_bytes / 1443:.2f} B"
    assert "weights and their upload copies 4.00" in row[2]
    assert f"optimizer state {8 + 32 / 1443:.2f}" in row[2] and "disk:" not in row[2]


# ---------------------------------------------------------------------------- data parallel on one node
ADAMW_STATE = 2 * 5772 + 4 * 8  # _model(): 1,443 float32 parameters (5,772 bytes) in 8 tensors, a step each


def _adamw_plan(**kwargs):
    model = _model()
    return _plan(model, [torch.optim.AdamW(model.parameters(), lr=1e-3)], **kwargs)


def test_the_per_parameter_row_gives_the_node_and_what_sharding_the_optimizer_state_makes_it():
    """_model(): 1,443 parameters; AdamW's state 8 B/param and 32 bytes of step counts, over 2 processes."""
    def row(plan):
        return next(note for item, _, note in plan.rows() if item == "per parameter")
    one, two = _adamw_plan(), _adamw_plan(processes_per_node=2)
    assert "this node" not in row(one) and "shard_optimizer" not in row(one)
    assert f"this node, 2 processes: {2 * two.host_total_bytes / 1443:.2f}" in row(two)
    assert f"shard_optimizer=True would make the optimizer state about {ADAMW_STATE / 2 / 1443:.2f} per process" in \
        row(two)
    sharded = _adamw_plan(processes_per_node=2, optimizer_shards=2)
    assert f"sharded over 2 processes (unsharded {ADAMW_STATE / 1443:.2f})" in row(sharded)


def test_processes_per_node_multiply_the_host_need_of_the_node_not_the_device_figures():
    one, two = _adamw_plan(), _adamw_plan(processes_per_node=2)
    assert _nbytes(_model().parameters()) == 5772 and one.optimizer_state_bytes == ADAMW_STATE == 11576
    # one process's figures are unchanged: parameters, gradients, optimizer state, copies
    for plan in (one, two):
        assert (plan.parameter_bytes, plan.gradient_bytes, plan.optimizer_state_bytes) == (5772, 5772, 11576)
        assert plan.new_bytes == 5772 + 11576 + one.device_copy_bytes + _staging_bytes(one, _model())
        assert plan.host_total_bytes == 5772 + plan.new_bytes
    assert one.node_new_bytes == one.new_bytes and one.headroom == 2**40 - one.new_bytes
    assert two.node_new_bytes == 2 * one.new_bytes and two.node_total_bytes == 2 * one.host_total_bytes
    assert two.headroom == 2**40 - 2 * one.new_bytes
    assert (two.device_stage_bytes, two.largest_layer, two.largest_stages) == \
        (one.device_stage_bytes, one.largest_layer, one.largest_stages)
    table = two.table()
    assert "  host (each of 2 processes on this node)\n" in table
    assert re.search(rf"\n +to allocate on this node +{re.escape(format_bytes(2 * one.new_bytes))}  2 processes", table)
    assert (f"2 processes on this node (rings_per_node=2), each holding all of the above: 2 x "
            f"{format_bytes(one.new_bytes)}; host total with parameters and buffers "
            f"{format_bytes(2 * one.host_total_bytes)}") in table
    assert "for activations, batches and everything else of the 2 processes" in table
    # one process on a node: the report as before, no line about processes or sharding
    plain = one.table()
    assert plain == _adamw_plan(processes_per_node=1, optimizer_shards=1).table()
    assert "on this node" not in plain and "sharded" not in plain and "  host\n" in plain
    assert len(table.splitlines()) == len(plain.splitlines()) + 1


@pytest.mark.parametrize(("shards", "share"), [(2, 5788), (4, 2894), (3, 3859)])  # 3: 11576 / 3 rounded up
def test_optimizer_shards_divide_the_optimizer_state_only(shards, share):
    whole, sharded = _adamw_plan(), _adamw_plan(optimizer_shards=shards)
    assert sharded.optimizer_state_bytes == share and sharded.unsharded_optimizer_state_bytes == ADAMW_STATE
    assert (sharded.parameter_bytes, sharded.gradient_bytes, sharded.upload_copy_bytes, sharded.device_copy_bytes) \
        == (whole.parameter_bytes, whole.gradient_bytes, whole.upload_copy_bytes, whole.device_copy_bytes)
    assert whole.new_bytes - sharded.new_bytes == ADAMW_STATE - share
    note = (f"sharded over {shards} processes (shard_optimizer): about 1/{shards} each of "
            f"{format_bytes(ADAMW_STATE)}, whole parameters per process; AdamW: exp_avg, exp_avg_sq + step")
    assert note in sharded.table() and dict(sharded.new_items())[f"optimizer state ({note})"] == share
    assert len(sharded.table().splitlines()) == len(whole.table().splitlines())  # the note, not a new line
    # both together: the node holds two processes' shares
    both = _adamw_plan(processes_per_node=2, optimizer_shards=shards)
    assert both.node_new_bytes == 2 * sharded.new_bytes


def test_sharding_sgd_without_state_or_evaluating_says_nothing_about_shards():
    model = _model()
    sgd = _plan(model, [torch.optim.SGD(model.parameters(), lr=0.1)], optimizer_shards=4)
    assert sgd.optimizer_state_bytes == 0 and "sharded" not in sgd.table()
    evaluating = _adamw_plan(optimizer_shards=4, processes_per_node=2, training=False)
    assert evaluating.optimizer_state_bytes == 0 and "sharded" not in evaluating.table()
    assert evaluating.node_new_bytes == 2 * evaluating.new_bytes


def test_a_plan_that_fits_one_process_but_not_two_on_the_node_is_refused_naming_rings_per_node():
    need = _adamw_plan().new_bytes
    limits = HostLimits(mem_available=2 * need - 5000)  # one process fits; two are short by 5,000 bytes
    assert _adamw_plan(limits=limits).fits
    plan = _adamw_plan(limits=limits, processes_per_node=2)
    assert [problem.kind for problem in plan.problems] == ["host"] and plan.shortfall == 5000
    message = plan.problems[0].message
    largest, nbytes = plan.new_items()[0]  # one process's: here the gradient staging of the two devices
    assert (largest, nbytes) == ("gradient staging", plan.staging_bytes)
    assert (f"Training will allocate {format_bytes(2 * need)} more on this node: 2 processes (rings_per_node=2), "
            f"each allocating {format_bytes(need)}; the largest is {largest}: {format_bytes(nbytes)}; the host has "
            f"{format_bytes(2 * need - 5000)} available (MemAvailable)") in message
    assert f"short by {format_bytes(5000)}" in message
    assert (f"fewer rings_per_node: each of the 2 processes on this node holds its own copy of the training state, "
            f"so the node needs 2 x {format_bytes(need)}") in message
    assert (f"shard_optimizer=True, which splits the optimizer state ({format_bytes(ADAMW_STATE)} in each process) "
            f"over all the processes, each keeping about 1/world size of it: at least {format_bytes(ADAMW_STATE)} "
            "less on this node") in message
    assert f"The parameters and buffers ({format_bytes(5772)} in each process) are already allocated" in message
    with pytest.raises(HostMemoryError, match=r"rings_per_node=2.*fewer rings_per_node.*shard_optimizer=True"):
        preflight.enforce(plan, "refuse")
    with pytest.warns(UserWarning, match=r"fewer rings_per_node.*preflight='warn': continuing"):
        preflight.enforce(plan, "warn")
    # the advice holds: sharded over the 2 processes, each keeps half the state and the node fits again
    assert 2 * (need - ADAMW_STATE // 2) < limits.available
    assert _adamw_plan(limits=limits, processes_per_node=2, optimizer_shards=2).fits


def test_one_process_per_node_of_several_nodes_is_told_to_shard_the_optimizer_state():
    """One ring per node on 4 nodes: the node holds one copy, and sharding would leave it 1/4 of the state."""
    need = _adamw_plan().new_bytes
    plan = _adamw_plan(world_size=4, limits=HostLimits(mem_available=need - 1))
    message = plan.problems[0].message
    assert "fewer rings_per_node" not in message
    assert (f"shard_optimizer=True, which splits the optimizer state ({format_bytes(ADAMW_STATE)} in each process) "
            f"over all the processes, each keeping about 1/world size of it: at least "
            f"{format_bytes(ADAMW_STATE * 3 // 4)} less on this node") in message
    alone = _adamw_plan(limits=HostLimits(mem_available=need - 1)).problems[0].message
    assert "shard_optimizer" not in alone  # one process in all: nothing to shard over


def test_a_sharded_plan_that_does_not_fit_says_so_and_does_not_suggest_sharding():
    sharded = _adamw_plan(processes_per_node=2, optimizer_shards=2)
    plan = _adamw_plan(processes_per_node=2, optimizer_shards=2,
                       limits=HostLimits(mem_available=sharded.node_new_bytes - 1))
    message = plan.problems[0].message
    assert f"short by {format_bytes(1)}" in message and "fewer rings_per_node" in message
    assert (f"The optimizer state is sharded over 2 processes: about 1/2 of {format_bytes(ADAMW_STATE)} in each."
            in message)
    assert "shard_optimizer=True" not in message


def test_pinned_memory_of_every_process_on_the_node_counts_against_memavailable():
    model = _model()
    trunk = build_trunk(model)
    plan = RoundPipeEngine(trunk, 2).plan
    cuda = [torch.device("cuda", 0), torch.device("cuda", 1)]
    one = plan_memory(model, trunk, plan, [], devices=cuda, limits=PLENTY, training=False)
    limits = HostLimits(mem_available=3 * one.pinned_bytes)  # one process pins a third, two pin two thirds
    assert not plan_memory(model, trunk, plan, [], devices=cuda, limits=limits, training=False).warnings
    two = plan_memory(model, trunk, plan, [], devices=cuda, limits=limits, processes_per_node=2, training=False)
    assert two.pinned_bytes == one.pinned_bytes and two.fits
    (warning,) = two.warnings
    assert (f"pins {format_bytes(2 * one.pinned_bytes)} of host weights and buffers (2 processes on this node, "
            f"{format_bytes(one.pinned_bytes)} each), over half of MemAvailable") in warning
    assert "pin_memory=False" in warning and "fewer rings_per_node" in warning
    assert f"each process; {format_bytes(2 * one.pinned_bytes)} on this node: what uploads read" in two.table()


def test_the_host_step_scratch_is_sized_by_one_process_share_of_the_node_headroom():
    need = _adamw_plan().new_bytes
    limits = HostLimits(mem_available=2 * need + 20 * 2**20)  # 20 MiB to spare on the node: 10 MiB each
    assert _adamw_plan(limits=limits, host_optimizer="exact").host_steps          # one process: room to measure
    assert _adamw_plan(limits=limits, host_optimizer="exact", processes_per_node=2).host_steps == []


@pytest.mark.parametrize("name", ["processes_per_node", "optimizer_shards"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_invalid_process_counts_are_refused(name, value):
    with pytest.raises(ValueError, match=f"`{name}` must be a positive integer"):
        _adamw_plan(**{name: value})


@pytest.mark.parametrize("shard", [False, True])
def test_plan_for_reads_what_plan_memory_needs_from_the_engine(monkeypatch, shard):
    """The strategy's one-line pre-flight: the same plan as plan_memory given every figure by hand, the world size
    and the optimizer shards read from the engine's data-parallel group."""
    _fake_host(monkeypatch, 2**40)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    group = DataParallel(world_size=4, rank=1, shard_optimizer=shard)
    engine = RoundPipeEngine(build_trunk(model), 2, EngineOptions(async_step=True), data_parallel=group)
    by_hand = plan_memory(model, engine.trunk, engine.plan, [optimizer], devices=engine.torch_devices,
                          async_step=True, trainer_fn="fit", host_optimizer="exact", processes_per_node=2,
                          optimizer_shards=4 if shard else 1, world_size=4)
    one_line = preflight.plan_for(engine, model, [optimizer], "fit", 2)
    assert len(one_line.host_steps) == len(by_hand.host_steps) == 1  # timed: the figures differ from run to run
    assert dataclasses.replace(one_line, host_steps=[]) == dataclasses.replace(by_hand, host_steps=[])
    evaluating = preflight.plan_for(engine, model, [optimizer], "validate")
    assert evaluating.trainer_fn == "validate" and evaluating.optimizer_state_bytes == 0

"""State a module is given between steps is what the next step uses (issue 14, item 3).

Code between steps may give a trunk layer new tensors instead of writing into the old ones: Lightning's
``StochasticWeightAveraging`` assigns new BatchNorm running statistics, ``load_state_dict(assign=True)`` and
``module.bias = nn.Parameter(...)`` new parameters, ``param.data = ...`` and ``module.to(torch.float64)``
new memory to the same parameter. Before each call the engine checks the trunk's registered tensors
against what it collected and follows a change (``Trunk.changed_layers``, ``ModuleFollower.follow_layers``).

References: Lightning's default strategy on the same seeded module and data, in float64 with one microbatch
per batch, so RoundPipe runs the same kernels on the same data in the same order: bitwise equal
(``assert_states_equal``, tests/numerics.py), except with ``deferred_batchnorm``, whose statistics are
computed by another formula (float64 tolerance). Async mode is one step stale, so its reference is the
plain-PyTorch delayed update (step k takes gradients computed on W(k-2)) with the same change at the same
batch; what async guarantees is stated with its tests.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from torch import nn

import lightning_roundpipe  # noqa: F401 - registers the strategy names
from lightning_roundpipe import EngineOptions, RoundPipeEngine, RoundPipeStrategy
from lightning_roundpipe.engine.pinned import PinnedStorages
from tests.models import classifier_data
from tests.numerics import assert_states_equal, assert_states_float64_equal

CHANGE_AT = 2  # the batch (of the first epoch: the optimizer step count) before which a callback changes state


class NormNet(pl.LightningModule):
    """A BatchNorm on the input (its statistics depend on the data only, not on the weights), then
    Linear/BatchNorm/Tanh twice and a head; SGD with momentum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(),
                                 nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x.to(self.dtype)), y)  # self.dtype follows module.to(dtype)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _reset_buffers(net: nn.Sequential) -> None:
    for norm, mean, var in ((net[0], 0.5, 2.0), (net[2], -0.25, 3.0)):
        norm.running_mean = torch.full_like(norm.running_mean, mean)
        norm.running_var = torch.full_like(norm.running_var, var)


def _new_parameter(net: nn.Sequential) -> None:
    net[4].bias = nn.Parameter(torch.full_like(net[4].bias, 0.25))


def _scaled_state(net: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value * 0.9 if value.is_floating_point() else value.clone()
            for name, value in net.state_dict().items()}


CHANGES = {
    "buffer": _reset_buffers,                                                     # new buffer tensors
    "parameter": _new_parameter,                                                  # a new Parameter object
    "data": lambda net: setattr(net[1].weight, "data", net[1].weight.data * 0.5),  # new memory, same object
    "load_state_dict": lambda net: net.load_state_dict(_scaled_state(net)),       # in place
    "load_state_dict_assign": lambda net: net.load_state_dict(_scaled_state(net), assign=True),  # new objects
    "to_float64": lambda net: net.to(torch.float64),                              # new memory and dtype
}


class Change(Callback):
    """Applies a change to the LightningModule's trunk before batch ``CHANGE_AT`` (between two steps)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.done = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == CHANGE_AT and not self.done:
            self.done = True
            if self.kind == "to_float64":
                pl_module.to(torch.float64)  # the LightningModule's own dtype follows
            else:
                CHANGES[self.kind](pl_module.net)


def _fit(module: pl.LightningModule, strategy, callbacks: list[Callback], *, precision: str = "64-true",
         epochs: int = 2) -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1 if strategy == "auto" else 2,
                         max_epochs=epochs, precision=precision, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    with warnings.catch_warnings():
        # a new parameter is not in the optimizer (as under the default strategy): RoundPipe says so
        warnings.filterwarnings("ignore", r".*trainable trunk parameters are not in the optimizer")
        trainer.fit(module, classifier_data())
    return trainer


def _sync(**options) -> RoundPipeStrategy:
    return RoundPipeStrategy(num_microbatches=1, num_stages=2, **options)


# ------------------------------------------------------------------------------------------ SWA's BatchNorm reset
class ClearGradientsForTheNormEpoch(Callback):
    """SWA's last epoch only recomputes BatchNorm statistics (no backward), yet Lightning still calls the
    optimizer at its end, which then applies the gradients the last real step left in ``param.grad``. Which
    gradients those are is a matter of gradient lifetime, not of this test: clear them in both runs, so both
    end at the averaged weights."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.fit_loop._skip_backward:  # set by SWA's on_train_epoch_start, which runs first
            for param in pl_module.parameters():
                param.grad = None


def _swa_fit(strategy, clear_gradients: bool = False) -> tuple[NormNet, StochasticWeightAveraging]:
    module = NormNet()
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    _fit(module, strategy, [swa, *([ClearGradientsForTheNormEpoch()] if clear_gradients else [])], epochs=3)
    return module, swa


def _buffers(module: NormNet) -> dict[str, torch.Tensor]:
    return {name: buffer.detach() for name, buffer in module.named_buffers()}


@pytest.mark.parametrize("deferred", [False, True], ids=["per-microbatch", "deferred"])
def test_swa_with_batchnorm_ends_with_the_default_strategys_buffers_and_weights(deferred):
    """SWA assigns new running statistics before its last epoch, which recomputes them with the averaged
    weights: before, the engine kept updating the tensors it had collected and the module ended with SWA's
    reset values (mean 0, variance 1). The final weights are compared with the norm epoch's stale-gradient
    step taken out of both runs (see ``ClearGradientsForTheNormEpoch``)."""
    reference, reference_swa = _swa_fit("auto")
    module, swa = _swa_fit(_sync(deferred_batchnorm=deferred))
    if deferred:  # the whole batch's statistics by Chan's formula, not the kernel's: float64 tolerance
        assert_states_float64_equal(_buffers(module), _buffers(reference))
    else:
        assert_states_equal(_buffers(module), _buffers(reference))
    assert not torch.equal(module.net[2].running_var, torch.ones(16, dtype=torch.float64))
    assert_states_equal(dict(swa._average_model.named_parameters()),
                        dict(reference_swa._average_model.named_parameters()))
    reference, _ = _swa_fit("auto", clear_gradients=True)
    module, _ = _swa_fit(_sync(deferred_batchnorm=deferred), clear_gradients=True)
    assert_states_equal(dict(module.named_parameters()), dict(reference.named_parameters()))  # the averaged ones


def test_swa_in_async_mode_recomputes_the_statistics_it_reset():
    """Async mode: the weights are one step stale, so only the input BatchNorm's statistics (which depend on
    the data alone) can equal the default strategy's; every BatchNorm must have left SWA's reset values."""
    reference, _ = _swa_fit("auto")
    module, _ = _swa_fit(_sync(async_step=True))
    for name in ("net.0.running_mean", "net.0.running_var", "net.0.num_batches_tracked",
                 "net.2.num_batches_tracked", "net.5.num_batches_tracked"):
        assert torch.equal(_buffers(module)[name], _buffers(reference)[name]), name
    for index in (2, 5):
        norm = module.net[index]
        assert not torch.equal(norm.running_mean, torch.zeros_like(norm.running_mean))
        assert not torch.equal(norm.running_var, torch.ones_like(norm.running_var))


# ------------------------------------------------------------------------------------------ a change in a callback
@pytest.mark.parametrize("kind", list(CHANGES))
def test_state_changed_in_a_callback_is_what_the_next_step_uses(kind):
    """Each change between two steps, then more steps: every parameter, buffer and loss equals the default
    strategy's (a replaced parameter object is outside the optimizer there, and here, so it is never
    stepped). ``to_float64`` starts in float32."""
    precision = "32-true" if kind == "to_float64" else "64-true"
    reference = NormNet()
    _fit(reference, "auto", [Change(kind)], precision=precision)
    module = NormNet()
    _fit(module, _sync(), [Change(kind)], precision=precision)
    assert module.losses == reference.losses
    assert_states_equal(module, reference)
    assert all(param.dtype == torch.float64 for param in module.parameters())


# ------------------------------------------------------------------------------------------ async mode
def _async_reference(kind: str, epochs: int = 2) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch of the one-step-delayed update (iteration k runs on the weights published before step k-1
    ran; W(k) = step(W(k-1), g(k))) with ``CHANGES[kind]`` applied to the module the iterations run on before
    batch ``CHANGE_AT``. A parameter replaced there is no longer one of the optimizer's (as in Lightning), so
    it keeps its value; buffers are the host's own in async mode (never published), so a new one is used at
    once. Returns the final parameters (the optimizer's masters, or the replacement) and buffers, and losses."""
    compute = NormNet().net.double()
    pairs = [(param, param.detach().clone().requires_grad_(True)) for param in compute.parameters()]
    optimizer = torch.optim.SGD([master for _, master in pairs], lr=0.1, momentum=0.9)
    losses = []
    batches = [(x.double(), y) for _ in range(epochs) for x, y in classifier_data()]
    for index, (x, y) in enumerate(batches):
        if index == CHANGE_AT:
            CHANGES[kind](compute)
            current = {id(param) for param in compute.parameters()}
            pairs = [(param, master) for param, master in pairs if id(param) in current]
        loss = F.cross_entropy(compute(x), y)
        losses.append(loss.item())
        loss.backward()
        published = [master.detach().clone() for _, master in pairs]  # W(k-1): what iteration k+1 runs on
        for param, master in pairs:
            master.grad, param.grad = param.grad, None
        optimizer.step()
        with torch.no_grad():
            for (param, _), value in zip(pairs, published, strict=True):
                param.copy_(value)
    masters = {id(param): master for param, master in pairs}
    state = {name: masters.get(id(param), param).detach() for name, param in compute.named_parameters()}
    return {**state, **{name: buffer for name, buffer in compute.named_buffers()}}, losses


@pytest.mark.parametrize("kind", ["buffer", "parameter"])
def test_async_mode_uses_new_tensors_at_the_next_call(kind):
    """Async mode: the step in flight writes the masters while the callback runs, so what async guarantees is
    for tensors replaced by new objects (new buffers, a new parameter: the step does not write them). The
    next call uses them, and the rest stays one step stale: the delayed-update reference with the same change.
    Before, new buffers were never updated and a parameter replaced made the optimizer's old one count as
    outside the trunk, which async mode refuses."""
    expected, expected_losses = _async_reference(kind)
    module = NormNet()
    _fit(module, _sync(async_step=True), [Change(kind)])
    assert module.losses == pytest.approx(expected_losses, rel=1e-12, abs=1e-12)
    assert_states_float64_equal(module.net, expected)


# ------------------------------------------------------------------------------------------ the engine directly
def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16)), nn.Tanh(),
                         nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh()), nn.Linear(16, 4))


def _replace_norm(model: nn.Sequential) -> None:
    norm = nn.BatchNorm1d(16)
    norm.running_mean.normal_()
    norm.running_var.uniform_(0.5, 2.0)
    model[2][1] = norm.eval()


ENGINE_CHANGES = {
    "buffer": lambda model: setattr(model[0][1], "running_mean", torch.randn(16)),
    "parameter": lambda model: setattr(model[2][0], "weight", nn.Parameter(torch.randn(16, 16) * 0.3)),
    "data": lambda model: setattr(model[0][0].weight, "data", torch.randn(16, 6)),
    "submodule": _replace_norm,
    "to_float64": lambda model: model.to(torch.float64),
    "unfreeze": lambda model: model[2][0].weight.requires_grad_(True),
}


@pytest.mark.parametrize("transport", ["off", "bfloat16"])
@pytest.mark.parametrize("async_step", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", list(ENGINE_CHANGES))
def test_every_device_computes_with_what_the_module_holds_now(kind, async_step, transport):
    """Forward calls on an eval-mode model (BatchNorms normalize with their running statistics), three stages
    on two devices so that each stage runs on both over two calls, in stress mode (released memory is
    poisoned): after each change the output equals the module's own, also under bf16 autocast with the
    low-precision upload copies (made again for a parameter given new memory: its version counter alone does
    not show a ``.data`` swap) and in async mode (a new published copy; with no step taken the published
    weights are the masters). ``unfreeze`` is no change to follow, but in async mode a parameter frozen at
    start has no published copy: it gets one at its first upload as a trainable parameter."""
    model = _blocks().eval()
    if kind == "unfreeze":
        model[2][0].weight.requires_grad_(False)
    inputs = torch.randn(8, 6)
    options = EngineOptions(num_microbatches=1, num_stages=3, async_step=async_step, transport_dtype=transport,
                            stress=True)

    def check(engine: RoundPipeEngine, x: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=transport != "off"):
            assert torch.equal(engine(x), model(x))

    with torch.no_grad(), RoundPipeEngine(model, 2, options) as engine:
        check(engine, inputs)
        ENGINE_CHANGES[kind](model)
        if kind == "to_float64":
            inputs = inputs.double()
        for _ in range(2):
            check(engine, inputs)


def test_a_dtype_change_inside_an_accumulation_window_casts_the_gradients_held():
    """Two calls accumulate into one step; between them (after ``synchronize``: the first call's backward
    must not read the weights while they change) the model becomes float64. As in plain PyTorch, where
    ``module.to`` casts ``param.grad``, the step adds the first call's gradients in float64."""
    model, reference = _blocks(), _blocks()
    batches = [(torch.randn(8, 6), torch.randint(0, 4, (8,))) for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for index, (x, y) in enumerate(batches):
        if index == 1:
            reference.double()
            x = x.double()
        F.cross_entropy(reference(x), y).backward()
    optimizers[1].step()
    with RoundPipeEngine(model, 2, EngineOptions(num_microbatches=1, num_stages=3)) as engine:
        for index, (x, y) in enumerate(batches):
            if index == 1:
                engine.synchronize()
                model.double()
                x = x.double()
            engine.forward_backward(x, y, F.cross_entropy)
        engine.step(optimizers[0])
        engine.synchronize()
    assert_states_equal(model, reference)


def test_the_trunk_check_sees_each_kind_of_change_and_nothing_else():
    model = _blocks()
    with RoundPipeEngine(model, 1) as engine:
        trunk = engine.trunk
        assert trunk.changed_layers() == []
        with torch.no_grad():
            model[0][0].weight.mul_(2.0)  # in place: the same tensor, nothing to follow
            model[0][1].running_mean.add_(1.0)
        model[2][1].momentum = 0.5  # a plain attribute: replicas take it at every job
        model[2][0].weight.requires_grad_(False)  # the same tensor (Lightning's toggle_optimizer, every step)
        assert trunk.changed_layers() == []
        model[2][1].register_buffer("extra", torch.zeros(1))
        assert trunk.changed_layers() == [2]
        model[3].bias = None
        assert trunk.changed_layers() == [2, 3]
        engine(torch.randn(4, 6))
        assert trunk.changed_layers() == []
        assert len(trunk.states[2].buffers) == 4 and len(trunk.states[3].params) == 1


class FakeCudart:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.registered: dict[int, int] = {}  # start -> bytes

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", pointer))
        self.registered[pointer] = nbytes
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:  # noqa: N802
        self.calls.append(("unregister", pointer))
        del self.registered[pointer]
        return 0

    def pins(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage lies in a registered range (ranges are whole pages, see pinned.py)."""
        storage = tensor.untyped_storage()
        return any(start <= storage.data_ptr() and storage.data_ptr() + storage.nbytes() <= start + size
                   for start, size in self.registered.items())


def test_pinned_memory_follows_replaced_tensors(monkeypatch):
    """Without a GPU: a fake CUDA runtime records registrations. A buffer replaced between calls: its new
    memory is registered, the old let go (its pages unregistered unless a tensor still used shares them), and the
    old memory stays allocated until then (registered memory freed and handed out again would stay registered
    under its new owner, or be unmapped under the registration)."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    model = _blocks().eval()
    with torch.no_grad(), RoundPipeEngine(model, 2, EngineOptions(num_microbatches=1, num_stages=3)) as engine:
        # as with a CUDA device in the ring; the CPU stand-ins read the same memory
        engine.follower.start_pinning(engine._ring.sources)
        old_tensor = model[0][1].running_mean
        old = old_tensor.untyped_storage().data_ptr()
        assert fake.pins(old_tensor) and old in engine.follower.pinned._registered
        model[0][1].running_mean = torch.randn(16)  # the module drops the old tensor
        assert fake.pins(old_tensor) and old in engine.follower.pinned._registered
        del old_tensor
        engine(torch.randn(8, 6))
        new = model[0][1].running_mean.untyped_storage().data_ptr()
        assert fake.pins(model[0][1].running_mean) and new in engine.follower.pinned._registered
        assert old not in engine.follower.pinned._registered or old == new  # the heap may reuse the address
    assert fake.registered == {}  # released at close


def test_pinned_storages_keep_only_what_is_still_used(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    kept, dropped = torch.zeros(4), torch.ones(4)
    storages = PinnedStorages()
    storages.pin([kept, dropped])
    storages.keep_only([kept[1:]])  # a view: the same storage
    # the dropped storage is let go (its page may stay registered for the kept one: tests/test_pinned.py)
    assert fake.pins(kept) and dropped.untyped_storage().data_ptr() not in storages._registered
    storages.release()
    assert fake.registered == {}


"""RoundPipeStrategy against Lightning's default strategy on the same LightningModule and data."""

from __future__ import annotations

import threading

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_roundpipe  # noqa: F401 - registers the strategy names (editable installs have no .pth hook)
from lightning_roundpipe import RoundPipeStrategy, pipeline_loss
from tests.models import clone


class Classifier(pl.LightningModule):
    """A plain LightningModule; ``fused`` picks ``pipeline_loss`` instead of calling the trunk."""

    def __init__(self, optimizer: str = "sgd", fused: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16),
                                 nn.Tanh(), nn.Linear(16, 3))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.hparams.fused:
            loss = pipeline_loss(self.net, x, y, F.cross_entropy)
        else:
            loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self.net(x), y))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        if self.hparams.optimizer == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _data(samples: int = 48, batch: int = 8) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 6, generator=generator)
    y = torch.randint(0, 3, (samples,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def _fit(module: pl.LightningModule, strategy, **trainer_kwargs) -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=trainer_kwargs.pop("devices", 1),
                         max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         **trainer_kwargs)
    trainer.fit(module, _data(), _data(16))
    return trainer


def _roundpipe_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("roundpipe-")]


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fit_equals_lightnings_default_strategy(optimizer, fused):
    reference = Classifier(optimizer, fused)
    _fit(reference, "auto")
    module = Classifier(optimizer, fused)
    # one microbatch per batch: Lightning's reference takes whole-batch gradients
    trainer = _fit(module, RoundPipeStrategy(num_microbatches=1, num_stages=2), devices=2)
    assert trainer.global_step == 6
    torch.testing.assert_close(module.losses, reference.losses, rtol=1e-4, atol=1e-6)
    for (name, param), expected in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert _roundpipe_threads() == []
    assert "forward" not in module.net.__dict__  # the trunk is restored after fit


def test_microbatches_with_sgd_equal_whole_batch_training():
    """With several microbatches and no batch-dependent layer the gradients are the whole batch's."""
    reference = Classifier("sgd")
    _fit(reference, "auto")
    module = Classifier("sgd")
    _fit(module, RoundPipeStrategy(num_microbatches=3, num_stages=2), devices=2)
    for param, expected in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected, rtol=1e-4, atol=1e-6)


def test_registered_names_select_the_strategy():
    trainer = pl.Trainer(strategy="roundpipe", accelerator="cpu", devices=3, logger=False)
    assert isinstance(trainer.strategy, RoundPipeStrategy) and not trainer.strategy.engine_options.async_step
    assert trainer.strategy.parallel_devices == [torch.device("cpu")] * 3
    assert trainer.strategy.root_device == torch.device("cpu")
    trainer = pl.Trainer(strategy="roundpipe_async", accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.engine_options.async_step


def test_validate_and_predict_run_pipelined_forward_passes():
    module = Classifier()
    trainer = pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=2), accelerator="cpu", devices=2,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    metrics = trainer.validate(module, _data(16), verbose=False)
    reference = clone(module)
    with torch.no_grad():
        expected = torch.stack([F.cross_entropy(reference.net(x), y) for x, y in _data(16)]).mean()
        torch.testing.assert_close(metrics[0]["val_loss"], expected.item(), rtol=1e-5, atol=1e-6)
        tested = trainer.test(module, _data(16), verbose=False)
        torch.testing.assert_close(tested[0]["test_loss"], expected.item(), rtol=1e-5, atol=1e-6)
        predictions = trainer.predict(module, _data(16))
        torch.testing.assert_close(torch.cat(predictions), torch.cat([reference.net(x) for x, _ in _data(16)]),
                                   rtol=1e-5, atol=1e-6)
    assert _roundpipe_threads() == []


def test_checkpoint_keys_and_load_from_checkpoint_without_the_strategy(tmp_path):
    module = Classifier()
    trainer = _fit(module, RoundPipeStrategy(num_microbatches=2), devices=2, default_root_dir=tmp_path)
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert set(checkpoint["state_dict"]) == set(module.state_dict())
    restored = Classifier.load_from_checkpoint(path)
    for param, expected in zip(restored.parameters(), module.parameters()):
        assert torch.equal(param, expected)
    assert not list(tmp_path.glob(".roundpipe-*"))  # no temporary file left behind


def test_resume_continues_like_uninterrupted_training(tmp_path):
    def trainer(epochs: int) -> pl.Trainer:
        return pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=2), accelerator="cpu", devices=2,
                          max_epochs=epochs, accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)

    uninterrupted = Classifier("adamw")
    trainer(2).fit(uninterrupted, _data())
    first = Classifier("adamw")
    first_trainer = trainer(1)
    first_trainer.fit(first, _data())
    first_trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = Classifier("adamw")
    trainer(2).fit(resumed, _data(), ckpt_path=tmp_path / "epoch1.ckpt")
    for param, expected in zip(resumed.parameters(), uninterrupted.parameters()):
        torch.testing.assert_close(param, expected, rtol=1e-5, atol=1e-7)


class Hooked(Classifier):
    """Logs in on_before_optimizer_step, which must see final gradients on the main thread."""

    def on_before_optimizer_step(self, optimizer):
        norms = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        self.seen = getattr(self, "seen", []) + [(threading.current_thread() is threading.main_thread(), len(norms))]
        self.log("grad_norm", torch.stack(norms).norm())


def test_on_before_optimizer_step_sees_final_gradients_on_the_main_thread():
    module = Hooked()
    _fit(module, RoundPipeStrategy(num_microbatches=2), devices=2)
    assert module.seen == [(True, 8)] * 6


def test_errors_name_what_to_change():
    class NoTrunk(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 2)

        def validation_step(self, batch, batch_idx):
            pass

    trainer = pl.Trainer(strategy=RoundPipeStrategy(), accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="has no nn.Sequential submodule or Hugging Face causal LM to pipeline"):
        trainer.validate(NoTrunk(), _data(4), verbose=False)
    trainer = pl.Trainer(strategy=RoundPipeStrategy(pipeline="nett"), accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"`pipeline='nett'` names no submodule of Classifier; its nn.Sequential "
                                         r"submodules are \['net'\]"):
        trainer.validate(Classifier(), _data(4), verbose=False)
    with pytest.raises(ValueError, match="`recompute` must be 'stage' or 'layer'"):
        RoundPipeStrategy(recompute="everything")
    assert _roundpipe_threads() == []


class FailsOnThirdBatch(Classifier):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise RuntimeError("data went bad")
        return super().training_step(batch, batch_idx)


def test_an_exception_inside_fit_leaves_no_thread_and_restores_the_module():
    module = FailsOnThirdBatch()
    with pytest.raises(RuntimeError, match="data went bad"):
        _fit(module, RoundPipeStrategy(num_microbatches=2), devices=2)
    assert _roundpipe_threads() == []
    assert "forward" not in module.net.__dict__ and "zero_grad" not in module.__dict__


def test_lbfgs_is_refused_with_a_clear_message():
    class WithLBFGS(Classifier):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters())

    with pytest.raises(ValueError, match="cannot re-evaluate a closure; LBFGS needs that"):
        _fit(WithLBFGS(), RoundPipeStrategy(num_microbatches=1), devices=1)
    assert _roundpipe_threads() == []


def _precision_fit(module, strategy, precision, devices=1):
    plugins = []
    if precision == "16-mixed":  # on CPU Lightning would turn 16-mixed into bf16-mixed; ask for the scaler
        from lightning.pytorch.plugins import MixedPrecision

        plugins, precision = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))], None
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1,
                         accumulate_grad_batches=2, gradient_clip_val=1.0, precision=precision, plugins=plugins,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, _data())
    return trainer


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_precision_flags_match_lightnings_default_strategy(precision, fused):
    # SGD, not Adam: Adam would hide a missing unscale (it is invariant to the gradients' scale)
    reference = Classifier("sgd", fused)
    reference_trainer = _precision_fit(reference, "auto", precision)
    module = Classifier("sgd", fused)
    trainer = _precision_fit(module, RoundPipeStrategy(num_microbatches=1, num_stages=2), precision, devices=2)
    # the same operations in the same low precision: the results agree to a few low-precision ulps
    tolerance = dict(rtol=2e-2, atol=1e-3) if precision == "bf16-true" else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(module.losses, reference.losses, **tolerance)
    for param, expected in zip(module.parameters(), reference.parameters()):
        assert param.dtype == expected.dtype
        torch.testing.assert_close(param, expected, **tolerance)
    if precision == "16-mixed":
        scaler, reference_scaler = trainer.precision_plugin.scaler, reference_trainer.precision_plugin.scaler
        assert scaler.get_scale() == reference_scaler.get_scale()


class Manual(Classifier):
    """Manual optimization: manual_backward, opt.step(), opt.zero_grad(), a scheduler stepped by hand."""

    def __init__(self):
        super().__init__("sgd")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        assert self.device == torch.device("cpu")  # the host is the root device
        optimizer = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.manual_backward(loss)
        self.losses.append(loss.item())
        if batch_idx % 2 == 1:
            self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad()
            self.lr_schedulers().step()


class LogsBeforeStep(pl.Callback):
    def __init__(self):
        self.norms = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        norm = torch.stack([p.grad.norm() for p in module.parameters()]).norm()
        self.norms.append(norm.item())
        module.log("grad_norm_callback", norm)


def test_manual_optimization_and_a_logging_callback():
    reference, callback_ref = Manual(), LogsBeforeStep()
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=[callback_ref]).fit(reference, _data())
    module, callback = Manual(), LogsBeforeStep()
    pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=2), accelerator="cpu", devices=2, max_epochs=1,
               logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               callbacks=[callback]).fit(module, _data())
    torch.testing.assert_close(module.losses, reference.losses, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(callback.norms, callback_ref.norms, rtol=1e-4, atol=1e-6)
    assert len(callback.norms) == 3
    for param, expected in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "trainer_kwargs, pattern",
    [
        (dict(num_nodes=2), r"one process on one machine; got Trainer\(num_nodes=2\)"),
        (dict(sync_batchnorm=True), r"set sync_batchnorm=False"),
    ],
)
def test_unsupported_trainer_settings_are_refused(trainer_kwargs, pattern):
    trainer = pl.Trainer(strategy=RoundPipeStrategy(), accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs)
    with pytest.raises(ValueError, match=pattern):
        trainer.validate(Classifier(), _data(4), verbose=False)


def test_a_compiled_trunk_is_refused():
    module = Classifier()
    module.net = torch.compile(module.net)
    trainer = pl.Trainer(strategy=RoundPipeStrategy(), accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(TypeError, match=r"the trunk `net._orig_mod` is \(or contains\) a torch.compile'd module"):
        trainer.validate(module, _data(4), verbose=False)
    trainer = pl.Trainer(strategy=RoundPipeStrategy(pipeline="net"), accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(TypeError, match=r"the trunk `net` is \(or contains\) a torch.compile'd module"):
        trainer.validate(module, _data(4), verbose=False)
    assert _roundpipe_threads() == []


class BreaksInsideThePipeline(Classifier):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.net[3].register_forward_hook(self._maybe_fail)  # inside the trunk: runs on a device worker

    def _maybe_fail(self, module, inputs, output):
        if torch.is_grad_enabled() and getattr(self, "armed", False):
            raise RuntimeError("a layer failed on a device")

    def training_step(self, batch, batch_idx):
        self.armed = batch_idx == 3
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("failure", ["user code", "pipeline"])
def test_on_exception_checkpoint_saves_the_last_consistent_weights(tmp_path, failure):
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    module = FailsOnThirdBatch() if failure == "user code" else BreaksInsideThePipeline()
    snapshots = []

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trainer.strategy.engine.synchronize()
            snapshots.append({k: v.clone() for k, v in pl_module.state_dict().items()})

    trainer = pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=2), accelerator="cpu", devices=2,
                         max_epochs=1, accumulate_grad_batches=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[OnExceptionCheckpoint(tmp_path), Snapshot()])
    with pytest.raises(RuntimeError):
        trainer.fit(module, _data())
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)["state_dict"]
    for key, value in snapshots[-1].items():  # the weights after the last completed step
        assert torch.equal(saved[key], value), key
    assert _roundpipe_threads() == []


def _async_reference(fused: bool) -> tuple[list[torch.Tensor], list[float]]:
    """Plain PyTorch of the one-step-delayed update with Lightning's accumulation, clipping and scheduler:
    step k takes gradients computed on W(k-2) and computes W(k) = step(W(k-1), clip(g(k)))."""
    compute = Classifier("sgd", fused)
    masters = [p.detach().clone().requires_grad_(True) for p in compute.parameters()]
    optimizer = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    losses = []
    batches = [batch for _ in range(2) for batch in _data()]  # two epochs
    for window in range(0, len(batches), 2):
        for x, y in batches[window: window + 2]:
            loss = F.cross_entropy(compute.net(x), y)
            losses.append(loss.item())
            (loss / 2).backward()
        published = [m.detach().clone() for m in masters]  # W(k-1), what the next iteration runs on
        for master, param in zip(masters, compute.parameters()):
            master.grad, param.grad = param.grad, None
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            for param, value in zip(compute.parameters(), published):
                param.copy_(value)
    return masters, losses


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
def test_roundpipe_async_equals_the_delayed_update_reference(fused):
    masters, expected_losses = _async_reference(fused)
    module = Classifier("sgd", fused)
    trainer = pl.Trainer(strategy="roundpipe_async", accelerator="cpu", devices=2, max_epochs=2,
                         accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _data())
    torch.testing.assert_close(module.losses, expected_losses, rtol=1e-4, atol=1e-6)
    for param, master in zip(module.parameters(), masters):
        torch.testing.assert_close(param, master.detach(), rtol=1e-4, atol=1e-6)


def test_pipeline_metrics_are_logged_after_each_step():
    logged = []

    class Collect(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.append({k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("roundpipe/")})

    module = Classifier()
    trainer = pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=2, device_memory_limit="1MiB"),
                         accelerator="cpu", devices=2, max_epochs=1, accumulate_grad_batches=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Collect()])
    trainer.fit(module, _data())
    stepped = [entry for batch, entry in enumerate(logged) if batch % 2 == 1]  # the batches that stepped
    assert len(stepped) == 3 and all(stepped) and not any(entry for batch, entry in enumerate(logged[:1]))
    model_bytes = sum(p.numel() * p.element_size() for p in module.net.parameters())
    for entry in stepped:
        assert set(entry) == {f"roundpipe/{k}" for k in ("bubble_ratio", "uploaded_bytes", "optimizer_seconds",
                                                          "optimizer_exposed_seconds", "peak_device_bytes")}
        assert 0.0 <= entry["roundpipe/bubble_ratio"] <= 1.0
        assert 0 < entry["roundpipe/peak_device_bytes"] <= 2**20
        assert entry["roundpipe/optimizer_seconds"] >= 0.0 and entry["roundpipe/optimizer_exposed_seconds"] >= 0.0
    # every parameter is uploaded at least twice per batch (forward and backward stages); the figures are
    # read while the pipeline runs, so one batch's traffic may land in the next report
    uploaded = sum(entry["roundpipe/uploaded_bytes"] for entry in stepped)
    assert uploaded >= 2 * model_bytes * (2 * len(stepped) - 1)
    assert not any(type(c).__name__ == "_PipelineMetrics" for c in trainer.callbacks)


class PlateauScheduler(Classifier):
    """A plateau scheduler on the validation loss, stepped once per epoch after validation."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}


def test_an_epoch_wise_plateau_scheduler_matches_lightnings_default_strategy():
    def fit(strategy, devices):
        module = PlateauScheduler()
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=3, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   ).fit(module, _data(), _data(16))
        return module

    reference, module = fit("auto", 1), fit(RoundPipeStrategy(num_microbatches=1), 2)
    torch.testing.assert_close(module.losses, reference.losses, rtol=1e-4, atol=1e-6)
    assert module.trainer.optimizers[0].param_groups[0]["lr"] == reference.trainer.optimizers[0].param_groups[0]["lr"]
    for param, expected in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected, rtol=1e-4, atol=1e-6)


class TransferHooks(Classifier):
    def __init__(self):
        super().__init__()
        self.transfers = []

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.transfers.append(device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x * 0 + x, y  # a visible no-op: the hook ran on the host batch


def test_batches_stay_on_the_host_and_transfer_hooks_still_run():
    module = TransferHooks()
    _fit(module, RoundPipeStrategy(num_microbatches=2), devices=2)
    assert module.transfers and all(device == torch.device("cpu") for device in module.transfers)


def test_devices_the_engine_cannot_drive_are_refused():
    from lightning.pytorch.accelerators import CPUAccelerator

    strategy = RoundPipeStrategy(accelerator=CPUAccelerator(), parallel_devices=[torch.device("meta")])
    with pytest.raises(ValueError, match="RoundPipe drives CUDA GPUs .* not 'meta' devices"):
        strategy.setup_environment()


def test_a_ring_may_visit_one_device_twice():
    """``ring=[0, 0]`` on one Trainer device: two ring members, the same results as Lightning's default."""
    reference = Classifier("sgd")
    _fit(reference, "auto")
    module = Classifier("sgd")
    strategy = RoundPipeStrategy(num_microbatches=1, num_stages=2, ring=[0, 0])
    _fit(module, strategy, devices=1)
    assert strategy.parallel_devices == [torch.device("cpu")] * 2 and strategy.engine.num_devices == 2
    for param, expected in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match=r"`ring` lists indices into the Trainer's 1 device\(s\)"):
        _fit(Classifier("sgd"), RoundPipeStrategy(ring=[0, 1]), devices=1)


class OverflowsOnce(Classifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx == 1 else loss


def test_16_bit_overflow_skips_the_step_and_halves_the_scale_as_lightning_does():
    reference, module = OverflowsOnce("sgd"), OverflowsOnce("sgd")
    reference_trainer = _precision_fit(reference, "auto", "16-mixed")
    trainer = _precision_fit(module, RoundPipeStrategy(num_microbatches=1), "16-mixed", devices=2)
    assert trainer.precision_plugin.scaler.get_scale() == reference_trainer.precision_plugin.scaler.get_scale()
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**15  # one overflow: 2**16 halved once
    for param, expected in zip(module.parameters(), reference.parameters()):
        assert torch.isfinite(param).all()
        torch.testing.assert_close(param, expected, rtol=1e-4, atol=1e-5)


class BatchNormClassifier(Classifier):
    def __init__(self, fused: bool = False):
        super().__init__("sgd", fused)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16),
                                 nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
def test_batchnorm_equals_manually_accumulated_microbatches(fused):
    """BatchNorm sees each microbatch: the reference runs the same microbatches one after another with
    Lightning's accumulation (2 batches), clipping (1.0) and step-wise scheduler, in plain PyTorch."""
    module = BatchNormClassifier(fused)
    reference = clone(module)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    losses = []
    batches = [batch for _ in range(2) for batch in _data()]
    for window in range(0, len(batches), 2):
        for x, y in batches[window: window + 2]:
            outputs = [reference.net(part) for part in x.split(4)]  # 8 samples in 2 microbatches of 4
            if fused:  # the mean of the microbatch means, each weighted by its 4 of 8 samples
                loss = sum(F.cross_entropy(out, part) * 0.5 for out, part in zip(outputs, y.split(4)))
                (loss / 2).backward()
            else:  # the loss of the merged output; backward one microbatch after another
                detached = [out.detach().requires_grad_(True) for out in outputs]
                loss = F.cross_entropy(torch.cat(detached), y)
                (loss / 2).backward()
                for out, leaf in zip(outputs, detached):
                    out.backward(leaf.grad)
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    trainer = pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=2, num_stages=2), accelerator="cpu",
                         devices=2, max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _data())
    torch.testing.assert_close(module.losses, losses, rtol=1e-4, atol=1e-6)
    for (name, value), expected in zip(module.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")

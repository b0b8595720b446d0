"""RoundPipeStrategy against Lightning's default strategy on the same LightningModule and data."""

from __future__ import annotations

import threading

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import Precision
from torch import nn

import lightning_roundpipe  # noqa: F401 - registers the strategy names (editable installs have no .pth hook)
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.checkpoint_io import StreamingCheckpointIO
from lightning_roundpipe.engine.pipelined import PipelinedForward
from lightning_roundpipe.metrics import PipelineMetrics
from lightning_roundpipe.trunk import build_module_trunk
from tests.models import Classifier, clone
from tests.models import classifier_data as _data
from tests.numerics import (
    assert_close_to_reference,
    assert_states_close_to_reference,
    assert_states_equal,
    assert_states_float64_equal,
    double,
)

# Tolerances (tests/numerics.py): with one microbatch per batch RoundPipe runs Lightning's kernels on the same
# data in the same order, so the results are bitwise Lightning's (``assert_states_equal``). With several
# microbatches the sums run in another order: float32 results must be within 4x Lightning's own float32
# distance from a float64 run (``precision="64-true"``), and float64 runs must agree to 1e-12.


def _fit(module: pl.LightningModule, strategy, **trainer_kwargs) -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=trainer_kwargs.pop("devices", 1),
                         max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         **trainer_kwargs)
    trainer.fit(module, _data(), _data(16))
    return trainer


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fit_equals_lightnings_default_strategy(optimizer, fused, roundpipe_threads):
    reference = Classifier(optimizer, fused)
    _fit(reference, "auto")
    module = Classifier(optimizer, fused)
    # one microbatch per batch: Lightning's reference takes whole-batch gradients with the same kernels on the
    # same data, and so does RoundPipe (stage by stage): bitwise equal
    trainer = _fit(module, RoundPipeStrategy(num_microbatches=1, num_stages=2), devices=2)
    assert trainer.global_step == 6
    assert module.losses == reference.losses
    assert_states_equal(module, reference)
    assert roundpipe_threads() == []
    assert "forward" not in module.net.__dict__  # the trunk is restored after fit


def test_microbatches_with_sgd_equal_whole_batch_training():
    """With several microbatches and no batch-dependent layer the gradients are the whole batch's: in float64
    (the algorithm) and in float32 (no further from the float64 result than Lightning's float32 run)."""
    references = {precision: Classifier("sgd") for precision in ("32-true", "64-true")}
    for precision, reference in references.items():
        _fit(reference, "auto", precision=precision)
    for precision in ("64-true", "32-true"):
        module = Classifier("sgd")
        _fit(module, RoundPipeStrategy(num_microbatches=3, num_stages=2), devices=2, precision=precision)
        if precision == "64-true":
            assert_states_float64_equal(module, references["64-true"])
        else:
            assert_close_to_reference(module.losses, references["32-true"].losses, references["64-true"].losses,
                                      what="losses")
            assert_states_close_to_reference(module, references["32-true"], references["64-true"])


def test_registered_names_select_the_strategy():
    trainer = pl.Trainer(strategy="roundpipe", accelerator="cpu", devices=3, logger=False)
    assert isinstance(trainer.strategy, RoundPipeStrategy) and not trainer.strategy.engine_options.async_step
    assert trainer.strategy.parallel_devices == [torch.device("cpu")] * 3
    assert trainer.strategy.root_device == torch.device("cpu")
    trainer = pl.Trainer(strategy="roundpipe_async", accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.engine_options.async_step


def test_validate_and_predict_run_pipelined_forward_passes(roundpipe_threads):
    module = Classifier()
    trainer = pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=2), accelerator="cpu", devices=2,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    metrics = trainer.validate(module, _data(16), verbose=False)
    references = {torch.float32: clone(module), torch.float64: double(module)}  # on whole batches, not halves
    with torch.no_grad():
        expected = [torch.stack([F.cross_entropy(reference.net(x.to(dtype)), y) for x, y in _data(16)]).mean()
                    for dtype, reference in references.items()]
        assert_close_to_reference(metrics[0]["val_loss"], *expected, what="val_loss")
        tested = trainer.test(module, _data(16), verbose=False)
        assert_close_to_reference(tested[0]["test_loss"], *expected, what="test_loss")
        predictions = trainer.predict(module, _data(16))
        assert_close_to_reference(torch.cat(predictions), *(
            torch.cat([reference.net(x.to(dtype)) for x, _ in _data(16)]) for dtype, reference in references.items()),
            what="predictions")
    assert roundpipe_threads() == []


def test_checkpoint_keys_and_load_from_checkpoint_without_the_strategy(tmp_path):
    module = Classifier()
    trainer = _fit(module, RoundPipeStrategy(num_microbatches=2), devices=2, default_root_dir=tmp_path)
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert set(checkpoint["state_dict"]) == set(module.state_dict())
    restored = Classifier.load_from_checkpoint(path)
    for param, expected in zip(restored.parameters(), module.parameters(), strict=True):
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
    # the same strategy, kernels and data in the same order, and a checkpoint stores values exactly: bitwise
    assert_states_equal(resumed, uninterrupted)


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


def test_errors_name_what_to_change(roundpipe_threads):
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
    with pytest.raises(ValueError, match=r"^`pipeline` is 'nett', which names no submodule of Classifier; its "
                                         r"nn.Sequential submodules are \['net'\]$"):
        trainer.validate(Classifier(), _data(4), verbose=False)
    with pytest.raises(ValueError, match="`recompute` must be 'stage' or 'layer'"):
        RoundPipeStrategy(recompute="everything")
    assert roundpipe_threads() == []


class FailsOnThirdBatch(Classifier):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise RuntimeError("data went bad")
        return super().training_step(batch, batch_idx)


def test_an_exception_inside_fit_leaves_no_thread_and_restores_the_module(roundpipe_threads):
    module = FailsOnThirdBatch()
    strategy = RoundPipeStrategy(num_microbatches=2)
    with pytest.raises(RuntimeError, match="data went bad"):
        _fit(module, strategy, devices=2)
    assert roundpipe_threads() == []
    assert "forward" not in module.net.__dict__ and "zero_grad" not in module.__dict__
    optimizer = strategy.optimizers[0]  # and its LightningOptimizer wrapper: the zero_grad guards are gone too
    assert "zero_grad" not in optimizer.__dict__ and "zero_grad" not in module.optimizers().__dict__


def test_lbfgs_is_refused_with_a_clear_message(roundpipe_threads):
    class WithLBFGS(Classifier):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters())

    with pytest.raises(ValueError, match="cannot re-evaluate a closure; LBFGS needs that"):
        _fit(WithLBFGS(), RoundPipeStrategy(num_microbatches=1), devices=1)
    assert roundpipe_threads() == []


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
    # one microbatch: the same operations on the same data in the same low precision, so bitwise equal (a
    # missing cast, autocast context or unscale would change the result by far more than a rounding)
    assert module.losses == reference.losses
    assert_states_equal(module, reference)  # dtypes included
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


def _manual_fit(strategy, devices: int, precision: str = "32-true") -> tuple[Manual, LogsBeforeStep]:
    module, callback = Manual(), LogsBeforeStep()
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, precision=precision,
               logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               callbacks=[callback]).fit(module, _data())
    return module, callback


def test_manual_optimization_and_a_logging_callback():
    # two microbatches against Lightning's whole batches: float32 within 4x Lightning's own float32 error
    (reference, callback_ref), (reference64, callback64) = (_manual_fit("auto", 1, p) for p in ("32-true", "64-true"))
    module, callback = _manual_fit(RoundPipeStrategy(num_microbatches=2), 2)
    assert_close_to_reference(module.losses, reference.losses, reference64.losses, what="losses")
    assert_close_to_reference(callback.norms, callback_ref.norms, callback64.norms, what="gradient norms")
    assert len(callback.norms) == 3
    assert_states_close_to_reference(module, reference, reference64)


def test_sync_batchnorm_is_refused():
    # (num_nodes > 1 is no longer refused: data parallel over rings, tests/test_scaleout.py)
    trainer = pl.Trainer(strategy=RoundPipeStrategy(), accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, sync_batchnorm=True)
    with pytest.raises(ValueError, match=r"set sync_batchnorm=False"):
        trainer.validate(Classifier(), _data(4), verbose=False)


def test_a_compiled_trunk_is_refused(roundpipe_threads):
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
    assert roundpipe_threads() == []


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
def test_on_exception_checkpoint_saves_the_last_consistent_weights(tmp_path, failure, roundpipe_threads):
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    module = FailsOnThirdBatch() if failure == "user code" else BreaksInsideThePipeline()
    snapshots = []

    class Snapshot(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trainer.strategy.engine.synchronize()
            snapshots.append({k: v.clone() for k, v in pl_module.state_dict().items()})

    # whole steps, each applied whole or not at all: the pipeline fails in a backward stage's recompute, and a step
    # cut by stage could have updated the deeper layers first, or not, as the threads' timing goes (seen under a
    # loaded CI). That torn case writes no checkpoint; tests/test_faults.py makes it happen every time
    trainer = pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=2, streaming_step="off"), accelerator="cpu",
                         devices=2, max_epochs=1, accumulate_grad_batches=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[OnExceptionCheckpoint(tmp_path), Snapshot()])
    with pytest.raises(RuntimeError):
        trainer.fit(module, _data())
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)["state_dict"]
    for key, value in snapshots[-1].items():  # the weights after the last completed step
        assert torch.equal(saved[key], value), key
    assert roundpipe_threads() == []


def _async_reference(fused: bool, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch of the one-step-delayed update with Lightning's accumulation, clipping and scheduler:
    step k takes gradients computed on W(k-2) and computes W(k) = step(W(k-1), clip(g(k))). In ``dtype``;
    returns the final weights by name and the losses."""
    compute = Classifier("sgd", fused).to(dtype)
    masters = [p.detach().clone().requires_grad_(True) for p in compute.parameters()]
    optimizer = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    losses = []
    batches = [batch for _ in range(2) for batch in _data()]  # two epochs
    for window in range(0, len(batches), 2):
        for x, y in batches[window: window + 2]:
            loss = F.cross_entropy(compute.net(x.to(dtype)), y)
            losses.append(loss.item())
            (loss / 2).backward()
        published = [m.detach().clone() for m in masters]  # W(k-1), what the next iteration runs on
        for master, param in zip(masters, compute.parameters(), strict=True):
            master.grad, param.grad = param.grad, None
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            for param, value in zip(compute.parameters(), published, strict=True):
                param.copy_(value)
    names = [name for name, _ in compute.named_parameters()]
    return dict(zip(names, (m.detach() for m in masters), strict=True)), losses


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
def test_roundpipe_async_equals_the_delayed_update_reference(fused):
    (masters, expected_losses), (masters64, expected_losses64) = (_async_reference(fused, dtype)
                                                                  for dtype in (torch.float32, torch.float64))
    module = Classifier("sgd", fused)
    trainer = pl.Trainer(strategy="roundpipe_async", accelerator="cpu", devices=2, max_epochs=2,
                         accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _data())
    # microbatches against whole batches: float32 within 4x the float32 reference's own error
    assert_close_to_reference(module.losses, expected_losses, expected_losses64, what="losses")
    assert_states_close_to_reference(dict(module.named_parameters()), masters, masters64)


def _logged_pipeline_metrics(log_every_n_steps: int) -> tuple[list[dict[str, float]], pl.Trainer, Classifier]:
    """The ``roundpipe/*`` callback metrics at the end of each batch of 3 optimizer steps (2 batches each)."""
    logged = []

    class Collect(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.append({k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("roundpipe/")})

    module = Classifier()
    trainer = pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=2, device_memory_limit="1MiB"),
                         accelerator="cpu", devices=2, max_epochs=1, accumulate_grad_batches=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=log_every_n_steps, callbacks=[Collect()])
    trainer.fit(module, _data())
    return logged, trainer, module


def test_pipeline_metrics_are_logged_only_at_the_logging_steps():
    logged, _, module = _logged_pipeline_metrics(log_every_n_steps=2)
    # batches 1, 3, 5 step the optimizer (global steps 1, 2, 3): step 2 is a logging step, step 3 ends the epoch
    assert not any(logged[:3]) and logged[3] and logged[4] == logged[3] and logged[5] != logged[3]
    model_bytes = sum(p.numel() * p.element_size() for p in module.net.parameters())
    # over steps 1 and 2, then step 3 alone: at least 2 uploads of the model a batch
    assert logged[3]["roundpipe/uploaded_bytes"] >= 2 * model_bytes * 3
    assert 2 * model_bytes <= logged[5]["roundpipe/uploaded_bytes"] <= logged[3]["roundpipe/uploaded_bytes"]


def test_pipeline_metrics_are_logged_after_each_step_when_every_step_logs():
    logged, trainer, module = _logged_pipeline_metrics(log_every_n_steps=1)
    stepped = [entry for batch, entry in enumerate(logged) if batch % 2 == 1]  # the batches that stepped
    assert len(stepped) == 3 and all(stepped) and not any(entry for batch, entry in enumerate(logged[:1]))
    model_bytes = sum(p.numel() * p.element_size() for p in module.net.parameters())
    for entry in stepped:
        assert set(entry) == {f"roundpipe/{k}" for k in ("bubble_ratio", "uploaded_bytes", "optimizer_seconds",
                                                          "optimizer_exposed_seconds", "gradient_download_seconds",
                                                          "peak_device_bytes")}
        assert 0.0 <= entry["roundpipe/bubble_ratio"] <= 1.0
        assert 0 < entry["roundpipe/peak_device_bytes"] <= 2**20
        assert entry["roundpipe/optimizer_seconds"] >= 0.0 and entry["roundpipe/optimizer_exposed_seconds"] >= 0.0
        assert entry["roundpipe/gradient_download_seconds"] >= 0.0
    # every parameter is uploaded at least twice per batch (forward and backward stages); the figures are
    # read while the pipeline runs, so one batch's traffic may land in the next report
    uploaded = sum(entry["roundpipe/uploaded_bytes"] for entry in stepped)
    assert uploaded >= 2 * model_bytes * (2 * len(stepped) - 1)
    assert sum(entry["roundpipe/gradient_download_seconds"] for entry in stepped) > 0.0
    assert not any(isinstance(c, PipelineMetrics) for c in trainer.callbacks)  # removed at teardown


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
    # one microbatch: Lightning's kernels on the same data in the same order, bitwise (the plateau decisions too)
    assert module.losses == reference.losses
    assert module.trainer.optimizers[0].param_groups[0]["lr"] == reference.trainer.optimizers[0].param_groups[0]["lr"]
    assert_states_equal(module, reference)


class TransferHooks(Classifier):
    """Records where batches are moved to; ``on_after_batch_transfer`` relabels every batch, and the training
    step records the labels it gets, so the hook's effect is seen where it matters."""

    def __init__(self):
        super().__init__()
        self.transfers, self.after_transfer, self.trained_labels = [], [], []

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.transfers.append(device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        self.after_transfer.append(x.device)
        return x, (y + 1) % 3

    def training_step(self, batch, batch_idx):
        self.trained_labels.append(batch[1].clone())
        return super().training_step(batch, batch_idx)


def test_batches_stay_on_the_host_and_transfer_hooks_still_run():
    module = TransferHooks()
    _fit(module, RoundPipeStrategy(num_microbatches=2), devices=2)
    assert module.transfers and all(device == torch.device("cpu") for device in module.transfers)
    assert module.after_transfer and all(device == torch.device("cpu") for device in module.after_transfer)
    # training saw the hook's output: every batch of both epochs, relabelled
    labels = torch.cat([y for _, y in _data()])
    assert torch.equal(torch.cat(module.trained_labels), (torch.cat([labels, labels]) + 1) % 3)


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
    assert_states_equal(module, reference)  # one microbatch: Lightning's kernels on the same data, bitwise
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
    assert all(torch.isfinite(param).all() for param in module.parameters())
    assert_states_equal(module, reference)  # one microbatch: the same float16 kernels on the same data, bitwise


class BatchNormClassifier(Classifier):
    def __init__(self, fused: bool = False):
        super().__init__("sgd", fused)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16),
                                 nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
def test_batchnorm_equals_manually_accumulated_microbatches(fused):
    """BatchNorm sees each microbatch: the reference runs the same microbatches one after another with
    Lightning's accumulation (2 batches), clipping (1.0) and step-wise scheduler, in plain PyTorch, in float32
    and in float64; RoundPipe's float32 run must be within 4x the float32 reference's own error."""
    module = BatchNormClassifier(fused)
    references = {dtype: _batchnorm_reference(module, fused, dtype) for dtype in (torch.float32, torch.float64)}
    trainer = pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=2, num_stages=2), accelerator="cpu",
                         devices=2, max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _data())
    (state32, losses32), (state64, losses64) = references[torch.float32], references[torch.float64]
    assert_close_to_reference(module.losses, losses32, losses64, what="losses")
    assert_states_close_to_reference(module.state_dict(), state32, state64)  # BatchNorm's statistics too


def _batchnorm_reference(module: BatchNormClassifier, fused: bool, dtype: torch.dtype):
    reference = clone(module).to(dtype)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    losses = []
    batches = [(x.to(dtype), y) for _ in range(2) for x, y in _data()]
    for window in range(0, len(batches), 2):
        for x, y in batches[window: window + 2]:
            outputs = [reference.net(part) for part in x.split(4)]  # 8 samples in 2 microbatches of 4
            if fused:  # the mean of the microbatch means, each weighted by its 4 of 8 samples
                loss = sum(F.cross_entropy(out, part) * 0.5 for out, part in zip(outputs, y.split(4), strict=True))
                (loss / 2).backward()
            else:  # the loss of the merged output; backward one microbatch after another
                detached = [out.detach().requires_grad_(True) for out in outputs]
                loss = F.cross_entropy(torch.cat(detached), y)
                (loss / 2).backward()
                for out, leaf in zip(outputs, detached, strict=True):
                    out.backward(leaf.grad)
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return reference.state_dict(), losses


# ---------------------------------------------------------------------------- checkpoint writing
def test_a_failed_checkpoint_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    writer = StreamingCheckpointIO()
    writer.save_checkpoint({"step": 1, "w": torch.ones(3)}, path)
    good = path.read_bytes()
    real_save = torch.save

    def fails_halfway(obj, f, *args, **kwargs):
        real_save({"step": 2}, f)  # bytes on disk, then the failure
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", fails_halfway)
    with pytest.raises(OSError, match="No space left on device"):
        writer.save_checkpoint({"step": 2, "w": torch.zeros(3)}, path)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert torch.load(path)["step"] == 1


def test_a_local_checkpoint_loads_memory_mapped_with_what_lightning_loads(tmp_path, monkeypatch):
    """The same dict as Lightning's loader, read through a memory map (a legacy-format file, which torch cannot
    map, loads as Lightning loads it)."""
    from lightning.fabric.plugins import TorchCheckpointIO

    reader = StreamingCheckpointIO()
    checkpoint = {"step": 3, "state": {"w": torch.arange(6.0).reshape(2, 3), "m": torch.ones(4, dtype=torch.float64)}}
    path = tmp_path / "last.ckpt"
    reader.save_checkpoint(checkpoint, path)
    real_load, mapped = torch.load, []

    def recording_load(*args, **kwargs):
        mapped.append(kwargs.get("mmap", False))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    ours = reader.load_checkpoint(path)
    assert mapped == [True]
    theirs = TorchCheckpointIO().load_checkpoint(path)
    assert ours["step"] == theirs["step"] == 3
    for name, tensor in checkpoint["state"].items():
        assert torch.equal(ours["state"][name], tensor) and torch.equal(theirs["state"][name], tensor)
    legacy = tmp_path / "legacy.ckpt"
    torch.save(checkpoint, legacy, _use_new_zipfile_serialization=False)
    mapped.clear()
    assert torch.equal(reader.load_checkpoint(legacy)["state"]["w"], checkpoint["state"]["w"])
    assert mapped == [True, False]  # tried, then loaded as Lightning does


def test_storage_options_go_to_lightnings_writer():
    # TorchCheckpointIO refuses storage_options with its own message: proof that the parent handled them
    with pytest.raises(TypeError, match="`storage_options` arg is not supported for `StreamingCheckpointIO`"):
        StreamingCheckpointIO().save_checkpoint({}, "unused.ckpt", storage_options={"acl": "private"})


def test_the_streaming_writer_is_the_default_and_a_trainer_plugin_of_the_users_wins(tmp_path):
    from lightning.fabric.plugins import TorchCheckpointIO

    assert type(RoundPipeStrategy().checkpoint_io) is StreamingCheckpointIO

    class Recording(TorchCheckpointIO):
        def __init__(self):
            self.saved = []

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            self.saved.append(str(path))
            super().save_checkpoint(checkpoint, path, storage_options)

    plugin = Recording()
    trainer = pl.Trainer(strategy=RoundPipeStrategy(num_microbatches=1), accelerator="cpu", devices=1,
                         plugins=[plugin], max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(), _data(8))
    trainer.save_checkpoint(tmp_path / "user.ckpt")
    assert trainer.strategy.checkpoint_io is plugin and plugin.saved == [str(tmp_path / "user.ckpt")]
    assert "state_dict" in torch.load(tmp_path / "user.ckpt", weights_only=False)


# ---------------------------------------------------------------------------- trunk discovery
def test_a_trunk_holding_a_minority_of_the_parameters_is_used_with_a_warning():
    class MostlyOutside(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))  # 12 parameters
            self.head = nn.Linear(2, 50)                                # 150 parameters

    module = MostlyOutside()
    with pytest.warns(UserWarning, match=r"RoundPipe pipelines `net`, which holds only 7% of the parameters"):
        trunk, driven, forward_patch = build_module_trunk(module)
    assert driven is module.net and trunk.layers == list(module.net) and forward_patch is PipelinedForward


class HalvingPrecision(Precision):
    """A precision plugin of the user's: its ``optimizer_step`` counts its calls and halves every gradient
    before Lightning's step."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        self.calls += 1

        def halved():
            result = closure()
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.mul_(0.5)
            return result

        return super().optimizer_step(optimizer, model, halved, **kwargs)


@pytest.mark.parametrize("fused", [False, True], ids=["transparent", "fused"])
def test_a_precision_plugin_with_an_optimizer_step_of_its_own_is_called(fused):
    """The strategy calls the precision plugin's optimizer_step, any plugin's (Lightning's own: the precision
    tests above), with the final gradients: its effect shows as under Lightning's default strategy, bitwise
    with one microbatch."""
    def fit(module, strategy, plugins, devices=1):
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=2,
                             accumulate_grad_batches=2, plugins=plugins, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, _data())
        return trainer

    reference, reference_plugin = Classifier("adamw", fused), HalvingPrecision()
    fit(reference, "auto", [reference_plugin])
    module, plugin = Classifier("adamw", fused), HalvingPrecision()
    trainer = fit(module, RoundPipeStrategy(num_microbatches=1, num_stages=2), [plugin], devices=2)
    assert plugin.calls == reference_plugin.calls == trainer.global_step == 6
    assert module.losses == reference.losses
    assert_states_equal(module, reference)
    unhalved = Classifier("adamw", fused)
    fit(unhalved, "auto", [])
    assert unhalved.losses != reference.losses  # the plugin's halving changed the training


def test_while_the_plugin_runs_the_optimizer_steps_on_the_engine_and_its_own_step_comes_back():
    """The plugin and the hooks get the optimizer itself, whose ``step`` asks for the engine's step; afterwards
    the optimizer is as it was: an LR scheduler's wrapper of ``step``, a fused optimizer's claim to unscale a
    GradScaler's gradients itself (withheld meanwhile, so that the plugin unscales them)."""
    from lightning_roundpipe.precision import _steps_on_the_engine

    optimizer = torch.optim.Adam(nn.Linear(2, 2).parameters(), fused=True)
    torch.optim.lr_scheduler.StepLR(optimizer, 1)  # wraps optimizer.step in an instance attribute
    scheduler_step = optimizer.__dict__["step"]
    with _steps_on_the_engine(optimizer) as asked:
        assert optimizer.step(closure=lambda: 3.0) == 3.0 and asked == [True]
        assert not optimizer._step_supports_amp_scaling
    assert optimizer.__dict__["step"] is scheduler_step and optimizer._step_supports_amp_scaling

"""The ``fp16_accumulation`` option: refused where it cannot apply, with what to change; otherwise the process-global
cuBLAS flag is set for the run and put back at teardown, after a failure too.

No GPU here: the flag is a stand-in object with the attribute (``torch.backends.cuda.matmul`` in real runs), and
the strategy-level tests give the refusal a CUDA device type so that a CPU run exercises the wiring.
"""

from __future__ import annotations

import types

import lightning.pytorch as pl
import pytest
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from lightning_roundpipe import RoundPipeStrategy, precision
from lightning_roundpipe.engine.options import OptionError
from tests.models import Classifier, classifier_data

FLAG = "allow_fp16_accumulation"


def _fp16_mixed() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu")


@pytest.mark.parametrize("plugin,named", [(MixedPrecision("bf16-mixed", "cpu"), "'bf16-mixed'"),
                                          (Precision(), "'32-true'")], ids=["bf16-mixed", "32-true"])
def test_a_precision_other_than_16_mixed_is_refused(plugin, named):
    backend = types.SimpleNamespace(**{FLAG: False})
    with pytest.raises(OptionError, match=rf"fp16_accumulation.*needs precision='16-mixed' \(the Trainer's is "
                                          rf"{named}\).*Trainer\(precision='16-mixed'\)"):
        precision.enable_fp16_accumulation(plugin, "cuda", backend)
    assert getattr(backend, FLAG) is False


def test_cpu_devices_are_refused():
    backend = types.SimpleNamespace(**{FLAG: False})
    with pytest.raises(OptionError, match=r"fp16_accumulation.*needs CUDA GPUs.*'cpu'.*accelerator='gpu'"):
        precision.enable_fp16_accumulation(_fp16_mixed(), "cpu", backend)
    assert getattr(backend, FLAG) is False


def test_a_torch_without_the_flag_is_refused():
    with pytest.raises(OptionError, match=rf"fp16_accumulation.*matmul\.{FLAG}, which torch .* does not have; "
                                          "upgrade torch"):
        precision.enable_fp16_accumulation(_fp16_mixed(), "cuda", types.SimpleNamespace())


@pytest.mark.parametrize("before", [False, True])
def test_the_flag_is_set_and_the_setting_found_is_restored(before):
    backend = types.SimpleNamespace(**{FLAG: before})
    restore = precision.enable_fp16_accumulation(_fp16_mixed(), "cuda", backend)
    assert getattr(backend, FLAG) is True
    restore()
    assert getattr(backend, FLAG) is before


def _trainer(plugin: Precision, callbacks=()) -> pl.Trainer:
    strategy = RoundPipeStrategy(fp16_accumulation=True, num_microbatches=2, precision_plugin=plugin)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=list(callbacks))


def test_the_strategy_refuses_cpu_devices_before_training():
    module = Classifier()
    with pytest.raises(OptionError, match="needs CUDA GPUs"):
        _trainer(_fp16_mixed()).fit(module, classifier_data())
    assert module.losses == []


@pytest.fixture
def cuda_backend(monkeypatch):
    """The strategy's call with a CUDA device type and a stand-in backend: the wiring runs on CPU."""
    backend = types.SimpleNamespace(**{FLAG: False})
    enable = precision.enable_fp16_accumulation
    monkeypatch.setattr(precision, "enable_fp16_accumulation",
                        lambda plugin, device_type: enable(plugin, "cuda", backend))
    return backend


def test_the_strategy_sets_the_flag_for_the_run_and_restores_it(cuda_backend):
    seen = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, *args) -> None:
            seen.append(getattr(cuda_backend, FLAG))

    _trainer(_fp16_mixed(), [Watch()]).fit(Classifier(), classifier_data())
    assert seen == [True, True]
    assert getattr(cuda_backend, FLAG) is False


def test_the_flag_is_restored_after_a_failing_run(cuda_backend):
    class Failing(Classifier):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("user code failed")

    with pytest.raises(RuntimeError, match="user code failed"):
        _trainer(_fp16_mixed()).fit(Failing(), classifier_data())
    assert getattr(cuda_backend, FLAG) is False

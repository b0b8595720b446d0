"""The Hydra app: every config composes and instantiates, bad input names its key, presets and multirun run."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf.errors import OmegaConfBaseException

from lightning_roundpipe.app.schema import ConfigError, validate
from lightning_roundpipe.app.train import CONFIG_DIR, run

REPO = pathlib.Path(__file__).resolve().parent.parent
GROUPS = ("model", "data", "trainer", "strategy", "experiment")
TINY = ["data.limit_bytes=200000", "data.val_windows=4"]


def _options(group: str) -> list[str]:
    return sorted(path.stem for path in (pathlib.Path(CONFIG_DIR) / group).glob("*.yaml"))


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_config_composes_and_instantiates(group, option, tmp_path):
    overrides = [f"{group}={option}", *TINY]
    if option == "text_path":
        (tmp_path / "corpus.txt").write_text("hello roundpipe\n" * 2000)
        overrides.append(f"data.path={tmp_path / 'corpus.txt'}")
    cfg = _compose(*overrides)
    validate(cfg)
    model = instantiate(cfg.model)
    assert len(model.net) >= 3
    instantiate(cfg.data).setup("fit")
    instantiate(cfg.strategy)
    assert cfg.trainer.accelerator in {"cpu", "cuda"}


@pytest.mark.parametrize("override,key", [
    ("strategy.no_such_option=1", "no_such_option"),
    ("model.net.colour=blue", "colour"),
    ("strategy.num_microbatches=many", "strategy.num_microbatches"),
    ("trainer.max_steps=lots", "trainer.max_steps"),
])
def test_unknown_keys_and_wrong_types_fail_at_compose_time(override, key):
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)) as error:
        _compose(override)
    message = str(error.value) + str(error.value.__cause__)
    assert key in message


@pytest.mark.parametrize("overrides,key", [
    (["strategy.num_microbatches=0"], "strategy.num_microbatches"),
    (["strategy.recompute=sometimes"], "strategy.recompute"),
    (["strategy.num_stages=0"], "strategy.num_stages"),
    (["strategy.device_memory_limit=lots"], "strategy.device_memory_limit"),
    (["data=text_path", "data.path=/no/such/corpus"], "data.path"),
    (["data=text_path"], "data.path"),  # not given at all
])
def test_impossible_values_fail_before_training_naming_the_key(overrides, key, tmp_path):
    cfg = _compose(*overrides)
    with pytest.raises((ConfigError, OmegaConfBaseException)) as error:
        run(cfg, tmp_path)
    assert key in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", _options("experiment"))
def test_every_experiment_preset_runs(experiment, tmp_path):
    cfg = _compose(f"experiment={experiment}", "trainer.fast_dev_run=true", "sample_tokens=8", *TINY)
    summary = run(cfg, tmp_path)
    assert summary.tokens_per_second > 0
    assert len(summary.sample) >= 1


def test_multirun_runs_one_job_per_combination(tmp_path):
    command = [sys.executable, str(REPO / "examples" / "train.py"), "-m",
               "strategy.num_microbatches=2,4", "strategy.num_stages=auto,6", "experiment=quick",
               "trainer.fast_dev_run=true", "trainer.enable_progress_bar=false", "sample_tokens=4", *TINY,
               f"hydra.sweep.dir={tmp_path}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(path for path in tmp_path.iterdir() if path.is_dir() and (path / ".hydra").is_dir())
    assert len(runs) == 4, [path.name for path in tmp_path.iterdir()]
    assert result.stdout.count("summary") == 4


def test_an_unknown_key_in_a_config_file_fails_at_compose_time(tmp_path):
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(CONFIG_DIR, conf)
    with open(conf / "model" / "gpt_small.yaml", "a") as file:
        file.write("learning_rate: 0.1\n")  # a typo of `lr`
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as error:
            compose(config_name="config")
    assert "learning_rate" in str(error.value) + str(error.value.__cause__)


def test_the_command_line_reports_a_bad_value_without_a_traceback():
    script = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train.py"
    result = subprocess.run([sys.executable, str(script), "strategy.num_microbatches=0"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "config error: `strategy.num_microbatches` must be at least 1 (or null for devices + 1), got 0")

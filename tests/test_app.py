"""The Hydra app: every config composes and instantiates, bad input names its key, presets and multirun run."""

from __future__ import annotations

import csv
import math
import pathlib
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf.errors import OmegaConfBaseException

from lightning_roundpipe.app.hf_model import CausalLM
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
    if isinstance(model, CausalLM):
        assert model.model is None  # built in configure_model: instantiating an 8B option allocates nothing
    else:
        assert len(model.net) >= 3
    instantiate(cfg.data).setup("fit")
    instantiate(cfg.strategy)
    assert cfg.trainer.accelerator in {"cpu", "cuda"}


@pytest.mark.parametrize("override,key", [
    ("strategy.no_such_option=1", "no_such_option"),
    ("model.net.colour=blue", "colour"),
    ("strategy.num_microbatches=many", "strategy.num_microbatches"),
    ("trainer.max_steps=lots", "trainer.max_steps"),
    ("+model/lora=default", "lora"),  # LoRA is for the Hugging Face options only, not gpt_small
])
def test_unknown_keys_and_wrong_types_fail_at_compose_time(override, key):
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)) as error:
        _compose(override)
    message = str(error.value) + str(error.value.__cause__)
    assert key in message


@pytest.mark.parametrize("overrides,key", [
    (["strategy.num_microbatches=0"], "strategy.num_microbatches"),
    (["strategy.recompute=sometimes"], "strategy.recompute"),
    (["strategy.preflight=maybe"], "strategy.preflight"),
    (["strategy.num_stages=0"], "strategy.num_stages"),
    (["strategy.device_memory_limit=lots"], "strategy.device_memory_limit"),
    (["data=text_path", "data.path=/no/such/corpus"], "data.path"),
    (["data=text_path"], "data.path"),  # not given at all
    (["model=llama_tiny", "model.family=gpt2"], "model.family"),
    (["model=llama_tiny", "model.dtype=float8"], "model.dtype"),
    (["model=llama_tiny", "model.attn_implementation=flash"], "model.attn_implementation"),
    (["model=llama_tiny", "model.hidden_size=66"], "model.hidden_size"),
    (["model=llama_tiny", "model.num_key_value_heads=3"], "model.num_key_value_heads"),
    (["model=llama_tiny", "model.num_hidden_layers=0"], "model.num_hidden_layers"),
    (["model=llama_tiny", "model.vocab_size=128"], "model.vocab_size"),
    (["model=llama_tiny", "model.max_position_embeddings=32"], "model.max_position_embeddings"),
    (["model=llama_tiny", "strategy.pipeline=net"], "strategy.pipeline"),
    (["model=llama_tiny", "+model/lora=default", "model.lora.r=0"], "model.lora.r"),
    (["model=llama_tiny", "+model/lora=default", "model.lora.target_modules=[]"], "model.lora.target_modules"),
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


# ---------------------------------------------------------------------------- Hugging Face causal LMs
HF_OPTIONS = {  # option: (config class, hidden size, tied head, parameters)
    "llama_tiny": ("LlamaConfig", 64, True, 164_416),
    "qwen3_tiny": ("Qwen3Config", 64, False, 180_928),
    "llama_1b": ("LlamaConfig", 2048, True, 1_235_814_400),
    "llama_8b": ("LlamaConfig", 4096, False, 8_030_261_248),
    "qwen3_8b": ("Qwen3Config", 4096, False, 8_190_735_360),
}


@pytest.mark.parametrize("option", sorted(HF_OPTIONS))
def test_hugging_face_options_describe_the_intended_models(option):
    import torch

    config_class, hidden, tied, parameters = HF_OPTIONS[option]
    cfg = _compose(f"model={option}")
    validate(cfg)
    model = instantiate(cfg.model)
    config = model.hf_config()
    assert (type(config).__name__, config.hidden_size, config.tie_word_embeddings) == (config_class, hidden, tied)
    assert config.vocab_size >= 256 and config.use_cache is False
    with torch.device("meta"):  # the real shape, counted without allocating it
        model.configure_model()
    assert sum(p.numel() for p in model.model.parameters()) == parameters
    assert next(model.model.parameters()).dtype == (torch.float32 if "tiny" in option else torch.bfloat16)


def test_lora_trains_only_the_adapters():
    cfg = _compose("model=llama_tiny", "+model/lora=default", "model.lora.r=4",
                   "model.lora.target_modules=[q_proj,v_proj]")
    validate(cfg)
    module = instantiate(cfg.model)
    module.configure_model()
    built = module.model
    module.configure_model()
    assert module.model is built  # Lightning calls the hook on every fit/validate: built once
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert {name.split(".")[-4] for name in trainable} == {"q_proj", "v_proj"}
    assert sum(p.numel() for p in module.parameters() if p.requires_grad) == 4 * 4 * (2 * 64 + 64 + 32)
    optimized = {id(p) for group in module.configure_optimizers().param_groups for p in group["params"]}
    assert optimized == {id(p) for p in module.parameters() if p.requires_grad}


def _train_losses(output_dir: pathlib.Path) -> list[float]:
    with open(output_dir / "logs" / "metrics.csv") as file:
        return [float(row["train/loss"]) for row in csv.DictReader(file) if row.get("train/loss")]


HF_RUN = ["trainer.max_steps=40", "trainer.val_check_interval=20", "trainer.log_every_n_steps=1",
          "trainer.enable_progress_bar=false", "sample_tokens=8", *TINY]


@pytest.mark.parametrize("overrides", [["model=llama_tiny"], ["model=qwen3_tiny", "+model/lora=default"]],
                         ids=["llama_tiny", "qwen3_tiny_lora"])
def test_a_hugging_face_model_trains_on_the_byte_data(overrides, tmp_path):
    summary = run(_compose(*overrides, "strategy=single_device", *HF_RUN), tmp_path)
    losses = _train_losses(tmp_path)
    assert len(losses) == 40 and all(map(math.isfinite, losses))
    assert sum(losses[-5:]) < sum(losses[:5])  # from ~ln(256) down
    assert summary.val_loss is not None and math.isfinite(summary.val_loss)
    assert len(summary.sample) >= 1


def test_a_hugging_face_model_trains_under_roundpipe(tmp_path):
    cfg = _compose("model=llama_tiny", "strategy=roundpipe", *HF_RUN)  # the default pipeline=null finds it
    run(cfg, tmp_path)
    losses = _train_losses(tmp_path)
    assert all(map(math.isfinite, losses)) and sum(losses[-5:]) < sum(losses[:5])

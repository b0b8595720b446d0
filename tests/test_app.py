"""The Hydra app: every config composes and instantiates, bad input names its key, presets and multirun run."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from torch.utils.data import DataLoader

# the app needs hydra-core; without it (a bare GPU image, `pytest -m gpu`) this module is skipped, not an error
pytest.importorskip("hydra", reason="the Hydra app needs hydra-core")

import yaml  # noqa: E402 - installed with hydra-core (through omegaconf)
from hydra import compose, initialize_config_dir, initialize_config_module  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402
from hydra.errors import ConfigCompositionException  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from lightning_roundpipe.app.hf_model import CausalLM  # noqa: E402
from lightning_roundpipe.app.progress import StepBoundRichProgressBar, StepBoundTQDMProgressBar  # noqa: E402
from lightning_roundpipe.app.schema import ConfigError, validate  # noqa: E402
from lightning_roundpipe.app.train import CONFIG_DIR, CONFIG_MODULE, intra_op_threads, run  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
GROUPS = ("model", "data", "trainer", "strategy", "logger", "callbacks", "experiment")
TINY = ["data.limit_bytes=200000", "data.val_windows=4"]
TENSORBOARD = any(importlib.util.find_spec(name) for name in ("tensorboard", "tensorboardX"))


def _options(group: str) -> list[str]:
    return sorted(path.stem for path in (pathlib.Path(CONFIG_DIR) / group).glob("*.yaml"))


def _app(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """The command line, as ``python -m lightning_roundpipe.app`` (the same job as ``roundpipe-train``)."""
    return subprocess.run([sys.executable, "-m", "lightning_roundpipe.app", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_config_composes_and_instantiates(group, option, tmp_path):
    overrides = [f"{group}={option}", f"output_dir={tmp_path}", *TINY]
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
    for name, entry in [*cfg.logger.items(), *cfg.callbacks.items()]:
        if name == "tensorboard" and not TENSORBOARD:
            continue  # test_a_logger_whose_package_is_missing_is_a_config_error
        built = instantiate(entry)
        folder = built.dirpath if isinstance(built, ModelCheckpoint) else getattr(built, "save_dir", None)
        if folder is not None:  # everything a run writes stays in its folder
            assert pathlib.Path(folder).is_relative_to(tmp_path), (name, folder)


@pytest.mark.parametrize("group", [*GROUPS, "model/lora"])
def test_a_group_offers_its_option_files_only_not_the_schemas(group):
    """Hydra lists ConfigStore entries of a group as options: the schemas live under schema/ instead."""
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        offered = sorted(GlobalHydra.instance().config_loader().get_group_options(group))
    assert offered == _options(group)


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
    (["ckpt_path=/no/such/last.ckpt"], "ckpt_path"),
    (["torch_threads=0"], "torch_threads"),
    (["model.optimizer=sgd"], "model.optimizer"),
    (["model=llama_tiny", "model.optimizer=adam8bit"], "model.optimizer"),
    (["model=llama_tiny", "model.family=gpt2"], "model.family"),
    (["model=llama_tiny", "model.dtype=float8"], "model.dtype"),
    (["model=llama_tiny", "model.attn_implementation=flash"], "model.attn_implementation"),
    (["model=llama_tiny", "model.hidden_size=66"], "model.hidden_size"),
    (["model=llama_tiny", "model.num_key_value_heads=3"], "model.num_key_value_heads"),
    (["model=llama_tiny", "model.num_hidden_layers=0"], "model.num_hidden_layers"),
    (["model=llama_tiny", "model.vocab_size=128"], "model.vocab_size"),
    (["model=llama_tiny", "model.max_position_embeddings=32"], "model.max_position_embeddings"),
    (["model=llama_tiny", "strategy.pipeline=net"], "strategy.pipeline"),
    # ruled out only when the strategy meets the model or the devices, or when Lightning builds the Trainer
    (["strategy.pipeline=nett"], "`strategy.pipeline` is 'nett', which names no submodule of ByteLM"),
    (["trainer.devices=3", "strategy.rings_per_node=2"], "`strategy.rings_per_node` must divide"),
    (["trainer.devices=0"], "`trainer`: `Trainer(devices=0)`"),
    (["model=llama_tiny", "+model/lora=default", "model.lora.r=0"], "model.lora.r"),
    (["model=llama_tiny", "+model/lora=default", "model.lora.target_modules=[]"], "model.lora.target_modules"),
    (["model=llama_tiny", "+model/lora=default", "model.lora.base=int4"], "model.lora.base"),
])
def test_impossible_values_fail_before_training_naming_the_key(overrides, key, tmp_path):
    cfg = _compose(*overrides)
    with pytest.raises((ConfigError, OmegaConfBaseException)) as error:
        run(cfg, tmp_path)
    assert key in str(error.value)


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


def test_two_processes_from_the_command_line_share_one_run_and_one_summary(tmp_path):
    """The README's two-process command, on CPU devices: Lightning's launcher runs the Hydra command again for
    process 1, in the same run folder; process 0 alone prints the summary, its tokens/s counting both."""
    command = [sys.executable, str(REPO / "examples" / "train.py"), "trainer.devices=4", "strategy.rings_per_node=2",
               "strategy.shard_optimizer=true", "trainer.fast_dev_run=true", "trainer.enable_progress_bar=false",
               "sample_tokens=4", *TINY]
    env = {key: value for key, value in os.environ.items()  # no launcher variables from whatever started pytest
           if key not in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(" summary ") == 1, result.stdout[-3000:]
    assert "(all 2 processes; the rest: process 0's)" in result.stdout
    runs = [path.parent for path in tmp_path.rglob(".hydra")]
    assert len(runs) == 1 and (runs[0] / "train_ddp_process_1.log").exists(), runs


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


def test_the_command_line_reports_a_bad_value_without_a_traceback(tmp_path):
    script = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train.py"
    result = subprocess.run([sys.executable, str(script), "strategy.num_microbatches=0"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)  # Hydra makes the run folder under cwd
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()  # one line: no traceback
    assert line.startswith("config error: `strategy.num_microbatches` ") and line.endswith("got 0"), line


def test_an_option_the_model_rules_out_is_one_config_error_line(tmp_path):
    """`strategy.pipeline` is checked when the strategy meets the model, inside fit: still one line, no traceback."""
    result = _app("strategy.pipeline=nett", "trainer.max_steps=1", "sample_tokens=0", *TINY, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "config error: `strategy.pipeline` is 'nett', which names no submodule of ByteLM; its nn.Sequential "
        "submodules are ['net', "), result.stderr[-3000:]


def test_a_bug_inside_fit_keeps_its_traceback(tmp_path, monkeypatch):
    """Only our options' errors and the Trainer's refused flags are config errors: a ValueError from the
    model's own code is not turned into one."""
    from lightning_roundpipe.app.model import ByteLM

    def broken(self, batch, batch_idx):
        raise ValueError("a bug in training_step")

    monkeypatch.setattr(ByteLM, "training_step", broken)
    with pytest.raises(ValueError, match="^a bug in training_step$") as error:
        run(_compose(*FEW_STEPS, "trainer.max_steps=1"), tmp_path)
    assert not isinstance(error.value, ConfigError)


def test_text_data_without_a_path_says_which_key_to_set(tmp_path):
    result = _app("data=text_path", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (
        "config error: `data.path` is required with data=text_path: add data.path=/your/corpus.txt (a file, or a "
        "folder whose files are read in sorted order)")


@pytest.mark.parametrize("how", ["--config-dir", "hydra.searchpath"])
def test_a_folder_of_your_own_adds_a_model_option(how, tmp_path):
    own = tmp_path / "my_conf"
    (own / "model").mkdir(parents=True)
    (own / "model" / "wide_gpt.yaml").write_text(
        "defaults:\n  - gpt_small   # the shipped option, found on the search path\n  - _self_\n\nnet:\n  width: 96\n")
    where = ["--config-dir", str(own)] if how == "--config-dir" else [f"hydra.searchpath=[file://{own}]"]
    result = _app(*where, "model=wide_gpt", "output_dir=unused", "--cfg", "job", "--resolve", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    composed = yaml.safe_load(result.stdout)
    assert composed["model"]["net"]["width"] == 96  # ours
    assert composed["model"]["net"]["depth"] == 6 and composed["model"]["fused"] is True  # gpt_small's
    assert composed["data"]["context"] == 64 and composed["strategy"]["_target_"].endswith("RoundPipeStrategy")


def test_an_option_of_your_own_is_checked_against_the_schema(tmp_path):
    """It extends a shipped option, so the schema still rejects an unknown key."""
    own = tmp_path / "my_conf"
    (own / "model").mkdir(parents=True)
    (own / "model" / "typo.yaml").write_text("defaults:\n  - gpt_small\n  - _self_\n\nlearning_rate: 0.1\n")
    result = _app("--config-dir", str(own), "model=typo", "--cfg", "job", cwd=tmp_path)
    assert result.returncode != 0 and "learning_rate" in result.stderr


# ---------------------------------------------------------------------------- loggers, callbacks, resuming
FEW_STEPS = ["experiment=quick", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
             "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "sample_tokens=0", *TINY]


def _optimizer_steps(checkpoint: pathlib.Path) -> tuple[int, set[int]]:
    """The trainer's global step and the AdamW step counts a checkpoint holds."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    steps = {int(entry["step"]) for optimizer in state["optimizer_states"] for entry in optimizer["state"].values()}
    return state["global_step"], steps


# expected here: the second run checkpoints into its own folder, and resumes mid-epoch
@pytest.mark.filterwarnings("ignore:The dirpath has changed", "ignore:.*your dataloader is not resumable")
def test_ckpt_path_resumes_from_the_checkpoint_of_an_earlier_run(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    run(_compose(*FEW_STEPS, "trainer.max_steps=4"), first)
    last = first / "checkpoints" / "last.ckpt"
    assert _optimizer_steps(last) == (4, {4})
    assert len(list((first / "checkpoints").glob("step=*-val_loss=*.ckpt"))) == 1  # the best, by val/loss

    run(_compose(*FEW_STEPS, "trainer.max_steps=6", f"ckpt_path={last}"), second)
    # resumed: two more steps, and AdamW's moments carried over (a fresh start would count 2)
    assert _optimizer_steps(second / "checkpoints" / "last.ckpt") == (6, {6})
    with open(second / "logs" / "metrics.csv") as file:
        logged = [int(row["step"]) for row in csv.DictReader(file) if row.get("train/loss")]
    assert logged == [4, 5]


def test_no_logger_writes_no_logs(tmp_path):
    run(_compose(*FEW_STEPS, "trainer.max_steps=2", "~logger"), tmp_path)
    assert not (tmp_path / "logs").exists() and not (tmp_path / "tensorboard").exists()
    assert not (tmp_path / "lightning_logs").exists()  # not Lightning's default logger either


def test_a_logger_whose_package_is_missing_is_a_config_error(tmp_path):
    cfg = _compose(*FEW_STEPS, "trainer.max_steps=2", "logger=many")
    if TENSORBOARD:
        run(cfg, tmp_path)
        assert (tmp_path / "logs" / "metrics.csv").is_file()
        assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    else:
        with pytest.raises(ConfigError, match=r"^`logger\.tensorboard` needs a package that is not installed"):
            run(cfg, tmp_path)


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


def test_qlora_keeps_the_frozen_projections_in_four_bits_and_the_tied_head_as_stored():
    pytest.importorskip("bitsandbytes")
    from lightning_roundpipe.nf4 import NF4Linear

    cfg = _compose("model=llama_tiny", "+model/lora=qlora", "model.lora.target_modules=[q_proj,v_proj]")
    validate(cfg)
    module = instantiate(cfg.model)
    module.configure_model()
    base = module.model.get_base_model()
    linears = {name: type(layer) for name, layer in base.named_modules()
               if isinstance(layer, torch.nn.Linear | NF4Linear) and "lora_" not in name}
    frozen = {name for name, kind in linears.items() if name != "lm_head"}
    assert frozen and all(linears[name] is NF4Linear for name in frozen)  # adapted or not, every frozen projection
    assert linears["lm_head"] is torch.nn.Linear and base.lm_head.weight is base.model.embed_tokens.weight
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)


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


@pytest.mark.parametrize("overrides", [[], ["+model/lora=qlora", "trainer.precision=bf16-mixed"]],
                         ids=["full", "qlora"])
def test_a_hugging_face_model_trains_under_roundpipe(overrides, tmp_path):
    if overrides:
        pytest.importorskip("bitsandbytes")
    cfg = _compose("model=llama_tiny", "strategy=roundpipe", *overrides, *HF_RUN)  # pipeline=null finds it
    run(cfg, tmp_path)
    losses = _train_losses(tmp_path)
    assert all(map(math.isfinite, losses)) and sum(losses[-5:]) < sum(losses[:5])


@pytest.mark.parametrize("overrides, expected", [
    ([], 1),                                     # CPU: one thread per simulated device
    (["trainer=gpu"], "default"),                # GPUs: every core for the host optimizer step
    (["trainer=gpu", "torch_threads=3"], 3),     # a set value wins
    (["torch_threads=2"], 2),
])
def test_torch_threads_default_follows_the_accelerator(overrides, expected):
    cfg = _compose(*overrides)
    assert intra_op_threads(cfg) == (torch.get_num_threads() if expected == "default" else expected)


# ---------------------------------------------------------------------------- the progress bar
class _OneWeight(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        return (self.weight * batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _train_bar(bar) -> tuple[str, int, int]:
    """The train bar's description, batches done and total, whichever of Lightning's two bars it is."""
    if isinstance(bar, RichProgressBar):
        task = bar.progress.tasks[bar.train_progress_bar_id]
        return task.description.rstrip(), int(task.completed), int(task.total)
    return bar.train_progress_bar.desc.rstrip(": "), bar.train_progress_bar.n, bar.train_progress_bar.total


def _fit_with_the_bar(bar_class, tmp_path, max_steps: int, ckpt_path=None) -> tuple[str, int, int]:
    """Fit 10 batches an epoch up to ``max_steps``, saving ``last.ckpt`` in ``tmp_path`` after each step (as in
    the middle of an epoch); the train bar's state at the end."""
    bar = bar_class()
    last = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=1)
    trainer = pl.Trainer(max_steps=max_steps, max_epochs=-1, accelerator="cpu", devices=1, callbacks=[bar, last],
                         logger=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_OneWeight(), DataLoader(torch.ones(10, 1), batch_size=1), ckpt_path=ckpt_path)
    return _train_bar(bar)


@pytest.mark.filterwarnings("ignore:The dirpath has changed", "ignore:.*your dataloader is not resumable")
@pytest.mark.parametrize("bar_class", [StepBoundRichProgressBar, StepBoundTQDMProgressBar])
def test_the_progress_bar_counts_to_max_steps_also_after_a_resume(bar_class, tmp_path):
    """Hand-counted: 10 batches an epoch. Lightning's own bar shows `Epoch 0/-2` (Rich), and after a resume at
    step 4 to max_steps=6 it counts the epoch's 6th batch against the 2 steps left (6/2)."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert _fit_with_the_bar(bar_class, first, max_steps=4) == ("Epoch 0", 4, 4)
    assert _fit_with_the_bar(bar_class, second, max_steps=6, ckpt_path=first / "last.ckpt") == ("Epoch 0", 6, 6)
    assert _fit_with_the_bar(bar_class, tmp_path, max_steps=13) == ("Epoch 1", 3, 3)  # epoch 1 stops at its 3rd


@pytest.mark.filterwarnings("ignore:The dirpath has changed", "ignore:.*your dataloader is not resumable")
def test_a_resumed_run_without_a_validation_reports_the_last_one(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    before = run(_compose(*FEW_STEPS, "trainer.max_steps=4"), first)  # validates at steps 2 and 4
    assert before.val_loss is not None and before.val_step == 4
    after = run(_compose(*FEW_STEPS, "trainer.max_steps=5", f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}"),
                second)  # one step more: no validation in this run
    assert (after.val_loss, after.val_step) == (before.val_loss, 4)
    assert f"val loss        {before.val_loss:.3f} (perplexity " in "\n".join(after.lines())
    assert "at step 4" in "\n".join(after.lines())

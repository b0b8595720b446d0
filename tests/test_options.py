"""The options are declared once (``StrategyOptions``, ``EngineOptions``); every other declaration agrees.

Each drift check is a helper that takes the declared options, so a test can also show that it fails: the
options of a dataclass with one extra field (``_with_an_extra_option``) must be reported as missing from
the strategy's signature, its docstring, the Hydra schema, the YAML and the README.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_roundpipe.app.schema import ConfigError, RoundPipeConf, hydra_type, roundpipe_conf, validate
from lightning_roundpipe.app.train import CONFIG_DIR
from lightning_roundpipe.engine.options import EngineOptions, OptionError
from lightning_roundpipe.planning.partition import Plan
from lightning_roundpipe.strategy import RoundPipeStrategy
from lightning_roundpipe.strategy_options import (
    SET_BY_STRATEGY,
    OptionSpec,
    StrategyOptions,
    build_options,
    option_specs,
)

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
YAML = pathlib.Path(CONFIG_DIR) / "strategy" / "roundpipe.yaml"
LIGHTNING_ARGUMENTS = ("accelerator", "parallel_devices", "checkpoint_io", "precision_plugin")


def _with_an_extra_option() -> list[OptionSpec]:
    """The strategy's options as if someone had added ``no_such_option`` to ``StrategyOptions`` only."""
    extended = dataclasses.make_dataclass("Extended", [("no_such_option", int, dataclasses.field(default=1))],
                                          bases=(StrategyOptions,))
    return option_specs((extended, EngineOptions))


# ---------------------------------------------------------------------------- drift checks
def _signature_drift(specs: Sequence[OptionSpec], function: Callable[..., Any]) -> list[str]:
    """How the option parameters of ``function`` differ from ``specs``: names and defaults."""
    parameters = {name: parameter.default for name, parameter in inspect.signature(function).parameters.items()
                  if name not in ("self", *LIGHTNING_ARGUMENTS)}
    declared = {spec.name: spec.default for spec in specs}
    problems = [f"{name}: no parameter" for name in declared if name not in parameters]
    problems += [f"{name}: not an option" for name in parameters if name not in declared]
    problems += [f"{name}: default {parameters[name]!r}, declared {declared[name]!r}" for name in declared
                 if name in parameters and parameters[name] != declared[name]]
    return sorted(problems)


def _docstring_drift(specs: Sequence[OptionSpec], docstring: str) -> list[str]:
    """How the entries of the docstring's ``Args:`` section differ from the options and Lightning's four."""
    args = docstring.split("Args:", 1)[1]
    documented = set(re.findall(r"^ {8}(\w+): ", args, flags=re.MULTILINE))
    expected = {spec.name for spec in specs} | set(LIGHTNING_ARGUMENTS)
    return sorted([f"{name}: undocumented" for name in expected - documented]
                  + [f"{name}: no such argument" for name in documented - expected])


def _schema_drift(specs: Sequence[OptionSpec], schema: type) -> list[str]:
    fields = {field.name: field.default for field in dataclasses.fields(schema) if field.name != "_target_"}
    declared = {spec.name: spec.default for spec in specs}
    return sorted([f"{name}: not in the schema" for name in declared.keys() - fields.keys()]
                  + [f"{name}: not an option" for name in fields.keys() - declared.keys()]
                  + [f"{name}: default {fields[name]!r}" for name in declared.keys() & fields.keys()
                     if fields[name] != declared[name]])


def _yaml_drift(specs: Sequence[OptionSpec], path: pathlib.Path) -> list[str]:
    """Every option is a line ``option: default  # what it means`` of the YAML file, and nothing else is."""
    commented = dict(re.findall(r"^(\w+):[^#\n]*#\s*(\S.*)$", path.read_text(), flags=re.MULTILINE))
    values = OmegaConf.to_container(OmegaConf.load(path))
    assert isinstance(values, dict)
    values.pop("defaults", None)
    problems = [f"{spec.name}: no line with a comment" for spec in specs if spec.name not in commented]
    problems += [f"{spec.name}: {values.get(spec.name)!r}, default {spec.default!r}" for spec in specs
                 if spec.name in values and values[spec.name] != spec.default]
    problems += [f"{name}: not an option" for name in values.keys() - {spec.name for spec in specs}]
    return sorted(problems)


def _readme_options(text: str) -> set[str]:
    """The first cells of the rows of every ``| option | default | meaning |`` table."""
    names: set[str] = set()
    for table in re.findall(r"^\| option \| default \| meaning \|\n((?:\|.*\n)+)", text, flags=re.MULTILINE):
        names.update(re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE))
    return names


def _readme_drift(names: set[str], text: str) -> list[str]:
    listed = _readme_options(text)
    return sorted([f"{name}: not in a README table" for name in names - listed]
                  + [f"{name}: not an option" for name in listed - names])


def _all_field_names(specs: Sequence[OptionSpec]) -> set[str]:
    return {spec.name for spec in specs} | SET_BY_STRATEGY  # the README documents the engine's too


# ---------------------------------------------------------------------------- the declarations agree
def test_the_strategy_signature_has_every_option_with_its_default():
    assert _signature_drift(option_specs(), RoundPipeStrategy.__init__) == []


def test_the_strategy_docstring_documents_every_argument():
    assert _docstring_drift(option_specs(), RoundPipeStrategy.__doc__ or "") == []


def test_the_hydra_schema_has_every_option_with_its_default():
    assert _schema_drift(option_specs(), RoundPipeConf) == []


def test_the_yaml_lists_every_option_at_its_default_with_a_comment():
    assert _yaml_drift(option_specs(), YAML) == []


def test_the_readme_tables_list_every_option():
    assert _readme_drift(_all_field_names(option_specs()), README.read_text()) == []


def test_the_checks_fail_on_an_option_added_to_the_dataclass_only():
    specs = _with_an_extra_option()
    assert "no_such_option" in {spec.name for spec in specs}
    assert _signature_drift(specs, RoundPipeStrategy.__init__) == ["no_such_option: no parameter"]
    assert _docstring_drift(specs, RoundPipeStrategy.__doc__ or "") == ["no_such_option: undocumented"]
    assert _schema_drift(specs, RoundPipeConf) == ["no_such_option: not in the schema"]
    assert _yaml_drift(specs, YAML) == ["no_such_option: no line with a comment"]
    assert _readme_drift(_all_field_names(specs), README.read_text()) == ["no_such_option: not in a README table"]
    # the schema is built from the fields, so it follows by itself
    assert _schema_drift(specs, roundpipe_conf(specs)) == []


def test_the_checks_fail_on_a_changed_default_or_a_stray_entry(tmp_path):
    specs = [spec._replace(default=7) if spec.name == "timeline_steps" else spec for spec in option_specs()]
    assert _signature_drift(specs, RoundPipeStrategy.__init__) == ["timeline_steps: default 3, declared 7"]
    assert _schema_drift(specs, RoundPipeConf) == ["timeline_steps: default 3"]
    assert _yaml_drift(specs, YAML) == ["timeline_steps: 3, default 7"]
    stray = tmp_path / "roundpipe.yaml"
    stray.write_text(YAML.read_text() + "colour: blue  # not an option\n")
    assert _yaml_drift(option_specs(), stray) == ["colour: not an option"]
    fewer = [spec for spec in option_specs() if spec.name != "seed"]
    assert _readme_drift(_all_field_names(fewer), README.read_text()) == ["seed: not an option"]


def test_record_timeline_is_the_only_engine_option_the_strategy_sets_itself():
    engine_fields = {field.name for field in dataclasses.fields(EngineOptions)}
    assert SET_BY_STRATEGY == {"record_timeline"} and SET_BY_STRATEGY <= engine_fields
    assert engine_fields - SET_BY_STRATEGY <= {spec.name for spec in option_specs()}
    for timeline, timeline_dir, recorded in ((False, None, False), (True, None, True), (False, "out", True)):
        strategy_options, engine_options = build_options({"timeline": timeline, "timeline_dir": timeline_dir})
        assert strategy_options.timeline is engine_options.record_timeline is recorded
    with pytest.raises(TypeError, match="record_timeline"):
        RoundPipeStrategy(record_timeline=True)  # type: ignore[call-arg]


@pytest.mark.parametrize("hint, expected", [
    (bool, bool), (float, float), (int | None, int | None), (Literal["stage", "layer"], str),
    (Literal["stage"] | None, str | None), (list[int] | None, list[int] | None), (int | str | None, Any),
    (Literal["auto"] | int | Plan, Any), (list[Plan] | None, Any),
])
def test_option_types_become_types_omegaconf_checks(hint, expected):
    assert hydra_type(hint) == expected


# ---------------------------------------------------------------------------- Hydra
HYDRA_SAMPLES = {  # option: (override value, what the strategy holds); none is the default
    "pipeline": ("net", "net"),
    "ring": ("[0,0]", [0, 0]),
    "rings_per_node": ("2", 2),
    "log_pipeline_metrics": ("false", False),
    "timeline": ("true", True),
    "timeline_dir": ("{tmp}/trace", "{tmp}/trace"),
    "timeline_steps": ("5", 5),
    "preflight": ("warn", "warn"),
    "fp16_accumulation": ("true", True),
    "keep_gradients": ("always", "always"),
    "weights_from": ("{tmp}/pretrained", "{tmp}/pretrained"),
    "num_microbatches": ("4", 4),
    "num_stages": ("6", 6),
    "round_size": ("whole", "whole"),
    "async_step": ("true", True),
    "streaming_step": ("off", "off"),
    "host_optimizer": ("fused", "fused"),
    "offload": ("optimizer", "optimizer"),
    "offload_dir": ("{tmp}/offload", "{tmp}/offload"),
    "frozen_weights": ("round", "round"),
    "stochastic_rounding": ("true", True),
    "recompute": ("layer", "layer"),
    "pin_memory": ("false", False),
    "transport_dtype": ("off", "off"),
    "device_memory_limit": ("2MiB", 2 * 2**20),
    "freeze_plan": ("true", True),
    "replan_hysteresis": ("0.25", 0.25),
    "deferred_batchnorm": ("true", True),
    "seed": ("7", 7),
    "jitter": ("0.001", 0.001),
    "stress": ("true", True),
    "wait_timeout": ("30", 30.0),
    "shard_optimizer": ("true", True),
    "reduce_dtype": ("bfloat16", "bfloat16"),
}


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_every_option_can_be_set_from_hydra(tmp_path):
    specs = option_specs()
    assert set(HYDRA_SAMPLES) == {spec.name for spec in specs}  # a new option needs a sample here
    samples = {name: (override.format(tmp=tmp_path), held.format(tmp=tmp_path) if isinstance(held, str) else held)
               for name, (override, held) in HYDRA_SAMPLES.items()}
    for spec in specs:
        assert samples[spec.name][1] != spec.default, f"{spec.name}: the sample is the default"
    cfg = _compose(*(f"strategy.{name}={override}" for name, (override, _) in samples.items()))
    validate(cfg)
    strategy = instantiate(cfg.strategy)
    assert isinstance(strategy, RoundPipeStrategy)
    for spec in specs:
        held = getattr(strategy.options if spec.owner is StrategyOptions else strategy.engine_options, spec.name)
        assert held == samples[spec.name][1], spec.name
    assert strategy.engine_options.record_timeline is True


# ---------------------------------------------------------------------------- validation messages
BAD_VALUES = [  # option, Python value, Hydra override value, the problem both report
    ("num_microbatches", 0, "0", "must be a positive int (or None for devices + 1, one device: 1), got 0"),
    ("num_stages", 0, "0", "must be 'auto', a positive int (the number of forward stages) or a Plan, got 0"),
    ("recompute", "sometimes", "sometimes", "must be 'stage' or 'layer', got 'sometimes'"),
    ("round_size", 0, "0", "must be 'auto', 'whole' or a positive int (microbatches per round), got 0"),
    ("device_memory_limit", "lots", "lots",
     "must be a positive number of bytes or a string such as '20GiB' or '512MB', got 'lots'"),
    ("replan_hysteresis", -0.5, "-0.5", "must be a fraction >= 0, got -0.5"),
    ("jitter", -1.0, "-1", "must be a number of seconds >= 0, got -1.0"),
    ("wait_timeout", 0.0, "0", "must be a number of seconds > 0, got 0.0"),
    ("timeline_steps", 0, "0", "must be a positive int (or None for every step), got 0"),
    ("preflight", "maybe", "maybe", "must be one of 'refuse', 'warn', 'off', got 'maybe'"),
    ("transport_dtype", "int8", "int8", "must be one of 'auto', 'off', 'bfloat16', 'float16', got 'int8'"),
    ("ring", [-1], "[-1]",
     "must be a non-empty list of device indices (ints >= 0), e.g. [0, 0], or None for each device once; got [-1]"),
    ("pipeline", "", "''", "must be a dotted attribute path such as 'net' or 'model.blocks', or None to find the "
                           "trunk; got ''"),
    ("rings_per_node", 0, "0",
     "must be a positive int (processes per node, each driving a ring of devices // rings_per_node devices), got 0"),
    ("reduce_dtype", "float16", "float16", "must be one of 'auto', 'float32', 'bfloat16', got 'float16'"),
    ("offload", "gpu", "gpu", "must be one of 'none', 'optimizer', 'optimizer+masters', got 'gpu'"),
    ("frozen_weights", "bf16", "bf16", "must be one of 'auto', 'as_stored', 'round', got 'bf16'"),
    ("weights_from", "", "''", "must be a safetensors file or a Hugging Face model directory, or None; got ''"),
    ("offload", "optimizer", "optimizer",
     "'optimizer' keeps state in files: set `offload_dir` to a directory on a local disk with room for it"),
]


@pytest.mark.parametrize("option, value, override, problem", BAD_VALUES, ids=[case[0] for case in BAD_VALUES])
def test_a_bad_value_names_the_option_in_python_and_the_key_in_hydra(option, value, override, problem):
    with pytest.raises(OptionError) as caught:
        RoundPipeStrategy(**{option: value})
    assert str(caught.value) == f"`{option}` {problem}"
    assert (caught.value.option, caught.value.problem) == (option, problem)
    with pytest.raises(ConfigError) as in_hydra:
        validate(_compose(f"strategy.{option}={override}"))
    assert str(in_hydra.value) == f"`strategy.{option}` {problem}"


def test_wrong_types_are_refused_with_the_option_named():
    for option, value in (("async_step", 1), ("seed", 1.5), ("timeline_dir", 3), ("jitter", "fast")):
        with pytest.raises(OptionError, match=f"^`{option}` must be .*got {re.escape(repr(value))}$"):
            RoundPipeStrategy(**{option: value})


def test_rounds_are_refused_with_deferred_batchnorm_which_needs_whole_jobs():
    with pytest.raises(OptionError, match="^`round_size` must be 'auto' or 'whole' with `deferred_batchnorm=True`"):
        RoundPipeStrategy(round_size=2, deferred_batchnorm=True)
    assert RoundPipeStrategy(round_size="auto", deferred_batchnorm=True).engine_options.round_size == "auto"


def test_unknown_names_are_refused():
    with pytest.raises(TypeError, match=r"unknown RoundPipe option\(s\) \['colour'\]; the options are \["):
        build_options({"colour": "blue"})


def test_option_defaults_are_valid():
    strategy_options, engine_options = build_options({})
    assert strategy_options == StrategyOptions() and engine_options == EngineOptions()

"""The example scripts run from a clean checkout and show what their README line says."""

from __future__ import annotations

import json
import math
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_a_plain_lightning_module_trains_unchanged_with_roundpipe():
    output = _run("plain_lightning.py")
    losses = [float(x) for x in re.findall(r"final loss, .*:\s+([0-9.]+)", output)]
    assert len(losses) == 2 and math.isclose(losses[0], losses[1], rel_tol=1e-4)


def test_the_fused_loss_example_learns():
    output = _run("fused_loss.py")
    loss, uniform = (float(x) for x in re.search(r"final train loss ([0-9.]+) .* is ([0-9.]+)", output).groups())
    assert loss < 0.75 * uniform


def _gpu_check():
    """``benchmarks/gpu.py`` as a module (it is a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", EXAMPLES.parent / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.smoke
def test_the_gpu_check_runs_every_section_in_smoke_mode(tmp_path):
    """``benchmarks/gpu.py --smoke`` runs every section on CPU, from any folder, so the GPU check is debugged
    before a GPU is at hand; what needs CUDA says so."""
    import json

    out = tmp_path / "gpu.json"
    result = subprocess.run([sys.executable, str(EXAMPLES.parent / "benchmarks" / "gpu.py"), "--smoke", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sections = json.loads(out.read_text())
    assert sections["smoke"] is True
    for name in _gpu_check().SECTIONS:
        assert "result" in sections[name] and "error" not in sections[name], (name, sections[name])
    environment = sections["environment"]["result"]
    assert environment["ulimit_l"] and environment["nproc"] >= 1 and environment["a6_probe"] == "skipped: no CUDA"
    assert sections["pytest"]["result"]["counts"]["skipped"] >= 1
    for name in ("fits_baseline", "fits_sync", "fits_async", "big_sync", "big_async"):
        run = sections[name]["result"]
        assert run["tokens_per_s"] > 0 and run["mfu"] > 0 and run["label"] == "0.18M", (name, run)
    assert "optimizer_seconds" in sections["fits_sync"]["result"]["engine_metric_keys"]
    assert sections["published"]["result"]["mask_shim"].startswith("ok")
    assert sections["comparisons"]["fits_async_over_baseline"] > 0
    assert "ratios:" in result.stdout and "fits_sync" in result.stdout


def test_the_gpu_check_keeps_the_steps_of_a_section_that_timed_out():
    gpu = _gpu_check()
    steps = [{"step": i, "seconds": 1.0, "tokens_per_s": 100.0 * (i + 1), "timed": i >= 1} for i in range(3)]
    output = "\n".join(["MODEL x"] + [f"STEP big_async {json.dumps(step)}" for step in steps])
    entry = gpu._entries(["big_async"], None, output, 65.0, 65.2)["big_async"]
    assert entry["error"] == "timed out after 65 s" and entry["partial"] == {"steps": 3, "tokens_per_s": 250.0}
    assert gpu._status(entry) == "partial"
    done = gpu._entries(["fits_sync"], 0, 'RESULT fits_sync 3.5 {"tokens_per_s": 7.0}', 60.0, 4.0)["fits_sync"]
    assert done == {"result": {"tokens_per_s": 7.0}, "seconds": 3.5}


def test_the_mask_shim_accepts_the_published_librarys_call():
    """roundpipe 0.1.1 calls ``create_causal_mask(input_embeds=..., cache_position=..., past_key_values=...)``."""
    seen = {}

    def builder(config, inputs_embeds, attention_mask, cache, position_ids=None):
        seen.update(config=config, inputs_embeds=inputs_embeds, cache=cache, position_ids=position_ids)
        return "mask"

    shim = _gpu_check().causal_mask_shim(builder)
    assert shim(config=1, input_embeds=2, attention_mask=None, cache_position=3, past_key_values=None, position_ids=4) == "mask"
    assert seen == {"config": 1, "inputs_embeds": 2, "cache": None, "position_ids": 4}

    def builder_5_17(config, inputs_embeds, attention_mask, past_key_values, position_ids=None, **kwargs):
        return sorted(kwargs), past_key_values  # transformers 5.17's names, with room for more

    shim = _gpu_check().causal_mask_shim(builder_5_17)
    assert shim(config=1, input_embeds=2, attention_mask=None, cache_position=3, past_key_values=5, position_ids=4) == ([], 5)


def test_the_gpu_check_labels_models_by_their_real_size_and_counts_no_flops_for_the_input_embedding():
    import transformers

    gpu = _gpu_check()
    for tied in (True, False):
        config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          num_key_value_heads=1, vocab_size=100, tie_word_embeddings=tied)
        model = transformers.AutoModelForCausalLM.from_config(config)
        sizes = gpu._sizes(model)
        assert sizes["parameters"] == sum(p.numel() for p in model.parameters())
        # the lookup does no matmul; the head does, tied or not
        assert sizes["matmul_parameters"] == sizes["parameters"] - 100 * 16 + (100 * 16 if tied else 0)
    assert gpu._billions(1_235_814_400) == "1.24B" and gpu._billions(180_800) == "0.18M"

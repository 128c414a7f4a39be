"""`--hf-overrides` (vLLM's flag): fields set on the model's Hugging Face config after it
loads. Qwen's long-context recipe is the case in point: YaRN rope scaling over the stored
context, which also lengthens the context the engine may serve. And `--max-model-len` in
vLLM's forms (128k, 128K)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from tandem import LLM
from tandem.config import ConfigError, ModelConfig, add_engine_args, parse_human_int
from tandem.engine_args import EngineArgs
from tests.parity.test_engine_parity import assert_matches, hf_greedy, run_tandem

YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}


def test_the_flag_is_a_json_object() -> None:
    assert ModelConfig(hf_overrides='{"a": 1}').overrides == {"a": 1}
    assert ModelConfig(hf_overrides={"a": 1}).overrides == {"a": 1}  # type: ignore[arg-type]
    assert ModelConfig().overrides == {}
    with pytest.raises(ConfigError, match="hf_overrides must be a JSON object, got list"):
        ModelConfig(hf_overrides="[1]")
    with pytest.raises(ConfigError, match="hf_overrides is not valid JSON"):
        ModelConfig(hf_overrides="{rope")


def test_yarn_override_serves_the_scaled_context_as_transformers_does(
    tiny_model_path, tmp_path: Path
) -> None:
    """The tiny Llama stores 1,024 positions. Asked for 2,048 it is refused; with YaRN x2
    over them set by --hf-overrides it serves 2,048, and its greedy tokens on a prompt past
    1,024 positions equal transformers' on a folder whose config says the same."""
    path = tiny_model_path("llama")
    with pytest.raises(ConfigError, match="exceeds the model's context"):
        EngineArgs(model=str(path), device="cpu", max_model_len=2048).create_engine_config()
    overrides = {"rope_scaling": YARN}
    config = EngineArgs(
        model=str(path), device="cpu", hf_overrides=json.dumps(overrides)
    ).create_engine_config()
    assert config.model.max_model_len == 2048
    assert config.model.hf_config.rope_parameters["rope_type"] == "yarn"

    reference_folder = tmp_path / "yarn"
    shutil.copytree(path, reference_folder)
    stored = json.loads((reference_folder / "config.json").read_text())
    stored["rope_scaling"] = YARN
    stored.pop("rope_parameters", None)
    (reference_folder / "config.json").write_text(json.dumps(stored))
    prompts = [[(13 * i) % 500 + 3 for i in range(1100)], [(7 * i) % 500 + 3 for i in range(40)]]
    reference = hf_greedy(reference_folder, prompts, 8)
    _, outs = run_tandem(path, prompts, 8, hf_overrides=overrides, max_num_batched_tokens=512)
    assert_matches(outs, reference)
    # Without the override the long prompt does not fit.
    with LLM(model=str(path), device="cpu", dtype="float32", num_gpu_blocks=200) as llm:
        assert llm.engine.config.model.max_model_len == 1024


def test_max_model_len_takes_vllms_suffixes() -> None:
    assert [parse_human_int(v) for v in ("4096", "128k", "128K", "1.5m", "2M")] == [
        4096,
        128_000,
        131_072,
        1_500_000,
        2_097_152,
    ]
    for bad in ("12x", "k", "1.0001k"):
        with pytest.raises(ValueError, match="not a"):
            parse_human_int(bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--max-model-len", "32K"]).max_model_len == 32768

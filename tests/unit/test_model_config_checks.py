"""A checkpoint whose config names an architecture, a variant or an option tandem cannot run is
refused when the engine config resolves (before anything is loaded) with a ConfigError naming
it; the families tandem runs resolve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tandem.config import ConfigError
from tandem.engine_args import EngineArgs


def _variant(src: Path, dst: Path, **changes: Any) -> Path:
    """`src`'s config.json alone in `dst`, with `changes` applied."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _resolve(folder: Path) -> Any:
    return EngineArgs(model=str(folder), device="cpu").create_engine_config()


@pytest.mark.parametrize(
    ("arch", "changes", "message"),
    [
        ("llama", {"architectures": ["FalconForCausalLM"]}, r"FalconForCausalLM is not supported"),
        ("llama", {"hidden_act": "gelu"}, r"LlamaForCausalLM: hidden_act 'gelu'"),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "dynamic",
                    "factor": 4.0,
                }
            },
            r"rope_scaling type 'dynamic' is not supported",
        ),
        (
            "qwen3",
            {"quantization_config": {"quant_method": "hqq", "bits": 4}},
            r"Qwen3ForCausalLM: quantization_config \(quant_method 'hqq'\)",
        ),
        (
            "qwen3",
            {"use_sliding_window": True, "sliding_window": 64},
            r"use_sliding_window \(sliding_window 64\)",
        ),
        (
            "mixtral",
            {"num_experts_per_tok": 6},
            r"MixtralForCausalLM: num_experts_per_tok 6 must be in \[1, num_local_experts 4\]",
        ),
        (
            "gemma3",
            {"attn_logit_softcapping": 50.0},
            r"Gemma3ForCausalLM: attn_logit_softcapping=50.0 is not supported",
        ),
        (
            "gemma3",
            {"use_bidirectional_attention": True},
            r"Gemma3ForCausalLM: use_bidirectional_attention=True is not supported",
        ),
        ("gemma3", {"hidden_activation": "relu"}, r"hidden_activation 'relu' is not supported"),
        ("granite", {"logits_scaling": 0}, r"GraniteForCausalLM: logits_scaling must not be 0"),
        (
            "phi3",
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 1.5,
                }
            },
            r"Phi3ForCausalLM: partial_rotary_factor 1.5 gives 24 rotating dims of 16",
        ),
        (
            "gemma3",
            {"layer_types": ["sliding_attention", "chunked_attention"]},
            r"layer_types\[1\] 'chunked_attention' is not supported",
        ),
    ],
)
def test_unsupported_variants_are_a_config_error(
    arch: str, changes: dict[str, Any], message: str, tiny_model_path, tmp_path: Path
) -> None:
    folder = _variant(tiny_model_path(arch), tmp_path / "variant", **changes)
    with pytest.raises(ConfigError, match=message) as info:
        _resolve(folder)
    assert str(folder) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "mixtral", "phi3", "granite"])
def test_new_families_resolve(arch: str, tiny_model_path, tmp_path: Path) -> None:
    config = _resolve(_variant(tiny_model_path(arch), tmp_path / arch))
    assert config.model.hf_config.model_type == arch


def test_random_presets_of_the_new_families_resolve(tmp_path: Path) -> None:
    for preset in ("qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "mixtral-8x7b", "gemma-3-27b"):
        args = EngineArgs(model=f"random:{preset}", device="cpu", cache_dir=str(tmp_path))
        assert args.create_engine_config().model.max_model_len >= 32768

"""Named model shapes with random weights, for machines that cannot download checkpoints.

`random:<name>` (e.g. `random:llama-3.1-8b`) resolves to a folder holding only a
config.json; the weights come from `random_weights`, generated directly on the target
device from a seed. The same (config, seed) gives the same tensors every time, so a
transformers model loaded with `load_state_dict(dict(random_weights(...)))` holds exactly
the weights tandem runs (parity checks).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

RANDOM_PREFIX = "random:"

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
}


def is_random_model(model: str) -> bool:
    return model.startswith(RANDOM_PREFIX)


def preset_config(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ValueError(f"unknown random model shape {name!r}; known: {sorted(PRESETS)}")
    return dict(PRESETS[name])


def write_random_model_folder(model: str, cache_dir: Path) -> Path:
    """A folder with config.json (and a marker) for `random:<name>`; no weight files."""
    name = model[len(RANDOM_PREFIX) :]
    config = preset_config(name)
    folder = cache_dir / "random" / name
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "config.json"
    text = json.dumps({**config, "torch_dtype": "bfloat16"}, indent=2)
    if not config_path.exists() or config_path.read_text() != text:
        config_path.write_text(text)
    (folder / "RANDOM_WEIGHTS").write_text(name + "\n")
    return folder


def has_random_weights(folder: Path) -> bool:
    return (folder / "RANDOM_WEIGHTS").exists()


def random_weights(
    hf_config: Any, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Deterministic random weights under Hugging Face names, made on `device`.

    Matrices ~ N(0, 0.02); norms ~ 1 + N(0, 0.02); biases ~ N(0, 0.02). Each tensor gets
    its own generator seeded from (seed, its index), so the stream does not depend on which
    tensors a caller keeps.
    """
    c = hf_config
    hidden = c.hidden_size
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    inter = c.intermediate_size
    bias = bool(getattr(c, "attention_bias", False)) or c.model_type == "qwen2"
    shapes: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (c.vocab_size, hidden), "mat")
    ]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,), "norm"),
            (p + "self_attn.q_proj.weight", (heads * head_dim, hidden), "mat"),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), "mat"),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden), "mat"),
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim), "mat"),
            (p + "post_attention_layernorm.weight", (hidden,), "norm"),
            (p + "mlp.gate_proj.weight", (inter, hidden), "mat"),
            (p + "mlp.up_proj.weight", (inter, hidden), "mat"),
            (p + "mlp.down_proj.weight", (hidden, inter), "mat"),
        ]
        if bias:
            shapes += [
                (p + "self_attn.q_proj.bias", (heads * head_dim,), "bias"),
                (p + "self_attn.k_proj.bias", (kv_heads * head_dim,), "bias"),
                (p + "self_attn.v_proj.bias", (kv_heads * head_dim,), "bias"),
            ]
    shapes.append(("model.norm.weight", (hidden,), "norm"))
    if not getattr(c, "tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (c.vocab_size, hidden), "mat"))
    for index, (name, shape, kind) in enumerate(shapes):
        gen = torch.Generator(device=device)
        gen.manual_seed(seed * 1_000_003 + index)
        t = torch.empty(shape, dtype=torch.float32, device=device)
        t.normal_(0.0, 0.02, generator=gen)
        if kind == "norm":
            t += 1.0
        yield name, t.to(dtype)


def load_transformers_model(
    model_path: Path, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> torch.nn.Module:
    """transformers' model on exactly the weights tandem runs for `model_path` (for parity
    checks and benchmarks): random presets get `random_weights(config, dtype, device, seed)`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(device)
    if not has_random_weights(Path(model_path)):
        return AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, local_files_only=True
        ).to(device)
    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, tensor in random_weights(config, dtype, device, seed):
            model.get_parameter(name).copy_(tensor)
    return model.to(device).eval()

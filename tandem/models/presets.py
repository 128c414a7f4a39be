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


def _gemma3(
    hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int, scalar: int
) -> dict[str, Any]:
    """A Gemma 3 text shape (the multimodal checkpoints' `text_config`): five sliding layers
    (1024-token window, local rope base 10k) to one global (rope 1M, linear scaling x8)."""
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "query_pre_attn_scalar": scalar,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
    }


PRESETS: dict[str, dict[str, Any]] = {
    "gemma-3-4b": _gemma3(2560, 10240, 34, 8, 4, 256, 256),
    "gemma-3-12b": _gemma3(3840, 15360, 48, 16, 8, 256, 256),
    "gemma-3-27b": _gemma3(5376, 21504, 62, 32, 16, 128, 168),
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
    # Two H200s' shape (about 141 GB in bf16): tensor or pipeline parallel.
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
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
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "qwen3-32b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}

# An EAGLE-1 head of the 8B's shape (one decoder layer; the target's embedding and LM head),
# for `speculative_config={"method": "eagle", "model": "random:eagle-llama-3.1-8b"}`: its
# weights come from tandem.spec_decode.eagle.random_eagle_weights.
PRESETS["eagle-llama-3.1-8b"] = {**PRESETS["llama-3.1-8b"], "num_hidden_layers": 1}


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

    Matrices ~ N(0, 0.02); norms ~ 1 + N(0, 0.02) (Gemma's, which store the offset from 1,
    ~ N(0, 0.02)); biases ~ N(0, 0.02). Each tensor gets
    its own generator seeded from (seed, its index), so the stream does not depend on which
    tensors a caller keeps.
    """
    c = hf_config
    hidden = c.hidden_size
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    bias = bool(getattr(c, "attention_bias", False)) or c.model_type == "qwen2"
    gemma = c.model_type == "gemma3_text"
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
        ]
        if c.model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
            shapes += [
                (p + "self_attn.q_norm.weight", (head_dim,), "norm"),
                (p + "self_attn.k_norm.weight", (head_dim,), "norm"),
            ]
        if c.model_type == "gemma3_text":
            shapes += [
                (p + "pre_feedforward_layernorm.weight", (hidden,), "norm"),
                (p + "post_feedforward_layernorm.weight", (hidden,), "norm"),
            ]
        shapes += _mlp_shapes(c, i)
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
        if kind == "norm" and not gemma:
            t += 1.0
        yield name, t.to(dtype)


def _mlp_shapes(c: Any, layer: int) -> list[tuple[str, tuple[int, ...], str]]:
    """The checkpoint tensors of layer `layer`'s MLP: dense, or a router and its experts."""
    p = f"model.layers.{layer}."
    hidden = c.hidden_size
    if c.model_type == "mixtral":
        moe, names, inter = p + "block_sparse_moe.", ("w1", "w3", "w2"), c.intermediate_size
        num_experts = c.num_local_experts
    elif c.model_type == "qwen3_moe" and _is_sparse_layer(c, layer):
        moe, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        inter, num_experts = c.moe_intermediate_size, c.num_experts
    else:
        inter = c.intermediate_size
        return [
            (p + "mlp.gate_proj.weight", (inter, hidden), "mat"),
            (p + "mlp.up_proj.weight", (inter, hidden), "mat"),
            (p + "mlp.down_proj.weight", (hidden, inter), "mat"),
        ]
    shapes: list[tuple[str, tuple[int, ...], str]] = [
        (moe + "gate.weight", (num_experts, hidden), "mat")
    ]
    for e in range(num_experts):
        gate, up, down = (f"{moe}experts.{e}.{n}.weight" for n in names)
        shapes += [
            (gate, (inter, hidden), "mat"),
            (up, (inter, hidden), "mat"),
            (down, (hidden, inter), "mat"),
        ]
    return shapes


def _is_sparse_layer(c: Any, layer: int) -> bool:
    """Qwen3-MoE: whether layer `layer` has experts (else a dense MLP)."""
    step = int(getattr(c, "decoder_sparse_step", 1) or 1)
    only_dense = set(getattr(c, "mlp_only_layers", None) or [])
    return layer not in only_dense and c.num_experts > 0 and (layer + 1) % step == 0


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
            _copy_into_transformers(model, name, tensor)
    return model.to(device).eval()


def _copy_into_transformers(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Checkpoint tensor `name` into transformers' model: as is, or (transformers 5 keeps the
    experts of a layer stacked, `experts.gate_up_proj [E, 2I, H]` and `experts.down_proj
    [E, H, I]`, and Mixtral's `block_sparse_moe` under `mlp`) into its slice."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    try:
        model.get_parameter(name).copy_(tensor)
        return
    except AttributeError:
        pass
    from tandem.models.utils import expert_param

    found = expert_param(name)
    if found is None:
        raise ValueError(f"transformers' model has no parameter for {name!r}")
    param_name, shard, expert = found
    prefix = param_name.rsplit(".", 1)[0]
    if shard == "w2":
        model.get_parameter(f"{prefix}.down_proj")[expert].copy_(tensor)
        return
    gate_up = model.get_parameter(f"{prefix}.gate_up_proj")[expert]
    inter = gate_up.shape[0] // 2
    (gate_up[:inter] if shard == "w1" else gate_up[inter:]).copy_(tensor)

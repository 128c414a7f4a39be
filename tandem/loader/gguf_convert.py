"""GGUF file -> Hugging Face model folder, converted once and cached.

The folder holds what `transformers` and tandem both read:

    config.json              LlamaConfig / Qwen2Config / ... fields from the GGUF metadata
    generation_config.json   bos / eos ids
    model.safetensors        every tensor dequantized to float32, under Hugging Face names
    tokenizer.json, tokenizer_config.json, chat_template.jinja

Weights equal what `transformers` itself loads from the same file
(`from_pretrained(dir, gguf_file=...)`): the same dequantization, and llama-arch Q/K rows
put back in Hugging Face's rotary order (GGUF conversion interleaves them for llama.cpp;
its Granite files are written as llama ones are, plus Granite's four scales: `_GRANITE_SCALES`).
Gemma 3 files differ in names, norms and metadata: tandem.loader.gguf_gemma3.

Cache layout: `<cache_dir>/gguf/<stem>-<size>-<hash of the first 8 MiB>-v<FORMAT>/`. The folder
is built under a temporary name in the same directory and renamed into place, so a reader
never sees a half-written folder and two processes converting at once don't clash (the
loser of the rename throws its copy away).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from tandem.loader import gguf_gemma3
from tandem.loader.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

# Bump when the converted folder's contents change meaning; old folders are then ignored.
CONVERTED_FORMAT_VERSION = 1
_HEADER_HASH_BYTES = 8 << 20

_VOCAB_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")

# GGUF architecture -> (Hugging Face architecture, model_type).
_GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "granite": ("GraniteForCausalLM", "granite"),
}
# GGUF architectures whose Q/K rows llama.cpp's converter interleaved (`unpermute_qk_rows`).
_PERMUTED_QK = ("llama", "granite")
# Granite's config fields and the `granite.*` keys llama.cpp writes them under (its logits
# are divided by `logit_scale`, as transformers divides them by `logits_scaling`).
_GRANITE_SCALES = {
    "attention_multiplier": "attention.scale",
    "embedding_multiplier": "embedding_scale",
    "residual_multiplier": "residual_scale",
    "logits_scaling": "logit_scale",
}
# llama.cpp writes Mixtral as a "llama" file with experts.
_MIXTRAL = ("MixtralForCausalLM", "mixtral")

# Per-layer stacked expert tensors `[E, ...]` -> each expert's projection, and the router.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_EXPERT_NAMES = {
    "qwen3_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
}

# Per-layer GGUF tensor name -> Hugging Face name (after "model.layers.{i}.").
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# model_type -> its per-layer names that differ from the llama ones above. Phi-3 files keep
# q/k/v in one tensor and gate/up in one (`ffn_up`, gate rows first), as its checkpoints do.
_LAYER_TENSOR_OVERRIDES = {
    "gemma3_text": gguf_gemma3.GEMMA3_LAYER_TENSOR_NAMES,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# model_type -> the name transformers' GGUF tokenizer conversion knows the family by.
_TOKENIZER_ARCHITECTURES = {"gemma3_text": "gemma3"}
_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp writes that have no Hugging Face counterpart (`rope_freqs` carries
# llama3-style rope scaling; transformers' own GGUF loading ignores it too).
# Rope tables llama.cpp stores as tensors: Llama 3's frequencies (also in the config's rope
# scaling), Phi-3's LongRoPE factors (read into the config: `_phi3_rope`).
_SKIPPED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class GGUFConversionError(ValueError):
    """The GGUF file can't be turned into a model folder; the message says why."""


def gguf_cache_key(gguf_path: Path) -> str:
    """Name of the converted folder: file name, size and a hash of the file's first 8 MiB.

    Cheap (no full read), and the header (metadata, vocabulary, tensor table) lives there.
    """
    import xxhash

    size = gguf_path.stat().st_size
    with open(gguf_path, "rb") as f:
        head = f.read(_HEADER_HASH_BYTES)
    digest = xxhash.xxh3_64_hexdigest(head)
    stem = gguf_path.name.removesuffix(".gguf")
    return f"{stem}-{size}-{digest}-v{CONVERTED_FORMAT_VERSION}"


def converted_folder(gguf_path: str | Path, cache_dir: str | Path) -> Path:
    """Where `convert_gguf` puts (or has put) this file's folder; nothing is written."""
    gguf_path = Path(gguf_path)
    return Path(cache_dir) / "gguf" / gguf_cache_key(gguf_path)


def convert_gguf(gguf_path: str | Path, cache_dir: str | Path) -> Path:
    """The cached Hugging Face folder for `gguf_path`, converting it on first use."""
    gguf_path = Path(gguf_path).resolve()
    final = converted_folder(gguf_path, cache_dir)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{uuid.uuid4().hex[:8]}-", dir=final.parent))
    try:
        start = time.perf_counter()
        write_hf_folder(gguf_path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process won the race; its folder is complete (renames are atomic).
            if not (final / "config.json").is_file():
                raise
        logger.info("converted %s in %.1f s -> %s", gguf_path, time.perf_counter() - start, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_hf_folder(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Convert `gguf_path` into a Hugging Face folder at `out_dir` (which must exist)."""
    from safetensors.torch import save_file

    gguf = GGUFFile(gguf_path, string_arrays=_VOCAB_KEYS)
    out_dir = Path(out_dir)
    arch = gguf.architecture
    if arch not in _GGUF_ARCHITECTURES:
        raise GGUFConversionError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {sorted(_GGUF_ARCHITECTURES)})"
        )
    config = _hf_config(gguf)
    config.save_pretrained(out_dir)
    _generation_config(gguf).save_pretrained(out_dir)
    _save_tokenizer(gguf, out_dir)
    weights = _hf_weights(gguf, config.num_attention_heads, config.num_key_value_heads)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _meta(gguf: GGUFFile, key: str, default: Any = None) -> Any:
    return gguf.metadata.get(f"{gguf.architecture}.{key}", default)


def _yarn_rope(gguf: GGUFFile) -> dict[str, Any]:
    """YaRN as llama.cpp stores it: the factor, the original context, and the ramp's betas
    and attention factor where given; DeepSeek's log multiplier is refused."""
    factor, original = (
        _meta(gguf, "rope.scaling.factor"),
        _meta(gguf, "rope.scaling.original_context_length"),
    )
    if factor is None or original is None:
        raise GGUFConversionError(
            f"{gguf.path}: yarn rope scaling needs {gguf.architecture}.rope.scaling.factor and "
            ".original_context_length"
        )
    if _meta(gguf, "rope.scaling.yarn_log_multiplier"):
        raise GGUFConversionError(f"{gguf.path}: yarn's log multiplier is not supported")
    rope: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
    }
    for key, name in (
        ("rope.scaling.yarn_beta_fast", "beta_fast"),
        ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ("rope.scaling.yarn_attn_factor", "attention_factor"),
    ):
        value = _meta(gguf, key)
        if value is not None:
            rope[name] = float(value)
    return rope


def _phi3_rope(gguf: GGUFFile, rope: dict[str, Any]) -> dict[str, Any]:
    """Phi-3.5's LongRoPE as llama.cpp stores it (the short and long factors as tensors, the
    original context and the attention factor as metadata) in the config's terms; nothing
    for a file without the factors."""
    names = ("rope_factors_long.weight", "rope_factors_short.weight")
    present = [name in gguf.tensors for name in names]
    if not any(present):
        return {}
    if not all(present):
        raise GGUFConversionError(f"{gguf.path}: a Phi-3 file needs both rope factor tensors")
    original = _meta(gguf, "rope.scaling.original_context_length")
    if original is None:
        raise GGUFConversionError(
            f"{gguf.path}: metadata key {gguf.architecture}.rope.scaling.original_context_length "
            "is missing (needed with rope factors)"
        )
    long, short = (gguf.dequantize(name).reshape(-1).tolist() for name in names)
    rope.update(
        rope_type="longrope",
        long_factor=long,
        short_factor=short,
        original_max_position_embeddings=int(original),
    )
    attn_factor = _meta(gguf, "rope.scaling.attn_factor")
    if attn_factor is not None:
        rope["attention_factor"] = float(attn_factor)
    return {"original_max_position_embeddings": int(original)}


def _hf_architecture(gguf: GGUFFile) -> tuple[str, str]:
    """(Hugging Face architecture, model_type) of the file: a llama file with experts is
    Mixtral."""
    if gguf.architecture == "llama" and int(_meta(gguf, "expert_count", 0) or 0) > 0:
        return _MIXTRAL
    return _GGUF_ARCHITECTURES[gguf.architecture]


def _hf_config(gguf: GGUFFile) -> Any:
    import transformers

    arch = gguf.architecture
    hf_arch, model_type = _hf_architecture(gguf)
    md = gguf.metadata
    required = {
        "num_hidden_layers": "block_count",
        "hidden_size": "embedding_length",
        "num_attention_heads": "attention.head_count",
    }
    if model_type != "qwen3_moe":  # Qwen3-MoE files may give only the experts' size
        required["intermediate_size"] = "feed_forward_length"
    fields: dict[str, Any] = {}
    for hf_key, gguf_key in required.items():
        value = _meta(gguf, gguf_key)
        if value is None:
            raise GGUFConversionError(f"{gguf.path}: metadata key {arch}.{gguf_key} is missing")
        fields[hf_key] = int(value)
    heads = fields["num_attention_heads"]
    fields["num_key_value_heads"] = int(_meta(gguf, "attention.head_count_kv", heads))
    fields["rms_norm_eps"] = float(_meta(gguf, "attention.layer_norm_rms_epsilon", 1e-6))
    fields["max_position_embeddings"] = int(_meta(gguf, "context_length", 2048))
    vocab_size = _meta(gguf, "vocab_size")
    if vocab_size is None:
        tokens = md.get("tokenizer.ggml.tokens")
        vocab_size = (
            len(tokens) if isinstance(tokens, list) else gguf.tensors["token_embd.weight"].shape[0]
        )
    fields["vocab_size"] = int(vocab_size)
    head_dim = _meta(gguf, "attention.key_length") or fields["hidden_size"] // heads
    fields["head_dim"] = int(head_dim)

    rope: dict[str, Any] = {"rope_type": "default"}
    scaling_type = _meta(gguf, "rope.scaling.type")
    if scaling_type == "linear":
        rope = {"rope_type": "linear", "factor": float(_meta(gguf, "rope.scaling.factor"))}
    elif scaling_type == "yarn":
        rope = _yarn_rope(gguf)
    elif scaling_type not in (None, "none"):
        raise GGUFConversionError(
            f"{gguf.path}: rope scaling {scaling_type!r} is not supported (none, linear, yarn)"
        )
    rope["rope_theta"] = float(_meta(gguf, "rope.freq_base", 10000.0))
    fields["rope_parameters"] = rope

    fields["tie_word_embeddings"] = "output.weight" not in gguf.tensors
    for key in ("bos_token_id", "eos_token_id"):
        value = md.get(f"tokenizer.ggml.{key}")
        fields[key] = int(value) if value is not None else None
    if model_type in ("llama", "granite"):
        fields["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    if model_type == "granite":
        for field, key in _GRANITE_SCALES.items():
            value = _meta(gguf, key)
            if value is not None:  # else the config's default, 1.0, as llama.cpp's
                fields[field] = float(value)
        # Without the key llama.cpp scales attention by head_dim ** -0.5, where transformers'
        # Granite default would be 1.0.
        fields.setdefault("attention_multiplier", fields["head_dim"] ** -0.5)
    if model_type in _EXPERT_NAMES:
        experts, used = _meta(gguf, "expert_count"), _meta(gguf, "expert_used_count")
        if experts is None or used is None:
            raise GGUFConversionError(
                f"{gguf.path}: metadata keys {arch}.expert_count / expert_used_count are missing"
            )
        fields["num_experts_per_tok"] = int(used)
    if model_type == "mixtral":
        fields["num_local_experts"] = int(experts)
        fields["sliding_window"] = None
    elif model_type == "qwen3_moe":
        fields["num_experts"] = int(experts)
        inter = _meta(gguf, "expert_feed_forward_length")
        if inter is None:
            raise GGUFConversionError(
                f"{gguf.path}: metadata key {arch}.expert_feed_forward_length is missing"
            )
        fields["moe_intermediate_size"] = int(inter)
        fields["intermediate_size"] = int(_meta(gguf, "feed_forward_length", inter))
        fields["norm_topk_prob"] = True  # as llama.cpp runs qwen3moe
        layers = range(fields["num_hidden_layers"])
        fields["mlp_only_layers"] = [
            i for i in layers if f"blk.{i}.ffn_gate_exps.weight" not in gguf.tensors
        ]
    if model_type == "phi3":
        fields.update(_phi3_rope(gguf, rope))
        window = _meta(gguf, "attention.sliding_window")
        fields["sliding_window"] = int(window) if window else None
        rotary = _meta(gguf, "rope.dimension_count")
        if rotary is not None and int(rotary) != fields["head_dim"]:
            fields["partial_rotary_factor"] = int(rotary) / fields["head_dim"]
        fields["pad_token_id"] = md.get("tokenizer.ggml.padding_token_id")
    if model_type == "gemma3_text":
        try:
            fields.update(
                gguf_gemma3.gemma3_config_fields(
                    lambda key: _meta(gguf, key), fields, str(gguf.path)
                )
            )
        except ValueError as e:
            raise GGUFConversionError(str(e)) from None
    config_cls = transformers.CONFIG_MAPPING[model_type]
    return config_cls(architectures=[hf_arch], dtype="float32", **fields)


def _generation_config(gguf: GGUFFile) -> Any:
    from transformers import GenerationConfig

    md = gguf.metadata
    return GenerationConfig(
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=md.get("tokenizer.ggml.padding_token_id"),
    )


def _save_tokenizer(gguf: GGUFFile, out_dir: Path) -> None:
    """Build the fast tokenizer from the GGUF vocabulary, as transformers' GGUF support does.

    transformers' GGUF path names the BOS token as EOS for llama files; the special tokens
    are set here from the file's own ids instead.
    """
    md = gguf.metadata
    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise GGUFConversionError(f"{gguf.path}: the file holds no tokenizer vocabulary")
    from transformers import PreTrainedTokenizerFast

    try:  # transformers 5.2x keeps them here; earlier ones in integrations.ggml
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        try:
            from transformers.integrations.ggml import (
                GGUF_TOKENIZER_MAPPING,
                convert_gguf_tokenizer,
            )
        except ImportError:  # a transformers without these helpers
            _save_tokenizer_through_transformers(gguf, out_dir)
            return

    tokenizer_dict = {
        name: md[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in md
    }
    _, model_type = _hf_architecture(gguf)
    backend, extra = convert_gguf_tokenizer(
        _TOKENIZER_ARCHITECTURES.get(model_type, model_type), tokenizer_dict
    )
    kwargs: dict[str, Any] = {
        k: v for k, v in extra.items() if k not in ("bos_token", "eos_token", "unk_token")
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = md.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            kwargs[name] = tokens[int(token_id)]
    if "tokenizer.chat_template" in md:
        kwargs["chat_template"] = md["tokenizer.chat_template"]
    kwargs["model_max_length"] = int(_meta(gguf, "context_length", 2048))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    tokenizer.save_pretrained(out_dir)


def _save_tokenizer_through_transformers(gguf: GGUFFile, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    md = gguf.metadata
    tokens = md["tokenizer.ggml.tokens"]
    tokenizer = AutoTokenizer.from_pretrained(
        gguf.path.parent, gguf_file=gguf.path.name, local_files_only=True
    )
    eos_id = md.get("tokenizer.ggml.eos_token_id")
    if eos_id is not None:
        tokenizer.eos_token = tokens[int(eos_id)]
    tokenizer.save_pretrained(out_dir)


def layer_tensor_names(model_type: str) -> dict[str, str]:
    """Per-layer GGUF tensor name -> Hugging Face name (after "model.layers.{i}.")."""
    return {**_LAYER_TENSOR_NAMES, **_LAYER_TENSOR_OVERRIDES.get(model_type, {})}


def hf_tensor_name(gguf_name: str, model_type: str = "llama") -> str | None:
    """The Hugging Face name for a GGUF tensor name in a `model_type` file; None for tensors
    that are skipped."""
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    if gguf_name in _SKIPPED_TENSORS:
        return None
    parts = gguf_name.split(".")
    names = layer_tensor_names(model_type)
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{int(parts[1])}.{names[parts[2]]}.{parts[3]}"
    raise GGUFConversionError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart")


def unpermute_qk_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation for one projection (weight or bias).

    llama.cpp stores each head's rows as interleaved (real, imaginary) pairs; Hugging Face
    keeps the first half of the head's rotary dims, then the second half.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )


def _hf_weights(gguf: GGUFFile, num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    permute = gguf.architecture in _PERMUTED_QK
    _, model_type = _hf_architecture(gguf)
    for gguf_name in gguf.tensors:
        parts = gguf_name.split(".")
        if len(parts) == 4 and parts[2] in _EXPERT_TENSORS:
            weights.update(_expert_weights(gguf, gguf_name, model_type))
            continue
        hf_name = hf_tensor_name(gguf_name, model_type)
        if hf_name is None:
            continue
        if model_type == "mixtral":
            hf_name = hf_name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        tensor = gguf.dequantize(gguf_name)
        if permute and ".attn_q." in gguf_name:
            tensor = unpermute_qk_rows(tensor, num_heads)
        elif permute and ".attn_k." in gguf_name:
            tensor = unpermute_qk_rows(tensor, num_kv_heads)
        elif model_type == "gemma3_text" and gguf_gemma3.is_shifted_norm(gguf_name):
            tensor = tensor - gguf_gemma3.NORM_SHIFT
        weights[hf_name] = tensor
    return weights


def _expert_weights(gguf: GGUFFile, gguf_name: str, model_type: str) -> dict[str, torch.Tensor]:
    """A stacked `blk.N.ffn_{gate,up,down}_exps.weight` `[E, ...]` as each expert's tensor."""
    if model_type not in _EXPERT_NAMES:
        raise GGUFConversionError(f"{gguf.path}: expert tensor {gguf_name} in a dense model")
    _, layer, kind, _ = gguf_name.split(".")
    module, names = _EXPERT_NAMES[model_type]
    proj = names[_EXPERT_TENSORS[kind]]
    stacked = gguf.dequantize(gguf_name)
    return {
        f"model.layers.{int(layer)}.{module}.experts.{e}.{proj}.weight": stacked[e].clone()
        for e in range(stacked.shape[0])
    }

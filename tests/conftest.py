"""Shared fixtures: the converted SmolLM2 folder and tiny random Hugging Face model folders."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# The suite runs in float32 (token-for-token parity with transformers, served output against
# offline runs; bf16 results depend on batch shapes): every service and `tandem serve` a test
# starts reads its --dtype default from here, and in-process engines pass dtype="float32".
# tests/parity/test_cpu_bf16.py runs bf16 and `auto` explicitly.
os.environ["TANDEM_DTYPE"] = "float32"

# A real redis-server on a free loopback port for the directory and service tests.
pytest_plugins = ["tests.conftest_redis"]

TINY_VOCAB_SIZE = 512

# arch -> (config class name, config fields beyond the shared tiny shape)
TINY_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    # llama3 rope scaling, tied embeddings, head_dim != hidden_size // num_attention_heads.
    "llama3": (
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "head_dim": 32,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        },
    ),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": None}),
    # Sliding windows in the Llama family: Mistral's on every layer, Qwen2's from
    # max_window_layers on.
    "mistral_swa": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": 8}),
    "qwen2_swa": (
        "Qwen2Config",
        {
            "tie_word_embeddings": True,
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
        },
    ),
    # q/k norms per head, head_dim != hidden_size // num_attention_heads.
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 32}),
    # 8 experts, top 2 renormalised; layer 1 dense (mlp_only_layers).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "tie_word_embeddings": False,
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "mixtral": (
        "MixtralConfig",
        {
            "tie_word_embeddings": False,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": None,
        },
    ),
    # A sliding layer (8-token window, its own rope base) then a global one (linear rope
    # scaling); q/k norms, query_pre_attn_scalar != head_dim, final logit softcapping.
    "gemma3": (
        "Gemma3TextConfig",
        {
            "tie_word_embeddings": True,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_theta": 10000.0,
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "final_logit_softcapping": 30.0,
            "pad_token_id": 0,
        },
    ),
    # Gemma 3 as a GGUF file can say it: the score scale is head_dim's (llama.cpp derives it
    # from the shape), sliding layers rotate with llama.cpp's fixed base 10000.
    "gemma3_gguf": (
        "Gemma3TextConfig",
        {
            "tie_word_embeddings": True,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "final_logit_softcapping": 30.0,
            "pad_token_id": 0,
        },
    ),
    # Added last: an arch's seed is its position here, so the earlier ones keep theirs.
    # Phi-3 / Phi-4: q, k and v stored as one tensor, gate and up as one (loaded whole into
    # the fused layers), a sliding window on every layer.
    "phi3": ("Phi3Config", {"tie_word_embeddings": False, "sliding_window": 8, "pad_token_id": 0}),
    # Granite 3.x: embedding, attention, residual and logits scales (IBM's 8B values but the
    # attention's, chosen for the tiny head size).
    "granite": (
        "GraniteConfig",
        {
            "tie_word_embeddings": True,
            "embedding_multiplier": 12.0,
            "attention_multiplier": 0.1,
            "residual_multiplier": 0.22,
            "logits_scaling": 16.0,
        },
    ),
    # Phi-3.5's LongRoPE: a short and a long set of per-frequency factors past a 64-token
    # original context (the 1,024 positions' growth gives the default attention factor).
    "phi3_longrope": (
        "Phi3Config",
        {
            "tie_word_embeddings": False,
            "pad_token_id": 0,
            "original_max_position_embeddings": 64,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0],
                "short_factor": [1.0, 1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7],
            },
        },
    ),
    # Phi-4-mini's partial rotary (12 of 16 dims rotate) with LongRoPE, q/k/v fused.
    "phi4_partial": (
        "Phi3Config",
        {
            "tie_word_embeddings": True,
            "pad_token_id": 0,
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 64,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": [1.0, 1.5, 2.0, 4.0, 8.0, 16.0],
                "short_factor": [1.0, 1.0, 1.1, 1.2, 1.4, 1.6],
            },
        },
    ),
    # YaRN rope scaling (Qwen2.5 / Qwen3's long-context setting): a factor of 4 over a
    # 256-token original context, so the tiny head's frequencies span the ramp.
    "llama_yarn": (
        "LlamaConfig",
        {
            "tie_word_embeddings": False,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        },
    ),
}


def tandem_cache_dir() -> Path:
    """TANDEM_CACHE_DIR when set, else ~/.cache/tandem (where converted models are kept)."""
    env = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tandem"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted to a Hugging Face folder (cached)."""
    from tandem.loader import resolve_model_path

    return resolve_model_path("default", tandem_cache_dir())


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: Path) -> Any:
    from tandem.loader import load_tokenizer

    return load_tokenizer(smollm2_path)


def write_tiny_model(path: Path, arch: str, seed: int = 0) -> Path:
    """A randomly initialised tiny model of `arch` (see TINY_ARCHS) saved with save_pretrained.

    Every parameter (norm weights and biases too) is drawn from a seeded generator, so the
    same (arch, seed) gives the same folder. A byte-level tokenizer covering the whole
    vocabulary is saved beside it.
    """
    import torch
    import transformers

    config_cls_name, extra = TINY_ARCHS[arch]
    config = getattr(transformers, config_cls_name)(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            mean = 1.0 if "norm" in name else 0.0
            param.copy_(mean + 0.1 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path)
    write_tiny_tokenizer(path, TINY_VOCAB_SIZE)
    return path


def write_tiny_tokenizer(path: Path, vocab_size: int) -> None:
    """Byte-level BPE without merges: ids 0-2 special, 3-258 the bytes, then fillers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort()
    vocab_list = specials + byte_chars
    vocab_list += [f"<extra_{i}>" for i in range(vocab_size - len(vocab_list))]
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_model_path(arch)` -> folder of a tiny random model (an arch of TINY_ARCHS); built
    once per session and arch."""
    built: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[arch] = write_tiny_model(folder, arch, seed=list(TINY_ARCHS).index(arch))
        return built[arch]

    return make


def deep_schema(depth: int) -> dict[str, Any]:
    """A JSON schema nested `depth` objects deep, each level also reachable through an anyOf
    of itself and an array of itself: its grammar's size grows fast with depth (compile-limit
    tests)."""
    schema: dict[str, Any] = {"type": "string"}
    for i in range(depth):
        schema = {
            "type": "object",
            "properties": {
                f"a{i}": schema,
                "b": {"anyOf": [schema, {"type": "array", "items": schema}]},
            },
            "required": [f"a{i}"],
        }
    return schema


def build_attn_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> Any:
    """AttentionMetadata for one flattened step (CPU): request r computes the last
    `query_lens[r]` of its `seq_lens[r]` tokens, whose blocks are `block_tables[r]`."""
    import torch

    from tandem.layers.attention import AttentionMetadata

    starts = [0]
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        starts.append(starts[-1] + q_len)
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        num_actual_tokens=starts[-1],
        num_reqs=len(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(padded, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
        is_decode_only=all(q == 1 for q in query_lens),
    )

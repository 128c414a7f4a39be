"""Loading by shard: rank r's parameters equal the matching slice of the unsharded model's, for
a safetensors folder, a GGUF-converted folder (the embedded SmolLM2) and a random preset; a
rank reads only its part of each sharded tensor; pipeline stages chained equal the whole
model; clear errors for shapes the parallel layout cannot split."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tandem.layers.attention import get_attention_backend
from tandem.loader import SafetensorsSlice, build_model, iterate_weight_slices, iterate_weights
from tandem.models import IntermediateTensors, LlamaForCausalLM, ModelContext
from tandem.models.presets import random_weights
from tests.conftest import build_attn_metadata
from tests.parallel_groups import CPU, fake_parallel_state

BLOCK_SIZE = 16


def context(tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> Any:
    state = fake_parallel_state(tp_rank, tp_size, pp_rank, pp_size)
    return ModelContext(torch.float32, CPU, get_attention_backend("torch"), state)


def expected_shard(name: str, full: torch.Tensor, cfg: Any, rank: int, size: int) -> torch.Tensor:
    """Rank `rank` of `size`'s part of the unsharded model's parameter `name`, derived here
    independently of the layers: Q heads and MLP rows split, KV heads split or replicated,
    o_proj / down_proj columns split, vocabulary rows split after padding to 64 * size."""
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if ".qkv_proj." in name:
        q, k, v = full.split([heads * head, kv_heads * head, kv_heads * head])
        kv_per_rank = max(1, kv_heads // size)
        first = rank * kv_heads // size
        rows = slice(first * head, (first + kv_per_rank) * head)
        return torch.cat([q.chunk(size)[rank], k[rows], v[rows]])
    if ".gate_up_proj." in name:
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full.chunk(size, dim=1)[rank]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        vocab = cfg.vocab_size
        per = -(-vocab // (64 * size)) * 64
        padded = torch.zeros(per * size, full.shape[1])
        padded[:vocab] = full[:vocab]
        return padded[rank * per : (rank + 1) * per]
    return full


def assert_sharded_equals_slices(path: Path, size: int, ranks: list[int] | None = None) -> None:
    whole = build_model(path, context())
    full = dict(whole.named_parameters())
    cfg = whole.hf_config
    for rank in ranks if ranks is not None else range(size):
        sharded = build_model(path, context(rank, size))
        names = dict(sharded.named_parameters())
        assert set(names) == set(full)
        for name, param in names.items():
            expected = expected_shard(name, full[name].data, cfg, rank, size)
            assert param.shape == expected.shape, (name, rank)
            assert torch.equal(param.data, expected), (name, rank)
        del sharded


# phi3: fused checkpoint tensors; granite: tied, scaled
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "granite"])
def test_safetensors_loads_by_shard(arch: str, tiny_model_path) -> None:
    assert_sharded_equals_slices(tiny_model_path(arch), 2)


def test_kv_heads_replicated_past_their_count(tiny_model_path) -> None:
    """TP = 4 over 2 KV heads: ranks 0, 1 hold KV head 0; ranks 2, 3 KV head 1."""
    assert_sharded_equals_slices(tiny_model_path("llama3"), 4)


def test_gguf_converted_smollm2_loads_by_shard(smollm2_path: Path) -> None:
    """The converted GGUF folder is safetensors: it shards the same way (9 heads, 3 KV heads:
    TP = 3). Rank 2: the last KV head and vocabulary rows."""
    assert_sharded_equals_slices(smollm2_path, 3, ranks=[2])


def test_random_preset_loads_by_shard(tiny_model_path, tmp_path: Path) -> None:
    """A random-weights folder: every rank's weights are its slice of the unsharded random
    model (made full from the seed; the loaders keep their part)."""
    folder = tmp_path / "random-tiny"
    folder.mkdir()
    shutil.copy(tiny_model_path("qwen2") / "config.json", folder / "config.json")
    (folder / "RANDOM_WEIGHTS").write_text("tiny\n")
    assert_sharded_equals_slices(folder, 2)
    # ...and the unsharded random model is exactly `random_weights` (fused q/k/v).
    whole = build_model(folder, context())
    weights = dict(random_weights(whole.hf_config, torch.float32, CPU, 0))
    qkv = whole.model.layers[1].self_attn.qkv_proj.weight
    p = "model.layers.1.self_attn."
    assert torch.equal(qkv, torch.cat([weights[p + s + "_proj.weight"] for s in "qkv"]))


def test_a_rank_reads_only_its_part(tiny_model_path, monkeypatch) -> None:
    """At TP = 2 no sharded tensor is read whole: only the norms (replicated) are."""
    whole_reads: list[str] = []
    load = SafetensorsSlice.load

    def spy(self: SafetensorsSlice) -> torch.Tensor:
        whole_reads.append(self.name)
        return load(self)

    monkeypatch.setattr(SafetensorsSlice, "load", spy)
    build_model(tiny_model_path("llama"), context(1, 2))
    assert whole_reads and all(name.endswith("norm.weight") for name in whole_reads)


def test_safetensors_slice_reads_rows_and_columns(tiny_model_path) -> None:
    path = tiny_model_path("llama")
    full = dict(iterate_weights(path))
    for name, lazy in iterate_weight_slices(path):
        assert lazy.shape == full[name].shape and lazy.dtype == full[name].dtype
        assert torch.equal(lazy.load(), full[name])
        n = lazy.shape[0]
        assert torch.equal(lazy.narrow(0, n // 4, n // 2), full[name][n // 4 : n // 4 + n // 2])
        if lazy.dim() == 2:
            m = lazy.shape[1]
            assert torch.equal(lazy.narrow(1, m // 2, m // 2), full[name][:, m // 2 :])


# ---------------------------------------------------------------------------------------------
# Pipeline stages


def run_stages(models: list[Any], lens: list[int], seed: int) -> torch.Tensor:
    """One paged prefill through the stages in turn (each with its layers' KV views)."""
    tables = [[2, 0], [3, 5], [1]][: len(lens)]
    md = build_attn_metadata(lens, lens, tables, BLOCK_SIZE)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, models[0].vocab_size, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    carried: IntermediateTensors | None = None
    with torch.inference_mode():
        for i, model in enumerate(models):
            start, end = model.layer_range
            kv = torch.zeros(6, end - start, 2, BLOCK_SIZE, model.num_kv_heads, model.head_size)
            out = model(
                ids if i == 0 else None,
                positions,
                [kv[:, j] for j in range(end - start)],
                md,
                carried,
            )
            if i < len(models) - 1:
                assert isinstance(out, IntermediateTensors)
                assert set(out.tensors) == {"hidden_states", "residual"}
                carried = out
        return models[-1].compute_logits(out)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe"])  # untied; tied; MoE
def test_pipeline_stages_chained_equal_the_whole_model(arch: str, tiny_model_path) -> None:
    path = tiny_model_path(arch)
    whole = build_model(path, context())
    stages = [build_model(path, context(pp_rank=r, pp_size=2)) for r in range(2)]
    assert [s.layer_range for s in stages] == [(0, 1), (1, 2)]
    first, last = (dict(s.named_parameters()) for s in stages)
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert "model.norm.weight" not in first and "model.layers.1.mlp.down_proj.weight" not in first
    assert (
        "model.embed_tokens.weight" not in last
        and "model.layers.0.mlp.gate_up_proj.weight" not in last
    )
    # Tied: the last stage's own LM head holds the embedding.
    assert torch.equal(
        last["lm_head.weight"],
        dict(whole.named_parameters()).get("lm_head.weight", whole.model.embed_tokens.weight),
    )
    empty = stages[0].make_empty_intermediate_tensors(7)
    assert empty["hidden_states"].shape == empty["residual"].shape == (7, whole.hidden_size)
    lens = [9, 23, 1]
    assert torch.equal(run_stages(stages, lens, seed=5), run_stages([whole], lens, seed=5))


# ---------------------------------------------------------------------------------------------
# Bad input


def llama_config(**fields: Any) -> Any:
    from transformers import LlamaConfig

    shape = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "architectures": ["LlamaForCausalLM"],
    }
    return LlamaConfig(**{**shape, **fields})


def test_parallel_layouts_that_cannot_split_are_refused(smollm2_path: Path) -> None:
    from tandem.loader import load_hf_config

    smollm2 = load_hf_config(smollm2_path)
    with pytest.raises(ValueError, match=r"num_attention_heads 9 .* tensor_parallel_size 2"):
        LlamaForCausalLM(smollm2, context(0, 2))
    LlamaForCausalLM(llama_config(), context(1, 4))  # 2 KV heads replicated over 4 ranks
    with pytest.raises(ValueError, match=r"num_key_value_heads 3 and tensor_parallel_size 2"):
        LlamaForCausalLM(
            llama_config(hidden_size=96, num_attention_heads=6, num_key_value_heads=3),
            context(0, 2),
        )
    with pytest.raises(ValueError, match=r"num_key_value_heads 2 and tensor_parallel_size 3"):
        LlamaForCausalLM(llama_config(hidden_size=96, num_attention_heads=6), context(0, 3))
    with pytest.raises(ValueError, match=r"intermediate_size 130 .* tensor_parallel_size 4"):
        LlamaForCausalLM(llama_config(intermediate_size=130), context(0, 4))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 3 .* num_hidden_layers 2"):
        LlamaForCausalLM(llama_config(), context(pp_rank=0, pp_size=3))


def test_load_weights_takes_parameters_a_method_adds(tiny_model_path) -> None:
    """A quantization method's extra parameter (here a per-tensor scale registered with the
    layer's weight_loader and no shard dims) is accepted by load_weights under its name."""
    from tandem.layers.quantization import set_weight_attrs
    from tandem.loader import load_hf_config

    path = tiny_model_path("llama")
    model = LlamaForCausalLM(load_hf_config(path), context(1, 2))
    layer = model.model.layers[0].self_attn.o_proj
    scale = nn.Parameter(torch.zeros(()), requires_grad=False)
    set_weight_attrs(scale, {"weight_loader": layer.weight_loader})
    layer.register_parameter("weight_scale", scale)
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    model.load_weights([*iterate_weight_slices(path), (name, torch.tensor(0.5))])
    assert scale.item() == 0.5

"""Layers against their references: Hugging Face modules, or plain dense math."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tandem.layers.activation import silu_and_mul
from tandem.layers.attention import get_attention_backend
from tandem.layers.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from tandem.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from tandem.layers.norm import RMSNorm, fused_add_rms_norm, rms_norm
from tandem.layers.rotary import RotaryEmbedding, rope_parameters_from_config
from tandem.models.interface import ModelContext
from tests.conftest import build_attn_metadata

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_hf(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x = torch.randn(7, 48).to(dtype)
    ref = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(48))
    ours = RMSNorm(48, 1e-5, dtype, CPU)
    ours.weight.data.copy_(ref.weight.data)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
        residual = torch.randn(7, 48).to(dtype)
        normed, new_residual = ours(x, residual)
        assert torch.equal(new_residual, residual + x)
        assert torch.equal(normed, ref(residual + x))


def test_fused_add_rms_norm_functions() -> None:
    torch.manual_seed(1)
    x, residual, weight = torch.randn(5, 32), torch.randn(5, 32), torch.randn(32)
    normed, out_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    expected = (x + residual) / torch.sqrt((x + residual).pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(normed, weight * expected)
    torch.testing.assert_close(rms_norm(x + residual, weight, 1e-6), normed)
    assert torch.equal(out_residual, x + residual)


def test_silu_and_mul() -> None:
    torch.manual_seed(2)
    gate, up = torch.randn(6, 40), torch.randn(6, 40)
    out = silu_and_mul(torch.cat([gate, up], dim=-1))
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-6, atol=1e-7)


ROPE_CASES = {
    "default": {"rope_theta": 10000.0},
    "linear": {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama3": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "yarn": {
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 16.0,
            "mscale": 1.2,
            "mscale_all_dim": 0.8,
        },
    },
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rotary_matches_hf(case: str) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        **ROPE_CASES[case],
    )
    ours = RotaryEmbedding(32, 512, rope_parameters_from_config(config), CPU)
    ref = LlamaRotaryEmbedding(config)
    torch.manual_seed(3)
    positions = torch.tensor([0, 1, 2, 7, 63, 64, 65, 300, 511])
    q, k = torch.randn(len(positions), 4, 32), torch.randn(len(positions), 2, 32)
    q_out, k_out = ours(positions, q, k)
    cos, sin = ref(q, positions.unsqueeze(0))
    q_ref, k_ref = apply_rotary_pos_emb(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin
    )
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_rotary_rejects_unknown_rope_type() -> None:
    with pytest.raises(ValueError, match="dynamic"):
        RotaryEmbedding(16, 8, {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, CPU)
    with pytest.raises(ValueError, match="yarn needs original_max_position_embeddings"):
        RotaryEmbedding(16, 8, {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}, CPU)


def test_fused_linears_load_shards() -> None:
    """At one rank the fused layers hold their parts whole, in order; a wrong shape is named."""
    ctx = ModelContext.single(torch.float32, CPU, get_attention_backend("torch"))
    torch.manual_seed(4)
    qkv = QKVParallelLinear(24, 6, 4, 2, bias=True, ctx=ctx, prefix="qkv")
    parts = {s: (torch.randn(n, 24), torch.randn(n)) for s, n in (("q", 24), ("k", 12), ("v", 12))}
    for shard, (w, b) in parts.items():
        qkv.weight.weight_loader(qkv.weight, w, shard)
        qkv.bias.weight_loader(qkv.bias, b, shard)
    x = torch.randn(3, 24)
    expected = torch.cat([F.linear(x, w, b) for w, b in parts.values()], dim=-1)
    torch.testing.assert_close(qkv(x), expected)
    with pytest.raises(ValueError, match="shape"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(24, 24), "k")

    merged = MergedColumnParallelLinear(8, [5, 5], bias=False, ctx=ctx)
    gate, up = torch.randn(5, 8), torch.randn(5, 8)
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    torch.testing.assert_close(
        merged(x[:, :8]), torch.cat([x[:, :8] @ gate.T, x[:, :8] @ up.T], -1)
    )
    # A checkpoint tensor already fused loads whole.
    fused = MergedColumnParallelLinear(8, [5, 5], bias=False, ctx=ctx)
    fused.weight.weight_loader(fused.weight, torch.cat([gate, up]))
    assert torch.equal(fused.weight, merged.weight)


# ---------------------------------------------------------------------------------------------
# Torch paged attention backend


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Q, H, D] at the last Q of the S positions of k/v [S, KVH, D]; float64 math."""
    num_q, heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    group = heads // kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.double(), k) * scale
    q_pos = torch.arange(num_q).unsqueeze(1) + (seq_len - num_q)
    scores = scores.masked_fill(torch.arange(seq_len).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v).float()


class PagedScene:
    """A paged cache with shuffled block ids and each request's full-context K/V kept aside."""

    def __init__(
        self,
        seq_lens: list[int],
        heads: int,
        kv_heads: int,
        head_size: int,
        block_size: int,
        seed: int,
    ) -> None:
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        needed = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(needed) + 5
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        self.block_tables = []
        for n in needed:
            self.block_tables.append(ids[:n])
            ids = ids[n:]
        self.block_size = block_size
        # One tensor for 3 layers; the backend sees layer 1's (strided) view.
        self.full_cache = torch.randn(
            num_blocks, 3, 2, block_size, kv_heads, head_size, generator=gen
        )
        self.kv_cache = self.full_cache[:, 1]
        self.keys = [torch.randn(s, kv_heads, head_size, generator=gen) for s in seq_lens]
        self.values = [torch.randn(s, kv_heads, head_size, generator=gen) for s in seq_lens]
        self.heads, self.seq_lens = heads, seq_lens
        self.gen = gen

    def step(self, query_lens: list[int]):
        """Cache the context before each request's new tokens; return the step's inputs."""
        for r, (q_len, s_len) in enumerate(zip(query_lens, self.seq_lens, strict=True)):
            if s_len > q_len:
                prior = build_attn_metadata(
                    [s_len - q_len], [s_len - q_len], [self.block_tables[r]], self.block_size
                )
                write_kv_cache(
                    self.keys[r][: s_len - q_len],
                    self.values[r][: s_len - q_len],
                    self.kv_cache,
                    prior.slot_mapping,
                )
        md = build_attn_metadata(query_lens, self.seq_lens, self.block_tables, self.block_size)
        key = torch.cat(
            [k[s - q :] for k, s, q in zip(self.keys, self.seq_lens, query_lens, strict=True)]
        )
        value = torch.cat(
            [v[s - q :] for v, s, q in zip(self.values, self.seq_lens, query_lens, strict=True)]
        )
        head_size = key.shape[-1]
        query = torch.randn(key.shape[0], self.heads, head_size, generator=self.gen)
        return query, key, value, md

    def reference(self, query: torch.Tensor, query_lens: list[int], scale: float) -> torch.Tensor:
        outs, start = [], 0
        for r, q_len in enumerate(query_lens):
            outs.append(
                dense_reference(query[start : start + q_len], self.keys[r], self.values[r], scale)
            )
            start += q_len
        return torch.cat(outs)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_torch_backend_mixed_batch(heads: int, kv_heads: int) -> None:
    # Requests: fresh prefill, a later prefill chunk over cached context, three decodes.
    seq_lens = [13, 40, 21, 1, 33]
    query_lens = [13, 9, 1, 1, 1]
    scene = PagedScene(seq_lens, heads, kv_heads, 16, block_size=4, seed=5)
    query, key, value, md = scene.step(query_lens)
    others_before = scene.full_cache[:, [0, 2]].clone()
    scale = 16**-0.5
    out = TorchAttentionBackend().forward(query, key, value, scene.kv_cache, md, scale)
    torch.testing.assert_close(out, scene.reference(query, query_lens, scale), rtol=1e-5, atol=1e-5)
    # The step's K/V went to their slots; other layers' caches are untouched.
    blocks, offsets = md.slot_mapping // 4, md.slot_mapping % 4
    assert torch.equal(scene.kv_cache[blocks, 0, offsets], key)
    assert torch.equal(scene.kv_cache[blocks, 1, offsets], value)
    assert torch.equal(scene.full_cache[:, [0, 2]], others_before)


def test_torch_backend_decode_only_batched_equals_reference() -> None:
    seq_lens = [1, 17, 64, 5, 30, 2]
    query_lens = [1] * len(seq_lens)
    scene = PagedScene(seq_lens, 6, 3, 8, block_size=8, seed=6)
    query, key, value, md = scene.step(query_lens)
    assert md.is_decode_only
    # Entries past a request's blocks may be anything: the length mask must hide them.
    md.block_table = torch.cat([md.block_table, torch.full((6, 2), 999, dtype=torch.int32)], 1)
    scale = 0.3
    out = TorchAttentionBackend().forward(query, key, value, scene.kv_cache, md, scale)
    torch.testing.assert_close(out, scene.reference(query, query_lens, scale), rtol=1e-5, atol=1e-5)


def test_torch_backend_padding_rows_are_zero_and_not_cached() -> None:
    scene = PagedScene([6, 3], 2, 1, 8, block_size=4, seed=7)
    query, key, value, md = scene.step([6, 1])
    pad = 3
    query = torch.cat([query, torch.randn(pad, 2, 8)])
    key = torch.cat([key, torch.full((pad, 1, 8), 7.0)])
    value = torch.cat([value, torch.full((pad, 1, 8), 7.0)])
    out = TorchAttentionBackend().forward(query, key, value, scene.kv_cache, md, 0.5)
    assert torch.equal(out[-pad:], torch.zeros(pad, 2, 8))
    torch.testing.assert_close(out[:-pad], scene.reference(query[:-pad], [6, 1], 0.5))
    assert not (scene.kv_cache == 7.0).all(dim=-1).any()


def test_torch_backend_without_cache_attends_over_the_step() -> None:
    gen = torch.Generator().manual_seed(8)
    query, key, value = (torch.randn(7, h, 4, generator=gen) for h in (2, 1, 1))
    md = build_attn_metadata([3, 4], [3, 4], [[0], [0]], 4)
    out = TorchAttentionBackend().forward(query, key, value, torch.empty(0), md, 0.5)
    ref = torch.cat(
        [
            dense_reference(query[:3], key[:3], value[:3], 0.5),
            dense_reference(query[3:], key[3:], value[3:], 0.5),
        ]
    )
    torch.testing.assert_close(out, ref)


def test_torch_backend_is_registered() -> None:
    assert isinstance(get_attention_backend("torch"), TorchAttentionBackend)

"""Tensor-parallel layers over gloo in real processes equal the unsharded layer.

Every rank builds each layer twice, unsharded (one rank) and at its TP rank, loads both from
the same full tensors through their `weight_loader`s, and runs both on the same input: the
sharded layer's output (after its collective) must be the unsharded one's, or this rank's
slice of it. The tiny Llama, Qwen2 and Qwen3-MoE models then run a paged prefill at TP = 2 (and
Llama at TP = 4: its 2 KV heads replicated) and must give the one-rank logits; at TP = 2 the
MoE layer and model also run expert parallel (tests/unit/test_moe.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from tandem.layers.attention import get_attention_backend
from tandem.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from tandem.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from tandem.models.interface import ModelContext
from tests.parallel_groups import CPU, gloo_tp_state

BLOCK_SIZE = 16


def contexts(rank: int, world: int, store: Path) -> tuple[ModelContext, ModelContext]:
    backend = get_attention_backend("torch")
    sharded = ModelContext(torch.float32, CPU, backend, gloo_tp_state(rank, world, store))
    return ModelContext.single(torch.float32, CPU, backend), sharded


def load(layer: torch.nn.Module, tensors: dict[str, list[tuple[torch.Tensor, object]]]) -> None:
    """`tensors`: parameter name -> [(full checkpoint tensor, shard id)]."""
    for name, parts in tensors.items():
        param = getattr(layer, name)
        for tensor, shard_id in parts:
            if shard_id is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)


def check_linear_layers(rank: int, world: int, one: ModelContext, tp: ModelContext) -> None:
    gen = torch.Generator().manual_seed(7)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    x = randn(5, 32)

    # Replicated and column parallel, with and without the gather.
    w, b = randn(48, 32), randn(48)
    ref = F.linear(x, w, b)
    rep = ReplicatedLinear(32, 48, True, tp)
    load(rep, {"weight": [(w, None)], "bias": [(b, None)]})
    torch.testing.assert_close(rep(x), ref)
    for gather in (True, False):
        col = ColumnParallelLinear(32, 48, True, tp, gather_output=gather)
        load(col, {"weight": [(w, None)], "bias": [(b, None)]})
        assert col.weight.shape == (48 // world, 32)
        expected = ref if gather else ref.chunk(world, dim=-1)[rank]
        torch.testing.assert_close(col(x), expected)

    # Merged gate/up: this rank's rows of each part, fused.
    gate, up = randn(40, 32), randn(40, 32)
    merged = MergedColumnParallelLinear(32, [40, 40], False, tp)
    load(merged, {"weight": [(gate, 0), (up, 1)]})
    expected = torch.cat(
        [F.linear(x, gate).chunk(world, -1)[rank], F.linear(x, up).chunk(world, -1)[rank]], -1
    )
    torch.testing.assert_close(merged(x), expected)

    # Row parallel: partial products summed by the all-reduce; bias added once.
    w, b = randn(24, 64), randn(24)
    ref = F.linear(torch.cat([x, x], -1), w, b)
    full_in = torch.cat([x, x], -1)
    for input_is_parallel in (True, False):
        row = RowParallelLinear(64, 24, True, tp, input_is_parallel=input_is_parallel)
        load(row, {"weight": [(w, None)], "bias": [(b, None)]})
        assert row.weight.shape == (24, 64 // world)
        inp = full_in.chunk(world, -1)[rank] if input_is_parallel else full_in
        torch.testing.assert_close(row(inp), ref, rtol=1e-5, atol=1e-5)

    check_qkv(rank, world, one, tp, gen, num_heads=4, num_kv_heads=2)


def check_qkv(
    rank: int,
    world: int,
    one: ModelContext,
    tp: ModelContext,
    gen: torch.Generator,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """QKV: this rank's query heads and its KV heads (replicated past `num_kv_heads` ranks:
    rank r holds KV head r * num_kv_heads // world), against the unsharded layer."""
    head, hidden = 8, 32
    parts = {
        "q": torch.randn(num_heads * head, hidden, generator=gen),
        "k": torch.randn(num_kv_heads * head, hidden, generator=gen),
        "v": torch.randn(num_kv_heads * head, hidden, generator=gen),
    }
    biases = {s: torch.randn(t.shape[0], generator=gen) for s, t in parts.items()}
    full = QKVParallelLinear(hidden, head, num_heads, num_kv_heads, True, one)
    sharded = QKVParallelLinear(hidden, head, num_heads, num_kv_heads, True, tp)
    for layer in (full, sharded):
        load(layer, {"weight": [(t, s) for s, t in parts.items()]})
        load(layer, {"bias": [(t, s) for s, t in biases.items()]})
    kv_per_rank = max(1, num_kv_heads // world)
    assert sharded.num_heads == num_heads // world and sharded.num_kv_heads == kv_per_rank
    assert sharded.num_kv_head_replicas == max(1, world // num_kv_heads)
    x = torch.randn(6, hidden, generator=gen)
    q, k, v = full(x).split([num_heads * head, num_kv_heads * head, num_kv_heads * head], -1)
    kv_head = rank * num_kv_heads // world
    kv_cols = slice(kv_head * head, (kv_head + kv_per_rank) * head)
    expected = torch.cat([q.chunk(world, -1)[rank], k[:, kv_cols], v[:, kv_cols]], -1)
    torch.testing.assert_close(sharded(x), expected)
    # The fused checkpoint tensor (shard_id None) loads the same shard.
    fused = QKVParallelLinear(hidden, head, num_heads, num_kv_heads, False, tp)
    load(fused, {"weight": [(torch.cat(list(parts.values())), None)]})
    assert torch.equal(fused.weight, sharded.weight)


def check_vocab_layers(rank: int, world: int, one: ModelContext, tp: ModelContext) -> None:
    gen = torch.Generator().manual_seed(8)
    vocab, hidden = 500, 32  # padded to 512 at TP = 2 (and 1): the last rank has padding
    table = torch.randn(vocab, hidden, generator=gen)
    emb_full = VocabParallelEmbedding(vocab, hidden, one)
    emb = VocabParallelEmbedding(vocab, hidden, tp)
    load(emb_full, {"weight": [(table, None)]})
    load(emb, {"weight": [(table, None)]})
    assert emb.weight.shape[0] == emb.num_embeddings_padded // world
    ids = torch.tensor([0, 1, 255, 256, 257, 400, 499, 3, 499])
    assert torch.equal(emb(ids), F.embedding(ids, table))
    assert torch.equal(emb_full(ids), F.embedding(ids, table))

    head = ParallelLMHead(vocab, hidden, tp)
    load(head, {"weight": [(table, None)]})
    h = torch.randn(7, hidden, generator=gen)
    logits = head.compute_logits(h)
    assert logits.dtype == torch.float32 and logits.shape == (7, vocab)
    torch.testing.assert_close(logits, F.linear(h, table))
    tied = ParallelLMHead(vocab, hidden, tp)
    tied.tie_weights(emb)
    assert tied.weight is emb.weight
    torch.testing.assert_close(tied.compute_logits(h), logits, rtol=0, atol=0)


def check_models(world: int, tp: ModelContext, one: ModelContext, paths: dict[str, Path]) -> None:
    from tandem.loader import build_model
    from tests.conftest import build_attn_metadata

    for arch, path in paths.items():
        full, sharded = build_model(path, one), build_model(path, tp)
        assert sharded.num_heads == 4 // world and sharded.num_kv_heads == max(1, 2 // world)
        lens = [9, 23, 1]
        tables = [[2, 0], [3, 5], [1]]
        md = build_attn_metadata(lens, lens, tables, BLOCK_SIZE)
        gen = torch.Generator().manual_seed(9)
        ids = torch.randint(3, full.vocab_size, (sum(lens),), generator=gen)
        positions = torch.cat([torch.arange(n) for n in lens])
        logits = []
        for model in (full, sharded):
            kv = torch.zeros(6, 2, 2, BLOCK_SIZE, model.num_kv_heads, model.head_size)
            with torch.inference_mode():
                hidden = model(ids, positions, [kv[:, i] for i in range(2)], md)
                logits.append(model.compute_logits(hidden))
        assert logits[1].shape == (sum(lens), full.vocab_size)
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4, msg=arch)


def run_rank(rank: int, world: int, store: Path, paths: dict[str, Path], layers: bool) -> None:
    torch.set_num_threads(1)
    one, tp = contexts(rank, world, store)
    if layers:
        check_linear_layers(rank, world, one, tp)
        check_vocab_layers(rank, world, one, tp)
        from tests.unit.test_moe import check_expert_parallel

        check_expert_parallel(rank, world, tp, paths["qwen3_moe"])
    else:  # TP = 4: the QKV layer's replicated KV heads
        check_qkv(rank, world, one, tp, torch.Generator().manual_seed(10), 4, 2)
    check_models(world, tp, one, paths)
    # Leave together: a rank that exits with gloo's threads still running can abort
    # ("terminate called without an active exception"; seen once in CI at TP = 4).
    import torch.distributed as dist

    from tandem.distributed.init import destroy_parallel_state

    dist.barrier()
    destroy_parallel_state()


def spawn(world: int, tmp_path: Path, paths: dict[str, Path], layers: bool) -> None:
    mp.spawn(run_rank, args=(world, tmp_path / "store", paths, layers), nprocs=world, join=True)


@pytest.fixture(autouse=True)
def _nccl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")


def test_parallel_layers_and_models_at_tp2_equal_one_rank(tiny_model_path, tmp_path) -> None:
    # Qwen3-MoE: its experts split over TP here, spread whole by expert parallel (test_moe).
    paths = {arch: tiny_model_path(arch) for arch in ("llama", "qwen2", "qwen3_moe")}
    spawn(2, tmp_path, paths, layers=True)


def test_qkv_replicates_kv_heads_at_tp4(tiny_model_path, tmp_path) -> None:
    spawn(4, tmp_path, {"llama": tiny_model_path("llama")}, layers=False)

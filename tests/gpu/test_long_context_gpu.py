"""The Triton attention kernels at 32k-token contexts, at the 8B attention shape (32 query heads,
8 KV heads, head 128, 16-token blocks), on a cache past 2^31 elements whose requests sit in its
top blocks (so every K/V address needs int64 offsets):

- decode: split-K with the split count a 32k and a 128k `max_seq_len` give (a runner captures
  its decode graphs with max_model_len), eager and replayed from a CUDA graph with new lengths;
- prefill: the last 1k-token chunk of a 32k prompt beside decodes (a mixed step), and a fresh
  32k prompt.

References are fp32 torch; outputs are compared relative to the reference's own scale (at 32k
keys attention outputs are small, so a fixed atol would pass anything). Run:
`python -m pytest -q -m gpu tests/gpu/test_long_context_gpu.py`.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tandem_kernels.paged_attention import (  # noqa: E402
    MAX_NUM_SPLITS,
    decode_num_splits,
    paged_attention_ref,
    paged_decode_attention,
    paged_prefill_attention,
)

DEV = torch.device("cuda")
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_LAYERS = 32, 8, 128, 16, 2
# Blocks of the whole cache: NUM_BLOCKS * NUM_LAYERS * 2 * 16 * 8 * 128 > 2^31 elements.
NUM_BLOCKS = 36_000
SCALE = HEAD_SIZE**-0.5
DTYPE = torch.bfloat16
REL_TOL = 2e-2


@pytest.fixture(scope="module")
def cache() -> torch.Tensor:
    """Layer 1 of a `[NUM_BLOCKS, NUM_LAYERS, 2, bs, Hkv, D]` bf16 cache (about 4.7 GB)."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    full = torch.empty(
        NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE, device=DEV
    )
    full.normal_(generator=gen)
    assert full.numel() > 2**31
    return full[:, 1]


def _top_block_table(seq_lens: list[int], gen: torch.Generator) -> torch.Tensor:
    """Distinct blocks from the top of the cache, shuffled."""
    per_req = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    top = torch.arange(NUM_BLOCKS - sum(per_req), NUM_BLOCKS)
    top = top[torch.randperm(top.numel(), generator=gen)]
    table = torch.zeros(len(seq_lens), max(per_req), dtype=torch.int32)
    used = 0
    for r, n in enumerate(per_req):
        table[r, :n] = top[used : used + n]
        used += n
    return table.to(DEV)


def _assert_close_rel(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Per query row: error norm within REL_TOL of the reference's norm."""
    out, ref = out.float(), ref.float()
    err = (out - ref).flatten(1).norm(dim=1)
    scale = ref.flatten(1).norm(dim=1)
    assert bool((scale > 0).all())
    worst = float((err / scale).max())
    assert worst < REL_TOL, worst


def _ref_chunked(
    query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, chunk: int
) -> torch.Tensor:
    """fp32 causal attention of one request's last `query.shape[0]` positions, chunk by chunk
    of query rows (a 32k x 32k score matrix per head does not fit)."""
    q_len = query.shape[0]
    pos = torch.arange(seq_len, device=DEV)
    blocks = block_table[0, pos // BLOCK_SIZE].long()
    offs = pos % BLOCK_SIZE
    group = NUM_HEADS // NUM_KV_HEADS
    k = cache[blocks, 0, offs].float().repeat_interleave(group, dim=1)
    v = cache[blocks, 1, offs].float().repeat_interleave(group, dim=1)
    out = torch.empty(q_len, NUM_HEADS, HEAD_SIZE, device=DEV)
    for lo in range(0, q_len, chunk):
        hi = min(lo + chunk, q_len)
        q_pos = torch.arange(seq_len - q_len + lo, seq_len - q_len + hi, device=DEV)
        scores = torch.einsum("qhd,khd->hqk", query[lo:hi].float(), k) * SCALE
        scores.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def test_decode_at_32k_with_the_splits_of_32k_and_128k(cache: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(1)
    seq_lens = [32768, 30001, 4097, 17, 1]
    block_table = _top_block_table(seq_lens, gen)
    assert int(block_table.max()) * cache.stride(0) > 2**31
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    # Peaked attention (logits of std ~3), so the output is not a near-zero average.
    query = 3 * torch.randn(len(seq_lens), NUM_HEADS, HEAD_SIZE, generator=gen).to(DEV, DTYPE)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEV)
    ref = paged_attention_ref(query.float(), cache, qsl, lens, block_table, SCALE)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    splits = {
        msl: decode_num_splits(len(seq_lens), NUM_KV_HEADS, msl, sms) for msl in (32768, 131072)
    }
    assert all(1 < s <= MAX_NUM_SPLITS for s in splits.values()), splits
    for msl in splits:
        out = paged_decode_attention(query, cache, lens, block_table, SCALE, max_seq_len=msl)
        _assert_close_rel(out, ref)
    for n in (1, MAX_NUM_SPLITS):
        out = paged_decode_attention(
            query, cache, lens, block_table, SCALE, max_seq_len=32768, num_splits=n
        )
        _assert_close_rel(out, ref)


def test_decode_graph_captured_for_128k_replays_at_32k(cache: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(2)
    batch = 4
    block_table = _top_block_table([32768] * batch, gen)
    lens = torch.full((batch,), 8, dtype=torch.int32, device=DEV)
    query = 3 * torch.randn(batch, NUM_HEADS, HEAD_SIZE, generator=gen).to(DEV, DTYPE)
    out = torch.empty_like(query)

    def run() -> None:
        paged_decode_attention(query, cache, lens, block_table, SCALE, max_seq_len=131072, out=out)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    new_lens = [32768, 32767, 20000, 1]
    lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    _assert_close_rel(out, paged_attention_ref(query.float(), cache, qsl, lens, block_table, SCALE))


def test_prefill_last_chunk_of_32k_beside_decodes(cache: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(3)
    chunk = 1024
    seq_lens = [32768, 31000, 900]
    query_lens = [chunk, 1, 1]
    block_table = _top_block_table(seq_lens, gen)
    starts = [0, chunk, chunk + 1, chunk + 2]
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    query = 3 * torch.randn(sum(query_lens), NUM_HEADS, HEAD_SIZE, generator=gen).to(DEV, DTYPE)
    out = paged_prefill_attention(query, cache, qsl, lens, block_table, SCALE)
    _assert_close_rel(out, paged_attention_ref(query.float(), cache, qsl, lens, block_table, SCALE))


def test_prefill_fresh_32k_prompt(cache: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(4)
    seq_len = 32768
    block_table = _top_block_table([seq_len], gen)
    qsl = torch.tensor([0, seq_len], dtype=torch.int32, device=DEV)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=DEV)
    query = 3 * torch.randn(seq_len, NUM_HEADS, HEAD_SIZE, generator=gen).to(DEV, DTYPE)
    out = paged_prefill_attention(query, cache, qsl, lens, block_table, SCALE)
    _assert_close_rel(out, _ref_chunked(query, cache, block_table, seq_len, chunk=2048))

"""The Triton kernels against their torch references on a CUDA device, at Llama-3.1-8B sizes
(32 query heads, 8 KV heads, head 128, block 16, contexts up to 4k, batches up to 256), in
bf16 and fp16. Also: the decode path captured in a CUDA graph and replayed with new lengths,
and a timing of decode and prefill against torch (printed; run with -s to see it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import triton.testing  # noqa: E402

from tandem.layers.attention.backend import AttentionMetadata  # noqa: E402
from tandem.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tandem_kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from tandem_kernels.paged_attention import (  # noqa: E402
    decode_num_splits,
    paged_attention_ref,
    paged_decode_attention,
    paged_prefill_attention,
)
from tandem_kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref  # noqa: E402
from tandem_kernels.rms_norm import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from tandem_kernels.rotary import rotary_embedding, rotary_embedding_ref  # noqa: E402

DEV = torch.device("cuda")
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_LAYERS = 32, 8, 128, 16, 2
DTYPES = [torch.bfloat16, torch.float16]
SCALE = HEAD_SIZE**-0.5


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return (
        {"atol": 1.5e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 3e-3, "rtol": 5e-3}
    )


def _cache(num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """Layer 1 of a `[num_blocks, NUM_LAYERS, 2, bs, Hkv, D]` cache (a strided view)."""
    full = torch.randn(
        num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype, device=DEV
    )
    return full[:, 1]


def _block_table(seq_lens: list[int], num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    per_req = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    assert sum(per_req) <= num_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(per_req), dtype=torch.int32)
    used = 0
    for r, n in enumerate(per_req):
        table[r, :n] = perm[used : used + n]
        used += n
    return table.to(DEV)


def _qsl(query_lens: list[int]) -> torch.Tensor:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    cache = _cache(1024, dtype)
    expected = cache.clone()
    num_tokens = 4096
    slots = torch.randperm(1024 * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[::97] = -1
    slots = slots.to(DEV)
    kv = torch.randn(num_tokens, 2, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype, device=DEV)
    reshape_and_cache(kv[:, 0], kv[:, 1], cache, slots)
    reshape_and_cache_ref(kv[:, 0], kv[:, 1], expected, slots)
    torch.cuda.synchronize()
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_mixed_batch(dtype: torch.dtype) -> None:
    """A fresh 4k prompt, a chunk after a 2k prefix, a short chunk, and 8 decodes."""
    gen = torch.Generator().manual_seed(1)
    decode_lens = torch.randint(1, 4096, (8,), generator=gen).tolist()
    seq_lens = [4096, 3000, 1500, *decode_lens]
    query_lens = [4096, 1000, 512, *([1] * 8)]
    cache = _cache(2048, dtype)
    block_table = _block_table(seq_lens, 2048, gen)
    qsl = _qsl(query_lens)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_SIZE, dtype=dtype, device=DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    out = paged_prefill_attention(query, cache, qsl, lens, block_table, SCALE)
    ref = paged_attention_ref(query, cache, qsl, lens, block_table, SCALE)
    torch.testing.assert_close(out, ref, **_tol(dtype))


def _decode_case(
    seq_lens: list[int], dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One query row per request over shuffled blocks: (query, cache, seq_lens, block_table,
    the torch reference's output)."""
    batch = len(seq_lens)
    num_blocks = sum(math.ceil(n / BLOCK_SIZE) for n in seq_lens) + 8
    cache = _cache(num_blocks, dtype)
    block_table = _block_table(seq_lens, num_blocks, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    query = torch.randn(batch, NUM_HEADS, HEAD_SIZE, dtype=dtype, device=DEV)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    ref = paged_attention_ref(query, cache, qsl, lens, block_table, SCALE)
    return query, cache, lens, block_table, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
def test_decode(dtype: torch.dtype, batch: int) -> None:
    gen = torch.Generator().manual_seed(2 + batch)
    seq_lens = [4096] if batch == 1 else torch.randint(1, 4097, (batch,), generator=gen).tolist()
    query, cache, lens, block_table, ref = _decode_case(seq_lens, dtype, gen)
    auto = paged_decode_attention(query, cache, lens, block_table, SCALE, max_seq_len=4096)
    torch.testing.assert_close(auto, ref, **_tol(dtype))
    for splits in (1, 5):
        out = paged_decode_attention(
            query, cache, lens, block_table, SCALE, max_seq_len=4096, num_splits=splits
        )
        torch.testing.assert_close(out, ref, **_tol(dtype))


def test_decode_every_tuning_candidate_and_the_tuned_config() -> None:
    """Each config the start-up tuner may pick gives the reference's result; after tuning,
    calls without knobs use the winner and still agree."""
    from tandem_kernels import paged_attention as pa

    dtype, batch = torch.bfloat16, 48
    gen = torch.Generator().manual_seed(11)
    seq_lens = torch.randint(1, 3000, (batch,), generator=gen).tolist()
    query, cache, lens, block_table, ref = _decode_case(seq_lens, dtype, gen)
    for block_n, warps, stages, heads_first, cap in pa._DECODE_CANDIDATES:
        for splits in (1, 4):
            out = paged_decode_attention(
                query, cache, lens, block_table, SCALE, max_seq_len=3000, num_splits=splits,
                block_n=block_n, num_warps=warps, num_stages=stages, heads_first=heads_first,
                max_registers=cap,
            )  # fmt: skip
            torch.testing.assert_close(out, ref, **_tol(dtype))
    saved = dict(pa._decode_configs)
    try:
        pa._decode_configs.clear()
        best = pa.tune_decode_attention(cache, NUM_HEADS, num_reqs=64, seq_len=512)
        assert best in pa._DECODE_CANDIDATES
        assert pa.decode_tuning_log[-1]["best"] == pa._config_name(best)
        # Once per process: a second call keeps the first pick and times nothing.
        entries = len(pa.decode_tuning_log)
        assert pa.tune_decode_attention(cache, NUM_HEADS, num_reqs=8, seq_len=64) == best
        assert len(pa.decode_tuning_log) == entries
        out = paged_decode_attention(query, cache, lens, block_table, SCALE, max_seq_len=3000)
        torch.testing.assert_close(out, ref, **_tol(dtype))
    finally:
        pa._decode_configs.clear()
        pa._decode_configs.update(saved)


def _captured_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The Triton backend's forward over these buffers captured in a CUDA graph (run once on
    a side stream first, so its kernels compile outside the capture), and its output."""
    backend = TritonAttentionBackend()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(query, key, value, cache, meta, SCALE)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(query, key, value, cache, meta, SCALE)
    return graph, out


def test_decode_cuda_graph_replay() -> None:
    """Capture the backend's decode step once (splits fixed by max_seq_len=4096), then replay
    with other lengths, block tables and slots written into the same buffers. Batch 8: from
    13 requests on, the 8B's shape takes one split (`decode_num_splits`)."""
    dtype, batch, max_blocks = torch.bfloat16, 8, 4096 // BLOCK_SIZE
    gen = torch.Generator().manual_seed(3)
    num_blocks = batch * max_blocks
    cache = _cache(num_blocks, dtype)
    query = torch.zeros(batch, NUM_HEADS, HEAD_SIZE, dtype=dtype, device=DEV)
    key = torch.zeros(batch, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype, device=DEV)
    value = torch.zeros_like(key)
    seq_lens = torch.ones(batch, dtype=torch.int32, device=DEV)
    block_table = torch.zeros(batch, max_blocks, dtype=torch.int32, device=DEV)
    slot_mapping = torch.full((batch,), -1, dtype=torch.int64, device=DEV)
    meta = AttentionMetadata(
        num_actual_tokens=batch,
        num_reqs=batch,
        max_query_len=1,
        max_seq_len=4096,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEV),
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=list(range(batch + 1)),
        seq_lens_cpu=[1] * batch,
        is_decode_only=True,
    )
    assert decode_num_splits(batch, NUM_KV_HEADS, 4096, 132) > 1
    graph, out = _captured_forward(query, key, value, cache, meta)

    for trial in range(2):
        lens = torch.randint(1, 4097, (batch,), generator=gen).tolist()
        table = _block_table(lens, num_blocks, gen)
        block_table.zero_()
        block_table[:, : table.shape[1]] = table
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        last = torch.tensor(lens) - 1
        slots = table.cpu()[torch.arange(batch), last // BLOCK_SIZE].long() * BLOCK_SIZE
        slot_mapping.copy_(slots + last % BLOCK_SIZE)
        query.normal_()
        key.normal_()
        value.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_ref(query, cache, meta.query_start_loc, seq_lens, block_table, SCALE)
        torch.testing.assert_close(out, ref, **_tol(dtype), msg=f"replay {trial}")
        got = cache[block_table[0, (lens[0] - 1) // BLOCK_SIZE], 0, (lens[0] - 1) % BLOCK_SIZE]
        assert torch.equal(got, key[0])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_merge_in_the_last_program(cache_dtype: torch.dtype, batch: int) -> None:
    """The split partitions merged by the last program of each (request, KV head) against the
    second merge kernel and the reference, eager and from a CUDA graph replayed many times
    with new lengths (a partial read before it is visible would show as a wrong row), the
    lock buffer all zeros after every call."""
    from tandem_kernels import paged_attention as pa

    gen = torch.Generator().manual_seed(17 + batch)
    max_len, max_blocks = 8192, 8192 // BLOCK_SIZE
    num_blocks = batch * max_blocks
    cache = _cache(num_blocks, torch.bfloat16)
    if cache_dtype != torch.bfloat16:
        cache = cache.to(cache_dtype)
    scales = {"k_scale": 0.5, "v_scale": 0.25} if cache_dtype != torch.bfloat16 else {}
    query = torch.randn(batch, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=DEV)
    seq_lens = torch.ones(batch, dtype=torch.int32, device=DEV)
    block_table = torch.zeros(batch, max_blocks, dtype=torch.int32, device=DEV)

    def set_lengths(lens: list[int]) -> None:
        table = _block_table(lens, num_blocks, gen)
        block_table.zero_()
        block_table[:, : table.shape[1]] = table
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))

    def ref() -> torch.Tensor:
        dequant = cache.to(torch.float32)
        if scales:
            dequant[:, 0] *= scales["k_scale"]
            dequant[:, 1] *= scales["v_scale"]
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        expected = paged_attention_ref(query.float(), dequant, qsl, seq_lens, block_table, SCALE)
        return expected.to(query.dtype)

    def run(merge_last: bool, splits: int) -> torch.Tensor:
        return paged_decode_attention(
            query, cache, seq_lens, block_table, SCALE, max_seq_len=max_len,
            num_splits=splits, merge_last=merge_last, **scales,
        )  # fmt: skip

    set_lengths(torch.randint(1, max_len + 1, (batch,), generator=gen).tolist())
    for splits in (2, 33, pa.MAX_NUM_SPLITS):
        merged, second = run(True, splits), run(False, splits)
        torch.testing.assert_close(merged, second, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(merged, ref(), **_tol(torch.bfloat16))
    locks = pa._merge_lock_buffers[query.device][-1]
    splits = decode_num_splits(batch, NUM_KV_HEADS, max_len, 132)
    assert splits > 1
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(True, splits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(True, splits)
    for trial in range(24):
        set_lengths(torch.randint(1, max_len + 1, (batch,), generator=gen).tolist())
        query.normal_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, ref(), **_tol(torch.bfloat16), msg=f"replay {trial}")
        assert not locks.any(), f"replay {trial} left a lock counted"


@pytest.mark.parametrize("cascade", [False, True])
def test_whole_step_graph_zeroes_its_padding_rows(cascade: bool) -> None:
    """A mixed step captured at a bucket of 64 rows (`graph_padded` metadata, as
    tandem.worker.mixed_graph captures) and replayed with fewer real rows: the rows past
    `query_start_loc[num_reqs]` come out zero although the graph's output memory held NaN
    before the replay (a per-tensor FP8 scale over every row would take it), and the real
    rows are attention over the requests, on both prefill paths."""
    dtype, bucket, slots_per_req = torch.bfloat16, 64, 4
    gen = torch.Generator().manual_seed(5)
    max_blocks = 256 // BLOCK_SIZE
    cache = _cache(slots_per_req * max_blocks, dtype)
    query = torch.zeros(bucket, NUM_HEADS, HEAD_SIZE, dtype=dtype, device=DEV)
    key = torch.zeros(bucket, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype, device=DEV)
    value = torch.zeros_like(key)
    qsl = torch.full((slots_per_req + 1,), bucket, dtype=torch.int32, device=DEV)
    qsl[0] = 0
    seq_lens = torch.zeros(slots_per_req, dtype=torch.int32, device=DEV)
    seq_lens[0] = bucket
    block_table = torch.arange(slots_per_req * max_blocks, dtype=torch.int32, device=DEV).reshape(
        slots_per_req, max_blocks
    )
    slot_mapping = torch.full((bucket,), -1, dtype=torch.int64, device=DEV)
    meta = AttentionMetadata(
        num_actual_tokens=bucket,
        num_reqs=slots_per_req,
        max_query_len=bucket,
        max_seq_len=256,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=[],
        seq_lens_cpu=[],
        graph_padded=True,
        prefill_path="triton" if cascade else "paged",
    )
    graph, out = _captured_forward(query, key, value, cache, meta)

    for lens in ([20, 9], [37], [bucket]):
        n = sum(lens)
        starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
        qsl.fill_(n)
        qsl[: len(starts)] = torch.tensor(starts, dtype=torch.int32)
        seq_lens.zero_()
        seq_lens[: len(lens)] = torch.tensor(lens, dtype=torch.int32)
        slot_mapping.fill_(-1)
        for r, (a, length) in enumerate(zip(starts, lens, strict=False)):
            base = int(block_table[r, 0]) * BLOCK_SIZE
            slot_mapping[a : a + length] = torch.arange(base, base + length, device=DEV)
        for t in (query, key, value):
            t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out[n:].any() and not out[n:].isnan().any(), (lens, "padding rows")
        ref = paged_attention_ref(
            query[:n], cache, qsl[: len(lens) + 1], seq_lens[: len(lens)],
            block_table[: len(lens)], SCALE,
        )  # fmt: skip
        torch.testing.assert_close(out[:n], ref, **_tol(dtype), msg=f"real rows {lens}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype: torch.dtype) -> None:
    x = torch.randn(2048, 4096, dtype=dtype, device=DEV)
    residual = torch.randn_like(x)
    weight = (1 + 0.1 * torch.randn(4096, device=DEV)).to(dtype)
    tol = {"atol": 2e-2, "rtol": 1e-2}  # one rounding step of the 16-bit output
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), **tol)
    out, new_res = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_res = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(dtype: torch.dtype) -> None:
    num_tokens = 2048
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_SIZE, 2, device=DEV).float() / HEAD_SIZE))
    freqs = torch.outer(torch.arange(8192, device=DEV).float(), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, 8192, (num_tokens,), device=DEV)
    qkv = torch.randn(num_tokens, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_SIZE, dtype=dtype, device=DEV)
    q, k = qkv[:, :NUM_HEADS], qkv[:, NUM_HEADS : NUM_HEADS + NUM_KV_HEADS]
    ref_q, ref_k = rotary_embedding_ref(positions, q, k, cos, sin)
    rotary_embedding(positions, q, k, cos, sin, inplace=True)
    tol = {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(q, ref_q, **tol)
    torch.testing.assert_close(k, ref_k, **tol)


def _rotary_tables(max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_SIZE, 2, device=DEV).float() / HEAD_SIZE))
    freqs = torch.outer(torch.arange(max_pos, device=DEV).float(), inv_freq)
    return freqs.cos(), freqs.sin()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` comparable with `torch.equal` (FP8 as its bytes)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("use_pdl", [False, True])
def test_rotary_and_cache_matches_the_two_kernels(cache_dtype: torch.dtype, use_pdl: bool) -> None:
    """`rotary_and_cache` (bf16, the 8B shape) against `rotary_embedding`, then
    `reshape_and_cache` of the rotated key, bit for bit: query, key, value and the cache (a
    layer's strided view, bf16 or FP8 with scales). Eager over 2048 rows of a strided
    projection (the last 100 past the slots, every 97th slot negative), then captured in a
    CUDA graph at batch 8 and replayed with new rows, positions and slots; PDL off and on."""
    from tandem.layers.attention.backend import split_qkv
    from tandem_kernels import pdl
    from tandem_kernels.rotary_and_cache import rotary_and_cache

    if use_pdl and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability >= 9.0")
    dtype, num_blocks, max_pos = torch.bfloat16, 512, 8192
    heads = (NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE)
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE
    scales = (0.05, 0.02) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    cos, sin = _rotary_tables(max_pos)
    gen = torch.Generator(device=DEV).manual_seed(21)
    shape = (num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    fused_full = torch.randn(shape, device=DEV, generator=gen).to(cache_dtype)
    two_full = fused_full.clone()
    fused_cache, two_cache = fused_full[:, 1], two_full[:, 1]

    def two_kernels(positions: torch.Tensor, qkv: torch.Tensor, slots: torch.Tensor) -> tuple:
        q, k, v = split_qkv(qkv, *heads)
        q, k = rotary_embedding(positions, q, k, cos, sin, inplace=False)
        reshape_and_cache(k, v, two_cache, slots, *scales)
        return q, k, v

    def inputs(num_tokens: int, num_slots: int) -> tuple[torch.Tensor, ...]:
        positions = torch.randint(0, max_pos, (num_tokens,), device=DEV, generator=gen)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEV, generator=gen)[:num_slots]
        slots[::97] = -1
        qkv = torch.randn(num_tokens, width, device=DEV, generator=gen).to(dtype)
        return positions, qkv, slots

    def check(got: tuple, want: tuple, what: str) -> None:
        torch.cuda.synchronize()
        for name, a, b in zip(("query", "key", "value"), got, want, strict=True):
            assert torch.equal(a, b), (what, name)
        assert torch.equal(_bits(fused_cache), _bits(two_cache)), (what, "cache")

    pdl.enable_pdl(use_pdl)
    try:
        positions, qkv, slots = inputs(2048, 1948)
        wide = torch.empty(2048, width + 64, dtype=dtype, device=DEV)
        wide[:, 32 : 32 + width] = qkv
        qkv = wide[:, 32 : 32 + width]  # a strided view
        got = rotary_and_cache(positions, qkv, cos, sin, fused_cache, slots, *heads, *scales)
        check(got, two_kernels(positions, qkv, slots), "eager")
        static = inputs(8, 8)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile outside the capture
            rotary_and_cache(
                static[0], static[1], cos, sin, fused_cache, static[2], *heads, *scales
            )
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = rotary_and_cache(
                static[0], static[1], cos, sin, fused_cache, static[2], *heads, *scales
            )
        two_full.copy_(fused_full)
        for trial in range(8):
            for buffer, new in zip(static, inputs(8, 8), strict=True):
                buffer.copy_(new)
            graph.replay()
            check(out, two_kernels(*static), f"replay {trial}")
    finally:
        pdl.enable_pdl(False)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("path", ["paged", "triton", "flash"])
def test_backend_forward_qkv_matches_split_rotary_forward(
    cache_dtype: torch.dtype, path: str
) -> None:
    """The `Attention` layer's fused call through the Triton backend (`forward_qkv`, one
    kernel for the rotary and the K/V write) against split, `RotaryEmbedding` and `forward`,
    bit for bit (output and cache): a mixed step, two decodes then chunks after prefixes,
    on each prefill path (the cascade's dense part reads the returned key and value)."""
    from tandem.layers.attention.layer import Attention
    from tandem.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(22)
    query_lens, seq_lens = [1, 1, 300, 77], [900, 40, 1300, 77]
    num_blocks = sum(math.ceil(n / BLOCK_SIZE) for n in seq_lens)
    full = torch.randn(num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device=DEV)
    full = full.to(cache_dtype)
    twin = full.clone()
    table = _block_table(seq_lens, num_blocks, gen)
    positions = torch.cat(
        [torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)]
    )
    block_ids = table.cpu().repeat_interleave(torch.tensor(query_lens), dim=0)
    slots = block_ids.gather(1, (positions // BLOCK_SIZE)[:, None])[:, 0].long() * BLOCK_SIZE
    slots = (slots + positions % BLOCK_SIZE).to(DEV)
    qsl = _qsl(query_lens)
    meta = AttentionMetadata(
        num_actual_tokens=len(positions),
        num_reqs=len(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_table=table,
        slot_mapping=slots,
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=seq_lens,
        num_decodes=2,
        prefill_path=path,
    )
    positions = positions.to(DEV)
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE
    qkv = torch.randn(len(positions), width, device=DEV).to(torch.bfloat16)
    rope = RotaryEmbedding(HEAD_SIZE, 4096, {"rope_type": "default", "rope_theta": 5e5}, DEV)
    backend = TritonAttentionBackend()
    backend.fuse_rotary_kv = True  # the kernel, whatever TANDEM_ROTARY_KV says
    layer = Attention(NUM_HEADS, HEAD_SIZE, NUM_KV_HEADS, SCALE, backend)
    layer.k_scale, layer.v_scale = 0.05, 0.02
    fused = layer.forward_qkv(positions, qkv, rope, full[:, 1], meta)
    q, k, v = layer.split_qkv(qkv)
    q, k = rope(positions, q, k)
    unfused = layer.forward(q, k, v, twin[:, 1], meta)
    torch.cuda.synchronize()
    assert torch.equal(fused, unfused)
    assert torch.equal(_bits(full), _bits(twin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = torch.randn(1024, 2 * 14336, dtype=dtype, device=DEV)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), atol=1e-2, rtol=1e-2)


# --- timings ----------------------------------------------------------------------------------


def _dense_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """`[B, 2, Hkv, seq_len, D]` gathered from the paged cache (all requests seq_len long)."""
    blocks = cache[block_table.long()]  # [B, nb, 2, bs, Hkv, D]
    b, nb = blocks.shape[:2]
    kv = blocks.permute(0, 2, 4, 1, 3, 5).reshape(b, 2, NUM_KV_HEADS, nb * BLOCK_SIZE, HEAD_SIZE)
    return kv[:, :, :, :seq_len]


def _bench(fn: Callable[[], object], graph: bool) -> float:
    """Milliseconds per call: replayed from a CUDA graph (as the engine runs decode), or
    launched eagerly (then host launch cost can dominate small kernels). NaN on failure."""
    try:
        if graph:
            return triton.testing.do_bench_cudagraph(fn)
        return triton.testing.do_bench(fn)
    except Exception as exc:  # a timing that cannot be taken is reported, not fatal
        print(f"    (bench failed: {exc!r:.200})")
        return float("nan")


def _decode_setup(
    batch: int, ctx: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_blocks = batch * ctx // BLOCK_SIZE
    cache = _cache(num_blocks, torch.bfloat16)
    block_table = _block_table([ctx] * batch, num_blocks, gen)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    query = torch.randn(batch, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=DEV)
    return query, cache, lens, block_table


def test_decode_timing(capsys: pytest.CaptureFixture[str]) -> None:
    """bf16 decode, Triton vs torch (gather from the paged cache + SDPA, and SDPA on K/V that
    is already dense). Batch 64 x context 1024 with a sweep of tile settings, then a few
    long-context shapes where the split count matters. Prints microseconds and K/V GB/s."""
    gen = torch.Generator().manual_seed(4)
    num_sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    lines = []

    def triton_fn(
        query: torch.Tensor,
        cache: torch.Tensor,
        lens: torch.Tensor,
        block_table: torch.Tensor,
        ctx: int,
        **kw: int,
    ) -> Callable[[], torch.Tensor]:
        return lambda: paged_decode_attention(
            query, cache, lens, block_table, SCALE, max_seq_len=ctx, **kw
        )

    def report(name: str, ms: float, kv_bytes: int) -> None:
        lines.append(f"  {name:56s} {ms * 1e3:8.1f} us  {kv_bytes / ms / 1e6:7.0f} GB/s")

    batch, ctx = 64, 1024
    query, cache, lens, block_table = _decode_setup(batch, ctx, gen)
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_SIZE * 2

    def torch_decode() -> torch.Tensor:
        kv = _dense_kv(cache, block_table, ctx)
        return torch.nn.functional.scaled_dot_product_attention(
            query[:, :, None], kv[:, 0], kv[:, 1], scale=SCALE, enable_gqa=True
        )

    dense = _dense_kv(cache, block_table, ctx).contiguous()

    def sdpa_dense() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            query[:, :, None], dense[:, 0], dense[:, 1], scale=SCALE, enable_gqa=True
        )

    ref = torch_decode()[:, :, 0]
    out = paged_decode_attention(query, cache, lens, block_table, SCALE, max_seq_len=ctx)
    torch.testing.assert_close(out, ref, **_tol(torch.bfloat16))
    auto = decode_num_splits(batch, NUM_KV_HEADS, ctx, num_sms)
    lines.append(f"decode bf16 batch {batch} x ctx {ctx} (32/8 heads, d 128), auto splits={auto}")
    report(
        "triton default, eager launch",
        _bench(triton_fn(query, cache, lens, block_table, ctx), False),
        kv_bytes,
    )
    report("torch gather + SDPA, eager", _bench(torch_decode, False), kv_bytes)
    report("torch SDPA on dense KV, eager", _bench(sdpa_dense, False), kv_bytes)
    report(
        "triton default, CUDA graph",
        _bench(triton_fn(query, cache, lens, block_table, ctx), True),
        kv_bytes,
    )
    report("torch gather + SDPA, CUDA graph", _bench(torch_decode, True), kv_bytes)
    report("torch SDPA on dense KV, CUDA graph", _bench(sdpa_dense, True), kv_bytes)
    for splits, block_n, warps, stages in [
        (1, 32, 4, 3), (1, 128, 4, 3), (1, 64, 4, 2), (1, 64, 8, 3), (2, 64, 4, 3), (4, 64, 4, 3),
    ]:  # fmt: skip
        fn = triton_fn(
            query, cache, lens, block_table, ctx, num_splits=splits, block_n=block_n,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        name = f"triton splits={splits} block_n={block_n} warps={warps} st={stages}, graph"
        report(name, _bench(fn, True), kv_bytes)

    for batch, ctx in [(1, 4096), (8, 4096), (32, 2048)]:
        query, cache, lens, block_table = _decode_setup(batch, ctx, gen)
        kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_SIZE * 2
        auto = decode_num_splits(batch, NUM_KV_HEADS, ctx, num_sms)
        lines.append(f"decode bf16 batch {batch} x ctx {ctx}, auto splits={auto} (CUDA graph)")
        for splits in sorted({1, 2, 4, auto, 2 * auto}):
            fn = triton_fn(query, cache, lens, block_table, ctx, num_splits=splits)
            report(f"triton splits={splits}", _bench(fn, True), kv_bytes)
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_prefill_timing(capsys: pytest.CaptureFixture[str]) -> None:
    """8 fresh prompts of 1024 tokens, bf16: Triton paged prefill vs SDPA on dense K/V."""
    dtype, batch, n = torch.bfloat16, 8, 1024
    gen = torch.Generator().manual_seed(5)
    num_blocks = batch * n // BLOCK_SIZE
    cache = _cache(num_blocks, dtype)
    block_table = _block_table([n] * batch, num_blocks, gen)
    lens = torch.full((batch,), n, dtype=torch.int32, device=DEV)
    qsl = _qsl([n] * batch)
    query = torch.randn(batch * n, NUM_HEADS, HEAD_SIZE, dtype=dtype, device=DEV)
    dense = _dense_kv(cache, block_table, n).contiguous()
    q_dense = query.view(batch, n, NUM_HEADS, HEAD_SIZE).transpose(1, 2)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q_dense, dense[:, 0], dense[:, 1], scale=SCALE, is_causal=True, enable_gqa=True
        )

    out = paged_prefill_attention(query, cache, qsl, lens, block_table, SCALE)
    ref = sdpa().transpose(1, 2).reshape(batch * n, NUM_HEADS, HEAD_SIZE)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    flops = 4 * batch * n * n / 2 * NUM_HEADS * HEAD_SIZE
    lines = ["prefill bf16 8 x 1024 causal (32/8 heads, d 128), eager launch:"]
    for block_q, block_n, warps, stages in [
        (None, None, 4, 3), (16, 32, 4, 3), (32, 64, 8, 3), (32, 128, 8, 3), (16, 64, 4, 4),
    ]:  # fmt: skip
        fn = lambda q=block_q, b=block_n, w=warps, st=stages: paged_prefill_attention(  # noqa: E731
            query, cache, qsl, lens, block_table, SCALE, block_q=q, block_n=b,
            num_warps=w, num_stages=st,
        )  # fmt: skip
        ms = _bench(fn, False)
        name = f"triton block_q={block_q} block_n={block_n} warps={warps} st={stages}"
        lines.append(f"  {name:56s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:7.1f} TFLOP/s")
    ms = _bench(sdpa, False)
    lines.append(
        f"  {'torch SDPA on dense KV':56s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:7.1f} TFLOP/s"
    )
    with capsys.disabled():
        print("\n" + "\n".join(lines))

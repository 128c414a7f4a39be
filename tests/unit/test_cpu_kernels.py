"""The CPU C++ kernels (tandem_kernels/cpu) against the pure-torch references."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.attention import get_attention_backend
from tandem.layers.attention.torch_backend import TorchAttentionBackend
from tandem.layers.norm import fused_add_rms_norm, rms_norm
from tandem.layers.rotary import RotaryEmbedding, apply_rotary_emb
from tandem_kernels import cpu
from tests.unit.test_layers import PagedScene

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the extension")


def _both(scene: PagedScene, query_lens: list[int], scale: float):
    """The torch backend's and the cpu backend's outputs on the same step and cache."""
    query, key, value, md = scene.step(query_lens)
    before = scene.full_cache.clone()
    ref = TorchAttentionBackend().forward(query, key, value, scene.kv_cache, md, scale)
    ref_cache = scene.full_cache.clone()
    scene.full_cache.copy_(before)
    out = get_attention_backend("cpu").forward(query, key, value, scene.kv_cache, md, scale)
    assert torch.equal(scene.full_cache, ref_cache)  # same slots written, other layers untouched
    return out, ref, scene.reference(query, query_lens, scale)


@pytest.mark.parametrize("head_size", [16, 64, 128])  # 64 and 128: the AVX-512 path
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
def test_cpu_attention_mixed_step(heads: int, kv_heads: int, head_size: int) -> None:
    # Decodes first (as the runner orders them), then a fresh prefill, a prefill chunk over a
    # cached prefix (a prefix-cache hit), and a chunk ending exactly on a block boundary.
    seq_lens = [1, 33, 16, 13, 40, 32]
    query_lens = [1, 1, 1, 13, 9, 16]
    scene = PagedScene(seq_lens, heads, kv_heads, head_size, block_size=4, seed=11)
    out, ref, dense = _both(scene, query_lens, 16**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_size", [8, 32])  # 32: the AVX-512 path
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_cpu_attention_block_boundaries(block_size: int, head_size: int) -> None:
    # Context lengths one before, at and one past block multiples (and of the AVX-512 path's
    # 16-position chunks); long query chunks (> the kernels' 16-row tile) over cached context.
    seq_lens = [15, 16, 17, 31, 32, 33, 50]
    query_lens = [1, 1, 1, 17, 32, 20, 35]
    scene = PagedScene(seq_lens, 6, 2, head_size, block_size=block_size, seed=block_size)
    out, ref, dense = _both(scene, query_lens, 0.35)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_cpu_attention_decode_ignores_unused_block_table_entries() -> None:
    seq_lens = [1, 17, 64, 5]
    scene = PagedScene(seq_lens, 6, 3, 8, block_size=8, seed=6)
    query, key, value, md = scene.step([1] * 4)
    md.block_table = torch.cat([md.block_table, torch.full((4, 3), 10**6, dtype=torch.int32)], 1)
    out = get_attention_backend("cpu").forward(query, key, value, scene.kv_cache, md, 0.3)
    torch.testing.assert_close(out, scene.reference(query, [1] * 4, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_size", [32, 64, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (4, 4)])
def test_cpu_attention_decode_rows_equal_reference(
    heads: int, kv_heads: int, head_size: int
) -> None:
    # A decode-only step (each request one new row: K read as it lies, lane sums) over
    # contexts around the 16-position tiles and the blocks; the first a one-token prompt.
    seq_lens = [1, 2, 15, 16, 17, 31, 33, 64, 100, 129]
    scene = PagedScene(seq_lens, heads, kv_heads, head_size, block_size=16, seed=head_size)
    out, ref, dense = _both(scene, [1] * len(seq_lens), head_size**-0.5)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_cpu_attention_decode_rows_16bit_cache_under_float32(cache_dtype: torch.dtype) -> None:
    # --kv-cache-dtype under a float32 model: the same as the float32 cache of those values.
    seq_lens = [5, 16, 47, 80]
    scene = PagedScene(seq_lens, 9, 3, 64, block_size=16, seed=4)
    query, key, value, md = scene.step([1] * 4)
    cache16 = scene.kv_cache.to(cache_dtype)
    attend = get_attention_backend("cpu").attend
    out = attend(query, key, value, cache16, md, 0.125)
    ref = attend(query, key, value, cache16.float(), md, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [1, 7, 16, 40])
def test_cpu_attention_decode_rows_sliding_window(window: int) -> None:
    seq_lens = [3, 17, 50, 90]
    scene = PagedScene(seq_lens, 9, 3, 64, block_size=16, seed=window)
    query, key, value, md = scene.step([1] * 4)
    backend = get_attention_backend("cpu")
    out = backend.forward(query, key, value, scene.kv_cache, md, 0.125, sliding_window=window)
    ref = TorchAttentionBackend().forward(
        query, key, value, scene.kv_cache.clone(), md, 0.125, sliding_window=window
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [16, 64])
def test_cpu_attention_chunked_prefill_equals_one_shot(d: int) -> None:
    # One 37-token prompt in chunks of 10: each chunk attends over the cache the earlier
    # chunks wrote; the outputs equal one prefill of the whole prompt.
    heads, kv_heads, bs = 4, 2, 4
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(37, heads, d, generator=gen)
    k = torch.randn(37, kv_heads, d, generator=gen)
    v = torch.randn(37, kv_heads, d, generator=gen)
    blocks = [7, 2, 9, 0, 4, 8, 1, 3, 6, 5]
    from tests.conftest import build_attn_metadata

    backend = get_attention_backend("cpu")
    cache = torch.zeros(10, 2, bs, kv_heads, d)
    chunks = []
    for start in range(0, 37, 10):
        end = min(start + 10, 37)
        md = build_attn_metadata([end - start], [end], [blocks], bs)
        chunks.append(backend.forward(q[start:end], k[start:end], v[start:end], cache, md, 0.25))
    whole_cache = torch.zeros_like(cache)
    md = build_attn_metadata([37], [37], [blocks], bs)
    whole = backend.forward(q, k, v, whole_cache, md, 0.25)
    torch.testing.assert_close(torch.cat(chunks), whole, rtol=1e-6, atol=1e-6)
    assert torch.equal(cache, whole_cache)


@pytest.mark.parametrize("head_size", [16, 64])
def test_cpu_attention_bf16_cache_close_to_float32(head_size: int) -> None:
    seq_lens = [9, 30, 1]
    query_lens = [9, 5, 1]
    scene = PagedScene(seq_lens, 4, 2, head_size, block_size=4, seed=2)
    query, key, value, md = scene.step(query_lens)
    cache16 = scene.kv_cache.to(torch.bfloat16)
    out = get_attention_backend("cpu").forward(
        query.bfloat16(), key.bfloat16(), value.bfloat16(), cache16, md, 0.25
    )
    assert out.dtype == torch.bfloat16
    dense = scene.reference(query, query_lens, 0.25)
    torch.testing.assert_close(out.float(), dense, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("h", [64, 40])  # 64: the 16-lane path; 40: the scalar one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rms_norms_equal_torch(dtype: torch.dtype, h: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, h, generator=gen).to(dtype)
    res = torch.randn(37, h, generator=gen).to(dtype)
    w = torch.randn(h, generator=gen).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.02}
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), **tol)
    ref_out, ref_res = fused_add_rms_norm(x, res, w, 1e-5)
    res_in = res.clone()
    out, res_out = cpu.fused_add_rms_norm(x, res_in, w, 1e-5)
    assert res_out is res_in  # updated in place
    assert torch.equal(res_out, ref_res)  # the add rounds as torch's does
    torch.testing.assert_close(out, ref_out, **tol)


@pytest.mark.parametrize("d", [16, 64])  # 64: the 16-lane path (half the head a multiple of 16)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_rotary_and_cache_write_equal_torch(dtype: torch.dtype, d: int) -> None:
    heads, kv_heads, bs = 6, 2, 4
    params = {"rope_type": "default", "rope_theta": 10000.0}
    rope = RotaryEmbedding(d, 64, params, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    t = 11
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    positions = torch.randint(0, 64, (t,), generator=gen)
    slots = torch.tensor([5, 6, 7, 8, 0, 1, -1, 12, 13, 14, 2])
    cache = torch.zeros(4, 2, bs, kv_heads, d, dtype=dtype)
    q, k, v = cpu.rotary_qkv_cache(
        qkv, positions, rope.cos_cache, rope.sin_cache, cache, slots, heads, kv_heads, d
    )
    q_ref, k_ref, v_ref = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    q_ref, k_ref = apply_rotary_emb(
        positions, q_ref.view(t, heads, d), k_ref.view(t, kv_heads, d), rope.cos_cache,
        rope.sin_cache,
    )  # fmt: skip
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(v, v_ref.reshape(t, kv_heads, d))
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(cache[s // bs, 0, s % bs], k_ref[i])
            assert torch.equal(cache[s // bs, 1, s % bs], v[i])
    # Slot -1 (a padding row) wrote nothing: 10 of the 16 slots hold a token, 6 stay zero.
    assert int((cache.flatten(3).abs().sum(-1) > 0).sum()) == 2 * 10


@pytest.mark.parametrize("d", [200, 192])  # 192: the 16-lane path; 200: the scalar one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_silu_and_mul_equals_torch(dtype: torch.dtype, d: int) -> None:
    from tandem.layers.activation import silu_and_mul

    gen = torch.Generator().manual_seed(2)
    x = (4 * torch.randn(37, 2 * d, generator=gen)).to(dtype)
    out = cpu.silu_and_mul(x)
    assert out.shape == (37, d) and out.dtype == dtype
    # ATen's silu arithmetic (SLEEF's exp where the CPU has AVX512), then the rounded product.
    torch.testing.assert_close(out, silu_and_mul(x), rtol=1e-6, atol=1e-6)
    if dtype == torch.bfloat16:
        assert torch.equal(out, silu_and_mul(x))


@pytest.mark.skipif(not cpu.has_packed_sgemm(), reason="this torch has no MKL packed sgemm")
@pytest.mark.parametrize("rows", [0, 1, 16, 64, 300])
def test_cpu_packed_linear_equals_f_linear(rows: int) -> None:
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 40, generator=gen)
    bias = torch.randn(96, generator=gen)
    packed = cpu.pack_linear_weight(w)
    x = torch.randn(rows, 40, generator=gen)
    bias_before = bias.clone()
    for b in (None, bias):
        out = cpu.packed_linear(x, packed, b, 96)
        assert out.shape == (rows, 96)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(bias, bias_before)  # the output starts as a copy of the bias rows
    # A view with a row stride (the left half of wider rows) reads only its own columns.
    wide = torch.randn(rows, 80, generator=gen)
    out = cpu.packed_linear(wide[:, :40], packed, None, 96)
    torch.testing.assert_close(out, F.linear(wide[:, :40], w), rtol=1e-5, atol=1e-5)


def test_bind_threads_pins_each_thread() -> None:
    import os

    cores = sorted(os.sched_getaffinity(0))[:2]
    threads = torch.get_num_threads()
    try:
        got = cpu.bind_threads(cores)
        assert got == cores
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", [(64, 49152), (3, 17), (1, 1), (0, 5)])
def test_cpu_argmax_rows_equals_torch(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=gen)
    assert torch.equal(cpu.argmax_rows(x), torch.argmax(x, dim=-1))
    if shape[0] >= 3 and shape[1] >= 17:
        x[0, :] = 1.0  # ties: the first maximum
        x[1, 5] = float("nan")  # a NaN: the first NaN (torch's answer too)
        x[1, 9] = float("nan")
        x[2, -1] = float("inf")
        assert cpu.argmax_rows(x).tolist()[:3] == [0, 5, shape[1] - 1]
        assert torch.equal(cpu.argmax_rows(x), torch.argmax(x, dim=-1))
        # A view whose rows are strided (every other row) reads only its own rows.
        assert torch.equal(cpu.argmax_rows(x[::2]), torch.argmax(x[::2], dim=-1))

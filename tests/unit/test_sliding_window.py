"""Sliding-window attention: which layers slide (from the HF config), and the torch and CPU
backends against a dense reference with transformers' window, `p - W < k <= p`.

The Triton kernels' cases are in test_kernels_interp.py (`sliding_*`). Blocks wholly left of a
step's windows are replaced, as a KV manager may free them, by the null block 0 filled with NaN:
a backend that read one would answer NaN.
"""

from __future__ import annotations

import pytest
import torch

from tandem.config import ConfigError
from tandem.layers.attention import get_attention_backend
from tandem.layers.attention.layer import Attention
from tandem.layers.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from tandem.models.utils import sliding_window_for_layer
from tandem_kernels import cpu
from tandem_kernels.paged_attention import paged_attention_ref
from tests.unit.test_layers import PagedScene


def windowed_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """q [Q, H, D] at the last Q of the S positions of k/v [S, KVH, D]; the row at position p
    sees keys p - window < k <= p; float64 math."""
    num_q, heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    group = heads // kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.double(), k) * scale
    q_pos = torch.arange(num_q).unsqueeze(1) + (seq_len - num_q)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v).float()


def _null_left_of_windows(scene: PagedScene, md, query_lens: list[int], window: int) -> None:
    """Point every block-table entry wholly left of the request's first query's window at
    block 0 and fill block 0 with NaN (block 0 is no request's)."""
    bs = scene.block_size
    for r, (q_len, seq_len) in enumerate(zip(query_lens, scene.seq_lens, strict=True)):
        lowest = max(seq_len - q_len - window + 1, 0)
        md.block_table[r, : lowest // bs] = 0
    scene.kv_cache[0] = float("nan")


def _scene(seq_lens: list[int], heads: int, kv_heads: int, head_size: int, seed: int):
    """A PagedScene (block size 4) in which no request holds block 0 (the null block)."""
    scene = PagedScene(seq_lens, heads, kv_heads, head_size, block_size=4, seed=seed)
    used = {b for table in scene.block_tables for b in table}
    spare = next(b for b in range(1, scene.kv_cache.shape[0]) if b not in used)
    scene.block_tables = [[spare if b == 0 else b for b in t] for t in scene.block_tables]
    return scene


# Decodes first, then a fresh prefill, a chunk over a cached prefix, a chunk crossing blocks.
SEQ_LENS = [9, 40, 23, 13, 40, 37]
QUERY_LENS = [1, 1, 1, 13, 9, 6]


@pytest.mark.parametrize("window", [1, 5, 13, 40, 64])
@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_backend_sliding_window(backend_name: str, window: int) -> None:
    # Windows smaller than, equal to and larger than the contexts.
    if backend_name == "cpu" and not cpu.available():
        pytest.skip("no C++ compiler for the extension")
    backend = get_attention_backend(backend_name)
    for head_size, seed in ((16, 3), (64, 4)):  # 64: the CPU kernel's AVX-512 path
        scene = _scene(SEQ_LENS, 8, 2, head_size, seed)
        query, key, value, md = scene.step(QUERY_LENS)
        _null_left_of_windows(scene, md, QUERY_LENS, window)
        scale = head_size**-0.5
        out = backend.forward(query, key, value, scene.kv_cache, md, scale, sliding_window=window)
        expected, start = [], 0
        for r, q_len in enumerate(QUERY_LENS):
            q = query[start : start + q_len]
            expected.append(windowed_reference(q, scene.keys[r], scene.values[r], scale, window))
            start += q_len
        torch.testing.assert_close(out, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_paged_reference_and_window_matter() -> None:
    # The kernels' torch reference agrees with the dense one, and a window shorter than the
    # context changes the answer (the tests above would pass vacuously otherwise).
    scene = _scene(SEQ_LENS, 4, 2, 16, 7)
    query, key, value, md = scene.step(QUERY_LENS)
    write_kv_cache(key, value, scene.kv_cache, md.slot_mapping)
    args = (query, scene.kv_cache, md.query_start_loc, md.seq_lens, md.block_table, 0.25)
    full = paged_attention_ref(*args)
    windowed = paged_attention_ref(*args, sliding_window=5)
    assert not torch.allclose(full, windowed)
    expected, start = [], 0
    for r, q_len in enumerate(QUERY_LENS):
        q = query[start : start + q_len]
        expected.append(windowed_reference(q, scene.keys[r], scene.values[r], 0.25, 5))
        start += q_len
    torch.testing.assert_close(windowed, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_attention_layer_passes_its_window() -> None:
    seen: list[int | None] = []

    class Spy(TorchAttentionBackend):
        def forward(self, *args, sliding_window=None, **kwargs):  # type: ignore[override]
            seen.append(sliding_window)
            return super().forward(*args, sliding_window=sliding_window, **kwargs)

    scene = _scene([12], 2, 1, 8, 1)
    query, key, value, md = scene.step([12])
    for window in (None, 4):
        Attention(2, 8, 1, 0.3, Spy(), sliding_window=window).forward(
            query, key, value, scene.kv_cache, md
        )
    assert seen == [None, 4]  # None: not passed, the default
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(2, 8, 1, 0.3, Spy(), sliding_window=0)


def test_sliding_window_for_layer() -> None:
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

    gemma = Gemma3TextConfig(num_hidden_layers=7, sliding_window=32)
    assert [sliding_window_for_layer(gemma, i) for i in range(7)] == [32] * 5 + [None, 32]
    qwen2 = Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2
    )
    assert [sliding_window_for_layer(qwen2, i) for i in range(4)] == [None, None, 64, 64]
    assert sliding_window_for_layer(Qwen2Config(num_hidden_layers=2), 1) is None
    assert sliding_window_for_layer(MistralConfig(sliding_window=4096), 0) == 4096
    assert sliding_window_for_layer(MistralConfig(sliding_window=None), 0) is None
    # A window covering every position is full attention.
    assert sliding_window_for_layer(MistralConfig(max_position_embeddings=4096), 0) is None
    gemma.layer_types = ["sliding_attention", "chunked_attention"] + ["full_attention"] * 5
    with pytest.raises(ConfigError, match="chunked_attention"):
        sliding_window_for_layer(gemma, 1)


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the extension")
@pytest.mark.parametrize("head_size", [48, 64])  # 48: the generic kernel; 64: AVX-512 (bf16 dots)
def test_cpu_backend_sliding_window_bf16(head_size: int) -> None:
    window = 13
    scene = _scene(SEQ_LENS, 8, 2, head_size, 5)
    query, key, value, md = scene.step(QUERY_LENS)
    _null_left_of_windows(scene, md, QUERY_LENS, window)
    cache16 = scene.kv_cache.to(torch.bfloat16)
    out = get_attention_backend("cpu").forward(
        query.bfloat16(), key.bfloat16(), value.bfloat16(), cache16, md, 0.25,
        sliding_window=window,
    )  # fmt: skip
    expected, start = [], 0
    for r, q_len in enumerate(QUERY_LENS):
        q = query[start : start + q_len]
        expected.append(windowed_reference(q, scene.keys[r], scene.values[r], 0.25, window))
        start += q_len
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch.cat(expected), rtol=3e-2, atol=3e-2)

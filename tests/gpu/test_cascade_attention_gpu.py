"""The cascade prefill attention on a CUDA device at the 8B shape (32 query heads, 8 KV heads,
head 128, block 16): against an fp32 torch reference at 1k, 8k and 32k tokens (every dense-part
kernel: FlashAttention-2, ours, on sm_90 our Hopper one; bf16 and fp16), through the Triton
backend (the default on CUDA), and captured in a CUDA graph as a whole mixed step is (replayed
with another split of its tokens). Over an FP8
cache and with sliding windows (1k, 8k): against the reference over the cache dequantized and
against the all-paged kernel, whose results the cascade's must equal.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tandem.layers.attention.backend import AttentionMetadata  # noqa: E402
from tandem.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tandem_kernels.cascade_attention import (  # noqa: E402
    PREFILL_PATHS,
    cascade_prefill_attention,
    cudnn_dense_supported,
    flash_dense_supported,
    hopper_dense_supported,
    planned_prefill_path,
    prefill_path,
    prefill_path_log,
)
from tandem_kernels.paged_attention import (  # noqa: E402
    FP8_KV_DTYPE,
    paged_prefill_attention,
    prefill_tuning,
    shape_key,
    time_config,
    time_device,
)
from tandem_kernels.reshape_and_cache import reshape_and_cache  # noqa: E402

DEV = torch.device("cuda")
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
SCALE = HEAD_SIZE**-0.5
DTYPES = [torch.bfloat16, torch.float16]
# Rows of each request checked against the reference (all of them below this length).
_ALL_ROWS_UP_TO = 1024


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return (
        {"atol": 1.5e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 3e-3, "rtol": 5e-3}
    )


class _Scene:
    """Requests of (context, new) tokens over a shuffled paged cache (layer 1 of two), the
    query, and the step's dense K/V as `forward` receives them (strided views of one qkv
    tensor, equal to the cache's rows at the new positions)."""

    def __init__(self, reqs: list[tuple[int, int]], dtype: torch.dtype, seed: int) -> None:
        gen = torch.Generator(device=DEV).manual_seed(seed)
        self.seq_lens = [c + n for c, n in reqs]
        self.query_lens = [n for _, n in reqs]
        per_req = [math.ceil(s / BLOCK_SIZE) for s in self.seq_lens]
        num_blocks = sum(per_req) + 4
        full = torch.randn(
            (num_blocks, 2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE),
            generator=gen, device=DEV, dtype=dtype,
        )  # fmt: skip
        self.cache = full[:, 1]
        perm = torch.randperm(num_blocks, generator=gen, device=DEV)
        self.block_table = torch.zeros(len(reqs), max(per_req), dtype=torch.int32, device=DEV)
        used = 0
        for r, n in enumerate(per_req):
            self.block_table[r, :n] = perm[used : used + n]
            used += n
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        self.starts = starts
        self.qsl = torch.tensor(starts, dtype=torch.int32, device=DEV)
        self.lens = torch.tensor(self.seq_lens, dtype=torch.int32, device=DEV)
        num_tokens = starts[-1]
        qkv = torch.randn(
            (num_tokens, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_SIZE),
            generator=gen, device=DEV, dtype=dtype,
        )  # fmt: skip
        self.query = qkv[:, :NUM_HEADS]
        self.key = qkv[:, NUM_HEADS : NUM_HEADS + NUM_KV_HEADS]
        self.value = qkv[:, NUM_HEADS + NUM_KV_HEADS :]
        for r, (s, q) in enumerate(zip(self.seq_lens, self.query_lens, strict=True)):
            k, v = self._kv(r, s - q, s)
            self.key[starts[r] : starts[r] + q] = k
            self.value[starts[r] : starts[r] + q] = v

    def _kv(
        self, r: int, lo: int, hi: int, cache: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.cache if cache is None else cache
        pos = torch.arange(lo, hi, device=DEV)
        blocks = self.block_table[r, pos // BLOCK_SIZE].long()
        return cache[blocks, 0, pos % BLOCK_SIZE], cache[blocks, 1, pos % BLOCK_SIZE]

    def slots(self) -> torch.Tensor:
        """The cache slots of the step's new tokens (`slot_mapping`)."""
        parts = []
        for r, (s, q) in enumerate(zip(self.seq_lens, self.query_lens, strict=True)):
            pos = torch.arange(s - q, s, device=DEV)
            parts.append(
                self.block_table[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
            )
        return torch.cat(parts)

    def fp8_cache(self, k_scale: float, v_scale: float) -> torch.Tensor:
        """The cache in FP8 (a fresh two-layer buffer's layer 1): the prefix converted by
        torch, the step's K/V written by `reshape_and_cache` as `forward` writes them."""
        full = torch.empty(
            (self.cache.shape[0], 2, *self.cache.shape[1:]), dtype=FP8_KV_DTYPE, device=DEV
        )
        cache = full[:, 1]
        cache[:, 0] = (self.cache[:, 0].float() / k_scale).clamp(-448, 448).to(FP8_KV_DTYPE)
        cache[:, 1] = (self.cache[:, 1].float() / v_scale).clamp(-448, 448).to(FP8_KV_DTYPE)
        reshape_and_cache(self.key, self.value, cache, self.slots(), k_scale, v_scale)
        return cache

    def check(
        self,
        out: torch.Tensor,
        dtype: torch.dtype,
        *,
        fp8: tuple[torch.Tensor, float, float] | None = None,
        window: int | None = None,
    ) -> None:
        """Rows of each request (all of them, or the first, a middle and the last 128 of a
        long one) against fp32 attention over the cache, 128 rows at a time. `fp8`: (the FP8
        cache, k_scale, v_scale), dequantized for the reference; `window`: sliding."""
        for r, (s, q) in enumerate(zip(self.seq_lens, self.query_lens, strict=True)):
            if fp8 is None:
                k, v = (t.float() for t in self._kv(r, 0, s))
            else:
                k, v = (t.float() for t in self._kv(r, 0, s, fp8[0]))
                k, v = k * fp8[1], v * fp8[2]
            if q <= _ALL_ROWS_UP_TO:
                rows = list(range(q))
            else:
                rows = [*range(128), *range(q // 2, q // 2 + 128), *range(q - 128, q)]
            for lo in range(0, len(rows), 128):
                idx = torch.tensor(rows[lo : lo + 128], device=DEV)
                qq = self.query[self.starts[r] + idx].float()
                qq = qq.view(-1, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_SIZE)
                scores = torch.einsum("nkgd,skd->kgns", qq, k) * SCALE
                q_pos = s - q + idx
                keys = torch.arange(s, device=DEV)
                scores.masked_fill_(keys[None, :] > q_pos[:, None], float("-inf"))
                if window:
                    scores.masked_fill_(keys[None, :] <= q_pos[:, None] - window, float("-inf"))
                ref = torch.einsum("kgns,skd->nkgd", scores.softmax(-1), v)
                got = out[self.starts[r] + idx].float().view_as(ref)
                torch.testing.assert_close(got, ref, **_tol(dtype))


def _impls() -> list[str]:
    probe = torch.empty(1, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=DEV)
    impls = ["flash", "triton"] if flash_dense_supported(probe, NUM_KV_HEADS) else ["triton"]
    if hopper_dense_supported(probe, probe):
        impls.append("triton_hopper")
    kv_probe = torch.empty(1, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=DEV)
    if cudnn_dense_supported(probe, kv_probe):
        impls.append("cudnn")
    return impls


# (context, new tokens) per request: fresh prompts, chunks after a cached prefix, decodes.
SCENES = {
    "1k": [(0, 1024)] * 4 + [(3072, 1024), (0, 1), (2000, 1), (700, 300)],
    "8k": [(0, 8192), (6144, 2048), (100, 1)],
    "32k": [(0, 32768), (28672, 4096)],
    # One query length for every request: the "cudnn" dense part runs (others fall back).
    "equal": [(0, 2048), (1024, 2048), (4096, 2048)],
}


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scene", list(SCENES))
def test_cascade_matches_reference(scene: str, dtype: torch.dtype, impl: str) -> None:
    s = _Scene(SCENES[scene], dtype, seed=len(scene))
    out = cascade_prefill_attention(
        s.query, s.key, s.value, s.cache, s.qsl, s.lens, s.block_table, SCALE,
        max_query_len=max(s.query_lens), dense_impl=impl,
    )  # fmt: skip
    s.check(out, dtype)


def _metadata(s: _Scene, max_query_len: int, max_seq_len: int) -> AttentionMetadata:
    num_tokens = s.starts[-1]
    return AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=len(s.seq_lens),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        query_start_loc=s.qsl,
        seq_lens=s.lens,
        block_table=s.block_table,
        # Slots < 0: the cache already holds the step's K/V (the write is skipped).
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=DEV),
        query_start_loc_cpu=list(s.starts),
        seq_lens_cpu=list(s.seq_lens),
    )


@pytest.mark.parametrize("cascade", [None, True, False])
def test_backend_paths_keep_decodes_split(cascade: bool | None) -> None:
    """The backend's default (None: `prefill_path`), forced cascade and forced all-paged
    kernel all match the reference on a mixed step with two leading decodes."""
    s = _Scene([(900, 1), (3000, 1), (0, 1024), (2048, 512)], torch.bfloat16, seed=5)
    backend = TritonAttentionBackend()
    backend.prefill_cascade = cascade
    meta = _metadata(s, 1024, 3072)
    meta.num_decodes = 2
    out = backend.forward(s.query, s.key, s.value, s.cache, meta, SCALE)
    s.check(out, torch.bfloat16)


def test_prefill_path_is_timed_at_start_up() -> None:
    """Inside `prefill_tuning()` the first large call times every path once for its shape
    key and keeps the fastest; later calls return it without timing. The long class (steps
    of more than 1,024 new rows a request) is planned at the same time: where the call's
    winner is a cascade with more than one dense part timed, the stand-in batch's timing
    picked it (logged after the call's entry), else it is the call's own path."""
    s = _Scene([(0, 1024), (0, 1024)], torch.bfloat16, seed=8)
    # Block size 16 and this shape may have been timed already in this process (an engine
    # test): use a view with another block size for a key of its own.
    cache = s.cache.reshape(s.cache.shape[0] // 2, 2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    cache = cache.transpose(1, 2).reshape(-1, 2, 2 * BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    assert cache.shape[2] == 32
    table = torch.arange(64, dtype=torch.int32, device=DEV).view(2, 32)
    args = (s.query, s.key, s.value, cache, s.qsl, s.lens, table, SCALE)
    logged = len(prefill_path_log)
    with prefill_tuning():
        path = prefill_path(*args, max_query_len=1024)
    assert path in PREFILL_PATHS
    if len(prefill_path_log) > logged:  # timed here (not when TANDEM_TUNE_KERNELS=0)
        entry = prefill_path_log[logged]
        assert entry["best"] == path and len(entry["ms"]) >= 2 and entry["long"] is False
        assert entry["ms"][path] == min(entry["ms"].values())
    assert prefill_path(*args, max_query_len=1024) == path
    long_path = planned_prefill_path(DEV, shape_key(NUM_HEADS, cache), 4096, 4096)
    assert long_path in PREFILL_PATHS
    new = prefill_path_log[logged:]
    assert len(new) <= 2
    if len(new) == 2:  # the long class timed on its stand-in
        stand_in = new[1]
        assert stand_in["long"] is True and stand_in["num_tokens"] == 8192
        assert stand_in["best"] == long_path == min(stand_in["ms"], key=stand_in["ms"].get)
    elif new:
        assert long_path == path


@pytest.mark.parametrize("impl", _impls())
def test_cascade_in_a_cuda_graph(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole mixed step captured once (max_query_len an upper bound, as the runner passes)
    and replayed with the same token count split into other requests and lengths."""
    monkeypatch.setenv("TANDEM_PREFILL_DENSE", impl)
    dtype = torch.bfloat16
    first = _Scene([(0, 512), (1500, 300), (40, 1), (0, 211)], dtype, seed=6)
    second = _Scene([(2000, 1), (0, 700), (600, 323)], dtype, seed=7)
    assert first.starts[-1] == second.starts[-1] == 1024
    backend = TritonAttentionBackend()
    backend.prefill_cascade = True
    # Static inputs sized for both scenes.
    num_reqs = 4
    query, key, value = (t.clone() for t in (first.query, first.key, first.value))
    cache = torch.zeros(
        (max(first.cache.shape[0], second.cache.shape[0]), *first.cache.shape[1:]),
        dtype=dtype, device=DEV,
    )  # fmt: skip
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32, device=DEV)
    lens = torch.zeros(num_reqs, dtype=torch.int32, device=DEV)
    table = torch.zeros(num_reqs, 256, dtype=torch.int32, device=DEV)

    def load(s: _Scene) -> None:
        n = len(s.seq_lens)
        query.copy_(s.query)
        key.copy_(s.key)
        value.copy_(s.value)
        cache[: s.cache.shape[0]].copy_(s.cache)
        qsl.fill_(s.starts[-1])
        qsl[: n + 1].copy_(s.qsl)
        lens.zero_()
        lens[:n].copy_(s.lens)
        table.zero_()
        table[:n, : s.block_table.shape[1]].copy_(s.block_table)

    meta = AttentionMetadata(
        num_actual_tokens=1024,
        num_reqs=num_reqs,
        max_query_len=1024,
        max_seq_len=4096,
        query_start_loc=qsl,
        seq_lens=lens,
        block_table=table,
        slot_mapping=torch.full((1024,), -1, dtype=torch.int64, device=DEV),
        query_start_loc_cpu=[],
        seq_lens_cpu=[],
    )
    load(first)
    for _ in range(2):  # compile outside the capture
        backend.forward(query, key, value, cache, meta, SCALE)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(query, key, value, cache, meta, SCALE)
    for s in (first, second):
        load(s)
        graph.replay()
        torch.cuda.synchronize()
        s.cache = cache[: s.cache.shape[0]]
        s.check(out, dtype)


# FP8 scales and sliding windows at the 1k and 8k scenes: a window shorter than the chunks and
# the prefixes (512), one as long as Mistral's (4,096: shorter than the 8k prompt, longer than
# the 1k scene's contexts but the 4k one).
FP8_SCALES = (0.02, 0.02)  # |x| / scale stays below e4m3's 448 for |x| < 8.9
WINDOW_CASES = [("1k", 512), ("1k", 4096), ("8k", 512), ("8k", 4096)]


@pytest.mark.parametrize("scene", ["1k", "8k"])
def test_cascade_over_fp8_cache(scene: str) -> None:
    """Over an FP8 cache the cascade (our dense kernel on the step's K/V rounded as the cache
    holds them) equals the all-paged kernel, and the reference over the dequantized cache."""
    dtype = torch.bfloat16
    s = _Scene(SCENES[scene], dtype, seed=20 + len(scene))
    ks, vs = FP8_SCALES
    cache = s.fp8_cache(ks, vs)
    args = (s.query, cache, s.qsl, s.lens, s.block_table, SCALE)
    paged = paged_prefill_attention(*args, k_scale=ks, v_scale=vs)
    out = cascade_prefill_attention(
        s.query, s.key, s.value, cache, s.qsl, s.lens, s.block_table, SCALE,
        max_query_len=max(s.query_lens), k_scale=ks, v_scale=vs,
    )  # fmt: skip
    torch.testing.assert_close(out, paged, **_tol(dtype))
    s.check(out, dtype, fp8=(cache, ks, vs))


@pytest.mark.parametrize(("scene", "window"), WINDOW_CASES)
def test_cascade_sliding_window(scene: str, window: int) -> None:
    """With a sliding window the cascade equals the all-paged kernel and the windowed
    reference; blocks left of each request's first row's window are the null block (0),
    filled with NaN (a block no request holds), so a read of one shows."""
    dtype = torch.bfloat16
    s = _Scene(SCENES[scene], dtype, seed=30 + window)
    held = {
        int(b)
        for r, seq in enumerate(s.seq_lens)
        for b in s.block_table[r, : math.ceil(seq / BLOCK_SIZE)].tolist()
    }
    null = min(set(range(s.cache.shape[0])) - held)  # a block no request holds
    table = s.block_table.clone()
    for r, (seq, q) in enumerate(zip(s.seq_lens, s.query_lens, strict=True)):
        table[r, : max(seq - q - window + 1, 0) // BLOCK_SIZE] = null
    cache = s.cache.clone()
    cache[null] = float("nan")
    args = (s.query, cache, s.qsl, s.lens, table, SCALE)
    paged = paged_prefill_attention(*args, sliding_window=window)
    out = cascade_prefill_attention(
        s.query, s.key, s.value, cache, s.qsl, s.lens, table, SCALE,
        max_query_len=max(s.query_lens), sliding_window=window,
    )  # fmt: skip
    assert not out.isnan().any()
    torch.testing.assert_close(out, paged, **_tol(dtype))
    s.check(out, dtype, window=window)


@pytest.mark.parametrize("cascade", [None, True])
def test_backend_fp8_sliding_mixed_step(cascade: bool | None) -> None:
    """A sliding layer (window 1,024) over an FP8 cache through the backend, as the engine
    runs it (the step's K/V written by `forward`, two leading decodes): the default path
    choice and the forced cascade match the all-paged kernel (`prefill_cascade` False)."""
    dtype = torch.bfloat16
    s = _Scene([(900, 1), (3000, 1), (0, 1024), (2048, 512)], dtype, seed=9)
    ks, vs = FP8_SCALES
    cache = s.fp8_cache(ks, vs)
    extra = {"k_scale": ks, "v_scale": vs, "sliding_window": 1024}
    outs = []
    for setting in (cascade, False):
        backend = TritonAttentionBackend()
        backend.prefill_cascade = setting
        meta = _metadata(s, 1024, 3072)
        meta.slot_mapping = s.slots()
        meta.num_decodes = 2
        outs.append(backend.forward(s.query, s.key, s.value, cache, meta, SCALE, **extra))
    torch.testing.assert_close(outs[0], outs[1], **_tol(dtype))
    s.check(outs[0], dtype, fp8=(cache, ks, vs), window=1024)


def test_cudnn_dense_part_is_probed_on_hopper() -> None:
    """On sm_90 with cuDNN present the "cudnn" dense part passes its probe (the layout and
    base of its output and LSE), so the start-up timing can pick it."""
    if torch.cuda.get_device_capability(DEV)[0] != 9 or not torch.backends.cudnn.is_available():
        pytest.skip("the probe's expectation is for sm_90 with cuDNN")
    q = torch.empty(1, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=DEV)
    k = torch.empty(1, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=DEV)
    assert cudnn_dense_supported(q, k)


def test_device_timing_leaves_the_host_side_out() -> None:
    """`time_device` (the prefill path's timer) charges a call for its kernels alone: a call
    that spends 1 ms on the host before a tiny kernel takes about 1 ms under `time_config`
    and well under it under `time_device`."""
    x = torch.zeros(1024, device=DEV)

    def run() -> None:
        time.sleep(0.001)
        x.add_(1.0)

    with_host = time_config(run, iters=3)
    device_only = time_device(run, iters=3)
    assert with_host is not None and device_only is not None
    assert with_host >= 0.9, with_host
    assert device_only < 0.3, device_only

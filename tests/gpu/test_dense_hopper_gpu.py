"""The Hopper dense causal kernel (`tandem_kernels.dense_attention_hopper`) on an sm_90 device at
the 8B shape (32 query heads, 8 KV heads, head 128): every start-up config against
`scaled_dot_product_attention` (causal, GQA, per request) at 8 x 1,024, 2 x 4,096 and a varlen
batch with lengths off the tiles and padding rows past the last request, K/V as views of one
qkv tensor (TMA reads them) and as contiguous tensors; its LSE against our first dense
kernel's; one compile serving every token count; the start-up timing of the prefill paths
listing it with its configs' times.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs a CUDA sm_90 device", allow_module_level=True)

from tandem_kernels import dense_attention_hopper as dh  # noqa: E402
from tandem_kernels.cascade_attention import (  # noqa: E402
    dense_causal_attention,
    hopper_config,
    hopper_dense_supported,
    prefill_path,
    prefill_path_log,
)
from tandem_kernels.paged_attention import prefill_tuning  # noqa: E402

DEV = torch.device("cuda")
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128
SCALE = HEAD_SIZE**-0.5
SCENES = {
    "8x1024": [1024] * 8,
    "2x4096": [4096] * 2,
    "varlen": [1000, 1, 333, 2047, 64, 129, 700],
}


def _inputs(
    lens: list[int], dtype: torch.dtype, packed: bool, seed: int, padding: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key, value (views of one qkv tensor when `packed`, as `forward` gets them, with
    64 NaN rows past the batch) and cu_seqlens; `padding` rows (finite) between the last
    request and the batch's end, as a captured step pads it."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    num_tokens = sum(lens) + padding
    width = NUM_HEADS + 2 * NUM_KV_HEADS
    qkv = torch.randn(num_tokens + 64, width, HEAD_SIZE, generator=gen, device=DEV, dtype=dtype)
    qkv[num_tokens:] = float("nan")
    query = qkv[:num_tokens, :NUM_HEADS]
    key = qkv[:, NUM_HEADS : NUM_HEADS + NUM_KV_HEADS]
    value = qkv[:, NUM_HEADS + NUM_KV_HEADS :]
    if not packed:
        key, value = key[:num_tokens].contiguous(), value[:num_tokens].contiguous()
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    cu = torch.tensor(starts, dtype=torch.int32, device=DEV)
    return query, key, value, cu


def _sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lens: list[int]
) -> torch.Tensor:
    """Causal GQA attention per request through SDPA (whichever backend torch picks)."""
    outs, lo = [], 0
    for n in lens:
        q, k, v = (t[lo : lo + n].transpose(0, 1)[None] for t in (query, key, value))
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=SCALE, enable_gqa=True
        )
        outs.append(o[0].transpose(0, 1))
        lo += n
    return torch.cat(outs)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 4e-3, "rtol": 5e-3}


@pytest.mark.parametrize("config", dh.HOPPER_CONFIGS, ids=dh.hopper_config_name)
@pytest.mark.parametrize("scene", list(SCENES))
def test_every_config_matches_sdpa(scene: str, config: dh.HopperConfig) -> None:
    lens = SCENES[scene]
    padding = 16 if scene == "varlen" else 0
    query, key, value, cu = _inputs(lens, torch.bfloat16, True, seed=len(lens), padding=padding)
    assert dh.tma_usable(query, key, value)
    out, lse = dh.dense_hopper_attention(query, key, value, cu, SCALE, config=config)
    real = sum(lens)
    out, lse = out[:real], lse[:, :real]
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, _sdpa(query, key, value, lens), **_tol(torch.bfloat16))
    _, ref_lse = dense_causal_attention(
        query, key, value, cu, SCALE, max_query_len=max(lens), impl="triton"
    )
    torch.testing.assert_close(lse, ref_lse[:, :real], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("config", dh.HOPPER_CONFIGS, ids=dh.hopper_config_name)
@pytest.mark.parametrize("head_size", [64, 256])
def test_other_head_sizes_match_sdpa(head_size: int, config: dh.HopperConfig) -> None:
    """Head sizes of other models (64: Llama 3.2 1B; 256: Gemma 3) at the varlen scene, K/V
    as views of one qkv tensor, output and LSE against the dense reference. A config may not
    fit this device's shared memory or registers at a head size (start-up timing then leaves
    it out): it must say so by raising, never run wrong."""
    from triton.runtime.errors import OutOfResources, PTXASError

    from tandem_kernels.cascade_attention import dense_causal_ref

    lens = [300, 1, 129, 64, 777]
    gen = torch.Generator(device=DEV).manual_seed(head_size)
    qkv = torch.randn(
        sum(lens), NUM_HEADS + 2 * NUM_KV_HEADS, head_size, generator=gen, device=DEV
    ).bfloat16()
    query, key = qkv[:, :NUM_HEADS], qkv[:, NUM_HEADS : NUM_HEADS + NUM_KV_HEADS]
    value = qkv[:, NUM_HEADS + NUM_KV_HEADS :]
    cu = torch.tensor([0, 300, 301, 430, 494, 1271], dtype=torch.int32, device=DEV)
    scale = head_size**-0.5
    try:
        out, lse = dh.dense_hopper_attention(query, key, value, cu, scale, config=config)
    except (OutOfResources, PTXASError):
        assert head_size > 128, "every config fits at head sizes up to 128"
        return
    ref_out, ref_lse = dense_causal_ref(query, key, value, cu, scale)
    torch.testing.assert_close(out, ref_out, **_tol(torch.bfloat16))
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loads_and_dtypes(dtype: torch.dtype, tma: bool) -> None:
    """TMA and pointer loads, bf16 and fp16, contiguous K/V, through `dense_causal_attention`
    (the untimed default config; the dispatcher's own pick, which a start-up timing earlier in
    the process may have replaced, for the bit-for-bit check)."""
    lens = SCENES["varlen"]
    query, key, value, cu = _inputs(lens, dtype, packed=False, seed=3)
    assert hopper_dense_supported(query, key)
    config = dh.default_hopper_config(max(lens), HEAD_SIZE)
    out, lse = dh.dense_hopper_attention(query, key, value, cu, SCALE, config=config, tma=tma)
    torch.testing.assert_close(out, _sdpa(query, key, value, lens), **_tol(dtype))
    got = dense_causal_attention(
        query, key, value, cu, SCALE, max_query_len=max(lens), impl="triton_hopper"
    )
    if tma:  # the same compiled kernel (TMA loads, the picked config): the same bits
        picked = hopper_config(query, key, max(lens))
        same = dh.dense_hopper_attention(query, key, value, cu, SCALE, config=picked)
        assert torch.equal(got[0], same[0]) and torch.equal(got[1], same[1]), picked
    torch.testing.assert_close(got[0], out, **_tol(dtype))
    torch.testing.assert_close(got[1], lse, atol=2e-3, rtol=2e-3)


def test_one_compile_serves_every_token_count() -> None:
    """Token counts and request counts vary from step to step: the kernel compiled for the
    first call serves the rest (nothing compiles while serving)."""
    config = (64, 32, 4, 3, 0)
    kernel = dh._dense_hopper_kernel
    before = sum(len(c[0]) for c in kernel.device_caches.values())
    for lens in ([1000, 24], [1], [17, 513, 3], [4096]):
        query, key, value, cu = _inputs(lens, torch.bfloat16, packed=True, seed=9)
        out, _ = dh.dense_hopper_attention(query, key, value, cu, SCALE, config=config)
        torch.testing.assert_close(out, _sdpa(query, key, value, lens), **_tol(torch.bfloat16))
    after = sum(len(c[0]) for c in kernel.device_caches.values())
    assert after - before <= 1, (before, after)


def test_start_up_timing_lists_the_hopper_kernel() -> None:
    """Inside `prefill_tuning()` the paths' timing (fresh prompts: no cached prefix) times the
    Hopper kernel's configs first and the cascade with it among the paths."""
    lens = [1024, 1024]
    query, key, value, cu = _inputs(lens, torch.bfloat16, packed=True, seed=11)
    # A cache with a block size of its own (64): a shape key no other test has timed.
    num_blocks = 40
    cache = torch.randn(num_blocks, 2, 64, NUM_KV_HEADS, HEAD_SIZE, device=DEV).bfloat16()
    table = torch.arange(32, dtype=torch.int32, device=DEV).view(2, 16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    logged = len(prefill_path_log)
    with prefill_tuning():
        path = prefill_path(query, key, value, cache, cu, seq_lens, table, SCALE,
                            max_query_len=1024)  # fmt: skip
    if len(prefill_path_log) == logged:
        pytest.skip("start-up timing is off here (TANDEM_TUNE_KERNELS=0)")
    entry = prefill_path_log[logged]  # the call's own (the long class's stand-in may follow)
    assert entry["long"] is False
    assert "triton_hopper" in entry["ms"], entry
    assert set(entry["hopper_dense_ms"]) == {dh.hopper_config_name(c) for c in dh.HOPPER_CONFIGS}
    assert entry["best"] == path == min(entry["ms"], key=lambda p: entry["ms"][p])
    print(entry)

"""`tandem_kernels.block_copy.copy_blocks` at real size on the GPU: llama-3.1-8b blocks (32 layers,
8 KV heads, head size 128, 16 tokens, bf16: 2 MiB each), 128 pairs in shuffled order, equal to
the torch reference byte for byte; and its rate beside a `copy_` of the same bytes."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPE = (384, 32, 2, 16, 8, 128)


def _mapping(num_blocks: int, n: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    pairs = list(
        zip(rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n), strict=True)
    )
    return torch.tensor(pairs, dtype=torch.int64, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copy_blocks_matches_reference(dtype: torch.dtype) -> None:
    from tandem_kernels.block_copy import copy_blocks, copy_blocks_ref

    shape = SHAPE if dtype != torch.float32 else (192, *SHAPE[1:])
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    dst = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    expected = dst.clone()
    mapping = _mapping(shape[0], 128, 1)
    copy_blocks(src, dst, mapping)
    copy_blocks_ref(src, expected, mapping)
    torch.cuda.synchronize()
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("chunk_bytes", [16 * 1024, 128 * 1024])
def test_copy_blocks_rows_entry_other_chunks(chunk_bytes: int) -> None:
    """The rows entry (as the CUDA IPC connector calls it) at the chunk sizes the transfer
    benchmark also times."""
    from tandem_kernels.block_copy import block_words, copy_block_rows, copy_blocks_ref

    gen = torch.Generator(device="cuda").manual_seed(4)
    src = torch.randn(SHAPE, generator=gen, device="cuda").bfloat16()
    dst = torch.zeros_like(src)
    expected = dst.clone()
    mapping = _mapping(SHAPE[0], 128, 5)
    copy_block_rows(block_words(src), block_words(dst), mapping, chunk_bytes=chunk_bytes)
    copy_blocks_ref(src, expected, mapping)
    torch.cuda.synchronize()
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


def test_copy_blocks_odd_block_and_int32_mapping() -> None:
    from tandem_kernels.block_copy import copy_blocks, copy_blocks_ref

    shape = (64, 3, 2, 5, 1, 7)  # 210 halves = 420 bytes per block: 4-byte words, a tail
    src = torch.randn(shape, device="cuda").half()
    dst = torch.zeros(shape, device="cuda").half()
    expected = dst.clone()
    mapping = _mapping(64, 40, 2).int()
    copy_blocks(src, dst, mapping)
    copy_blocks_ref(src, expected, mapping)
    assert torch.equal(dst, expected)


def test_copy_blocks_rate() -> None:
    from tandem_kernels.block_copy import copy_blocks

    src = torch.randn(SHAPE, device="cuda").bfloat16()
    dst = torch.empty_like(src)
    n = 128
    mapping = _mapping(SHAPE[0], n, 3)

    def timed(fn: Callable[[], object]) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 10

    copy_ms = timed(lambda: dst[:n].copy_(src[:n]))
    kernel_ms = timed(lambda: copy_blocks(src, dst, mapping))
    print(
        f"\n128 x 2 MiB blocks: copy_ {copy_ms:.3f} ms, copy_blocks (shuffled) {kernel_ms:.3f} ms"
        f" ({copy_ms / kernel_ms:.0%} of the copy rate)"
    )
    assert kernel_ms < 3 * copy_ms, (kernel_ms, copy_ms)

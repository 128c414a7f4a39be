"""Host memory for the CPU engine's large tensors: backed by 2 MiB pages where the kernel can,
and the KV cache laid out layer-major.

A step reads the KV cache a layer at a time: for each request's blocks, one layer's K and V
(24 KB at the embedded model's shape). The engine indexes the cache as
`[num_blocks, num_layers, ...]` (a block id names the same slot in every layer); stored that
way, one layer's pieces of neighbouring blocks sit a whole block over all layers apart
(720 KB), and a decode step's reads are scattered. `layer_major_kv_cache` stores it
`[num_layers, num_blocks, ...]` and hands back the transposed view: the same shape and
indexing, but each layer's view `kv_cache[:, i]` is one contiguous span::

    storage   [ layer 0: block 0 | block 1 | ... ][ layer 1: block 0 | block 1 | ... ] ...
    engine    kv_cache[b, i] = storage[i, b]      (kv_cache.stride(0) < kv_cache.stride(1))

so a block's KV over all layers (`kv_cache[b]`) is no longer one contiguous span: whatever
moves whole blocks as bytes gathers and scatters them (`tandem.kv_transfer`).

With 4 KiB pages every piece a step reads is pages no other piece shares, and a decode step
of 64 requests walks thousands of page-table entries a layer, far past what the TLB holds.
Backed by 2 MiB pages, neighbouring pieces share one page.

Linux backs anonymous memory with huge pages where `transparent_hugepage` is `always`, or
`madvise` and the range was advised `MADV_HUGEPAGE` before it was touched. `huge_page_empty`
maps the tensor's memory itself (a fresh anonymous mapping, so nothing of it was touched, as
memory the allocator hands back again may have been) and advises it. Elsewhere (another OS,
THP `never`, a refused call) the pages are plain ones: they are a speed-up, never a
requirement.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20


def huge_page_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor like `torch.empty(shape, dtype=dtype)`, on its own anonymous
    mapping advised `MADV_HUGEPAGE` (Linux, at least one huge page's worth; otherwise
    `torch.empty`), starting at a huge page's boundary: the kernel backs only whole aligned
    2 MiB spans with huge pages and a mapping starts on any 4 KiB boundary, so the spans at
    its ends were plain pages (a 7 MiB tensor got two huge pages of three). The mapping (a
    huge page longer; the untouched rest takes no memory) lives as long as the tensor and its
    views do."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if not sys.platform.startswith("linux") or advice is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # refused: plain pages
        buf.madvise(advice)
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(tuple(shape))


def layer_major_kv_cache(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed KV cache of `shape` `[num_blocks, num_layers, ...]` whose memory is
    `[num_layers, num_blocks, ...]` (on `huge_page_empty`'s pages): the transposed view, so
    each layer's `kv_cache[:, i]` is contiguous and a block's `kv_cache[b]` is not (see the
    module docstring)."""
    num_blocks, num_layers, *rest = shape
    storage = huge_page_empty((num_layers, num_blocks, *rest), dtype).zero_()
    return storage.transpose(0, 1)

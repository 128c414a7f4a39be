"""Host memory for the CPU engine's large tensors: backed by 2 MiB pages where the kernel can.

A step reads the KV cache a layer at a time: for each request's blocks, one layer's K and V
(24 KB at the embedded model's shape), at a stride of a whole block over all layers (`kv_cache`
is `[num_blocks, num_layers, ...]`). With 4 KiB pages every such piece is pages no other piece
shares, and a decode step of 64 requests walks thousands of page-table entries a layer, far
past what the TLB holds: attention then waits on page walks as well as on memory. Backed by
2 MiB pages, a layer's pieces of neighbouring blocks share one page.

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
    `torch.empty`). The mapping lives as long as the tensor (and its views) do."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if not sys.platform.startswith("linux") or advice is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # refused: plain pages
        buf.madvise(advice)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(tuple(shape))

"""Host memory for the CPU engine's large tensors: backed by 2 MiB pages where the kernel can.

A step reads the KV cache a layer at a time: for each request's blocks, one layer's K and V
(24 KB at the embedded model's shape), at a stride of a whole block over all layers (`kv_cache`
is `[num_blocks, num_layers, ...]`). With 4 KiB pages every such piece is pages no other piece
shares, and a decode step of 64 requests walks thousands of page-table entries a layer, far
past what the TLB holds: attention then waits on page walks as well as on memory. Backed by
2 MiB pages, a layer's pieces of neighbouring blocks share one page.

Linux backs anonymous memory with huge pages where `transparent_hugepage` is `always`, or
`madvise` and the range was advised `MADV_HUGEPAGE` before it was touched; `huge_page_empty`
does that advice. Elsewhere (another OS, THP `never`, a failed call) it is a plain
`torch.empty`: the pages are a speed-up, never a requirement.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Advise the 2 MiB-aligned part of `t`'s storage `MADV_HUGEPAGE`; True if the call was
    made and succeeded. Pages already touched stay as they are until the kernel collapses
    them, so advise a tensor before writing it (see `huge_page_empty`)."""
    fn = _madvise()
    if fn is None or t.device.type != "cpu":
        return False
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return False
    return fn(lo, hi - lo, _MADV_HUGEPAGE) == 0


def huge_page_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype)` on the CPU, advised for 2 MiB pages before any page
    of it is touched (large allocations are fresh mappings: nothing is touched yet)."""
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t)
    return t

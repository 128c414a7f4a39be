"""The CPU engine's KV cache on 2 MiB pages (tandem/worker/cpu_memory.py): a fresh mapping
advised before its first touch, which the kernel backs with huge pages where transparent huge
pages are `always` or `madvise`, and the cache is zeroed as before. It is stored layer-major:
each layer's view is one contiguous span."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tandem.engine_args import EngineArgs
from tandem.loader import load_hf_config
from tandem.worker.cpu_memory import HUGE_PAGE, huge_page_empty, layer_major_kv_cache
from tandem.worker.worker import Worker


def thp_mode() -> str | None:
    """The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled, None if absent."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None


def anon_huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages (kB) summed over this process's mappings that overlap `t`'s storage."""
    lo = t.untyped_storage().data_ptr()
    hi = lo + t.untyped_storage().nbytes()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) < hi and lo < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


HUGE_OK = thp_mode() in ("always", "madvise")


def test_huge_page_empty_is_backed_by_huge_pages() -> None:
    t = huge_page_empty((16 << 20,), torch.float32)  # 64 MiB
    assert t.shape == (16 << 20,) and t.dtype == torch.float32
    t.fill_(1.5)
    assert float(t[-1]) == 1.5
    # It starts on a huge page's boundary: every whole 2 MiB span of it can be one huge page.
    assert t.data_ptr() % HUGE_PAGE == 0
    if HUGE_OK:
        assert anon_huge_kb(t) >= t.numel() * 4 // 1024
        # A weight-sized one (SmolLM2's packed gate_up, 7 MiB): its three whole spans too.
        w = huge_page_empty((3072, 576), torch.float32).fill_(1.0)
        assert w.data_ptr() % HUGE_PAGE == 0
        assert anon_huge_kb(w) >= 3 * HUGE_PAGE // 1024
    # Views keep the mapping; writes through them land in it.
    v = t.view(4, -1)[1:3]
    del t
    v.zero_()
    assert int(torch.count_nonzero(v)) == 0
    # Below one huge page: a plain tensor, same contract.
    small = huge_page_empty((3, 5), torch.bfloat16)
    assert small.shape == (3, 5) and small.dtype == torch.bfloat16


def test_cpu_kv_cache_is_zeroed_and_on_huge_pages(tiny_model_path) -> None:
    path = tiny_model_path("llama")
    config = EngineArgs(
        model=str(path), device="cpu", dtype="float32", kv_cache_memory_gb=0.064
    ).create_engine_config()
    worker = Worker(config, path, load_hf_config(path), 256, None)
    num_blocks = worker.determine_num_blocks()
    cache = worker.allocate_kv_cache(num_blocks)
    assert tuple(cache.shape) == tuple(worker.model_runner.kv_cache_shape(num_blocks))
    assert cache.nbytes >= 32 << 20
    assert int(torch.count_nonzero(cache)) == 0
    if HUGE_OK:
        assert anon_huge_kb(cache) >= (cache.nbytes - 2 * HUGE_PAGE) // 1024
    # Layer-major: every layer's view (what the attention kernels read) is one span.
    assert cache.shape[1] > 1
    assert all(cache[:, i].is_contiguous() for i in range(cache.shape[1]))
    assert cache.stride(0) < cache.stride(1)


def test_layer_major_kv_cache_indexes_as_block_major() -> None:
    shape = (5, 3, 2, 4, 2, 8)  # blocks, layers, K/V, block size, KV heads, head size
    cache = layer_major_kv_cache(shape, torch.float32)
    assert tuple(cache.shape) == shape and int(torch.count_nonzero(cache)) == 0
    ref = torch.randn(shape)
    cache.copy_(ref)
    assert torch.equal(cache, ref)
    assert torch.equal(cache[3, 1], ref[3, 1])
    # The memory is [layers, blocks, ...]: layer 1's blocks follow layer 0's.
    flat = cache.transpose(0, 1).reshape(-1)
    assert flat.data_ptr() == cache.data_ptr()
    assert torch.equal(flat[: ref[:, 0].numel()], ref[:, 0].reshape(-1))

"""A KV cache tensor opened by another process on the same host.

The engine's cache lives in the process of its rank (the engine's own process with one
in-process rank, a rank process under a `MultiprocExecutor`); a worker service that hands
KV blocks over opens the same memory in its own process::

    owner:   export_kv_cache(tensor) -> SharedKVCache   (picklable)
    other:   open_shared_kv_cache(shared) -> tensor      (the same memory)

`kind` "cuda": `handle` is the storage's `_share_cuda_()` tuple (a CUDA IPC handle; the opener
must not be the owner, and memory opened this way cannot be exported again: pass the
`SharedKVCache` on instead). `kind` "cpu": `handle` is (shm manager handle, file name, size) of
a shared-memory file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SharedKVCache:
    """How another process opens a KV cache tensor (see the module docstring)."""

    kind: str
    handle: tuple[Any, ...]
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


def export_kv_cache(cache: torch.Tensor) -> SharedKVCache:
    """Export `cache` (owned by this process) for other processes of this host."""
    storage = cache.untyped_storage()
    if cache.device.type == "cuda":
        handle: tuple[Any, ...] = tuple(storage._share_cuda_())
        kind = "cuda"
    else:
        handle = tuple(storage._share_filename_cpu_())
        kind = "cpu"
    return SharedKVCache(
        kind=kind,
        handle=handle,
        dtype=str(cache.dtype).removeprefix("torch."),
        shape=tuple(cache.shape),
        stride=tuple(cache.stride()),
        storage_offset=cache.storage_offset(),
    )


def open_shared_kv_cache(shared: SharedKVCache) -> torch.Tensor:
    """Open another process's KV cache tensor in this process."""
    dtype = getattr(torch, shared.dtype)
    if shared.kind == "cuda":
        index = int(shared.handle[0])
        with torch.cuda.device(index):
            storage = torch.UntypedStorage._new_shared_cuda(*shared.handle)
            device = torch.device("cuda", index)
    else:
        manager, name, size = shared.handle
        storage = torch.UntypedStorage._new_shared_filename_cpu(manager, name, size)
        device = torch.device("cpu")
    return torch.empty(0, dtype=dtype, device=device).set_(
        storage, shared.storage_offset, shared.shape, shared.stride
    )

"""CPU paged attention read in place: the C++ kernel of `tandem_kernels.cpu`.

The torch backend gathers each request's blocks into padded K/V tensors and runs SDPA over the
padding; this one reads every K/V row where its block is, one work item per (request, KV head,
tile of 16 query rows), items taken dynamically by the OpenMP threads. Decode, chunked prefill,
prefix hits and mixed steps are one code path: query row j of request r attends to positions
`0 .. seq_lens[r] - query_len + j` of its cached context (with a sliding window W, to the last
W of them, reading no block left of the window).

`forward_qkv` fuses the K/V write into the rotary kernel
(`tandem_kernels.cpu.rotary_qkv_cache`) and calls `attend` on the written cache; `forward`
(write, then attend) keeps the backend interface for every other caller.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    register_attention_backend,
)
from tandem.layers.attention.torch_backend import TorchAttentionBackend, write_kv_cache


@register_attention_backend
class CpuAttentionBackend(AttentionBackend):
    """Paged attention on the CPU through the C++ extension (built on first use)."""

    name = "cpu"
    fuses_rotary_kv_write = True

    def __init__(self) -> None:
        from tandem_kernels import cpu

        if not cpu.available():
            raise RuntimeError("the cpu attention backend needs the tandem CPU extension")
        self._reference = TorchAttentionBackend()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if kv_cache.dtype == torch.float8_e4m3fn:
            raise ValueError("the cpu attention backend has no FP8 KV cache")
        n = metadata.num_actual_tokens
        if kv_cache.numel() > 0 and n > 0:
            write_kv_cache(key[:n], value[:n], kv_cache, metadata.slot_mapping[:n])
        return self.attend(query, key, value, kv_cache, metadata, scale, sliding_window)

    def forward_qkv(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        rotary_emb: Any,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """One kernel splits Q/K/V, rotates Q and K and writes K/V into the paged cache; the
        attention then reads the cache in place. No FP8 cache, so both scales are 1.0."""
        from tandem_kernels import cpu

        if kv_cache.dtype == torch.float8_e4m3fn:
            raise ValueError("the cpu attention backend has no FP8 KV cache")
        del k_scale, v_scale

        q, k, v = cpu.rotary_qkv_cache(
            qkv,
            positions,
            rotary_emb.cos_cache,
            rotary_emb.sin_cache,
            kv_cache,
            metadata.slot_mapping,
            num_heads,
            num_kv_heads,
            head_size,
        )
        return self.attend(q, k, v, kv_cache, metadata, scale, sliding_window)

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # this step's K/V already written at slot_mapping
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Attention over a cache that already holds this step's K/V (`key`/`value` are
        read only when there is no cache)."""
        if kv_cache.numel() == 0 or metadata.num_actual_tokens == 0:
            return self._reference.forward(
                query, key, value, kv_cache, metadata, scale, sliding_window=sliding_window
            )
        from tandem_kernels import cpu

        r = metadata.num_reqs
        out = cpu.paged_attention(
            query[: metadata.num_actual_tokens],
            kv_cache,
            metadata.block_table[:r],
            metadata.seq_lens[:r],
            metadata.query_start_loc[: r + 1],
            scale,
            sliding_window,
        )
        if out.shape[0] == query.shape[0]:
            return out
        full = torch.zeros_like(query)
        full[: out.shape[0]] = out
        return full

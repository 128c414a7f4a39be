"""Attention through the Triton kernels in `kernels/` (the GPU path).

`forward` writes the step's K/V into the paged cache, then runs the decode kernel (split-K)
when `metadata.is_decode_only`, else the prefill/mixed kernel, which reads every K/V of a
request's context (prefix hits and earlier chunks too) from the cache. In a mixed step the
leading `metadata.num_decodes` one-token requests go through the decode kernel instead.

No host-device syncs: sizes come from tensor shapes and metadata's Python ints. The decode
path is CUDA-graph capturable: its number of splits is a function of `num_reqs`,
`num_kv_heads` and `metadata.max_seq_len` (a runner capturing a graph should pass the largest
length the graph will serve, e.g. max_model_len; any value gives correct results, it only
changes how the work is cut), and it allocates only buffers sized by those ints.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from kernels.reshape_and_cache import reshape_and_cache
from tandem.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    register_attention_backend,
)


@register_attention_backend
class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels; rows past `num_actual_tokens` come back as zeros."""

    name: ClassVar[str] = "triton"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        num_reqs = metadata.num_reqs
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping[:num_tokens])
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        seq_lens = metadata.seq_lens[:num_reqs]
        block_table = metadata.block_table[:num_reqs]
        if metadata.is_decode_only:
            paged_decode_attention(
                query,
                kv_cache,
                seq_lens,
                block_table,
                scale,
                max_seq_len=metadata.max_seq_len,
                out=out,
            )
        elif 0 < metadata.num_decodes < num_reqs:
            # Mixed step: its one-token requests (first) through the split-K decode kernel,
            # which reads long contexts at full bandwidth; the rest through the prefill kernel.
            nd = metadata.num_decodes
            paged_decode_attention(
                query[:nd],
                kv_cache,
                seq_lens[:nd],
                block_table[:nd],
                scale,
                max_seq_len=metadata.max_seq_len,
                out=out[:nd],
            )
            paged_prefill_attention(
                query[nd:],
                kv_cache,
                metadata.query_start_loc[nd : num_reqs + 1] - nd,
                seq_lens[nd:],
                block_table[nd:],
                scale,
                out=out[nd:],
            )
        else:
            paged_prefill_attention(
                query,
                kv_cache,
                metadata.query_start_loc[: num_reqs + 1],
                seq_lens,
                block_table,
                scale,
                out=out,
            )
        if query.shape[0] > num_tokens:
            out[num_tokens:].zero_()
        return out

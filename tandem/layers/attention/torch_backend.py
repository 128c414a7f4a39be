"""Pure-torch paged attention: the reference backend, and the CPU one.

Each call first writes the step's new K/V into the paged cache at `slot_mapping` (for every
request), then attends:

- requests with one query token (decode) in one padded, batched SDPA: their contexts are
  gathered through their block-table rows to a common length, and a length mask hides the
  padding;
- the other requests (prefill chunks) one at a time: the query rows against the first
  `seq_lens[r]` cached positions, causal with the offset `seq_lens[r] - query_len`
  (a fresh prefill, where the context is exactly the new tokens, reads them directly).

Sliding-window layers (`sliding_window` W): a query at position p sees keys p - W < k <= p;
only the blocks from the one holding the earliest such key on are gathered (blocks left of
every query's window may be freed, their block-table entries the null block).

GQA: SDPA's `enable_gqa` shares each KV head among its `num_heads // num_kv_heads` query heads
(no repeated copy of K/V).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    register_attention_backend,
)


def write_kv_cache(
    key: torch.Tensor,  # [N, num_kv_heads, head_size]
    value: torch.Tensor,  # [N, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [N] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store token i's K/V at slot `slot_mapping[i]` (block s // block_size, offset s % bs);
    an FP8 cache takes `key / k_scale`, `value / v_scale`, saturated to e4m3."""
    block_size = kv_cache.shape[2]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    if kv_cache.dtype == torch.float8_e4m3fn:
        key = (key.float() / k_scale).clamp(-448.0, 448.0)
        value = (value.float() / v_scale).clamp(-448.0, 448.0)
    kv_cache[block_ids, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = value.to(kv_cache.dtype)


def _widen(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cached K or V in the query's dtype (an FP8 cache's values times their scale)."""
    x = x.to(dtype)
    return x if scale == 1.0 else x * scale


def gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's first `seq_len` cached K and V: `[seq_len, num_kv_heads, head_size]` each."""
    block_ids = block_ids.long()
    _, _, block_size, kv_heads, head_size = kv_cache.shape
    length = block_ids.shape[0] * block_size
    key = kv_cache[:, 0].index_select(0, block_ids).reshape(length, kv_heads, head_size)
    value = kv_cache[:, 1].index_select(0, block_ids).reshape(length, kv_heads, head_size)
    return key[:seq_len], value[:seq_len]


def _sdpa(
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, KVH, S, D]
    value: torch.Tensor,  # [B, KVH, S, D]
    scale: float,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@register_attention_backend
class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain torch (CPU or any device); exact in float32."""

    name = "torch"

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
        num_tokens = metadata.num_actual_tokens
        output = torch.zeros_like(query)
        if num_tokens == 0:
            return output
        has_cache = kv_cache.numel() > 0
        if has_cache:
            write_kv_cache(
                key[:num_tokens],
                value[:num_tokens],
                kv_cache,
                metadata.slot_mapping[:num_tokens],
                k_scale,
                v_scale,
            )
        kv_scales = (k_scale, v_scale) if has_cache else (1.0, 1.0)

        query_start_loc = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu
        num_reqs = metadata.num_reqs
        if metadata.is_decode_only:
            decode_reqs = list(range(num_reqs))
        else:
            decode_reqs = [
                r for r in range(num_reqs) if query_start_loc[r + 1] - query_start_loc[r] == 1
            ]
        if has_cache and decode_reqs:
            self._decode(
                query, kv_cache, metadata, scale, decode_reqs, output, kv_scales, sliding_window
            )
        else:
            decode_reqs = []
        decode_set = set(decode_reqs)
        for r in range(num_reqs):
            if r in decode_set:
                continue
            start, end = query_start_loc[r], query_start_loc[r + 1]
            query_len, seq_len = end - start, seq_lens[r]
            if query_len == 0:
                continue
            first_pos = 0  # the position of k[0]
            if not has_cache or (seq_len == query_len and kv_cache.dtype == key.dtype):
                # The context is exactly this step's tokens (or there is no cache yet).
                k, v = key[start:end], value[start:end]
                seq_len = query_len
            else:
                block_size = kv_cache.shape[2]
                lowest = seq_len - query_len - sliding_window + 1 if sliding_window else 0
                first_block = max(lowest, 0) // block_size
                first_pos = first_block * block_size
                num_blocks = _cdiv(seq_len, block_size)
                block_ids = metadata.block_table[r, first_block:num_blocks]
                k, v = gather_kv(kv_cache, block_ids, seq_len - first_pos)
            q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            k = _widen(k, query.dtype, kv_scales[0]).transpose(0, 1).unsqueeze(0)
            v = _widen(v, query.dtype, kv_scales[1]).transpose(0, 1).unsqueeze(0)
            if query_len == seq_len and not sliding_window:
                out = _sdpa(q, k, v, scale, is_causal=True)
            else:
                # Query row j sits at position seq_len - query_len + j.
                q_pos = torch.arange(query_len, device=query.device) + (seq_len - query_len)
                k_pos = torch.arange(first_pos, seq_len, device=query.device)
                mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
                if sliding_window:
                    mask &= k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - sliding_window
                out = _sdpa(q, k, v, scale, attn_mask=mask)
            output[start:end] = out[0].transpose(0, 1)
        return output

    @staticmethod
    def _decode(
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        reqs: list[int],
        output: torch.Tensor,
        kv_scales: tuple[float, float] = (1.0, 1.0),
        sliding_window: int | None = None,
    ) -> None:
        """One query token per request in `reqs`: one batched SDPA over padded contexts (with
        a window, each request's blocks from the one holding its first key in the window)."""
        device = query.device
        block_size = kv_cache.shape[2]
        max_seq_len = max(metadata.seq_lens_cpu[r] for r in reqs)
        num_blocks = _cdiv(max_seq_len, block_size)
        if sliding_window:
            num_blocks = min(num_blocks, _cdiv(sliding_window - 1, block_size) + 1)
        if len(reqs) == metadata.num_reqs:
            rows = metadata.query_start_loc[:-1].long()
            block_table = metadata.block_table
            seq_lens = metadata.seq_lens
        else:
            req_idx = torch.tensor(reqs, device=device, dtype=torch.long)
            rows = metadata.query_start_loc.index_select(0, req_idx).long()
            block_table = metadata.block_table.index_select(0, req_idx)
            seq_lens = metadata.seq_lens.index_select(0, req_idx)
        batch = rows.shape[0]
        seq_lens = seq_lens[:batch]
        block_table = block_table[:batch]
        columns = torch.arange(num_blocks, device=device).unsqueeze(0)
        lowest = torch.zeros_like(seq_lens)
        if sliding_window:  # the first key in the window: seq_len - W
            lowest = (seq_lens - sliding_window).clamp(min=0)
            first_block = (lowest // block_size).long().unsqueeze(1)
            columns = (first_block + columns).clamp(max=block_table.shape[1] - 1)
            block_table = block_table.gather(1, columns)
        else:
            block_table = block_table[:, :num_blocks]
        # Unused block-table entries may hold anything; they are masked out, but must index.
        block_ids = block_table.long().clamp(0, kv_cache.shape[0] - 1)
        _, _, _, kv_heads, head_size = kv_cache.shape
        length = num_blocks * block_size
        # Gather K and V separately (index_select copies whole blocks, far faster than
        # advanced indexing here): each is contiguous [B * n, block_size, KVH, D].
        flat_ids = block_ids.reshape(-1)
        k = kv_cache[:, 0].index_select(0, flat_ids).view(batch, length, kv_heads, head_size)
        v = kv_cache[:, 1].index_select(0, flat_ids).view(batch, length, kv_heads, head_size)
        k = _widen(k, query.dtype, kv_scales[0]).transpose(1, 2)
        v = _widen(v, query.dtype, kv_scales[1]).transpose(1, 2)
        positions = torch.arange(length, device=device).unsqueeze(0)
        if sliding_window:
            positions = positions + (lowest // block_size * block_size).unsqueeze(1)
        mask = (positions < seq_lens.unsqueeze(1)) & (positions >= lowest.unsqueeze(1))
        # SDPA adds -inf to masked scores and weighs masked V rows 0, so a NaN there would
        # still spread: K and V of padding (the null block's, whatever it holds) are zeroed.
        hidden = ~mask[:, None, :, None]
        k, v = k.masked_fill(hidden, 0.0), v.masked_fill(hidden, 0.0)
        q = query.index_select(0, rows).unsqueeze(2)  # [B, H, 1, D]
        out = _sdpa(q, k, v, scale, attn_mask=mask[:, None, None, :])
        output[rows] = out.squeeze(2)

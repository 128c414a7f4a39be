"""The attention layer a model builds: its backend comes from the model context, never from
the model.

    q [T, H, D], k/v [T, Hkv, D] --Attention--> [T, H * D]   (K/V written into the paged cache)

`forward` takes rotated Q/K (models that norm or scale Q/K between the projection and the
rotary embedding); `forward_qkv` takes the fused projection and the rotary embedding, and lets
a backend that can (`fuses_rotary_kv_write`: the CPU's, the Triton one's) split, rotate and
write in one kernel. While the runner captures or replays piecewise CUDA graphs it sets
`attn_metadata.graph_splitter`, and every call goes to it (split, rotated, then `forward`): the
runner splits the forward at these layers (tandem.worker.piecewise_graph).

Sliding-window layers (`sliding_window` W): the query at absolute position p attends to the
keys at positions k with p - W < k <= p (W keys, itself included; transformers' convention).
Blocks wholly left of the window are never read: a KV manager may free them and leave the null
block id 0 in their block-table slots.

    position        0 1 2 3 4 5 6 7 8 9
    p = 9, W = 4                x x x x   (keys 6..9)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.layers.attention.backend import AttentionBackend, AttentionMetadata, split_qkv


class Attention(nn.Module):
    """Paged attention over this rank's heads (`num_heads` query heads, `num_kv_heads` KV
    heads, GQA when fewer)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        backend: AttentionBackend,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.backend = backend
        # Keys this layer attends to, counting back from the query (None: the whole context).
        self.sliding_window = sliding_window
        # The KV cache group whose block table this layer reads (`AttentionMetadata.kv_groups`);
        # set by the runner from the cache's spec.
        self.kv_cache_group = 0
        self.q_size = num_heads * head_size
        self.kv_size = num_kv_heads * head_size
        # Per-tensor scales of an FP8 KV cache (`x ~= x_fp8 * scale`): the checkpoint's
        # `k_scale` / `v_scale` when it has them (`load_kv_scale`), else 1.0.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def load_kv_scale(self, which: str, loaded: torch.Tensor) -> None:
        """Set `k_scale` or `v_scale` (`which`) from a checkpoint's scalar tensor."""
        if which not in ("k_scale", "v_scale"):
            raise ValueError(f"no KV cache scale {which!r} (k_scale, v_scale)")
        value = float(loaded.float().reshape(-1).max())
        if not value > 0.0:
            raise ValueError(f"KV cache {which} must be positive, got {value}")
        setattr(self, which, value)

    def kv_scales(self, kv_cache: torch.Tensor) -> tuple[float, float]:
        """`(k_scale, v_scale)` for `kv_cache`: the layer's for an FP8 cache, else 1.0."""
        if kv_cache.dtype == torch.float8_e4m3fn:
            return self.k_scale, self.v_scale
        return 1.0, 1.0

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`[T, H * D]` from rotated Q `[T, H, D]` and K/V `[T, Hkv, D]`."""
        if attn_metadata.kv_groups is not None:
            attn_metadata = attn_metadata.kv_groups[self.kv_cache_group]
        splitter = attn_metadata.graph_splitter
        if splitter is not None:
            return splitter.attend(self, query, key, value, kv_cache, attn_metadata)
        return self.attend(query, key, value, kv_cache, attn_metadata)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The backend's K/V write and attention (what `forward` runs when nothing splits)."""
        k_scale, v_scale = self.kv_scales(kv_cache)
        out = self.backend.forward(
            query, key, value, kv_cache, attn_metadata, self.scale, k_scale, v_scale,
            **self._window_kwargs(),
        )  # fmt: skip
        return out.reshape(query.shape[0], self.q_size)

    def _window_kwargs(self) -> dict[str, int]:
        """`sliding_window` for the backend, only when the layer slides (a backend written
        before windows existed still serves full-attention layers)."""
        return {} if self.sliding_window is None else {"sliding_window": self.sliding_window}

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection `[T, q | k | v]` as Q `[T, H, D]`, K and V `[T, Hkv, D]`."""
        return split_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_size)

    def forward_qkv(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        rotary_emb: Any,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`[T, H * D]` from the fused projection: split, rotate Q and K, write, attend."""
        backend = self.backend
        if attn_metadata.kv_groups is not None:
            attn_metadata = attn_metadata.kv_groups[self.kv_cache_group]
        if backend.fuses_rotary_kv_write and attn_metadata.graph_splitter is None:
            k_scale, v_scale = self.kv_scales(kv_cache)
            out = backend.forward_qkv(
                positions,
                qkv,
                rotary_emb,
                kv_cache,
                attn_metadata,
                self.scale,
                self.num_heads,
                self.num_kv_heads,
                self.head_size,
                k_scale,
                v_scale,
                **self._window_kwargs(),
            )
            return out.reshape(qkv.shape[0], self.q_size)
        q, k, v = self.split_qkv(qkv)
        q, k = rotary_emb(positions, q, k)
        return self.forward(q, k, v, kv_cache, attn_metadata)

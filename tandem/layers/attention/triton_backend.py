"""Attention through the Triton kernels in `tandem_kernels/` (the GPU path).

`forward` writes the step's K/V into the paged cache, then runs the decode kernel (split-K)
when `metadata.is_decode_only`, else the prefill/mixed kernel, which reads every K/V of a
request's context (prefix hits and earlier chunks too) from the cache. In a mixed step the
leading `metadata.num_decodes` one-token requests go through the decode kernel instead.
`forward_qkv` (the `Attention` layer's call with the fused projection, outside piecewise
graphs) rotates Q and K and writes K/V in one kernel (`tandem_kernels.rotary_and_cache`),
then runs the same attention:

    forward      = reshape_and_cache  + _attend     (Q and K rotated by the layer)
    forward_qkv  = rotary_and_cache   + _attend     (split, rotation and write in one kernel)

No host-device syncs: sizes come from tensor shapes and metadata's Python ints. The decode
path is CUDA-graph capturable: its number of splits is a function of `num_reqs`,
`num_kv_heads` and `metadata.max_seq_len` (a runner capturing a graph should pass the largest
length the graph will serve, e.g. max_model_len; any value gives correct results, it only
changes how the work is cut), and it allocates only buffers sized by those ints.

Prefill rows go through the cascade (`tandem_kernels.cascade_attention`) on CUDA when it
wins: the new tokens attend to themselves from the dense `key`/`value` this call receives
(torch's FlashAttention-2 or our Triton kernel), then to their cached prefix through the
paged cache, merged by log-sum-exp in the paged kernel's epilogue. Which path (all-paged,
cascade with either dense kernel) is timed once per shape in the start-up profile forward
(`prefill_path`); untimed, the cascade. The path is chosen once per step, by `plan_step`
where the runner builds the metadata (`AttentionMetadata.prefill_path`), and every layer of
the step reads it. `TANDEM_PREFILL_CASCADE=0` forces the all-paged
kernel (`paged_prefill_attention`) for A/B; `=1` forces the cascade on any device. Layers
with a sliding window and FP8 caches take the cascade too: the dense part reads the step's K/V
rounded as the FP8 cache holds them and masks the window, the paged part reads only the
prefix inside it; FlashAttention-2, our Hopper dense kernel and cuDNN take neither, so such a
layer runs our first dense kernel where the step's path is "flash", "triton_hopper" or "cudnn"
(`layer_prefill_path`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, ClassVar

import torch

from tandem.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionShape,
    prefill_rows_have_context,
    register_attention_backend,
)
from tandem.layers.rotary import RotaryEmbedding
from tandem_kernels.cascade_attention import (
    default_dense_impl,
    dense_causal_attention,
    fp8_rounded_kv,
    layer_prefill_path,
    paged_context_attention,
    planned_prefill_path,
    prefill_cascade_setting,
    prefill_path,
)
from tandem_kernels.padding import zero_rows_from
from tandem_kernels.paged_attention import (
    attention_shape_key,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_tuning,
    tune_decode_attention,
)
from tandem_kernels.reshape_and_cache import FP8_KV_DTYPE, reshape_and_cache
from tandem_kernels.rotary_and_cache import rotary_and_cache, rotary_kv_setting


def _fused_rotary_takes(rotary_emb: Any, qkv: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether `rotary_and_cache` serves this call: the standard `RotaryEmbedding`, a 2-D
    projection (innermost dim contiguous) in a dtype of the kernel's, the cache in that dtype
    or FP8."""
    return (
        type(rotary_emb) is RotaryEmbedding
        and qkv.dim() == 2
        and qkv.stride(-1) == 1
        and qkv.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and kv_cache.dtype in (qkv.dtype, FP8_KV_DTYPE)
    )


@register_attention_backend
class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels; rows past `num_actual_tokens` come back as zeros."""

    name: ClassVar[str] = "triton"

    # The decode tuning batch: the throughput case, where the kernel is bound by reading the
    # cache (up to this many requests of up to this many tokens).
    TUNE_MAX_REQS: ClassVar[int] = 512
    TUNE_MAX_SEQ_LEN: ClassVar[int] = 1024

    graph_kv_write: ClassVar[bool] = True
    # `forward_qkv`: the rotary embedding and the K/V write in one kernel (`rotary_and_cache`).
    fuses_rotary_kv_write: ClassVar[bool] = True
    # The varlen kernel finds each program's request on the device (`find_request`).
    full_graph_mixed: ClassVar[bool] = True

    def __init__(self) -> None:
        # Prefill rows through the cascade (True) or the all-paged kernel (False); None: as
        # `prefill_path` picks (measured at start-up on CUDA). TANDEM_PREFILL_CASCADE sets it.
        self.prefill_cascade: bool | None = prefill_cascade_setting()
        # `forward_qkv` in one kernel (True) or split, rotary, `forward` (False, the default
        # until measured). TANDEM_ROTARY_KV sets it.
        self.fuse_rotary_kv: bool = rotary_kv_setting()

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """One kernel, no host sync (slots < 0 skipped): capturable."""
        reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)

    def plan_step(
        self,
        metadata: AttentionMetadata,
        shape: AttentionShape,
        sliding_window: int | None = None,
    ) -> AttentionMetadata:
        """The step's prefill path (`metadata.prefill_path`), for every layer of the group
        (each runs it through `layer_prefill_path`: FP8 caches and sliding windows swap
        FlashAttention-2 and the Hopper kernel for our first dense kernel): as
        `prefill_cascade` forces it, else `planned_prefill_path` for the cache's dtype (None
        on the start-up step whose path is timed: its first layer's call times it).
        Decode-only steps have no prefill rows.

        A whole-step graph (`metadata.graph_padded`) takes "paged" unless the cascade is
        forced: its steps' one-token requests, counted only on the device, cannot go to the
        decode kernel, and the cascade's context kernel would give each one a tile sized for
        long prefixes."""
        del sliding_window  # a layer's own window only changes the dense kernel
        if metadata.is_decode_only:
            return metadata
        if self.prefill_cascade is False or (metadata.graph_padded and not self.prefill_cascade):
            path: str | None = "paged"
        elif self.prefill_cascade:
            path = default_dense_impl()
        else:
            key = attention_shape_key(
                shape.num_heads,
                shape.num_kv_heads,
                shape.head_size,
                shape.kv_cache_dtype,
                shape.block_size,
            )
            path = planned_prefill_path(
                shape.device, key, metadata.num_actual_tokens, metadata.max_query_len
            )
        has_context = metadata.graph_padded or prefill_rows_have_context(metadata)
        return dataclasses.replace(metadata, prefill_path=path, prefill_has_context=has_context)

    def startup_tuning(self) -> contextlib.AbstractContextManager[None]:
        """The prefill kernel picks its tile config inside (see `prefill_tuning`)."""
        return prefill_tuning()

    def tune(
        self,
        kv_cache: torch.Tensor,
        *,
        num_heads: int,
        max_num_reqs: int,
        max_seq_len: int,
    ) -> str | None:
        """Time the decode kernel's configs on this cache and keep the fastest, once per
        process (`tune_decode_attention`; on CUDA only). The batch is the largest the engine
        runs, capped at `TUNE_MAX_REQS` requests of `TUNE_MAX_SEQ_LEN` tokens."""
        block_size = kv_cache.shape[2]
        seq_len = min(max(max_seq_len, block_size), self.TUNE_MAX_SEQ_LEN)
        num_reqs = min(max_num_reqs, self.TUNE_MAX_REQS)
        with torch.inference_mode():
            best = tune_decode_attention(kv_cache, num_heads, num_reqs=num_reqs, seq_len=seq_len)
        return None if best is None else str(best)

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
        slot_mapping = metadata.slot_mapping[:num_tokens]
        reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)
        return self._attend(
            query, key, value, kv_cache, metadata, scale, k_scale, v_scale, sliding_window
        )

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
        """One kernel (`rotary_and_cache`) rotates Q and K and writes K/V into the paged cache
        (`slot_mapping[:num_actual_tokens]`, as `forward` writes), then `forward`'s attention
        runs on its query and key and a view of V. Its rotation is `rotary_embedding`'s, which
        is what `RotaryEmbedding` runs on CUDA: the same bits as splitting, rotating and
        calling `forward`. It takes that class's tables only (a subclass or another rotary
        may rotate otherwise) and a 2-D projection, innermost dim contiguous, in the cache's
        dtype (or an FP8 cache); anything else, and every call with `fuse_rotary_kv` off,
        goes the unfused way (the base class's)."""
        if not (self.fuse_rotary_kv and _fused_rotary_takes(rotary_emb, qkv, kv_cache)):
            return super().forward_qkv(
                positions, qkv, rotary_emb, kv_cache, metadata, scale, num_heads,
                num_kv_heads, head_size, k_scale, v_scale, sliding_window=sliding_window,
            )  # fmt: skip
        slot_mapping = metadata.slot_mapping[: metadata.num_actual_tokens]
        query, key, value = rotary_and_cache(
            positions, qkv, rotary_emb.cos_cache, rotary_emb.sin_cache, kv_cache, slot_mapping,
            num_heads, num_kv_heads, head_size, k_scale, v_scale,
        )  # fmt: skip
        return self._attend(
            query, key, value, kv_cache, metadata, scale, k_scale, v_scale, sliding_window
        )

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float,
        v_scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """`forward` after its K/V write: attention over a cache that holds the step's K/V
        (`key`/`value`, the step's rows, feed the cascade's dense part)."""
        num_reqs = metadata.num_reqs
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        window = {"sliding_window": sliding_window}
        seq_lens = metadata.seq_lens[:num_reqs]
        block_table = metadata.block_table[:num_reqs]
        decode = functools.partial(
            paged_decode_attention, max_seq_len=metadata.max_seq_len, **scales, **window
        )
        if metadata.is_decode_only:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
            decode(query, kv_cache, seq_lens, block_table, scale, out=out)
            return self._zero_padding(out, metadata)
        # A mixed step's one-token requests (first) go through the split-K decode kernel,
        # which reads long contexts at full bandwidth; the rest through a prefill path.
        nd = metadata.num_decodes if 0 < metadata.num_decodes < num_reqs else 0
        qsl = metadata.query_start_loc[: num_reqs + 1]
        prefill_qsl = qsl[nd:] - nd if nd else qsl
        path = self._prefill_path(
            query, key, value, kv_cache, qsl, seq_lens, block_table, scale, metadata,
            k_scale, v_scale, sliding_window,
        )  # fmt: skip
        if path != "paged":
            # Part 1 over every row (a leading decode's row, itself alone, is replaced below),
            # from the K/V as the cache holds them (FP8: rounded).
            dense_k, dense_v = fp8_rounded_kv(key, value, kv_cache.dtype, k_scale, v_scale)
            out, lse = dense_causal_attention(
                query, dense_k, dense_v, qsl, scale, max_query_len=metadata.max_query_len,
                impl=path, need_lse=metadata.prefill_has_context, **scales, **window,
            )  # fmt: skip
            if nd:
                decode(query[:nd], kv_cache, seq_lens[:nd], block_table[:nd], scale, out=out[:nd])
            if not metadata.prefill_has_context:
                return self._zero_padding(out, metadata)
            paged_context_attention(
                query[nd:],
                kv_cache,
                prefill_qsl,
                seq_lens[nd:],
                block_table[nd:],
                scale,
                out[nd:],
                lse[:, nd:],
                **scales,
                **window,
            )
            return self._zero_padding(out, metadata)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if nd:
            decode(query[:nd], kv_cache, seq_lens[:nd], block_table[:nd], scale, out=out[:nd])
        paged_prefill_attention(
            query[nd:],
            kv_cache,
            prefill_qsl,
            seq_lens[nd:],
            block_table[nd:],
            scale,
            out=out[nd:],
            **scales,
            **window,
        )
        return self._zero_padding(out, metadata)

    @staticmethod
    def _zero_padding(out: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """`out` with its rows past the step's tokens zeroed: on the device in a whole-step
        graph (`metadata.graph_padded`), else past `num_actual_tokens`."""
        if metadata.graph_padded:
            return zero_rows_from(out, metadata.query_start_loc[metadata.num_reqs :])
        if out.shape[0] > metadata.num_actual_tokens:
            out[metadata.num_actual_tokens :].zero_()
        return out

    def _prefill_path(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        scale: float,
        metadata: AttentionMetadata,
        k_scale: float,
        v_scale: float,
        sliding_window: int | None,
    ) -> str:
        """The prefill rows' path: "paged" (the all-paged kernel), or the cascade's dense
        kernel ("flash", "triton", "triton_hopper", "cudnn"). Every layer takes the step's path,
        `metadata.prefill_path`, through `layer_prefill_path` (the layer's own rule: a KV
        cache group may hold full and sliding layers, and FlashAttention-2 takes no window and
        no FP8 cache). Where the step has none (metadata not planned, or the start-up step
        timed on this call), it is chosen here once, `prefill_cascade` forcing either way and
        None leaving it to `prefill_path`, and kept in the metadata for the step's other
        layers."""
        fp8 = kv_cache.dtype != query.dtype
        if metadata.prefill_path is not None:
            return layer_prefill_path(metadata.prefill_path, fp8, sliding_window)
        if self.prefill_cascade is False:
            path = "paged"
        elif self.prefill_cascade:
            path = default_dense_impl()
        else:
            path = prefill_path(
                query, key, value, kv_cache, query_start_loc, seq_lens, block_table, scale,
                max_query_len=metadata.max_query_len, k_scale=k_scale, v_scale=v_scale,
                sliding_window=sliding_window, has_context=metadata.prefill_has_context,
            )  # fmt: skip
        metadata.prefill_path = path
        return layer_prefill_path(path, fp8, sliding_window)

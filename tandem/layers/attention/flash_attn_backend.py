"""Attention through FlashAttention's varlen kernel over the paged cache: `--attention-backend
FLASH_ATTN` (CUDA only, float16 / bfloat16).

Which build, in this order:
- vLLM's (`vllm.vllm_flash_attn`, or the standalone `vllm_flash_attn`): pages of any multiple
  of 16 tokens, context lengths as `seqused_k`;
- Dao-AILab's `flash_attn` (FA2 >= 2.5): its paged path needs pages of a multiple of 256
  tokens, so it serves only with `--block-size 256` (or larger); with tandem's default 16 it
  is refused at start, naming the build that would work.

Cache layout: the kernel takes K and V as `[num_blocks, block, num_kv_heads, head_dim]`, last
dimension contiguous, and reads the page stride from the tensor: a layer's view of tandem's
cache (`kv_cache[:, 0]` and `kv_cache[:, 1]`, page stride spanning every layer) goes in as it
is. The causal mask is aligned to the end of each context, as tandem's is.

No host-device sync: cumulative context lengths are a device cumsum; the maximum lengths come
from the metadata's host ints. The K/V write is the Triton `reshape_and_cache`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from tandem.config import ConfigError
from tandem.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    register_attention_backend,
)
from tandem_kernels.reshape_and_cache import reshape_and_cache

# FA2's paged KV reads whole pages of this many tokens.
FA2_PAGE_MULTIPLE = 256


def import_flash_attn() -> tuple[str, Callable[..., Any]]:
    """`(build, flash_attn_varlen_func)` of the first importable build: "vllm" or "fa2"."""
    errors = []
    for module, build in (
        ("vllm.vllm_flash_attn", "vllm"),
        ("vllm_flash_attn", "vllm"),
        ("flash_attn", "fa2"),
    ):
        try:
            return build, importlib.import_module(module).flash_attn_varlen_func
        except (ImportError, AttributeError) as exc:
            errors.append(f"{module}: {exc}")
    raise ConfigError(
        "attention_backend FLASH_ATTN needs vllm-flash-attn (vLLM's build) or flash-attn: "
        + "; ".join(errors)
    )


@register_attention_backend
class FlashAttnAttentionBackend(AttentionBackend):
    """Paged varlen FlashAttention (prefill, decode and mixed steps in one call)."""

    name: ClassVar[str] = "flash_attn"

    graph_kv_write: ClassVar[bool] = True

    def __init__(self) -> None:
        self.build, self._varlen = import_flash_attn()

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        if (k_scale, v_scale) != (1.0, 1.0):
            raise ConfigError("attention_backend FLASH_ATTN has no FP8 KV cache; use TRITON_ATTN")
        reshape_and_cache(key, value, kv_cache, slot_mapping)

    def _check(self, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        if query.dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(
                f"attention_backend FLASH_ATTN runs float16 or bfloat16, not {query.dtype}"
            )
        block_size = kv_cache.shape[2]
        if self.build == "fa2" and block_size % FA2_PAGE_MULTIPLE:
            raise ConfigError(
                f"attention_backend FLASH_ATTN with flash-attn (FA2) needs --block-size a "
                f"multiple of {FA2_PAGE_MULTIPLE}, not {block_size}; install vllm-flash-attn "
                "for tandem's 16-token blocks"
            )

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
        self._check(query, kv_cache)
        if (k_scale, v_scale) != (1.0, 1.0):
            raise ConfigError("attention_backend FLASH_ATTN has no FP8 KV cache; use TRITON_ATTN")
        num_tokens = metadata.num_actual_tokens
        num_reqs = metadata.num_reqs
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping[:num_tokens])
        out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
        if num_tokens == 0:
            return out
        seq_lens = metadata.seq_lens[:num_reqs]
        kwargs: dict[str, Any] = dict(
            q=query[:num_tokens],
            k=kv_cache[:, 0],
            v=kv_cache[:, 1],
            cu_seqlens_q=metadata.query_start_loc[: num_reqs + 1],
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=metadata.block_table[:num_reqs],
        )
        if sliding_window is not None:
            # FlashAttention's window counts keys left of the query, itself excluded.
            kwargs["window_size"] = (sliding_window - 1, 0)
        if self.build == "vllm":
            kwargs["seqused_k"] = seq_lens
        else:
            cu_k = torch.zeros(num_reqs + 1, dtype=torch.int32, device=query.device)
            cu_k[1:] = torch.cumsum(seq_lens, 0, dtype=torch.int32)
            kwargs["cu_seqlens_k"] = cu_k
        out[:num_tokens] = self._varlen(**kwargs)
        return out

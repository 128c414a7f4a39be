"""Attention through FlashInfer (`flashinfer-python`, CUDA only): `--attention-backend
FLASHINFER`.

Cache layout: FlashInfer's paged KV in the NHD layout is, per layer,
`[num_pages, 2, page_size, num_kv_heads, head_dim]`, which is exactly a layer's view of
tandem's cache `[num_blocks, layers, 2, block, heads, dim]` (a page is a block): the view is
not contiguous (its page stride spans every layer), and FlashInfer >= 0.2 reads the tensor's
own strides (`paged_kv_t` keeps a page stride; its Hopper path precomputes offsets from it,
which needs the page stride to be a multiple of the token stride: true here). Nothing is
copied. Older FlashInfer (no `plan`/`run` wrappers) is refused at start.

Per step the wrappers are planned once (host work and a small host-to-device copy, from the
host copies of the metadata), on the first layer's call, and run for every layer: the plan is
kept for the metadata object it was made for. Because a plan is host work, decode steps do not
run as whole CUDA graphs (`decode_cuda_graphs` False); the K/V write is the Triton
`reshape_and_cache`, capturable, so piecewise graphs keep it inside.

Page tables: request r's pages are `block_table[r, :ceil(seq_lens[r] / block)]`, its last page
holds `seq_lens[r] - (pages - 1) * block` tokens. FlashInfer's causal mask is aligned to the
end of the context (query row j at position `seq_len - query_len + j`), as tandem's is.

No FP8 KV cache: refused at start (`resolve_kv_cache_dtype`), and here. FlashInfer 0.5.3's
decode reads e4m3 pages with the per-tensor scales, but its Hopper prefill does not compile
for bf16 queries over e4m3 K/V (CUTLASS: "MajorB must be GMMA::Major::K for this config"),
so an engine's mixed steps could not run (one H200, session 29).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tandem.config import ConfigError
from tandem.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    register_attention_backend,
)
from tandem_kernels.reshape_and_cache import reshape_and_cache

# FlashInfer's scratch space (its own examples use 128 MiB), one per backend instance.
_WORKSPACE_BYTES = 128 * 1024 * 1024
# Query heads per KV head from which decode runs on FlashInfer's tensor-core kernel.
_TENSOR_CORE_MIN_GROUP = 4


def _refuse_fp8(kv_cache: torch.Tensor) -> None:
    if kv_cache.dtype.itemsize == 1:
        raise ConfigError("attention_backend FLASHINFER has no FP8 KV cache; use TRITON_ATTN")


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as exc:
        raise ConfigError(
            "attention_backend FLASHINFER needs the flashinfer-python package "
            f"(import flashinfer failed: {exc})"
        ) from None
    wrapper = getattr(flashinfer, "BatchPrefillWithPagedKVCacheWrapper", None)
    if wrapper is None or not hasattr(wrapper, "plan"):
        raise ConfigError(
            "attention_backend FLASHINFER needs flashinfer-python >= 0.2 (plan/run wrappers)"
        )
    return flashinfer


def page_table(
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32, on the device
    seq_lens: list[int],
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's page table of a step: `(kv_indptr [num_reqs + 1] host int32,
    kv_indices [total_pages] on the device, kv_last_page_len [num_reqs] host int32)`.
    No device-to-host sync: the page counts come from the host `seq_lens`."""
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    pages = (lens + block_size - 1) // block_size
    indptr64 = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    torch.cumsum(pages, 0, out=indptr64[1:])
    indptr = indptr64.to(torch.int32)
    last = torch.where(pages > 0, lens - (pages - 1) * block_size, 0).to(torch.int32)
    # Positions in the flattened block table of every used page, built on the host in a few
    # vectorized operations (a request's pages are the first of its row): page k of request
    # r sits at r * width + k.
    total = int(indptr64[-1])
    row_start = torch.arange(len(seq_lens), dtype=torch.int64) * block_table.shape[1]
    flat = torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(
        row_start - indptr64[:-1], pages, output_size=total
    )
    indices = block_table.reshape(-1).index_select(
        0, flat.to(block_table.device, non_blocking=True)
    )
    return indptr, indices, last


@register_attention_backend
class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention with FlashInfer's batch prefill (mixed steps) and batch decode
    (decode-only steps) wrappers over tandem's cache, unchanged."""

    name: ClassVar[str] = "flashinfer"

    graph_kv_write: ClassVar[bool] = True
    decode_cuda_graphs: ClassVar[bool] = False

    def __init__(self) -> None:
        self._fi = _import_flashinfer()
        self._workspace: torch.Tensor | None = None
        self._prefill: Any = None
        self._decode: Any = None
        # The metadata the current plan was made for (held, so its id is never reused).
        self._planned_for: AttentionMetadata | None = None

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        _refuse_fp8(kv_cache)
        reshape_and_cache(key, value, kv_cache, slot_mapping)

    def _wrappers(self, device: torch.device, group: int) -> tuple[Any, Any]:
        """The prefill and decode wrappers, made on first use. Decode runs on tensor cores
        (FlashInfer's prefill kernel at one query row) where ``group`` query heads share a KV
        head, at least ``_TENSOR_CORE_MIN_GROUP``: 64 x 32k decode with the 8B's group of 4
        took 2.755 ms that way against 3.010 ms on CUDA cores (one H100, session 28)."""
        if self._workspace is None:
            self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, kv_layout="NHD"
            )
            self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                kv_layout="NHD",
                use_tensor_cores=group >= _TENSOR_CORE_MIN_GROUP,
            )
        return self._prefill, self._decode

    def _plan(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> Any:
        """The wrapper planned for this step (planned on its first layer's call)."""
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        prefill, decode = self._wrappers(query.device, query.shape[1] // num_kv_heads)
        wrapper = decode if metadata.is_decode_only else prefill
        if self._planned_for is metadata:
            return wrapper
        num_reqs = metadata.num_reqs
        indptr, indices, last = page_table(
            metadata.block_table[:num_reqs], metadata.seq_lens_cpu[:num_reqs], block_size
        )
        num_heads = query.shape[1]
        if metadata.is_decode_only:
            decode.plan(
                indptr,
                indices,
                last,
                num_heads,
                num_kv_heads,
                head_dim,
                block_size,
                sm_scale=scale,
                q_data_type=query.dtype,
                kv_data_type=kv_cache.dtype,
            )
        else:
            starts = metadata.query_start_loc_cpu[: num_reqs + 1]
            qo_indptr = torch.tensor(starts, dtype=torch.int32)
            prefill.plan(
                qo_indptr,
                indptr,
                indices,
                last,
                num_heads,
                num_kv_heads,
                head_dim,
                block_size,
                causal=True,
                sm_scale=scale,
                q_data_type=query.dtype,
                kv_data_type=kv_cache.dtype,
            )
        self._planned_for = metadata
        return wrapper

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
        if sliding_window is not None:
            raise ConfigError(
                "attention_backend FLASHINFER has no sliding-window layers here; use TRITON_ATTN"
            )
        _refuse_fp8(kv_cache)
        num_tokens = metadata.num_actual_tokens
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping[:num_tokens])
        out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
        if num_tokens == 0:
            return out
        wrapper = self._plan(query, kv_cache, metadata, scale)
        out[:num_tokens] = wrapper.run(query[:num_tokens], kv_cache)
        return out

"""The attention backend interface and the per-batch metadata it reads.

A step's tokens are flattened into one sequence (no padding). Request r owns query rows
`query_start_loc[r]:query_start_loc[r+1]`; its context is `seq_lens[r]` tokens long, the
last `query_len` of which are the new tokens, so query row j of r sits at position
`seq_lens[r] - query_len + j` and attends causally to positions 0..that position.

KV cache per layer: `[num_blocks, 2, block_size, num_kv_heads, head_size]` (a view into
one tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]`, so a block's
KV over all layers is one contiguous span). Token with slot s lives at block s // block_size,
offset s % block_size.

With several KV cache groups (one per attention kind: tandem.core.kv_cache_spec) the tensor is
`[num_blocks, layers_per_group, 2, ...]`, a layer's view is its slot of every block, and the
layer reads its group's block table and slot mapping (`AttentionMetadata.kv_groups`).

Choices that depend only on the step (which kernel path its prefill rows take) are made once
per step, on the host, where the runner builds the metadata (`plan_step_metadata`, before a
CUDA graph of the step is captured or replayed), and every layer reads them from it:

    runner: metadata = plan_step_metadata(backend, metadata, shape, windows)   (once a step)
    layer 0 .. L-1: backend.forward(..., metadata)   reads metadata.prefill_path
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass
class AttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on device
    seq_lens: torch.Tensor  # [num_reqs] int32, on device
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32, on device
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, on device
    # Host copies for backends that loop on the CPU.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # True when every request has exactly one query token (pure decode step).
    is_decode_only: bool = False
    # In a mixed step, the first `num_decodes` requests have exactly one query token each
    # (the runner orders them first): a backend may run them through its decode path.
    num_decodes: int = 0
    # Set by the runner while it captures or replays piecewise graphs: every `Attention` layer
    # hands its call to it (`graph_splitter.attend(layer, q, k, v, kv_cache, metadata)`), so
    # the runner splits the forward at attention and no model knows of graphs.
    graph_splitter: Any = None
    # A cache with a group per attention kind (tandem.core.kv_cache_spec): each group's
    # metadata (its own `block_table` and `slot_mapping`, the rest shared), indexed by the
    # `Attention` layer's `kv_cache_group`. None: one group, this metadata is every layer's.
    kv_groups: tuple[AttentionMetadata, ...] | None = None
    # The step's prefill path, as the backend's `plan_step` chose it for this KV cache group
    # (the Triton backend: "paged", "flash", "triton", "triton_hopper" or "cudnn"; see its
    # `_prefill_path`). None: not planned (metadata built by hand, a proposer's), or chosen by
    # the step's first layer call (a start-up step timed on that call's tensors), which then
    # keeps it here for the rest.
    prefill_path: str | None = None
    # False when, by the host lists, no prefill request of the step (rows past the leading
    # decodes) has cached tokens before its new ones: the cascade then skips its context part
    # (a launch whose programs all find no prefix). Set by the backend's `plan_step`; True
    # (run it) where unplanned and in whole-step graphs, whose replays the lists don't show.
    prefill_has_context: bool = True
    # A whole-step CUDA graph's metadata (tandem.worker.mixed_graph): `num_actual_tokens` is
    # the bucket's row count, and the rows past `query_start_loc[num_reqs]` are padding whose
    # count only the device knows. A backend zeroes those rows of its output on the device
    # (tandem_kernels.padding): no request owns them, and their stale memory (NaN, inf) would
    # reach a per-tensor activation scale taken over every row.
    graph_padded: bool = False


def prefill_rows_have_context(metadata: AttentionMetadata) -> bool:
    """Whether a request past the step's leading decodes (`num_decodes`, run by the decode
    path when the step also has longer requests) has cached tokens before its new ones, by the
    host lists: `seq_len > query length`. True where the lists don't cover the step's
    requests (metadata made for a graph's capture leaves them empty)."""
    qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    if len(seq_lens) < metadata.num_reqs or len(qsl) < metadata.num_reqs + 1:
        return True
    nd = metadata.num_decodes if 0 < metadata.num_decodes < metadata.num_reqs else 0
    return any(seq_lens[r] > qsl[r + 1] - qsl[r] for r in range(nd, metadata.num_reqs))


@dataclass(frozen=True)
class AttentionShape:
    """What a step's plan may depend on besides the step: the attention layers' shape on this
    rank, the KV cache's dtype and block size, the model's dtype and the device (fixed for an
    engine)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    device: torch.device


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged cache, then attends over each request's context.

    Kernel tuning goes through two hooks, both no-ops unless a backend overrides them; the
    runner calls them at start-up, never while serving:

    - `startup_tuning()`: a context around the engine's profile forward (one eager step of
      `max_num_batched_tokens` tokens), in which the backend may tune the kernels it runs;
    - `tune(kv_cache, ...)`: given one layer's view of the engine's own KV cache, once the
      cache exists and before CUDA graphs are captured (a graph keeps the kernel config it
      was captured with). Tuned configs are per process: every engine in it runs the same.
    """

    name: ClassVar[str]

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        """Write the step's K/V, then attend. An FP8 cache (`float8_e4m3fn`, the query in the
        model's dtype) holds `k / k_scale`, `v / v_scale` (per-tensor scales of the layer);
        with any other cache both scales are 1.0. `sliding_window` W (the layer's; None: full
        attention): the query at position p attends to keys p - W < k <= p only, and blocks
        wholly left of that are never read (their block-table entries may be the null
        block)."""

    # True when `write_kv` is implemented and CUDA-graph capturable: a runner capturing the
    # ops around attention may then write the step's K/V inside its graphs, and call
    # `forward` with an empty `slot_mapping` (nothing left to write there).
    graph_kv_write: ClassVar[bool] = False

    # True when `forward` on a mixed step (`is_decode_only` False, `num_decodes` 0) is
    # CUDA-graph capturable for any split of its tokens into requests: it reads query start
    # locations, context lengths and the block table from the device only, and its work
    # depends on the token count and `num_reqs` alone (empty request slots: `seq_len` 0,
    # query length 0). A runner may then capture whole mixed steps (`cudagraph_mode="full"`).
    full_graph_mixed: ClassVar[bool] = False

    # False when `forward` on a decode-only step cannot be captured in a CUDA graph (it plans
    # on the host per step, as FlashInfer's wrappers do): the runner then runs decode steps
    # eagerly (mixed steps may still run piecewise, attention outside the graphs).
    decode_cuda_graphs: ClassVar[bool] = True

    # True when `forward_qkv` fuses the Q/K/V split, the rotary embedding and the K/V write
    # into one kernel (the CPU and Triton backends); else the `Attention` layer splits and
    # rotates itself.
    fuses_rotary_kv_write: ClassVar[bool] = False

    def forward_qkv(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_size]
        rotary_emb: Any,  # tandem.layers.rotary.RotaryEmbedding
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        """Split the fused projection, rotate Q and K (`rotary_emb(positions, q, k)`), write
        K/V and attend: `forward` of the split and rotated tensors. A backend with
        `fuses_rotary_kv_write` does the split, the rotation and the write in one pass, with
        the same result, and comes here for what its kernel does not take."""
        query, key, value = split_qkv(qkv, num_heads, num_kv_heads, head_size)
        query, key = rotary_emb(positions, query, key)
        return self.forward(
            query, key, value, kv_cache, metadata, scale, k_scale, v_scale,
            sliding_window=sliding_window,
        )  # fmt: skip

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens] int64; slots < 0 are skipped
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Write K/V rows into the paged cache (what `forward` does first)."""
        raise NotImplementedError(f"{self.name} has no separate KV write")

    def plan_step(
        self,
        metadata: AttentionMetadata,
        shape: AttentionShape,
        sliding_window: int | None = None,
    ) -> AttentionMetadata:
        """The step's metadata (one KV cache group's) with the choices this backend's layers
        read from it made: on the host, from Python values only, once per step, before the
        step's graph is captured or replayed (a captured graph keeps what was chosen at
        capture). `sliding_window`: the group's (None: full attention, or a group of mixed
        layers, whose sliding layers keep their own rule). Default: nothing to choose."""
        return metadata

    def startup_tuning(self) -> contextlib.AbstractContextManager[None]:
        """Context for the engine's start-up profile forward: kernels may tune themselves on
        the shapes they see inside it (and only there)."""
        return contextlib.nullcontext()

    def tune(
        self,
        kv_cache: torch.Tensor,  # one layer's [num_blocks, 2, block_size, num_kv_heads, head]
        *,
        num_heads: int,
        max_num_reqs: int,
        max_seq_len: int,
    ) -> str | None:
        """Tune the decode kernels on the engine's KV cache (its contents are irrelevant and
        may be overwritten) for batches of up to `max_num_reqs` requests of up to
        `max_seq_len` tokens. Returns a description of what was picked, or None when
        nothing was tuned."""
        return None


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection `[T, q | k | v]` as views Q `[T, H, D]`, K and V `[T, Hkv, D]`."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        q.view(num_tokens, num_heads, head_size),
        k.view(num_tokens, num_kv_heads, head_size),
        v.view(num_tokens, num_kv_heads, head_size),
    )


def plan_step_metadata(
    backend: AttentionBackend,
    metadata: AttentionMetadata,
    shape: AttentionShape,
    group_windows: Sequence[int | None],
) -> AttentionMetadata:
    """`backend.plan_step` over a step's metadata and each of its KV cache groups'
    (`group_windows[g]`: group g's sliding window)."""
    if metadata.kv_groups is None:
        return backend.plan_step(metadata, shape, group_windows[0] if group_windows else None)
    groups = tuple(
        backend.plan_step(group, shape, group_windows[g])
        for g, group in enumerate(metadata.kv_groups)
    )
    return dataclasses.replace(groups[0], kv_groups=groups)


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register_attention_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _REGISTRY[cls.name] = cls
    return cls


# Each backend's module, imported when it is asked for (importing it registers its class).
_MODULES = {
    "torch": "tandem.layers.attention.torch_backend",
    "cpu": "tandem.layers.attention.cpu_backend",
    "triton": "tandem.layers.attention.triton_backend",
    "flashinfer": "tandem.layers.attention.flashinfer_backend",
    "flash_attn": "tandem.layers.attention.flash_attn_backend",
}


def get_attention_backend(name: str) -> AttentionBackend:
    """Instantiate a registered backend by name: "torch", "triton", "cpu", "flashinfer",
    "flash_attn", or vLLM's names (TRITON_ATTN, FLASHINFER, FLASH_ATTN). An optional backend
    whose package is missing raises ConfigError naming the package."""
    import importlib

    from tandem.config import attention_backend_name

    resolved = attention_backend_name(name)
    if resolved in _MODULES:
        importlib.import_module(_MODULES[resolved])
    if resolved not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[resolved]()

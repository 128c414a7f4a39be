"""Piecewise CUDA graphs of mixed steps (prefill and decode tokens together), one set per
bucketed token count.

A mixed step cannot be one graph: its attention depends on how its tokens split into
requests (query lengths, prefill and decode rows), which only the host knows per step. Every
other op is per token row, so the forward between two attention calls is captured as one
graph per layer boundary (`LlamaForCausalLM.first_piece`, `middle_piece`, `last_piece`) for a
fixed number of rows, and the attention (prefill/decode kernels) runs eagerly between the
replays on the step's real rows. Where the backend can (`graph_kv_write`), the step's K/V
writes go inside the pieces, from a static slot mapping (padding -1); else the eager
attention writes them. A step of n tokens replays the smallest bucket of size >= n; rows n..
are padding (their ids and positions are whatever the buffers hold; rows never mix, and
neither the cache nor a real row sees them). An eager forward of an 8B model costs the host
about 17 ms (kernel launches: measured on an H200 against 5.7 ms of device time); this
leaves 33 graph launches and the attention's.

Invariants: every piece's outputs are held from capture to `clear`, at the addresses the next
piece's graph reads; the attention output is copied into one static buffer per bucket, which
the next piece reads. Buckets share one memory pool; one bucket's pieces always replay in
capture order and never interleave with another bucket's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

from tandem.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from tandem.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_T = TypeVar("_T")


@dataclass
class _Bucket:
    """One token count's graphs and the static tensors they read and write."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_out: torch.Tensor
    # The step's slots, padding -1: read by the K/V writes inside the pieces (backends with
    # `graph_kv_write`); unused otherwise.
    slot_mapping: torch.Tensor
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    # Per piece but the last: (q, k, v, residual) as captured; the last piece's hidden.
    outputs: list[_Outputs] = field(default_factory=list)
    hidden: torch.Tensor | None = None


class PiecewiseCudaGraphs:
    """Captured mixed-step pieces for one model and KV cache, by token bucket."""

    def __init__(self, sizes: Sequence[int], max_num_tokens: int, device: torch.device) -> None:
        # Buckets past the step token budget could never be used.
        self.sizes: list[int] = sorted({s for s in sizes if s <= max_num_tokens})
        self.device = device
        self.buckets: dict[int, _Bucket] = {}
        self.num_replays = 0

    def size_for(self, num_tokens: int) -> int | None:
        """The bucket a mixed step of `num_tokens` tokens replays; None: run it eagerly."""
        if not self.buckets:
            return None
        for size in self.sizes:
            if size >= num_tokens:
                return size
        return None

    def capture(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor]) -> None:
        """Capture every bucket's pieces, largest first (after warm-up runs of each piece).
        The attention between pieces runs on a dummy one-request step whose slots are all
        -1 (nothing is written to the cache)."""
        if not self.sizes:
            return
        dev = self.device
        hidden_width = model.num_heads * model.head_size
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                bucket = _Bucket(
                    input_ids=torch.zeros(size, dtype=torch.long, device=dev),
                    positions=torch.arange(size, dtype=torch.long, device=dev),
                    attn_out=torch.zeros((size, hidden_width), dtype=model.dtype, device=dev),
                    slot_mapping=torch.full((size,), -1, dtype=torch.long, device=dev),
                )
                meta = self._dummy_metadata(size, kv_caches[0].shape[2])
                for _ in range(2):  # warm-up: Triton compiles, the allocator settles
                    self._run(model, bucket, kv_caches, meta, size, capture=None)
                torch.cuda.synchronize(dev)
                self._run(model, bucket, kv_caches, meta, size, capture=pool)
                self.buckets[size] = bucket
        torch.cuda.synchronize(dev)
        logger.info("captured piecewise CUDA graphs of mixed steps for %s tokens", self.sizes)

    def _dummy_metadata(self, size: int, block_size: int) -> AttentionMetadata:
        dev = self.device
        num_blocks = -(-size // block_size)
        return AttentionMetadata(
            num_actual_tokens=size,
            num_reqs=1,
            max_query_len=size,
            max_seq_len=size,
            query_start_loc=torch.tensor([0, size], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([size], dtype=torch.int32, device=dev),
            block_table=torch.zeros((1, num_blocks), dtype=torch.int32, device=dev),
            slot_mapping=torch.full((size,), -1, dtype=torch.long, device=dev),
            query_start_loc_cpu=[0, size],
            seq_lens_cpu=[size],
        )

    def _run(
        self,
        model: LlamaForCausalLM,
        bucket: _Bucket,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        size: int,
        capture: tuple[int, int] | None,
    ) -> None:
        """Run (capture=None) or capture (capture=the pool) every piece of `bucket`, with the
        dummy attention between them."""
        num_layers = model.num_layers
        backend = model.attn_backend
        in_graph = backend.graph_kv_write
        if in_graph:
            meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping[:0])

        def piece(layer: int | None, fn: Callable[..., _T], *args: object) -> _T:
            """Run or capture `fn`; with the K/V write of `layer` (its outputs) inside."""

            def body() -> _T:
                out = fn(*args)
                if in_graph and layer is not None:
                    _, k, v, _ = out  # type: ignore[misc]
                    backend.write_kv(k, v, kv_caches[layer], bucket.slot_mapping)
                return out

            if capture is None:
                return body()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=capture):
                out = body()
            bucket.graphs.append(graph)
            return out

        outs = piece(0, model.first_piece, bucket.input_ids, bucket.positions)
        kept = [outs]
        for i in range(1, num_layers + 1):
            q, k, v, residual = outs
            attn = model.attend(i - 1, q[:size], k[:size], v[:size], kv_caches[i - 1], meta)
            bucket.attn_out.copy_(attn)
            if i < num_layers:
                outs = piece(i, model.middle_piece, i, bucket.positions, bucket.attn_out, residual)
                kept.append(outs)
            else:
                hidden = piece(None, model.last_piece, bucket.attn_out, residual)
        if capture is not None:
            bucket.outputs = kept
            bucket.hidden = hidden
            # Padding rows start from zeros, not from the dummy attention's output.
            bucket.attn_out.zero_()

    def replay(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The step's forward through bucket `size`: `[n, hidden]` for its n real tokens.

        `input_ids`, `positions`: the step's n tokens on the device; `meta`: its attention
        metadata (n tokens)."""
        bucket = self.buckets[size]
        self.num_replays += 1
        n = input_ids.shape[0]
        bucket.input_ids[:n].copy_(input_ids)
        bucket.positions[:n].copy_(positions)
        if model.attn_backend.graph_kv_write:
            # The pieces write the K/V: attention gets nothing left to write.
            bucket.slot_mapping[:n].copy_(meta.slot_mapping[:n])
            bucket.slot_mapping[n:].fill_(-1)
            meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping[:0])
        graphs = bucket.graphs
        graphs[0].replay()
        for i in range(model.num_layers):
            q, k, v, _ = bucket.outputs[i]
            attn = model.attend(i, q[:n], k[:n], v[:n], kv_caches[i], meta)
            bucket.attn_out[:n].copy_(attn)
            graphs[i + 1].replay()
        assert bucket.hidden is not None
        return bucket.hidden[:n]

    def clear(self) -> None:
        """Drop the graphs (their pool is freed with the last one) and static tensors."""
        self.buckets.clear()

"""Piecewise CUDA graphs of mixed steps (prefill and decode tokens together), one set per
bucketed token count.

A mixed step cannot be one graph: its attention depends on how its tokens split into
requests (query lengths, prefill and decode rows), which only the host knows per step. Every
other op is per token row, so the forward between two attention calls is captured as one
graph per layer boundary (`LlamaForCausalLM.first_piece`, `middle_piece`, `last_piece`) for a
fixed number of rows, and the attention (KV write, prefill/decode kernels) runs eagerly
between the replays on the step's real rows. A step of n tokens replays the smallest bucket
of size >= n; rows n.. are padding (their ids and positions are whatever the buffers hold,
rows never mix, and attention sees only the first n rows, so they never reach the cache or
a real row). An eager forward of an 8B model costs the host about 17 ms (kernel launches:
measured on an H200 against 5.7 ms of device time); this leaves 33 graph launches and the
attention's.

Invariants: every piece's outputs are held from capture to `clear`, at the addresses the next
piece's graph reads; the attention output is copied into one static buffer per bucket, which
the next piece reads. Buckets share one memory pool; one bucket's pieces always replay in
capture order and never interleave with another bucket's.
"""

from __future__ import annotations

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

        def piece(fn: Callable[..., _T], *args: object) -> _T:
            if capture is None:
                return fn(*args)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=capture):
                out = fn(*args)
            bucket.graphs.append(graph)
            return out

        outs = piece(model.first_piece, bucket.input_ids, bucket.positions)
        kept = [outs]
        for i in range(1, num_layers + 1):
            q, k, v, residual = outs
            attn = model.attend(i - 1, q[:size], k[:size], v[:size], kv_caches[i - 1], meta)
            bucket.attn_out.copy_(attn)
            if i < num_layers:
                outs = piece(model.middle_piece, i, bucket.positions, bucket.attn_out, residual)
                kept.append(outs)
            else:
                hidden = piece(model.last_piece, bucket.attn_out, residual)
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

"""Full CUDA graphs of mixed steps (prefill and decode tokens together), one per bucketed
token count: `cudagraph_mode="full"`.

A mixed step's attention depends on how its tokens split into requests. With a backend whose
varlen attention reads that split from the device only (`full_graph_mixed`: query start
locations, context lengths and the block table are device tensors, its launch grid a function
of the token and request counts), the whole forward of a bucket is one graph: every request
row of the step, decodes included, goes through the varlen kernel over a fixed number of
request slots. A step of n tokens in r requests replays the smallest bucket of `size >= n`
whose request slots `R = min(size, max_num_seqs) >= r`:

- token rows n..size are padding (slot -1: no K/V write; they belong to no request, so no real
  row attends to them and their outputs are never read);
- request slots r..R are empty: `query_start_loc` stays at n, `seq_len` 0.

Compared with the piecewise graphs (`piecewise_graph`), the host launches one graph instead
of 33 plus the eager attention's kernels; the device runs decode rows through the varlen
kernel rather than split-K decode, which costs little at the context lengths where mixed
steps are host-bound.

Invariants: buffers are held from capture to `clear` at the addresses the graphs read; one
memory pool for all buckets, replayed one at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from tandem.models.llama import LlamaForCausalLM
    from tandem.worker.input_batch import StepInputs
    from tandem.worker.staging import PinnedStaging

logger = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    num_req_slots: int
    hidden: torch.Tensor  # [size, hidden]: the last norm's output


class MixedCudaGraphs:
    """Captured full graphs of mixed steps, by token bucket, for one model and KV cache."""

    def __init__(
        self,
        sizes: Sequence[int],
        max_num_tokens: int,
        max_num_seqs: int,
        device: torch.device,
    ) -> None:
        # Buckets past the step token budget could never be used.
        self.sizes: list[int] = sorted({s for s in sizes if s <= max_num_tokens})
        self.max_num_seqs = max_num_seqs
        self.device = device
        self.graphs: dict[int, _Graph] = {}
        self.num_replays = 0
        self._input_ids: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._slot_mapping: torch.Tensor | None = None
        self._query_start_loc: torch.Tensor | None = None
        self._seq_lens: torch.Tensor | None = None
        self._block_table: torch.Tensor | None = None

    def _slots(self, size: int) -> int:
        return max(1, min(size, self.max_num_seqs))

    def size_for(self, num_tokens: int, num_reqs: int) -> int | None:
        """The bucket a mixed step replays; None: no bucket holds it (run it otherwise)."""
        for size in self.sizes:
            if size >= num_tokens and size in self.graphs:
                return size if self.graphs[size].num_req_slots >= num_reqs else None
        return None

    def capture(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        max_model_len: int,
        block_size: int,
    ) -> None:
        """Capture every bucket's graph, largest first, after two warm-up runs each (Triton
        compiles, the allocator settles). The capture step is one request of `size` tokens
        whose slots are all -1 (nothing is written to the cache)."""
        if not self.sizes:
            return
        dev = self.device
        max_size = self.sizes[-1]
        max_slots = self._slots(max_size)
        # Wide enough for any request, and for the capture step's one request of max_size.
        max_blocks = -(-max(max_model_len, max_size) // block_size)
        self._input_ids = torch.zeros(max_size, dtype=torch.long, device=dev)
        self._positions = torch.zeros(max_size, dtype=torch.long, device=dev)
        self._slot_mapping = torch.full((max_size,), -1, dtype=torch.long, device=dev)
        self._query_start_loc = torch.zeros(max_slots + 1, dtype=torch.int32, device=dev)
        self._seq_lens = torch.zeros(max_slots, dtype=torch.int32, device=dev)
        self._block_table = torch.zeros((max_slots, max_blocks), dtype=torch.int32, device=dev)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                slots = self._slots(size)
                # One request of `size` tokens at positions 0..size-1 (within its blocks).
                self._positions[:size].copy_(torch.arange(size, device=dev))
                self._query_start_loc.fill_(size)
                self._query_start_loc[0] = 0
                self._seq_lens.zero_()
                self._seq_lens[0] = size
                meta = self._metadata(size, slots, max_model_len)
                args = (self._input_ids[:size], self._positions[:size], kv_caches, meta)
                for _ in range(2):
                    model(*args)
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = model(*args)
                self.graphs[size] = _Graph(graph, slots, hidden)
        torch.cuda.synchronize(dev)
        logger.info("captured full CUDA graphs of mixed steps for %s tokens", self.sizes)

    def _metadata(self, size: int, slots: int, max_model_len: int) -> AttentionMetadata:
        assert self._query_start_loc is not None and self._seq_lens is not None
        assert self._block_table is not None and self._slot_mapping is not None
        return AttentionMetadata(
            num_actual_tokens=size,
            num_reqs=slots,
            max_query_len=size,
            max_seq_len=max_model_len,
            query_start_loc=self._query_start_loc[: slots + 1],
            seq_lens=self._seq_lens[:slots],
            block_table=self._block_table[:slots],
            slot_mapping=self._slot_mapping[:size],
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
            is_decode_only=False,
            num_decodes=0,
        )

    def replay(
        self,
        inp: StepInputs,
        size: int,
        staging: PinnedStaging,
        fill_from_previous: Callable[[torch.Tensor, StepInputs], None],
    ) -> torch.Tensor:
        """Replay bucket `size` for the step `inp`; returns the hidden states of its n real
        token rows. `fill_from_previous(input_ids, inp)` writes the ids the previous step
        samples into the static input ids (device op, after the host's ids are copied in)."""
        assert self._input_ids is not None and self._positions is not None
        assert self._slot_mapping is not None and self._seq_lens is not None
        assert self._block_table is not None and self._query_start_loc is not None
        entry = self.graphs[size]
        n, r = inp.total, inp.num_reqs
        slots = entry.num_req_slots
        width = inp.block_table.shape[1]
        self.num_replays += 1
        staging.copy_to(self._input_ids[:n], inp.input_ids)
        fill_from_previous(self._input_ids[:n], inp)
        staging.copy_to(self._positions[:n], inp.positions)
        staging.copy_to(self._slot_mapping[:n], inp.slot_mapping)
        staging.copy_to(self._query_start_loc[: r + 1], inp.query_start_loc)
        staging.copy_to(self._seq_lens[:r], inp.seq_lens)
        staging.copy_to(self._block_table[:r, :width], inp.block_table)
        if size > n:
            self._slot_mapping[n:size].fill_(-1)
        if slots > r:
            self._query_start_loc[r + 1 : slots + 1].fill_(n)
            self._seq_lens[r:slots].zero_()
        entry.graph.replay()
        return entry.hidden[:n]

    def clear(self) -> None:
        """Drop the graphs (their pool is freed with the last one) and static buffers."""
        self.graphs.clear()
        self._input_ids = self._positions = self._slot_mapping = None
        self._query_start_loc = self._seq_lens = self._block_table = None

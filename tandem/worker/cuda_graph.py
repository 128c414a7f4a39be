"""CUDA graphs of decode steps (one token per request), one per bucketed batch size.

Static device buffers hold a decode step's inputs; a step of n requests replays the smallest
graph of size >= n with rows n.. padded (slot -1: no KV write; seq_len 1). Graphs are
captured largest first into one shared memory pool, with the logits computed inside the
graph. A step with more requests than the largest bucket, or any step that is not decode
only, runs eagerly (`size_for` returns None).

The attention metadata of every graph says `max_seq_len = max_model_len`: the decode kernel's
split count is fixed at capture, and any length up to it gives correct results.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from tandem.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from tandem.models.llama import LlamaForCausalLM
    from tandem.worker.input_batch import StepInputs
    from tandem.worker.staging import PinnedStaging

logger = logging.getLogger(__name__)


class DecodeCudaGraphs:
    """Captured decode graphs and their static inputs, for one model and KV cache."""

    def __init__(self, sizes: Sequence[int], max_num_seqs: int, device: torch.device) -> None:
        # Buckets past max_num_seqs could never be used.
        self.sizes: list[int] = sorted({s for s in sizes if s <= max_num_seqs})
        self.device = device
        # Batch size -> (graph, its logits output).
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._input_ids: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._slot_mapping: torch.Tensor | None = None
        self._seq_lens: torch.Tensor | None = None
        self._block_table: torch.Tensor | None = None
        self._query_start_loc: torch.Tensor | None = None

    def capture(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        max_model_len: int,
        block_size: int,
    ) -> None:
        """Capture a graph per bucket (after warm-up runs: Triton compiles, the allocator
        settles). Kernel configs must be tuned before this: graphs keep the ones they ran."""
        if not self.sizes:
            return
        max_bs = self.sizes[-1]
        dev = self.device
        max_blocks = -(-max_model_len // block_size)
        self._input_ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self._positions = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self._slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, device=dev)
        self._seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self._block_table = torch.zeros((max_bs, max_blocks), dtype=torch.int32, device=dev)
        self._query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bs in reversed(self.sizes):
                meta = self._metadata(bs, max_model_len)
                args = (self._input_ids[:bs], self._positions[:bs], kv_caches, meta)
                for _ in range(2):  # warm-up: Triton compiles, allocator settles
                    model.compute_logits(model(*args))
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = model.compute_logits(model(*args))
                self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize(dev)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _metadata(self, bs: int, max_model_len: int) -> AttentionMetadata:
        assert self._query_start_loc is not None and self._seq_lens is not None
        assert self._block_table is not None and self._slot_mapping is not None
        return AttentionMetadata(
            num_actual_tokens=bs,
            num_reqs=bs,
            max_query_len=1,
            max_seq_len=max_model_len,
            query_start_loc=self._query_start_loc[: bs + 1],
            seq_lens=self._seq_lens[:bs],
            block_table=self._block_table[:bs],
            slot_mapping=self._slot_mapping[:bs],
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
            is_decode_only=True,
        )

    def size_for(self, num_reqs: int) -> int | None:
        """The bucket a decode step of `num_reqs` requests replays; None: run it eagerly."""
        if not self.graphs:
            return None
        for size in self.sizes:
            if size >= num_reqs:
                return size
        return None

    def replay(
        self,
        inp: StepInputs,
        size: int,
        staging: PinnedStaging,
        fill_from_previous: Callable[[torch.Tensor, StepInputs], None],
    ) -> torch.Tensor:
        """Replay the decode graph of `size` rows; returns the logits of the first n rows.

        `fill_from_previous(input_ids, inp)` writes the ids the previous step samples into
        the static input ids (device op, after the host's ids are copied in)."""
        assert self._input_ids is not None and self._positions is not None
        assert self._slot_mapping is not None and self._seq_lens is not None
        assert self._block_table is not None
        n = inp.num_reqs
        width = inp.block_table.shape[1]
        # Straight from the pinned staging buffers into the graph's static inputs.
        staging.copy_to(self._input_ids[:n], inp.input_ids)
        fill_from_previous(self._input_ids[:n], inp)
        staging.copy_to(self._positions[:n], inp.positions)
        staging.copy_to(self._slot_mapping[:n], inp.slot_mapping)
        staging.copy_to(self._seq_lens[:n], inp.seq_lens)
        staging.copy_to(self._block_table[:n, :width], inp.block_table)
        if size > n:
            self._slot_mapping[n:size].fill_(-1)
            self._seq_lens[n:size].fill_(1)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]

    def clear(self) -> None:
        """Drop the graphs (their pool is freed with the last one) and static buffers."""
        self.graphs.clear()
        self._input_ids = self._positions = self._slot_mapping = None
        self._seq_lens = self._block_table = self._query_start_loc = None

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

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tandem.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from tandem.worker.input_batch import StepInputs
    from tandem.worker.staging import PinnedStaging

logger = logging.getLogger(__name__)


class DecodeStepModel(Protocol):
    """What a decode graph runs: a forward over one token per row, called as a module is
    (a `CausalLM`; a proposer's step adapter), and the logits of its output rows."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> Any: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...


class StaticStepInputs:
    """The device buffers a captured step reads, at fixed addresses: token rows (ids,
    positions, slots) and request slots (query start locations, context lengths, block-table
    rows). A replay copies a step's host arrays into the leading rows and marks the rest
    empty: padding token rows get slot -1 (no K/V write); padding request slots get context
    length `seq_len_pad` and, where the step's query start locations are copied in, a query
    length of 0.

    With `num_kv_groups` G > 1 (a KV cache group per attention kind) each group has its own
    block table and slot mapping rows (`[G, ...]`), handed to the layers as
    `AttentionMetadata.kv_groups`; `block_table` and `slot_mapping` are then unused."""

    def __init__(
        self,
        max_tokens: int,
        max_reqs: int,
        max_blocks: int,
        device: torch.device,
        seq_len_pad: int,
        num_kv_groups: int = 1,
    ) -> None:
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        # One token per request unless a step's own are copied in (`copy_in`).
        self.query_start_loc = torch.arange(max_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((max_reqs,), seq_len_pad, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((max_reqs, max_blocks), dtype=torch.int32, device=device)
        self.seq_len_pad = seq_len_pad
        self.group_block_table: torch.Tensor | None = None
        self.group_slot_mapping: torch.Tensor | None = None
        if num_kv_groups > 1:
            self.group_block_table = torch.zeros(
                (num_kv_groups, max_reqs, max_blocks), dtype=torch.int32, device=device
            )
            self.group_slot_mapping = torch.full(
                (num_kv_groups, max_tokens), -1, dtype=torch.long, device=device
            )

    def metadata(
        self,
        num_tokens: int,
        num_reqs: int,
        max_query_len: int,
        max_seq_len: int,
        graph_padded: bool = False,
    ) -> AttentionMetadata:
        """The metadata of a captured step over the first `num_tokens` rows and `num_reqs`
        request slots (decode only when they are equal and `max_query_len` is 1).
        `graph_padded`: replays fill fewer rows than `num_tokens` (a whole mixed step), so
        the backend zeroes the rest of its output (`AttentionMetadata.graph_padded`)."""
        decode_only = max_query_len == 1
        metadata = AttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=num_reqs,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_table=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
            is_decode_only=decode_only,
            num_decodes=0,
            graph_padded=graph_padded,
        )
        tables, slots = self.group_block_table, self.group_slot_mapping
        if tables is None or slots is None:
            return metadata
        groups = tuple(
            dataclasses.replace(
                metadata, block_table=tables[g, :num_reqs], slot_mapping=slots[g, :num_tokens]
            )
            for g in range(tables.shape[0])
        )
        return dataclasses.replace(groups[0], kv_groups=groups)

    def copy_in(
        self,
        inp: StepInputs,
        num_tokens: int,
        num_reqs: int,
        staging: PinnedStaging,
        fill_from_previous: Callable[[torch.Tensor, StepInputs], None],
        query_start_loc: bool,
    ) -> None:
        """Copy the step `inp` into the leading rows of a graph of `num_tokens` token rows and
        `num_reqs` request slots; the rest empty. `fill_from_previous(input_ids, inp)` writes
        the ids the previous step samples (device op, after the host's ids are copied in).
        `query_start_loc`: copy the step's query start locations too (else they stay one
        token per request)."""
        n, r = inp.total, inp.num_reqs
        width = inp.block_table.shape[1]
        # Straight from the pinned staging buffers into the graph's static inputs.
        staging.copy_to(self.input_ids[:n], inp.input_ids)
        fill_from_previous(self.input_ids[:n], inp)
        staging.copy_to(self.positions[:n], inp.positions)
        staging.copy_to(self.seq_lens[:r], inp.seq_lens)
        tables, slots = self.group_block_table, self.group_slot_mapping
        if tables is not None and slots is not None:
            assert inp.group_block_tables is not None and inp.group_slot_mappings is not None
            staging.copy_to(slots[:, :n], inp.group_slot_mappings)
            staging.copy_to(tables[:, :r, :width], inp.group_block_tables)
            if num_tokens > n:
                slots[:, n:num_tokens].fill_(-1)
        else:
            staging.copy_to(self.slot_mapping[:n], inp.slot_mapping)
            staging.copy_to(self.block_table[:r, :width], inp.block_table)
        if query_start_loc:
            staging.copy_to(self.query_start_loc[: r + 1], inp.query_start_loc)
            if num_reqs > r:
                self.query_start_loc[r + 1 : num_reqs + 1].fill_(n)
        if num_tokens > n:
            self.slot_mapping[n:num_tokens].fill_(-1)
        if num_reqs > r:
            self.seq_lens[r:num_reqs].fill_(self.seq_len_pad)


class DecodeCudaGraphs:
    """Captured decode graphs and their static inputs, for one model and KV cache."""

    def __init__(
        self,
        sizes: Sequence[int],
        max_num_seqs: int,
        device: torch.device,
        num_kv_groups: int = 1,
    ) -> None:
        self.num_kv_groups = num_kv_groups
        # Buckets past max_num_seqs could never be used.
        self.sizes: list[int] = sorted({s for s in sizes if s <= max_num_seqs})
        self.device = device
        # Batch size -> (graph, its logits output).
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._inputs: StaticStepInputs | None = None

    def capture(
        self,
        model: DecodeStepModel,
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
        inputs = self._inputs = StaticStepInputs(
            max_bs, max_bs, max_blocks, dev, seq_len_pad=1, num_kv_groups=self.num_kv_groups
        )
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bs in reversed(self.sizes):
                meta = inputs.metadata(bs, bs, 1, max_model_len)
                args = (inputs.input_ids[:bs], inputs.positions[:bs], kv_caches, meta)
                for _ in range(2):  # warm-up: Triton compiles, allocator settles
                    model.compute_logits(model(*args))
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = model.compute_logits(model(*args))
                self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize(dev)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

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
        assert self._inputs is not None
        self._inputs.copy_in(inp, size, size, staging, fill_from_previous, query_start_loc=False)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[: inp.num_reqs]

    def clear(self) -> None:
        """Drop the graphs (their pool is freed with the last one) and static buffers."""
        self.graphs.clear()
        self._inputs = None

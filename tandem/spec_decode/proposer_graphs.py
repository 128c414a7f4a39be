"""CUDA graphs of a proposer that runs a model (draft model, EAGLE head).

A proposer's engine step (`tandem.spec_decode.model_proposer`) is one catch-up pass over the
step's token rows, then k - 1 draft steps of one token per request. On CUDA (unless
--enforce-eager, or the attention backend runs no decode graphs) both replay graphs captured
on the proposer's own KV cache, as the target's steps do:

    draft steps     decode graphs (`DecodeCudaGraphs`) at the target's `cuda_graph_sizes`;
    catch-up pass   whole mixed-step graphs (`MixedCudaGraphs`, cudagraph_mode full and a
                    backend that runs them) at its `piecewise_cuda_graph_sizes`, up to the
                    step's token budget plus one token per request.

A step larger than every captured size runs eagerly (`catch_up` / `draft_step` return None).
What a graph runs is a `DecodeStepModel`: the draft model itself, or an adapter that reads
extra inputs (EAGLE's hidden states) from static buffers the replay's `fill` writes.
Block tables reach past `max_model_len` into the proposer's scratch blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from tandem.spec_decode.model_proposer import CatchUpPass
from tandem.spec_decode.proposer import TargetInfo
from tandem.worker.cuda_graph import DecodeCudaGraphs, DecodeStepModel
from tandem.worker.input_batch import StepInputs
from tandem.worker.mixed_graph import MixedCudaGraphs
from tandem.worker.staging import PinnedStaging

logger = logging.getLogger(__name__)

# Writes a replay's extra inputs (device ops), after the step's host arrays are copied in:
# the static input ids and the step.
Fill = Callable[[torch.Tensor, StepInputs], None]


def decode_graph_sizes(target: TargetInfo) -> tuple[int, ...]:
    """The batch sizes whose draft steps a proposer replays as decode CUDA graphs: the
    target's `cuda_graph_sizes` on CUDA, unless --enforce-eager or the attention backend runs
    no decode graphs (then none: every draft step is eager)."""
    device_config = target.config.device
    use_graphs = (
        target.model_context.device.type == "cuda"
        and not device_config.enforce_eager
        and target.model_context.attn_backend.decode_cuda_graphs
    )
    return tuple(device_config.cuda_graph_sizes) if use_graphs else ()


class ProposerGraphs:
    """A proposer's draft-step and catch-up graphs (see the module docstring)."""

    def __init__(self, target: TargetInfo, max_num_seqs: int, block_size: int) -> None:
        device = target.model_context.device
        backend = target.model_context.attn_backend
        self.attn_backend = backend
        self.max_model_len = target.max_model_len
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        sizes = decode_graph_sizes(target)
        self.decode = DecodeCudaGraphs(sizes, max_num_seqs, device)
        full = (
            bool(sizes)
            and target.config.device.cudagraph_mode == "full"
            and backend.full_graph_mixed
        )
        self.mixed = MixedCudaGraphs(
            target.config.device.piecewise_cuda_graph_sizes if full else (),
            target.config.scheduler.max_num_batched_tokens + max_num_seqs,
            max_num_seqs,
            device,
        )
        self.staging = PinnedStaging(device)

    @property
    def enabled(self) -> bool:
        return bool(self.decode.sizes or self.mixed.sizes)

    def capture(
        self,
        draft_step: DecodeStepModel,
        catch_up: DecodeStepModel,
        kv_caches: list[torch.Tensor],
        num_heads: int,
        scratch_per_row: int,
        name: str,
    ) -> None:
        """The decode kernel tuned on the proposer's cache (graphs keep the configs they
        ran), then both kinds captured; block tables reach into each row's
        `scratch_per_row` scratch blocks past `max_model_len`."""
        if not self.enabled:
            return
        reach = self.max_model_len + (scratch_per_row + 1) * self.block_size
        self.attn_backend.tune(
            kv_caches[0],
            num_heads=num_heads,
            max_num_reqs=self.max_num_seqs,
            max_seq_len=self.max_model_len,
        )
        self.decode.capture(draft_step, kv_caches, reach, self.block_size)
        self.mixed.capture(catch_up, kv_caches, reach, self.block_size)
        logger.info(
            "%s: draft steps as CUDA graphs for sizes %s, catch-up passes for %s tokens",
            name,
            self.decode.sizes,
            self.mixed.sizes,
        )

    def catch_up(self, catch_up: CatchUpPass, fill: Fill) -> torch.Tensor | None:
        """The catch-up pass through the mixed-step graph of its token count: the output
        states of its rows; None when no graph holds it (run it eagerly)."""
        c = catch_up
        size = self.mixed.size_for(len(c.input_ids), len(c.seq_lens))
        if size is None:
            return None
        max_query_len = int(np.diff(c.query_start_loc).max())
        inp = self._inputs(
            c.table,
            c.req_index,
            c.positions,
            c.input_ids,
            c.query_start_loc,
            c.seq_lens,
            max_query_len,
        )
        return self.mixed.replay(inp, size, self.staging, fill)

    def draft_step(
        self, table: np.ndarray, positions: np.ndarray, fill: Fill
    ) -> tuple[int, torch.Tensor] | None:
        """A draft step of one token per row of `table` at `positions` through the decode
        graph of its batch size: (that size, the logits of its rows); None when it is larger
        than every captured size (run it eagerly). `fill` writes the step's input ids."""
        n = len(positions)
        size = self.decode.size_for(n)
        if size is None:
            return None
        rows = np.arange(n)
        inp = self._inputs(
            table, rows, positions, np.zeros(n, dtype=np.int64), np.arange(n + 1), positions + 1, 1
        )
        return size, self.decode.replay(inp, size, self.staging, fill)

    def _inputs(
        self,
        table: np.ndarray,
        req_index: np.ndarray,
        positions: np.ndarray,
        input_ids: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        max_query_len: int,
    ) -> StepInputs:
        """A replay's host arrays: token rows (each of request `req_index[i]` at
        `positions[i]`, its slot from `table`) and request rows."""
        bs = self.block_size
        return StepInputs(
            num_reqs=len(seq_lens),
            total=len(positions),
            input_ids=input_ids,
            positions=positions,
            slot_mapping=table[req_index, positions // bs] * bs + positions % bs,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=table,
            max_query_len=max_query_len,
            sampled_rows=[],
            states=[],
        )

    def clear(self) -> None:
        self.decode.clear()
        self.mixed.clear()
        self.staging.clear()

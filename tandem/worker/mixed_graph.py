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

from tandem.worker.cuda_graph import DecodeStepModel, StaticStepInputs

if TYPE_CHECKING:
    from tandem.layers.attention import AttentionMetadata
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
        num_kv_groups: int = 1,
    ) -> None:
        self.num_kv_groups = num_kv_groups
        # Buckets past the step token budget could never be used.
        self.sizes: list[int] = sorted({s for s in sizes if s <= max_num_tokens})
        self.max_num_seqs = max_num_seqs
        self.device = device
        self.graphs: dict[int, _Graph] = {}
        self.num_replays = 0
        self._inputs: StaticStepInputs | None = None

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
        model: DecodeStepModel,
        kv_caches: list[torch.Tensor],
        max_model_len: int,
        block_size: int,
        plan: Callable[[AttentionMetadata], AttentionMetadata] | None = None,
    ) -> None:
        """Capture every bucket's graph, largest first, after two warm-up runs each (Triton
        compiles, the allocator settles). The capture step is one request of `size` tokens
        whose slots are all -1 (nothing is written to the cache). `plan` makes the backend's
        per-step choices on its metadata (the runner's `_plan`), on the host before warm-up
        and capture: the graph keeps them for every step it replays."""
        if not self.sizes:
            return
        dev = self.device
        max_size = self.sizes[-1]
        # Wide enough for any request, and for the capture step's one request of max_size.
        max_blocks = -(-max(max_model_len, max_size) // block_size)
        inputs = StaticStepInputs(
            max_size,
            self._slots(max_size),
            max_blocks,
            dev,
            seq_len_pad=0,
            num_kv_groups=self.num_kv_groups,
        )
        self._inputs = inputs
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                slots = self._slots(size)
                # One request of `size` tokens at positions 0..size-1 (within its blocks).
                inputs.positions[:size].copy_(torch.arange(size, device=dev))
                inputs.query_start_loc.fill_(size)
                inputs.query_start_loc[0] = 0
                inputs.seq_lens.zero_()
                inputs.seq_lens[0] = size
                meta = inputs.metadata(size, slots, size, max_model_len, graph_padded=True)
                if plan is not None:
                    meta = plan(meta)
                args = (inputs.input_ids[:size], inputs.positions[:size], kv_caches, meta)
                for _ in range(2):
                    model(*args)
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = model(*args)
                self.graphs[size] = _Graph(graph, slots, hidden)
        torch.cuda.synchronize(dev)
        logger.info("captured full CUDA graphs of mixed steps for %s tokens", self.sizes)

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
        assert self._inputs is not None
        entry = self.graphs[size]
        self.num_replays += 1
        self._inputs.copy_in(
            inp, size, entry.num_req_slots, staging, fill_from_previous, query_start_loc=True
        )
        entry.graph.replay()
        return entry.hidden[: inp.total]

    def clear(self) -> None:
        """Drop the graphs (their pool is freed with the last one) and static buffers."""
        self.graphs.clear()
        self._inputs = None

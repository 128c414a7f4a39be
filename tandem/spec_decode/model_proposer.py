"""Proposers that run a model on the target's device (draft model, EAGLE head).

The proposer's model has its own KV tensors, laid out as the target's
(`[blocks, layers, 2, block_size, kv_heads, head_size]`) and indexed by the SAME block ids and
slot mapping as the target's cache: there is no second block manager. Its blocks are the
target's `num_blocks` (the Worker sizes the pool on the sum of both caches' bytes per block)
plus a few scratch blocks per request row for the lookahead below.

After a step's tokens land on the host, `ModelProposer.propose_step` (called through the
`Proposer` interface from `PendingStep.result()`) runs, per request of the step::

    catch-up pass   every request of the step, over the positions the target computed this
                    step that now hold final tokens (c .. end - 1), one flattened forward;
                    a sampled request's last row gives its first draft d0
    draft steps     k - 1 one-token forwards of the sampled requests: d_{j-1} at position
                    end - 1 + j gives d_j (greedy)

The catch-up writes the proposer's KV at exactly the target's slots for the same tokens, so
its cache stays in step with the target's under chunked prefill, preemption (the request's
blocks are recomputed by both) and prefix hits (a cached block was computed by both). Draft
steps write positions >= the target's next `num_computed_tokens`: they are overwritten by
the next step's catch-up before anything reads them, like the target's rejected positions.
Positions past a request's allocated blocks go to that row's scratch blocks (the scheduler
allocates no lookahead beyond the drafts it schedules).

Requests whose drafts the scheduler will not take (backing off: `SchedulerOutput.
no_draft_req_ids`; structured, penalties, max_tokens reached: `SamplingParams.max_drafts`)
get the catch-up only. KV another worker computed (disaggregated decode:
`NewRequestData.num_external_computed_tokens`) is the target's only: a draft model's first
catch-up of such a request starts that many positions earlier (EAGLE has no target hidden
states for them and drafts from what its cache holds). `catch_up` and `draft_step` run
eagerly here; on CUDA both proposers replay graphs for them (`proposer_graphs`).

Drafts are greedy (argmax), so the draft distribution q is one-hot at the draft: the
rejection sampler's one-hot rule (draft_probs None: accept with probability p(d), resample
from p with d removed) is the exact accept / resample rule for them, and sampling requests
keep the target's distribution.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from tandem.core.outputs import SchedulerOutput
from tandem.layers.attention import AttentionMetadata
from tandem.spec_decode.proposer import ProposerState
from tandem.worker.input_batch import StepInputs


@dataclass(frozen=True)
class CatchUpPass:
    """A catch-up pass over a flattened batch: request r's rows are `query_start_loc[r]` ..
    `query_start_loc[r + 1]`, its context `seq_lens[r]` tokens; row i is token `input_ids[i]`
    at `positions[i]` of request `req_index[i]`, whose blocks are `table[req_index[i]]`."""

    input_ids: np.ndarray
    positions: np.ndarray
    table: np.ndarray
    req_index: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray


class ModelProposer(ABC):
    """A proposer with a model and a KV cache on the target's device (see the module doc).

    Subclasses give the model (`forward`, `compute_logits`, its KV shape) and `input_shift`:
    0 when the proposer's entry at position p reads token p (a draft model), 1 when it reads
    token p + 1 beside the target's hidden state at p (EAGLE)."""

    # Whether `propose_step` needs the target's hidden states of the step (all token rows).
    needs_hidden_states: ClassVar[bool] = False
    input_shift: ClassVar[int] = 0

    def __init__(
        self,
        num_speculative_tokens: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        block_size: int,
        max_num_seqs: int,
        max_position: int,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        # `SpeculativeConfig.disable_by_batch_size` (0: always draft).
        self.disable_by_batch_size = 0
        self.device = device
        self.kv_dtype = kv_dtype
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_position = max_position
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        # Scratch blocks per request row: the draft steps reach k positions past the last
        # position the target computed (its blocks end at or after it).
        self.scratch_per_row = -(-num_speculative_tokens // block_size) + 1
        self.num_blocks = 0
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[torch.Tensor] = []

    # ----------------------------------------------------------------- the model

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`[T, hidden]` states over the proposer's KV views; `hidden_states`: the target's
        (catch-up) or the proposer's own previous outputs (draft steps), when it reads them."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def shutdown(self) -> None:
        """Drop the KV cache (the model with the proposer)."""
        self.kv_cache = None
        self.kv_caches = []

    # ----------------------------------------------------------------- KV cache

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_size)

    def kv_bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return int(np.prod(self.kv_cache_shape(1))) * elem

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the proposer's cache: the target's `num_blocks` plus the scratch rows."""
        self.num_blocks = num_blocks
        total = num_blocks + self.max_num_seqs * self.scratch_per_row
        self.kv_cache = torch.zeros(
            self.kv_cache_shape(total), dtype=self.kv_dtype, device=self.device
        )
        self.kv_caches = [self.kv_cache[:, i] for i in range(self.num_layers)]

    # ----------------------------------------------------------------- one step

    def bind_step(
        self, inp: StepInputs, hidden_states: torch.Tensor | None, so: SchedulerOutput
    ) -> BoundStep:
        """The `Proposer` that `PendingStep.result()` calls for this step's drafts, with what
        the scheduler tells of it: requests whose drafts it will not take, and new requests'
        KV computed by another worker (`NewRequestData.num_external_computed_tokens`)."""
        external = {
            r.req_id: r.num_external_computed_tokens
            for r in so.scheduled_new_reqs
            if r.num_external_computed_tokens
        }
        return BoundStep(self, inp, hidden_states, so.no_draft_req_ids, external)

    @torch.inference_mode()
    def propose_step(
        self,
        inp: StepInputs,
        hidden_states: torch.Tensor | None,
        no_draft_req_ids: AbstractSet[str] = frozenset(),
        external: Mapping[str, int] | None = None,
    ) -> list[list[int]]:
        """Drafts for the step's sampled requests (`inp.sampled_rows` order), after their
        tokens were appended to `inp.states` (see the module docstring); none for
        `no_draft_req_ids` and requests that take none (`SamplingParams.max_drafts`).
        `external`: request -> its last computed tokens whose KV another worker wrote: the
        catch-up starts that many positions earlier (a proposer that reads the target's
        hidden states cannot: it has none for them, and drafts from what its cache holds)."""
        if self.kv_cache is None:
            raise RuntimeError("the proposer has no KV cache (not initialized, or shut down)")
        k = self.num_speculative_tokens
        shift = self.input_shift
        sampled = set(inp.sampled_rows)
        qsl = inp.query_start_loc.tolist()
        first_pos = inp.positions[inp.query_start_loc[:-1]].tolist()
        ids: list[int] = []
        rows: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        for i, state in enumerate(inp.states):
            c, n = int(first_pos[i]), qsl[i + 1] - qsl[i]
            length = len(state.token_ids)
            end = min(c + n + 1 - shift, length - shift) if i in sampled else c + n
            end = max(end, c)
            rows.extend(range(qsl[i], qsl[i] + end - c))
            if external and not shift:
                c -= external.get(state.req_id, 0)
            ids.extend(state.token_ids[c + shift : end + shift])
            starts.append(c)
            ends.append(end)
        start_arr = np.asarray(starts, dtype=np.int64)
        end_arr = np.asarray(ends, dtype=np.int64)
        table = self._block_table(inp.states, end_arr + k)
        query_lens = end_arr - start_arr
        qsl_pass = np.zeros(len(starts) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl_pass[1:])
        req_index = np.repeat(np.arange(len(starts)), query_lens)
        positions = start_arr[req_index] + np.arange(int(qsl_pass[-1])) - qsl_pass[req_index]
        hidden_in = None
        if hidden_states is not None:
            hidden_in = hidden_states.index_select(0, self._to_device(np.asarray(rows)))
        catch_up = CatchUpPass(
            np.asarray(ids, dtype=np.int64), positions, table, req_index, qsl_pass, end_arr
        )
        out = self.catch_up(catch_up, hidden_in)
        sampled_rows = inp.sampled_rows
        if not sampled_rows:
            return []
        limit = self.disable_by_batch_size
        if limit and inp.num_reqs >= limit:
            # The scheduler takes no drafts while this many requests run: KV only.
            return [[] for _ in sampled_rows]
        # Requests that take no drafts (backing off, structured, penalties, max_tokens
        # reached): KV only.
        drafting = [
            i
            for i in sampled_rows
            if inp.states[i].req_id not in no_draft_req_ids
            and inp.states[i].sampling_params.max_drafts(len(inp.states[i].output_token_ids), k)
        ]
        if not drafting:
            return [[] for _ in sampled_rows]
        out_drafts = self._draft(drafting, qsl_pass, table, end_arr, out)
        by_row = dict(zip(drafting, out_drafts, strict=True))
        return [by_row.get(i, []) for i in sampled_rows]

    def _draft(
        self,
        sampled_rows: list[int],
        qsl_pass: np.ndarray,
        table: np.ndarray,
        end_arr: np.ndarray,
        out: torch.Tensor,
    ) -> list[list[int]]:
        """k greedy drafts for the requests of rows `sampled_rows`: the first from their last
        catch-up row of `out`, then k - 1 one-token draft steps."""
        k = self.num_speculative_tokens
        last = self._to_device(qsl_pass[1:][sampled_rows] - 1)
        hidden = out.index_select(0, last)
        drafts = [self.compute_logits(hidden).argmax(dim=-1)]
        # Draft steps: one token per sampled request.
        step_table = table[sampled_rows]
        last_pos = end_arr[sampled_rows] - 1
        limit = self.max_position - 1
        for j in range(1, k):
            pos = np.minimum(last_pos + j, limit)
            hidden, logits = self.draft_step(step_table, pos, drafts[-1], hidden)
            drafts.append(logits.argmax(dim=-1))
        return torch.stack(drafts, dim=1).tolist()

    def catch_up(self, catch_up: CatchUpPass, hidden_states: torch.Tensor | None) -> torch.Tensor:
        """The catch-up pass: the proposer's output states of every row. Eager here; a
        subclass may replay a CUDA graph."""
        c = catch_up
        meta = self._metadata(c.table, c.req_index, c.positions, c.query_start_loc, c.seq_lens)
        ids = self._to_device(c.input_ids)
        return self.forward(ids, self._to_device(c.positions), hidden_states, meta)

    def draft_step(
        self,
        table: np.ndarray,
        positions: np.ndarray,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One token per request (`table`'s rows) at `positions`: the proposer's output states
        (what the next step reads as `hidden_states`) and the logits. Eager here; a subclass
        may replay a CUDA graph."""
        n = len(positions)
        meta = self._metadata(table, np.arange(n), positions, np.arange(n + 1), positions + 1)
        hidden = self.forward(input_ids, self._to_device(positions), hidden_states, meta)
        return hidden, self.compute_logits(hidden)

    def _block_table(self, states: Sequence[Any], reach: np.ndarray) -> np.ndarray:
        """Each request's blocks, then its row's scratch blocks, wide enough for positions
        below `reach`."""
        bs = self.block_size
        width = int(max(-(-int(r) // bs) for r in reach)) if len(reach) else 1
        width = max(width, max(len(s.block_ids) for s in states))
        table = np.empty((len(states), width), dtype=np.int64)
        for i, state in enumerate(states):
            held = state.block_ids[:width]
            table[i, : len(held)] = held
            extra = width - len(held)
            base = self.num_blocks + i * self.scratch_per_row
            scratch = base + np.arange(extra) % self.scratch_per_row
            table[i, len(held) :] = scratch
        return table

    def _metadata(
        self,
        table: np.ndarray,
        req_index: np.ndarray,
        positions: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
    ) -> AttentionMetadata:
        bs = self.block_size
        slots = table[req_index, positions // bs] * bs + positions % bs
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        query_lens = np.diff(qsl)
        num_reqs = len(qsl) - 1
        total = int(qsl[-1])
        return AttentionMetadata(
            num_actual_tokens=total,
            num_reqs=num_reqs,
            max_query_len=int(query_lens.max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
            query_start_loc=self._to_device(qsl, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            block_table=self._to_device(table, torch.int32),
            slot_mapping=self._to_device(slots),
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=np.asarray(seq_lens).tolist(),
            is_decode_only=total == num_reqs,
            num_decodes=num_reqs if total == num_reqs else 0,
        )

    def _to_device(self, array: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, dtype)


class BoundStep:
    """One step's `Proposer`: `propose(states)` runs `ModelProposer.propose_step` for the
    step it was bound to (`states`: the step's sampled requests, already in `inp`)."""

    def __init__(
        self,
        proposer: ModelProposer,
        inp: StepInputs,
        hidden_states: torch.Tensor | None,
        no_draft_req_ids: AbstractSet[str],
        external: Mapping[str, int],
    ) -> None:
        self.num_speculative_tokens = proposer.num_speculative_tokens
        self._proposer = proposer
        self._inp = inp
        self._hidden_states = hidden_states
        self._no_draft_req_ids = no_draft_req_ids
        self._external = external

    def propose(self, states: Sequence[ProposerState]) -> list[list[int]]:
        drafts = self._proposer.propose_step(
            self._inp, self._hidden_states, self._no_draft_req_ids, self._external
        )
        self._hidden_states = None
        return drafts

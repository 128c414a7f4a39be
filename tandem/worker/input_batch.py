"""The runner's per-request state, its persistent block table, and a step's host inputs.

The runner keeps each running request's token ids and block table across steps, so a running
request costs only its new block ids in each step's message. All tokens scheduled in a step
form one sequence (no padding). For request r with `num_computed_tokens` c and
`num_scheduled_tokens` n::

    input_ids[qsl[r]:qsl[r+1]]   = token_ids[c : c + n]
    positions[qsl[r]:qsl[r+1]]   = c, c+1, ..., c+n-1
    slot_mapping[...]            = block_table[pos // block_size] * block_size + pos % block_size
    seq_lens[r]                  = c + n

A request is sampled when c + n reaches its token count (its last query row).

With G > 1 KV cache groups (one per attention kind) a request's table interleaves the groups'
tables (`flat[j * G + g]`); each group gets its own block table and slot mapping
(`StepInputs.group_block_tables`, `group_slot_mappings`).

Speculative decoding: a request's scheduled draft tokens d (`scheduled_spec_decode_tokens`)
follow its known tokens in its query (`input_ids[...] = token_ids[c:] + d`); such a request
is sampled at its last len(d) + 1 query rows (`logits_indices`), verified by the rejection
sampler.

Async scheduling: a token whose id the previous step samples on the device (at most one per
request: position `len(token_ids)`) is not known on the host; its input row is listed in
`StepInputs.fill_dst`, with the previous step's sampled row in `fill_src`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tandem.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    # Row of the input batch's persistent block-table array that holds this request's table.
    row: int = -1


@dataclass
class StepInputs:
    """Host-side arrays of one step (see the module docstring for their meaning)."""

    num_reqs: int
    total: int
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    max_query_len: int
    sampled_rows: list[int]
    # The step's request states, in row order.
    states: list[CachedRequestState]
    # Tokens whose ids the previous step samples on the device: flat input row <- its row.
    fill_dst: list[int] = field(default_factory=list)
    fill_src: list[int] = field(default_factory=list)
    # Leading one-token requests of a mixed step (see AttentionMetadata.num_decodes).
    num_decodes: int = 0
    # Flat rows whose logits are computed: the last query row of each sampled request, or
    # under speculation its last k + 1 rows (k = its drafts).
    logits_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # Speculation: drafts per sampled request and the drafts in that order (None: no drafts
    # this step).
    num_draft: list[int] | None = None
    draft_token_ids: list[int] = field(default_factory=list)
    # A cache of G > 1 groups (the tables interleaved: `tandem.core.hybrid_kv_cache_manager`):
    # each group's block table `[G, num_reqs, blocks]` and slot mapping `[G, total]`;
    # `block_table` and `slot_mapping` are then group 0's. None with one group.
    group_block_tables: np.ndarray | None = None
    group_slot_mappings: np.ndarray | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.total == self.num_reqs


class InputBatch:
    """The requests a runner holds: their states and one block-table row each.

    Block tables live in one persistent array, one row per held request, kept across steps (a
    step gathers its rows in one indexing op); it grows when more requests are held than rows
    exist, or a table is wider than a row. A dropped request's row is reused.
    """

    def __init__(self, block_size: int, max_num_seqs: int, num_kv_groups: int = 1) -> None:
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        # KV cache groups: a request's table interleaves them (`flat[j * G + g]`).
        self.num_kv_groups = num_kv_groups
        self.requests: dict[str, CachedRequestState] = {}
        self.block_table_rows = np.zeros((0, 1), dtype=np.int32)
        self.free_rows: list[int] = []
        # Requests whose sampling reads their whole output (penalties, min_tokens).
        self.history_reqs: set[str] = set()

    def add_request(
        self, new: NewRequestData, eos_token_id: int | None, generator: torch.Generator | None
    ) -> CachedRequestState:
        """Hold a request scheduled for the first time (or again after preemption)."""
        params = new.sampling_params
        state = CachedRequestState(
            req_id=new.req_id,
            token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            sampling_params=params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            eos_token_id=eos_token_id,
            generator=generator,
            output_token_ids=list(new.output_token_ids),
            prompt_token_ids=list(new.prompt_token_ids),
        )
        state.row = self._take_row(len(state.block_ids))
        self.block_table_rows[state.row, : len(state.block_ids)] = state.block_ids
        self.requests[new.req_id] = state
        if params.needs_output_history:
            self.history_reqs.add(new.req_id)
        return state

    def update_cached(self, cached_reqs: Iterable[CachedRequestData]) -> None:
        """Append running requests' new block ids and take their computed-token counts."""
        for cached in cached_reqs:
            state = self.requests[cached.req_id]
            if cached.new_block_ids:
                n = len(state.block_ids)
                state.block_ids.extend(cached.new_block_ids)
                self._ensure_row_width(len(state.block_ids))
                self.block_table_rows[state.row, n : len(state.block_ids)] = cached.new_block_ids
            state.num_computed_tokens = cached.num_computed_tokens

    def drop_requests(self, req_ids: Iterable[str]) -> None:
        """Forget finished or preempted requests (their states and block-table rows)."""
        for req_id in req_ids:
            gone = self.requests.pop(req_id, None)
            if gone is not None:
                self.free_rows.append(gone.row)
            self.history_reqs.discard(req_id)

    def needs_prior_tokens(self, so: SchedulerOutput) -> bool:
        """True when a request of this step samples from its whole output (penalties,
        min_tokens): the previous step's tokens must be on the host before it launches."""
        if any(r.sampling_params.needs_output_history for r in so.scheduled_new_reqs):
            return True
        history = self.history_reqs
        return bool(history) and any(r.req_id in history for r in so.scheduled_cached_reqs)

    def clear(self) -> None:
        self.requests.clear()
        self.history_reqs.clear()
        self.block_table_rows = np.zeros((0, 1), dtype=np.int32)
        self.free_rows = []

    def _take_row(self, width: int) -> int:
        self._ensure_row_width(width)
        if not self.free_rows:
            old = self.block_table_rows
            grown = max(2 * old.shape[0], self.max_num_seqs, 8)
            self.block_table_rows = np.zeros((grown, old.shape[1]), dtype=np.int32)
            self.block_table_rows[: old.shape[0]] = old
            self.free_rows.extend(range(grown - 1, old.shape[0] - 1, -1))
        return self.free_rows.pop()

    def _ensure_row_width(self, width: int) -> None:
        old = self.block_table_rows
        if width > old.shape[1]:
            wider = np.zeros((old.shape[0], max(width, 2 * old.shape[1])), dtype=np.int32)
            wider[:, : old.shape[1]] = old
            self.block_table_rows = wider

    # ----------------------------------------------------------------- step inputs

    def prepare(
        self, so: SchedulerOutput, req_ids: list[str], prev_row_of: Mapping[str, int]
    ) -> StepInputs:
        """Host-side arrays of one step, built with numpy ops (no loop over tokens).

        `prev_row_of`: request id -> its row in the previous launched step's sampled ids
        (empty when there is none)."""
        bs = self.block_size
        num_reqs = len(req_ids)
        states = [self.requests[r] for r in req_ids]
        query_lens = np.fromiter(
            (so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=num_reqs
        )
        starts = np.fromiter(
            (s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs
        )
        seq_lens = starts + query_lens
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        total = int(query_start_loc[-1])

        max_blocks = max(len(s.block_ids) for s in states)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=num_reqs)
        # Entries past a request's own blocks hold stale ids; nothing reads them (positions
        # never reach past seq_lens).
        block_table = self.block_table_rows[rows, :max_blocks]

        # A request's token at position len(token_ids) is being sampled by the previous step
        # (async scheduling): its input row is filled on the device from that step's ids.
        fill_dst: list[int] = []
        fill_src: list[int] = []
        spec = so.scheduled_spec_decode_tokens
        starts_list = starts.tolist()
        if total == num_reqs:  # decode only: one token per request
            positions = starts
            ids = [0] * num_reqs
            for i, (state, c) in enumerate(zip(states, starts_list, strict=True)):
                tokens = state.token_ids
                if c < len(tokens):
                    ids[i] = tokens[c]
                else:
                    fill_dst.append(i)
                    fill_src.append(_prev_row(prev_row_of, state, c))
            input_ids = np.array(ids, dtype=np.int64)
            slot_mapping = block_table[np.arange(num_reqs), positions // bs].astype(np.int64)
        else:
            req_index = np.repeat(np.arange(num_reqs), query_lens)
            offsets = np.arange(total) - np.repeat(query_start_loc[:-1], query_lens)
            positions = starts[req_index] + offsets
            slot_mapping = block_table[req_index, positions // bs].astype(np.int64)
            input_ids = np.empty(total, dtype=np.int64)
            loc = query_start_loc.tolist()
            for i, (state, c) in enumerate(zip(states, starts_list, strict=True)):
                tokens = state.token_ids
                lo, hi = loc[i], loc[i + 1]
                if c + hi - lo <= len(tokens):
                    input_ids[lo:hi] = tokens[c : c + hi - lo]
                elif spec and state.req_id in spec:
                    known = len(tokens) - c
                    input_ids[lo : lo + known] = tokens[c:]
                    input_ids[lo + known : hi] = spec[state.req_id]
                else:
                    input_ids[lo : hi - 1] = tokens[c:]
                    input_ids[hi - 1] = 0
                    fill_dst.append(hi - 1)
                    fill_src.append(_prev_row(prev_row_of, state, c + hi - lo - 1))
        group_tables: np.ndarray | None = None
        group_slots: np.ndarray | None = None
        G = self.num_kv_groups
        if G > 1:
            # De-interleave: group g's table is columns g, g + G, ... of the flat one. A copy,
            # not `ascontiguousarray`: that keeps a view numpy deems contiguous because its
            # odd strides lie on size-1 axes (one request of one block), and a kernel that
            # checks a table's column stride (the CPU attention's) refuses it.
            group_tables = (
                block_table.reshape(num_reqs, max_blocks // G, G).transpose(2, 0, 1).copy()
            )
            ridx = np.arange(num_reqs) if total == num_reqs else req_index
            slot_mapping = group_tables[:, ridx, positions // bs].astype(np.int64)
            group_slots = np.ascontiguousarray(slot_mapping * bs + positions % bs)
            block_table = group_tables[0]
            slot_mapping = group_slots[0]
        else:
            slot_mapping = slot_mapping * bs + positions % bs
        sampled_rows = [i for i, state in enumerate(states) if seq_lens[i] >= len(state.token_ids)]
        ends = query_start_loc[1:][sampled_rows]
        num_draft: list[int] | None = None
        draft_token_ids: list[int] = []
        if spec and any(states[i].req_id in spec for i in sampled_rows):
            drafts = [spec.get(states[i].req_id, []) for i in sampled_rows]
            num_draft = [len(d) for d in drafts]
            draft_token_ids = [t for d in drafts for t in d]
            counts = np.array(num_draft, dtype=np.int64) + 1
            first = np.cumsum(counts) - counts
            logits_indices = np.repeat(ends - counts - first, counts) + np.arange(counts.sum())
        else:
            logits_indices = ends - 1
        return StepInputs(
            num_reqs=num_reqs,
            total=total,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            max_query_len=int(query_lens.max()),
            sampled_rows=sampled_rows,
            states=states,
            fill_dst=fill_dst,
            fill_src=fill_src,
            logits_indices=logits_indices,
            num_draft=num_draft,
            draft_token_ids=draft_token_ids,
            group_block_tables=group_tables,
            group_slot_mappings=group_slots,
        )


def _prev_row(prev_row_of: Mapping[str, int], state: CachedRequestState, position: int) -> int:
    """Row of the previous step's sampled ids that holds `state`'s token at `position`."""
    row = prev_row_of.get(state.req_id)
    if row is None or position != len(state.token_ids):
        raise RuntimeError(
            f"request {state.req_id}: token {position} is unknown and not sampled by the "
            "previous step (a step's result() was skipped?)"
        )
    return row

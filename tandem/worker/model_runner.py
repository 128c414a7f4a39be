"""The model runner: turns a `SchedulerOutput` into one flattened forward pass and samples.

All tokens scheduled in a step form one sequence (no padding). For request r with
`num_computed_tokens` c and `num_scheduled_tokens` n::

    input_ids[qsl[r]:qsl[r+1]]   = token_ids[c : c + n]
    positions[qsl[r]:qsl[r+1]]   = c, c+1, ..., c+n-1
    slot_mapping[...]            = block_table[pos // block_size] * block_size + pos % block_size
    seq_lens[r]                  = c + n

A request is sampled when c + n reaches its token count; logits are computed only for
those rows (the last query row of each sampled request).

The runner keeps its own per-request state (token ids, block table) so a running request
costs only its new block ids in each step's message.

Async scheduling: `execute_async` launches a step and returns a `PendingStep` whose
`result()` waits for that step's sampled ids only. The engine may plan and launch step N+1
before it calls step N's `result()`; a token of step N+1 whose id step N samples (at most one
per request: position `len(token_ids)`) is read on the device from step N's sampled ids.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tandem.config import EngineConfig
from tandem.core.outputs import Logprobs, ModelRunnerOutput, SchedulerOutput
from tandem.layers.attention import AttentionMetadata, get_attention_backend
from tandem.layers.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    to_logprobs_lists,
)
from tandem.loader import build_model
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return _DTYPES[name]


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
    # Row of the runner's persistent block-table array that holds this request's table.
    row: int = -1


# Pinned staging buffers in rotation (a step makes at most 8 host->device copies); each
# slot's event says when the copy that last read it has finished.
_NUM_STAGING = 16


@dataclass
class _StepInputs:
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


class PendingStep:
    """A launched step. `result()` waits for its sampled ids (not for later steps), appends
    them to the runner's request states and returns the `ModelRunnerOutput`; call it once,
    in launch order. Once it has waited, `on_done` (if any) is called: the device has
    finished this step and every step launched before it."""

    def __init__(
        self,
        req_ids: list[str],
        sampled_rows: list[int],
        states: list[CachedRequestState],
        sampled: torch.Tensor | None,
        host_sampled: torch.Tensor | None,
        event: torch.cuda.Event | None,
        sampler_output: SamplerOutput | None,
        num_logprobs: list[int | None],
        on_done: Callable[[], None] | None = None,
    ) -> None:
        self.req_ids = req_ids
        self.sampled_rows = sampled_rows
        self.states = states
        # Device ids, one per sampled row; a later step reads its inputs from here.
        self.sampled = sampled
        self.row_of = {states[j].req_id: j for j in range(len(states))}
        self._host_sampled = host_sampled
        self._event = event
        self._sampler_output = sampler_output
        self._num_logprobs = num_logprobs
        self._on_done = on_done
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        n = len(self.req_ids)
        sampled: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[Logprobs | None] = [None] * n
        if self.sampled_rows:
            if self._event is not None:
                assert self._host_sampled is not None
                self._event.synchronize()  # this step's ids only; later steps keep running
                tokens = self._host_sampled.tolist()
            else:
                assert self.sampled is not None
                tokens = self.sampled.tolist()
            if self._on_done is not None:
                self._on_done()
            assert self._sampler_output is not None
            lp_lists = to_logprobs_lists(self._sampler_output, self._num_logprobs)
            for row, state, token, lp in zip(
                self.sampled_rows, self.states, tokens, lp_lists, strict=True
            ):
                sampled[row] = [token]
                logprobs[row] = lp
                state.token_ids.append(token)
                state.output_token_ids.append(token)
        self._sampler_output = None
        self._output = ModelRunnerOutput(
            req_ids=self.req_ids, sampled_token_ids=sampled, logprobs=logprobs
        )
        return self._output


class ModelRunner:
    """Owns the model, the KV cache tensor and the sampler of one engine."""

    def __init__(self, config: EngineConfig, model_path: Path, eos_token_id: int | None) -> None:
        self.config = config
        self.device = torch.device(config.device.resolved_device())
        if config.device.device_index is not None:
            # Current on this (the engine's) thread before anything is built: Triton launches,
            # CUDA graphs, streams and the KV cache go to the current device.
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device.type)
        self.kv_dtype = (
            self.dtype
            if config.cache.kv_cache_dtype == "auto"
            else resolve_dtype(config.cache.kv_cache_dtype, self.device.type)
        )
        self.block_size = config.cache.block_size
        self.eos_token_id = eos_token_id
        backend_name = config.device.attention_backend
        if backend_name == "auto":
            backend_name = "triton" if self.device.type == "cuda" else "torch"
        self.attn_backend = get_attention_backend(backend_name)
        self.hf_config = config.model.hf_config  # resolved once, in tandem.config
        torch.manual_seed(config.model.seed)
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.model = build_model(
            model_path,
            self.dtype,
            self.device,
            self.attn_backend,
            seed=config.model.seed,
            hf_config=self.hf_config,
        )
        self.vocab_size: int = self.model.vocab_size
        self.weight_bytes = (
            torch.cuda.memory_allocated(self.device) - before if self.device.type == "cuda" else 0
        )
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.max_model_len: int = config.model.max_model_len
        self.use_cuda_graphs = self.device.type == "cuda" and not config.device.enforce_eager
        self._graphs = {}
        self._graph_sizes: list[int] = []
        self._staging: list[torch.Tensor | None] = [None] * _NUM_STAGING
        self._staging_slot = 0
        self._staging_events: list[torch.cuda.Event | None] = [None] * _NUM_STAGING
        # The last launched step (its device ids feed the next step's inputs) and the
        # requests whose sampling needs their whole output on the host.
        self._last_step: PendingStep | None = None
        # Cache slots written by launched steps the device may not have finished (a step's
        # sampled ids arriving on the host proves it and every earlier step done), by launch
        # number: `may_write_blocks` reads them.
        self._unfinished_writes: list[tuple[int, np.ndarray]] = []
        self._num_launched = 0
        self._history_reqs: set[str] = set()
        # Pinned host buffers for sampled ids, in rotation (at most 2 steps are unresolved).
        self._host_sampled: list[torch.Tensor] = []
        self._host_slot = 0
        # Block tables of the requests held, one row each, kept across steps (a step gathers
        # its rows in one indexing op); grows when more requests are held than rows exist.
        self._block_table_rows = np.zeros((0, 1), dtype=np.int32)
        self._free_rows: list[int] = []

    # ----------------------------------------------------------------- KV cache

    def kv_bytes_per_block(self) -> int:
        m = self.model
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return m.num_layers * 2 * self.block_size * m.num_kv_heads * m.head_size * elem

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks:
            return cache.num_gpu_blocks
        if self.device.type == "cuda":
            # This engine's share: `gpu_memory_utilization` of the device, less its weights and
            # what a step needs (profiled); never more than is free.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            activation = self.profile_activation_bytes()
            budget = min(
                total * cache.gpu_memory_utilization - self.weight_bytes - activation,
                free - activation - (1 << 30),
            )
            return max(int(budget // self.kv_bytes_per_block()), 1)
        return max(int(cache.kv_cache_memory_gb * (1 << 30) // self.kv_bytes_per_block()), 1)

    def profile_activation_bytes(self) -> int:
        """Memory to keep free for activations, logits, sampler temporaries and CUDA graphs.

        Measured: one eager forward of `max_num_batched_tokens` tokens (in requests of at most
        1024 tokens) through a scratch KV cache, plus the logits and sampler buffers of
        `max_num_seqs` rows, plus a fixed margin for the graph pool.
        """
        sched = self.config.scheduler
        m = self.model
        tokens = sched.max_num_batched_tokens
        per_req = min(tokens, 1024)
        num_reqs = -(-tokens // per_req)
        blocks = num_reqs * -(-per_req // self.block_size)
        scratch = torch.zeros(
            (blocks, m.num_layers, 2, self.block_size, m.num_kv_heads, m.head_size),
            dtype=self.kv_dtype,
            device=self.device,
        )
        caches = [scratch[:, i] for i in range(m.num_layers)]
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        qsl = [min(i * per_req, tokens) for i in range(num_reqs + 1)]
        lens = [qsl[i + 1] - qsl[i] for i in range(num_reqs)]
        bpr = -(-per_req // self.block_size)
        table = torch.arange(blocks, dtype=torch.int32, device=self.device).view(num_reqs, bpr)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        slots = torch.cat(
            [
                (table[i].long() * self.block_size).repeat_interleave(self.block_size)[: lens[i]]
                + torch.arange(lens[i], device=self.device) % self.block_size
                for i in range(num_reqs)
            ]
        )
        meta = AttentionMetadata(
            num_actual_tokens=tokens,
            num_reqs=num_reqs,
            max_query_len=max(lens),
            max_seq_len=max(lens),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_table=table,
            slot_mapping=slots,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
        )
        from kernels.paged_attention import prefill_tuning

        # The prefill attention kernel picks its tile config here (see prefill_tuning).
        with torch.inference_mode(), prefill_tuning():
            ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
            hidden = self.model(ids, positions, caches, meta)
            logits = self.model.compute_logits(hidden[: min(sched.max_num_seqs, tokens)])
            del hidden, logits
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch, caches
        torch.cuda.empty_cache()
        sampler_bytes = 4 * sched.max_num_seqs * self.vocab_size * 4
        return int(peak + sampler_bytes + (1 << 30))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]`.

        A block's KV over all layers is the contiguous span `kv_cache[b]`, so a run of
        consecutive block ids moves as one copy; each layer sees a strided view.
        """
        m = self.model
        self.kv_cache = torch.zeros(
            (num_blocks, m.num_layers, 2, self.block_size, m.num_kv_heads, m.head_size),
            dtype=self.kv_dtype,
            device=self.device,
        )
        self.kv_caches = [self.kv_cache[:, i] for i in range(m.num_layers)]
        if self.device.type == "cuda" and self.attn_backend.name == "triton":
            self.tune_decode_attention()
        if self.use_cuda_graphs:
            self.capture_cuda_graphs()

    def tune_decode_attention(self) -> None:
        """Time the decode attention kernel's configs on this cache and keep the fastest.

        Before graph capture (graphs keep the config they are captured with). The batch is
        the largest this engine runs, up to 512 requests of min(max_model_len, 1024) tokens:
        the throughput case, where the kernel is bound by reading the cache.
        """
        from kernels.paged_attention import tune_decode_attention

        seq_len = min(max(self.max_model_len, self.block_size), 1024)
        num_reqs = min(self.config.scheduler.max_num_seqs, 512)
        with torch.inference_mode():
            best = tune_decode_attention(
                self.kv_caches[0], self.model.num_heads, num_reqs=num_reqs, seq_len=seq_len
            )
        logger.info("decode attention config: %s", best)

    # ----------------------------------------------------------------- CUDA graphs

    def capture_cuda_graphs(self) -> None:
        """Capture decode steps (one token per request) for each bucketed batch size.

        Static buffers hold the step inputs; a step of n requests replays the smallest graph
        of size >= n with rows n.. padded (slot -1: no KV write; seq_len 1). The graphs share
        one memory pool and are captured largest first. Logits are computed in the graph.
        """
        sizes = sorted(
            {
                s
                for s in self.config.device.cuda_graph_sizes
                if s <= self.config.scheduler.max_num_seqs
            }
        )
        if not sizes:
            return
        max_bs = sizes[-1]
        dev = self.device
        max_blocks = -(-self.max_model_len // self.block_size)
        self._g_input_ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self._g_positions = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self._g_slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, device=dev)
        self._g_seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self._g_block_table = torch.zeros((max_bs, max_blocks), dtype=torch.int32, device=dev)
        self._g_query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bs in reversed(sizes):
                meta = self._graph_metadata(bs)
                args = (self._g_input_ids[:bs], self._g_positions[:bs], self.kv_caches, meta)
                for _ in range(2):  # warm-up: Triton compiles, allocator settles
                    self.model.compute_logits(self.model(*args))
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.model.compute_logits(self.model(*args))
                self._graphs[bs] = (graph, logits)
        torch.cuda.synchronize(dev)
        self._graph_sizes = sizes
        logger.info("captured decode CUDA graphs for batch sizes %s", sizes)

    def _graph_metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=bs,
            num_reqs=bs,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=self._g_query_start_loc[: bs + 1],
            seq_lens=self._g_seq_lens[:bs],
            block_table=self._g_block_table[:bs],
            slot_mapping=self._g_slot_mapping[:bs],
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
            is_decode_only=True,
        )

    def _graph_size_for(self, num_reqs: int) -> int | None:
        if not self._graphs:
            return None
        for size in self._graph_sizes:
            if size >= num_reqs:
                return size
        return None

    # ----------------------------------------------------------------- state

    def _update_states(self, so: SchedulerOutput) -> None:
        self.drop_requests(so.finished_req_ids | so.preempted_req_ids)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            state = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_id=self.eos_token_id,
                generator=generator,
                output_token_ids=list(new.output_token_ids),
                prompt_token_ids=list(new.prompt_token_ids),
            )
            if generator is not None and not params.is_greedy and new.output_token_ids:
                # Resumed after preemption: advance the stream past the draws already made.
                for _ in range(len(new.output_token_ids)):
                    torch.empty(self.vocab_size, device=self.device).exponential_(
                        generator=generator
                    )
            state.row = self._take_row(len(state.block_ids))
            self._block_table_rows[state.row, : len(state.block_ids)] = state.block_ids
            self.requests[new.req_id] = state
            if params.needs_output_history:
                self._history_reqs.add(new.req_id)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.new_block_ids:
                n = len(state.block_ids)
                state.block_ids.extend(cached.new_block_ids)
                self._ensure_row_width(len(state.block_ids))
                self._block_table_rows[state.row, n : len(state.block_ids)] = cached.new_block_ids
            state.num_computed_tokens = cached.num_computed_tokens

    def drop_requests(self, req_ids: set[str]) -> None:
        """Forget finished or preempted requests (their states and block-table rows)."""
        for req_id in req_ids:
            gone = self.requests.pop(req_id, None)
            if gone is not None:
                self._free_rows.append(gone.row)
            self._history_reqs.discard(req_id)

    def _take_row(self, width: int) -> int:
        self._ensure_row_width(width)
        if not self._free_rows:
            old = self._block_table_rows
            grown = max(2 * old.shape[0], self.config.scheduler.max_num_seqs, 8)
            self._block_table_rows = np.zeros((grown, old.shape[1]), dtype=np.int32)
            self._block_table_rows[: old.shape[0]] = old
            self._free_rows.extend(range(grown - 1, old.shape[0] - 1, -1))
        return self._free_rows.pop()

    def _ensure_row_width(self, width: int) -> None:
        old = self._block_table_rows
        if width > old.shape[1]:
            wider = np.zeros((old.shape[0], max(width, 2 * old.shape[1])), dtype=np.int32)
            wider[:, : old.shape[1]] = old
            self._block_table_rows = wider

    # ----------------------------------------------------------------- step

    def _prepare_inputs(self, so: SchedulerOutput, req_ids: list[str]) -> _StepInputs:
        """Host-side arrays of one step, built with numpy ops (no loop over tokens)."""
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
        block_table = self._block_table_rows[rows, :max_blocks]

        # A request's token at position len(token_ids) is being sampled by the previous step
        # (async scheduling): its input row is filled on the device from that step's ids.
        fill_dst: list[int] = []
        fill_src: list[int] = []
        starts_list = starts.tolist()
        if total == num_reqs:  # decode only: one token per request
            positions = starts
            ids = [0] * num_reqs
            row_of = self._last_step.row_of if self._last_step is not None else {}
            for i, (state, c) in enumerate(zip(states, starts_list, strict=True)):
                tokens = state.token_ids
                if c < len(tokens):
                    ids[i] = tokens[c]
                else:
                    row = row_of.get(state.req_id)
                    fill_dst.append(i)
                    fill_src.append(
                        row if row is not None and c == len(tokens) else self._prev_row(state, c)
                    )
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
                else:
                    input_ids[lo : hi - 1] = tokens[c:]
                    input_ids[hi - 1] = 0
                    fill_dst.append(hi - 1)
                    fill_src.append(self._prev_row(state, c + hi - lo - 1))
        slot_mapping = slot_mapping * bs + positions % bs
        sampled_rows = [i for i, state in enumerate(states) if seq_lens[i] >= len(state.token_ids)]
        return _StepInputs(
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
        )

    def _prev_row(self, state: CachedRequestState, position: int) -> int:
        """Row of the previous step's sampled ids that holds `state`'s token at `position`."""
        prev = self._last_step
        row = prev.row_of.get(state.req_id) if prev is not None else None
        if row is None or position != len(state.token_ids):
            raise RuntimeError(
                f"request {state.req_id}: token {position} is unknown and not sampled by the "
                "previous step (a step's result() was skipped?)"
            )
        return row

    def _fill_from_previous(self, input_ids: torch.Tensor, inp: _StepInputs) -> None:
        """Write the previous step's sampled ids into the rows `inp.fill_dst` (device op)."""
        if not inp.fill_dst:
            return
        assert self._last_step is not None and self._last_step.sampled is not None
        prev = self._last_step.sampled
        k = len(inp.fill_dst)
        if inp.fill_dst == list(range(k)) and inp.fill_src == list(range(k)):
            input_ids[:k].copy_(prev[:k])
            return
        index = self._to_device(np.array([inp.fill_dst, inp.fill_src], dtype=np.int64), torch.int64)
        input_ids.index_copy_(0, index[0], prev.index_select(0, index[1]))

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """Host array -> a new device tensor (see `_copy_to`)."""
        if self.device.type != "cuda":
            return torch.from_numpy(array).to(dtype)
        out = torch.empty(array.shape, dtype=dtype, device=self.device)
        self._copy_to(out, array)
        return out

    def _copy_to(self, dst: torch.Tensor, array: np.ndarray) -> None:
        """Copy a host array into `dst` (same shape). On CUDA through reused pinned staging
        buffers, so the copy is asynchronous and no pinned memory is allocated per step."""
        t = torch.from_numpy(array).to(dst.dtype)
        if self.device.type != "cuda":
            dst.copy_(t)
            return
        nbytes = t.numel() * t.element_size()
        slot = self._staging_slot % _NUM_STAGING
        self._staging_slot += 1
        buf = self._staging[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(2 * nbytes, 1 << 16), dtype=torch.uint8, pin_memory=True)
            self._staging[slot] = buf
        event = self._staging_events[slot]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer has finished
        staged = buf[:nbytes].view(dst.dtype).view(t.shape)
        staged.copy_(t)
        dst.copy_(staged, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._staging_events[slot] = event

    def _run_eager(self, inp: _StepInputs) -> torch.Tensor:
        metadata = AttentionMetadata(
            num_actual_tokens=inp.total,
            num_reqs=inp.num_reqs,
            max_query_len=inp.max_query_len,
            # Decode steps cut their work as the captured graphs do (same results either way).
            max_seq_len=self.max_model_len
            if inp.total == inp.num_reqs and self.device.type == "cuda"
            else int(inp.seq_lens.max()),
            query_start_loc=self._to_device(inp.query_start_loc, torch.int32),
            seq_lens=self._to_device(inp.seq_lens, torch.int32),
            block_table=self._to_device(inp.block_table, torch.int32),
            slot_mapping=self._to_device(inp.slot_mapping, torch.int64),
            query_start_loc_cpu=inp.query_start_loc.tolist(),
            seq_lens_cpu=inp.seq_lens.tolist(),
            is_decode_only=inp.total == inp.num_reqs,
            num_decodes=inp.num_decodes,
        )
        input_ids = self._to_device(inp.input_ids, torch.int64)
        self._fill_from_previous(input_ids, inp)
        hidden = self.model(
            input_ids,
            self._to_device(inp.positions, torch.int64),
            self.kv_caches,
            metadata,
        )
        if not inp.sampled_rows:
            return hidden[:0]
        logits_indices = inp.query_start_loc[1:][inp.sampled_rows] - 1
        idx = self._to_device(logits_indices, torch.int64)
        return self.model.compute_logits(hidden.index_select(0, idx))

    def _run_graph(self, inp: _StepInputs, size: int) -> torch.Tensor:
        """Replay the decode graph of `size` rows; returns the logits of the first n rows."""
        n = inp.num_reqs
        width = inp.block_table.shape[1]
        # Straight from the pinned staging buffers into the graph's static inputs.
        self._copy_to(self._g_input_ids[:n], inp.input_ids)
        self._fill_from_previous(self._g_input_ids[:n], inp)
        self._copy_to(self._g_positions[:n], inp.positions)
        self._copy_to(self._g_slot_mapping[:n], inp.slot_mapping)
        self._copy_to(self._g_seq_lens[:n], inp.seq_lens)
        self._copy_to(self._g_block_table[:n, :width], inp.block_table)
        if size > n:
            self._g_slot_mapping[n:size].fill_(-1)
            self._g_seq_lens[n:size].fill_(1)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:n]

    def needs_prior_tokens(self, so: SchedulerOutput) -> bool:
        """True when a request of this step samples from its whole output (penalties,
        min_tokens): the previous step's tokens must be on the host before it launches."""
        if any(r.sampling_params.needs_output_history for r in so.scheduled_new_reqs):
            return True
        history = self._history_reqs
        return bool(history) and any(r.req_id in history for r in so.scheduled_cached_reqs)

    def synchronize(self) -> None:
        """Wait until every launched step has finished on the device."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._unfinished_writes.clear()

    def may_write_blocks(self, block_ids: list[int]) -> bool:
        """Whether a launched step not known to have finished writes K/V into any of
        `block_ids`. Such a block was freed after that step was planned (its request stopped
        or was aborted meanwhile); whoever hands it to another writer (a remote KV transfer,
        outside this runner's stream order) must `synchronize` first."""
        if not self._unfinished_writes or not block_ids:
            return False
        ids = np.asarray(block_ids, dtype=np.int64)
        for _, slots in self._unfinished_writes:
            if np.isin(ids, slots[slots >= 0] // self.block_size).any():
                return True
        return False

    def _writes_done(self, launch: int) -> None:
        """The device finished launch number `launch` and everything before it."""
        self._unfinished_writes = [w for w in self._unfinished_writes if w[0] > launch]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled ids."""
        return self.execute_async(so).result()

    @torch.inference_mode()
    def execute_async(self, so: SchedulerOutput) -> PendingStep:
        """Launch one step: inputs, forward, sampling; the host does not wait for the device.

        Every step launched before must have had `result()` called, except the last one."""
        self._update_states(so)
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + [
            r.req_id for r in so.scheduled_cached_reqs
        ]
        if not req_ids:
            return PendingStep([], [], [], None, None, None, None, [])
        num_decodes = 0
        if so.total_num_scheduled_tokens != len(req_ids):
            # Mixed step: one-token requests first, so attention can run them as decodes.
            counts = so.num_scheduled_tokens
            decodes = [r for r in req_ids if counts[r] == 1]
            if decodes:
                num_decodes = len(decodes)
                req_ids = decodes + [r for r in req_ids if counts[r] != 1]
        inp = self._prepare_inputs(so, req_ids)
        inp.num_decodes = num_decodes
        graph_size = self._graph_size_for(inp.num_reqs) if inp.total == inp.num_reqs else None
        if graph_size is not None:
            logits = self._run_graph(inp, graph_size)
        else:
            logits = self._run_eager(inp)

        states = [inp.states[i] for i in inp.sampled_rows]
        sampled = host = event = out = None
        num_logprobs = [s.sampling_params.logprobs for s in states]
        if states:
            meta = SamplingMetadata.build(
                params=[s.sampling_params for s in states],
                prompt_token_ids=[s.prompt_token_ids for s in states],
                output_token_ids=[s.output_token_ids for s in states],
                eos_token_ids=[s.eos_token_id for s in states],
                generators=[s.generator for s in states],
                vocab_size=self.vocab_size,
                device=self.device,
            )
            out = self.sampler(logits, meta)
            sampled = out.sampled_token_ids
            if self.device.type == "cuda":
                host = self._next_host_buffer(len(states))
                host.copy_(sampled, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
        self._num_launched += 1
        launch = self._num_launched
        self._unfinished_writes.append((launch, inp.slot_mapping))
        step = PendingStep(
            req_ids,
            inp.sampled_rows,
            states,
            sampled,
            host,
            event,
            out,
            num_logprobs,
            on_done=lambda: self._writes_done(launch),
        )
        self._last_step = step
        return step

    def _next_host_buffer(self, n: int) -> torch.Tensor:
        """A pinned int64 buffer of n ids, from a rotation of 4 (at most 2 steps unresolved)."""
        if not self._host_sampled:
            size = max(self.config.scheduler.max_num_seqs, 1)
            self._host_sampled = [
                torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(4)
            ]
        buf = self._host_sampled[self._host_slot % 4]
        self._host_slot += 1
        if buf.numel() < n:
            buf = torch.empty(n, dtype=torch.int64, pin_memory=True)
            self._host_sampled[(self._host_slot - 1) % 4] = buf
        return buf[:n]

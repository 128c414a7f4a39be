"""Step-level scheduling on a token budget.

Every request has `num_computed_tokens` catching up to `num_tokens`; each step hands out at
most `max_num_batched_tokens` tokens, one request at most `long_prefill_token_threshold` of
them when that is set (so a long prompt cannot take a whole step from the others). One rule
covers decode (1 token left), chunked prefill (many left, a budget-sized chunk), prefix hits
(computed tokens start at the hit) and resumption after preemption (computed tokens dropped
to 0)::

    step:  running requests, in order          waiting requests, in policy order
           [decode 1][decode 1][chunk k] ...   [prefill / chunk] ... until budget or seqs run out
           (preempt by recompute when blocks   (skipped in a step that preempted)
            run out)

`schedule()` returns a `SchedulerOutput` and advances each scheduled request's
`num_computed_tokens` as if the step had run; `update_from_output()` appends the sampled
tokens, applies the stop rules and frees finished requests.

Speculative decoding: a running request's draft tokens (`Request.spec_token_ids`, set from
the runner's proposals in `update_from_output`) are scheduled after its known tokens under
the same budget (1 + k query tokens for a decode; they mix with prefills in one step), with
their KV slots allocated (the lookahead). Drafts are never part of `all_token_ids`, so only
verified tokens are hashed into full blocks. After the step, the rejected positions are
rolled back::

    before:  num_computed = L - 1, known tokens L, drafts d0..d{k-1}: schedule 1 + k
    step:    num_computed = L + k (as if every draft were right)
    update:  a accepted -> emits a + 1 tokens; num_computed -= k - a  (= L + a, the
             last emitted token's KV is computed next step); the slots past it are reused

Async scheduling (k placeholders): a request verifying k drafts in step N has 1 + a tokens
coming (a unknown until N lands) but counts one placeholder, and its `num_computed_tokens`
assumes every draft accepted; the engine applies step N before it plans step N+1 whenever N
verified drafts or N+1 may schedule drafts (`tandem.engine.core`), so no step is ever planned
on a guessed acceptance. Proposals that arrive while a later step of the request is already
planned (a plain step N+1 planned before N landed) are stale and dropped: drafts always
follow the request's last verified token. Requests with structured outputs, penalties or
min_tokens get no drafts (their sampling reads the output history token by token).
A request whose drafts were all rejected in `SPEC_BACKOFF_AFTER` verify steps in a row drafts
nothing for 1, 2, 4, ... (at most `SPEC_BACKOFF_MAX`) steps, until a draft is accepted again:
drafts that keep failing cost a verify pass each, so a request that gains nothing from them
soon runs as a plain decode (and its steps take the decode CUDA graphs).

Structured outputs (`tandem.core.structured`): a request whose grammar is still compiling is
passed over (waiting ones keep their place in the queue; the others are scheduled around
them); one whose grammar failed ends with FINISHED_ERROR (`take_error_outputs`). The grammar
follows the output tokens appended here and stops the request when it terminates.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tandem.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tandem.core.hybrid_kv_cache_manager import HybridKVCacheManager, build_kv_cache_manager
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.kv_cache_spec import KVCacheSpec
from tandem.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tandem.core.spec_decode_stats import SpecDecodingStats
from tandem.core.structured import GrammarStatus
from tandem.request import (
    FINISH_REASONS,
    FIRST_FINISHED,
    RUNNING,
    Request,
    RequestStatus,
)

# Speculation backoff (see the module docstring).
SPEC_BACKOFF_AFTER = 2
SPEC_BACKOFF_MAX = 32


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler's load, for logs and metrics."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_preemptions: int  # total since start
    # Speculative decoding counters (None without speculation).
    spec_decoding: SpecDecodingStats | None = None


class _FcfsQueue:
    """Waiting requests in arrival order; preempted ones go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request, seq: int) -> None:
        self._queue.append(request)

    def prepend(self, request: Request, seq: int) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class _PriorityQueue:
    """Waiting requests by (priority, arrival_time, admission seq): lower priority value first."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []

    def add(self, request: Request, seq: int) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, seq, request))

    prepend = add  # a preempted request takes its place by its own key

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    `max_model_len` (0: unbounded) caps every request's tokens; the pool must hold at least
    one request of that length (ValueError otherwise). `kv_cache_spec` gives the cache's
    groups by attention kind (None: one full-attention group, the plain cache).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        speculative_config: SpeculativeConfig | None = None,
        kv_cache_spec: KVCacheSpec | None = None,
        max_concurrent_batches: int = 1,
    ) -> None:
        if max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {max_concurrent_batches}")
        spec = kv_cache_spec
        if spec is None:
            spec = KVCacheSpec.full(cache_config.block_size, 1)
        elif spec.block_size != cache_config.block_size:
            raise ValueError(
                f"kv_cache_spec has block_size {spec.block_size}, the cache "
                f"{cache_config.block_size}"
            )
        if max_model_len and num_blocks < spec.max_blocks_per_request(
            max_model_len, scheduler_config.max_num_batched_tokens
        ):
            # One request of max_model_len tokens could never fit: it would preempt itself forever.
            raise ValueError(
                f"{num_blocks} KV blocks of {cache_config.block_size} tokens cannot hold one "
                f"request of max_model_len {max_model_len}"
            )
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        # Steps in flight at once with disjoint requests (pipeline parallel: one per stage).
        # Above 1, a request whose sampled token is still in flight waits for it, and a step
        # takes at most its share of the running requests, so consecutive steps hold
        # different requests and a stage can start one while the next stage runs the other.
        self.max_concurrent_batches = max_concurrent_batches
        self.kv_cache_spec = spec
        self._kv_cache_manager = build_kv_cache_manager(
            spec,
            num_blocks,
            enable_caching=cache_config.enable_prefix_caching,
            max_model_len=max_model_len,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: _FcfsQueue | _PriorityQueue = (
            _PriorityQueue() if scheduler_config.policy == "priority" else _FcfsQueue()
        )
        # In admission order (the last one is the fcfs preemption victim).
        self.running: list[Request] = []
        # Finished or aborted since the last `schedule()`; handed to the runner there.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Block-table length the runner has seen, per request it holds state for.
        self._num_sent_blocks: dict[str, int] = {}
        self._seq: dict[str, int] = {}
        self._seq_counter = itertools.count()
        # Disaggregation: finished prefills whose blocks wait to be sent, and reservations
        # for prompts whose KV arrives from another worker.
        self.held: dict[str, Request] = {}
        self.reserved: dict[str, Request] = {}
        # Requests ended because their grammar failed, not yet reported (take_error_outputs).
        self._error_outputs: list[EngineCoreOutput] = []
        # Speculative decoding: the most drafts per request per step (0: off) and counters.
        spec = speculative_config
        self.num_spec_tokens = spec.k if spec is not None else 0
        self.spec_disable_by_batch_size = spec.disable_by_batch_size if spec is not None else 0
        self.spec_stats = SpecDecodingStats(self.num_spec_tokens) if self.num_spec_tokens else None

    @property
    def kv_cache_manager(self) -> KVCacheManager | HybridKVCacheManager:
        return self._kv_cache_manager

    # ---- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING). Raises ValueError for a duplicate id, an
        empty prompt or a prompt longer than max_model_len."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} already exists")
        if request.num_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if self.max_model_len and request.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} tokens "
                f"> max_model_len {self.max_model_len}"
            )
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id!r} is {request.status.name}")
        seq = next(self._seq_counter)
        self._seq[request.request_id] = seq
        self.requests[request.request_id] = request
        self.waiting.add(request, seq)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string): remove them from the queues
        and free their blocks. Unknown or already finished ids are ignored."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"{status.name} is not a finished status")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for req_id in ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)

    # ---- disaggregation ----------------------------------------------------------------

    def release_held(self, request_id: str) -> bool:
        """Free the blocks of a finished `hold_kv` request. False if it holds none."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self._kv_cache_manager.free(request)
        return True

    def reserve(self, request: Request) -> tuple[list[int], int] | None:
        """Allocate blocks for a prompt whose KV another worker computes.

        Returns (block ids, number of leading prompt tokens already cached here, which need
        not be sent), or None when the pool is short. The new blocks enter the prefix index
        only in `add_prefilled`, once their KV landed.
        """
        req_id = request.request_id
        if req_id in self.requests or req_id in self.reserved:
            raise ValueError(f"request {req_id!r} already exists")
        kv = self._kv_cache_manager
        hits, num_hit_tokens = kv.get_computed_blocks(request)
        if (
            kv.allocate_slots(request, 0, request.num_prompt_tokens, hits, delay_caching=True)
            is None
        ):
            return None
        request.num_cached_tokens = num_hit_tokens
        self.reserved[req_id] = request
        return kv.get_block_ids(req_id), num_hit_tokens

    def cancel_reservation(self, request_id: str) -> bool:
        request = self.reserved.pop(request_id, None)
        if request is None:
            return False
        self._kv_cache_manager.free(request)
        return True

    def add_prefilled(self, request_id: str, first_token_id: int) -> EngineCoreOutput | None:
        """Start decoding a reserved request whose prompt KV has landed in its blocks.

        The first token was sampled by the prefill worker. Returns an output only when that
        token already finishes the request (eos, max_tokens=1).
        """
        request = self.reserved.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_external_computed_tokens = request.num_prompt_tokens - max(
            request.num_cached_tokens, 0
        )
        request.append_output_token_ids([first_token_id])
        self._kv_cache_manager.cache_blocks(request, request.num_prompt_tokens)
        seq = next(self._seq_counter)
        self._seq[request_id] = seq
        self.requests[request_id] = request
        self._admit(request, request.num_prompt_tokens)
        if self._check_stop(request, first_token_id):
            self.running.remove(request)
            self._release(request)
            return EngineCoreOutput(
                request_id=request_id,
                new_token_ids=[],
                finish_reason=request.status.finish_reason(),
                stop_reason=request.stop_reason,
            )
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def reset_prefix_cache(self) -> bool:
        return self._kv_cache_manager.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        kv = self._kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_stats.num_query_tokens,
            prefix_cache_hits=kv.prefix_cache_stats.num_hit_tokens,
            num_preemptions=self.num_preemptions,
            spec_decoding=self.spec_stats.snapshot() if self.spec_stats is not None else None,
        )

    # ---- one step -----------------------------------------------------------------------

    def schedule(
        self, num_drafts: int | None = None, propose_drafts: bool = True
    ) -> SchedulerOutput:
        """Plan one step under the token budget (see the module docstring).

        `num_drafts` caps each request's drafts in this step (None: up to k; the engine's
        `SpeculationRule` decides it); `propose_drafts` False: nothing is proposed after the
        step (the next one takes no drafts)."""
        kv = self._kv_cache_manager
        budget = self.scheduler_config.max_num_batched_tokens
        scheduled: list[Request] = []
        num_scheduled: dict[str, int] = {}
        preempted: list[Request] = []

        # 1. Running requests: decodes and continuing chunked prefills.
        concurrent = self.max_concurrent_batches
        share = -(-len(self.running) // concurrent)
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RUNNING:
                continue  # preempted earlier in this step
            if concurrent > 1 and (request.num_output_placeholders or len(scheduled) >= share):
                continue  # its token is in flight, or this step has its share (see __init__)
            if request.grammar is not None and not self._grammar_ready(request):
                continue
            if num_drafts is not None and len(request.spec_token_ids) > num_drafts:
                request.spec_token_ids = request.spec_token_ids[:num_drafts]
            num_new = self._num_tokens_to_schedule(request, request.num_computed_tokens, budget)
            if num_new == 0:
                continue
            while (new_blocks := kv.allocate_slots(request, num_new)) is None:
                victim = self._select_victim()
                self._preempt(victim)
                preempted.append(victim)
                if victim.request_id in num_scheduled:  # scheduled earlier in this step
                    budget += num_scheduled.pop(victim.request_id)
                    scheduled.remove(victim)
                if victim is request:
                    break
            if new_blocks is None:
                continue
            scheduled.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new

        # 2. Waiting requests, only in a step that preempted nothing.
        max_num_seqs = self.scheduler_config.max_num_seqs
        passed_over: list[Request] = []  # grammars still compiling: back in front, in order
        while not preempted and len(self.waiting) and budget > 0:
            if len(self.running) >= max_num_seqs:
                break
            request = self.waiting.peek()
            if request.grammar is not None and not self._grammar_ready(request):
                if not request.is_finished:  # a failed one has left the queue
                    passed_over.append(self.waiting.pop())
                continue
            # Prompt logprobs need every prompt position computed: no prefix-cache hit.
            computed_blocks, num_computed = (
                ([], 0) if request.prompt_logprobs is not None else kv.get_computed_blocks(request)
            )
            num_new = self._num_tokens_to_schedule(request, num_computed, budget)
            if num_new == 0:
                break  # does not fit this step's budget unchunked: wait, keeping the order
            if kv.allocate_slots(request, num_new, num_computed, computed_blocks) is None:
                break
            self.waiting.pop()
            self._admit(request, num_computed)
            scheduled.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        for request in reversed(passed_over):
            self.waiting.prepend(request, self._seq[request.request_id])

        output = self._build_output(scheduled, num_scheduled, preempted)
        structured = output.structured_req_ids
        spec = output.scheduled_spec_decode_tokens
        backoff_counts = bool(self.num_spec_tokens) and num_drafts != 0
        if self.num_spec_tokens and not propose_drafts:
            output.propose_drafts = False
            output.no_draft_req_ids.update(num_scheduled)
        for request in scheduled:
            if request.spec_skip_steps:
                # Its next proposals are dropped whatever this step's outcome (`_next_drafts`).
                output.no_draft_req_ids.add(request.request_id)
            request.num_computed_tokens += num_scheduled[request.request_id]
            if backoff_counts and request.spec_backed_off and not request.spec_token_ids:
                output.spec_backoff_req_ids.add(request.request_id)
            if request.spec_token_ids:
                # Drafts consumed: those within this step's tokens are verified by it.
                num_drafts = request.num_computed_tokens - request.num_tokens_with_placeholders
                if num_drafts > 0:
                    spec[request.request_id] = request.spec_token_ids[:num_drafts]
                request.spec_token_ids = []
            if request.num_computed_tokens >= request.num_tokens_with_placeholders:
                # This step samples the request's next token: count it before it is known,
                # so the next step can be planned before this one's tokens come back.
                request.num_output_placeholders += 1
                if request.grammar is not None:
                    structured.append(request.request_id)
        return output

    def _grammar_ready(self, request: Request) -> bool:
        """Whether `request`'s grammar lets it be scheduled now. A failed grammar ends the
        request here (FINISHED_ERROR, reported by `take_error_outputs`)."""
        assert request.grammar is not None
        status = request.grammar.poll()
        if status == GrammarStatus.READY:
            return True
        if status == GrammarStatus.FAILED:
            error = request.grammar.error or "structured_outputs: the grammar failed"
            self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
            request.stop_reason = error
            self._error_outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ERROR,
                    stop_reason=error,
                )
            )
        return False

    def take_error_outputs(self) -> list[EngineCoreOutput]:
        """The outputs of requests ended because their grammar failed since the last call."""
        outputs, self._error_outputs = self._error_outputs, []
        return outputs

    def _num_tokens_to_schedule(self, request: Request, num_computed: int, budget: int) -> int:
        """Tokens to compute this step from `num_computed` on; 0 when it must wait.

        A request with tokens still in flight is not planned past a length it is sure to stop
        at (max_tokens, max_model_len): those steps would only be thrown away."""
        placeholders = request.num_output_placeholders
        num_tokens = len(request.all_token_ids) + placeholders
        max_model_len = self.max_model_len
        if placeholders:
            max_tokens = request.sampling_params.max_tokens
            if (
                max_tokens is not None
                and len(request.output_token_ids) + placeholders >= max_tokens
            ) or (max_model_len and num_tokens >= max_model_len):
                return 0
        remaining = num_tokens + len(request.spec_token_ids) - num_computed
        if max_model_len and max_model_len - num_computed < remaining:
            remaining = max_model_len - num_computed
        if remaining <= 0:
            return 0
        if remaining > budget and not self.scheduler_config.enable_chunked_prefill:
            return 0
        threshold = self.scheduler_config.long_prefill_token_threshold
        if threshold and remaining > threshold and self.scheduler_config.enable_chunked_prefill:
            remaining = threshold  # one request's share of a step is bounded
        return min(remaining, budget)

    def _admit(self, request: Request, num_computed_tokens: int) -> None:
        """Move a request whose slots are allocated into the running set.

        `num_computed_tokens` counts tokens whose KV is already in its blocks (prefix hits;
        later also KV pushed from another worker)."""
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens
        self.running.append(request)

    def _select_victim(self) -> Request:
        """The running request to preempt: last admitted (fcfs) or worst (priority, arrival)."""
        if self.scheduler_config.policy == "priority":
            return max(
                self.running,
                key=lambda r: (r.priority, r.arrival_time, self._seq[r.request_id]),
            )
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: free the blocks, forget progress, back to the waiting front."""
        self.running.remove(request)
        self._kv_cache_manager.free(request)  # reads num_computed_tokens: free before reset
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.spec_backed_off = False
        request.num_external_computed_tokens = 0  # recomputed here when it resumes
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request.grammar is not None:
            request.grammar.reset()  # rebuilt from the token ids when it runs again
        self._num_sent_blocks.pop(request.request_id, None)
        self.waiting.prepend(request, self._seq[request.request_id])

    def _build_output(
        self,
        scheduled: list[Request],
        num_scheduled: dict[str, int],
        preempted: list[Request],
    ) -> SchedulerOutput:
        kv = self._kv_cache_manager
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        req_to_blocks = kv.req_to_blocks
        num_sent_blocks = self._num_sent_blocks
        for request in scheduled:
            req_id = request.request_id
            blocks = req_to_blocks.get(req_id, ())
            num_sent = num_sent_blocks.get(req_id)
            if num_sent is None:
                new_reqs.append(
                    NewRequestData(
                        req_id=req_id,
                        prompt_token_ids=list(request.prompt_token_ids),
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=[b.block_id for b in blocks],
                        num_computed_tokens=request.num_computed_tokens,
                        num_external_computed_tokens=request.num_external_computed_tokens,
                    )
                )
                request.num_external_computed_tokens = 0
            else:
                # Most steps add no block: only the tail is converted.
                cached_reqs.append(
                    CachedRequestData(
                        req_id,
                        [b.block_id for b in blocks[num_sent:]] if len(blocks) > num_sent else [],
                        request.num_computed_tokens,
                    )
                )
            num_sent_blocks[req_id] = len(blocks)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
        )
        self.finished_req_ids = set()
        return output

    # ---- after the step ran -------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, free finished requests.

        Returns one `EngineCoreOutput` per request that got new tokens or finished. Requests
        finished or aborted since the step was planned are skipped. Under async scheduling the
        next step may already be planned (and the request preempted by it): the tokens still
        land, in order, since every planned step is updated before the one after it is planned.
        """
        requests = self.requests
        logprobs = model_runner_output.logprobs
        for req_id, (start, entries) in model_runner_output.prompt_logprobs.items():
            owner = requests.get(req_id)
            if owner is not None and owner.prompt_logprobs is not None:
                # By position: a chunk computed again (after a preemption) overwrites itself.
                owner.prompt_logprobs[start : start + len(entries)] = entries
        spec_token_ids = model_runner_output.spec_token_ids
        scheduled_spec = scheduler_output.scheduled_spec_decode_tokens
        if self.spec_stats is not None and model_runner_output.spec_verify_path:
            self.spec_stats.observe_step(model_runner_output.spec_verify_path)
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        for i, (req_id, sampled) in enumerate(
            zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True)
        ):
            if not sampled:
                continue  # a partial prefill chunk samples nothing
            request = requests.get(req_id)
            if (
                request is None
                or request.status >= FIRST_FINISHED
                or not request.num_output_placeholders
                or req_id not in scheduler_output.num_scheduled_tokens
            ):
                continue
            request.num_output_placeholders -= 1
            drafts = scheduled_spec.get(req_id) if scheduled_spec else None
            if drafts:
                # Roll back the rejected positions (see the module docstring).
                num_accepted = len(sampled) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                if num_accepted:
                    request.spec_num_misses = 0
                else:
                    request.spec_num_misses += 1
                    misses = request.spec_num_misses - SPEC_BACKOFF_AFTER
                    if misses >= 0:
                        request.spec_skip_steps = min(1 << misses, SPEC_BACKOFF_MAX)
                if self.spec_stats is not None:
                    self.spec_stats.observe(len(drafts), num_accepted)
            was_running = request.status == RUNNING
            new_token_ids: list[int] = []
            for token_id in sampled:
                request.output_token_ids.append(token_id)
                request.all_token_ids.append(token_id)
                new_token_ids.append(token_id)
                if self._check_stop(request, token_id):
                    break
            lp = logprobs[i] if i < len(logprobs) else None
            finished = request.status >= FIRST_FINISHED
            if spec_token_ids and not finished:
                # Proposed after this step's tokens: stale when a later step of the request is
                # already planned (async scheduling), its token in flight after these; none
                # for a request preempted meanwhile (it resumes from its prompt).
                request.spec_token_ids = (
                    []
                    if request.num_output_placeholders or not was_running
                    else self._next_drafts(request, spec_token_ids[i])
                )
            prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=None if lp is None else lp[: len(new_token_ids)],
                    finish_reason=FINISH_REASONS.get(request.status) if finished else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    prompt_logprobs=prompt_logprobs,
                )
            )
            if finished:
                if was_running:
                    any_finished = True
                else:
                    self.waiting.remove(request)  # preempted after this step was planned
                self._release(request)
        if any_finished:
            self.running = [r for r in self.running if r.status < FIRST_FINISHED]
        return outputs

    def _next_drafts(self, request: Request, proposed: list[int]) -> list[int]:
        """The drafts `request` verifies in its next step: at most `num_spec_tokens`, none past
        max_tokens (a step emits up to 1 + drafts tokens), none for a structured request or one
        whose sampling reads its output counts (penalties, min_tokens), none while
        `disable_by_batch_size` requests or more run, none while the request backs off.
        Logits processors (logit_bias, allowed_token_ids, bad words, custom) apply at every
        verified position (tandem.layers.logits_processors.speculative)."""
        if not self.num_spec_tokens:
            return []
        request.spec_backed_off = bool(request.spec_skip_steps)
        if request.spec_skip_steps:
            request.spec_skip_steps -= 1
            return []
        limit = self.spec_disable_by_batch_size
        if not proposed or (limit and len(self.running) >= limit):
            return []
        if request.grammar is not None:
            return []
        params = request.sampling_params
        k = params.max_drafts(len(request.output_token_ids), self.num_spec_tokens)
        return list(proposed[:k]) if k > 0 else []

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Apply the stop rules after `token_id` was appended; True if the request finished."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        grammar = request.grammar
        if grammar is not None:
            if not grammar.sync():
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = (
                    f"structured_outputs: token {token_id} does not continue the grammar"
                )
                return True
            if grammar.is_terminated():
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = None
                return True
        if num_output >= params.min_tokens:
            if (
                not params.ignore_eos
                and request.eos_token_id is not None
                and token_id == request.eos_token_id
            ):
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = None
                return True
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        if params.max_tokens is not None and num_output >= params.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if self.max_model_len and len(request.all_token_ids) >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _release(self, request: Request) -> None:
        """Free a finished request's blocks and forget it (it stays out of the queues).

        A request with `hold_kv` keeps its blocks in `held` until `release_held` (unless it
        was aborted or failed: then there is nothing to hand off)."""
        if request.hold_kv and request.status < RequestStatus.FINISHED_ABORTED:
            self.held[request.request_id] = request
        else:
            self._kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        self._num_sent_blocks.pop(request.request_id, None)
        self._seq.pop(request.request_id, None)
        del self.requests[request.request_id]

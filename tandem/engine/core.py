"""EngineCore: the step loop of one worker, with no transport.

    step():  scheduler.schedule() -> executor.execute_async() -> scheduler.update_from_output()

    EngineCore ──> Scheduler (tandem.core: no torch)
               └─> Executor (tandem.executor) ──> Worker per rank ──> ModelRunner

With async scheduling (on by default on CUDA) a step plans and launches step N+1 and then
waits for step N's tokens, so the host's scheduling and output handling run while the device
computes::

    step():  schedule(N+1) -> execute_async(N+1) -> update_from_output(N, result(N))

A request that stops at step N has one more token computed in step N+1, which is dropped.

Late planning (`--async-scheduling late`) keeps that overlap but plans step N+1 shortly before
step N is predicted to end, not as it starts (`plan_deadline()`; `tandem.engine.late_plan`):
the engine-core process takes commands until then, so a request that arrives while step N
runs starts in N+1 rather than N+2. `LLM` and other callers that add requests only between
steps plan at once, as under "on".

Speculative decoding under async scheduling: a step that verifies drafts emits 1 + a tokens
per request, a known only when it lands, and a step's drafts are proposed from the previous
step's tokens. So the engine applies the launched step before planning the next one when
that step verified drafts, or when the next one may schedule drafts; otherwise (no drafts
either side: speculation off for this step, by `disable_by_batch_size` or the measured rule)
steps overlap as above::

    verify step N:  [result(N), update(N): drafts for N+1] -> schedule(N+1) -> launch(N+1)
                    -> return (the caller's output work overlaps N+1 on the device)
    plain step N:   schedule(N+1) -> launch(N+1) -> result(N), update(N)   (overlapped)
A step whose requests sample from their whole output (penalties, min_tokens) waits for the
previous step first. A step with structured-output rows needs step N's tokens only to sample:
their grammar bitmask (`tandem.structured_output`) is filled from the matchers advanced by
them, so the runner asks for it once step N+1's forward is launched, and the host's work
(step N's result and update, the fill) runs while the device computes that forward::

    step():  schedule(N+1) -> forward(N+1) -> [result(N), update(N), fill bitmask(N+1)]
                           -> sample(N+1)          (all inside execute_async(N+1, source))

Requests whose grammar is still compiling are passed over by the scheduler; when nothing
else can run, the step waits (a few ms) for a compile instead of spinning.

Callers (the offline `LLM`, a worker service's engine thread) own the loop; EngineCore is
not thread-safe and never blocks on anything but the model. `shutdown()` frees the device
memory (KV cache, CUDA graphs, weights); an engine shut down runs no more steps.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import EngineConfig
from tandem.core.outputs import EngineCoreOutput, GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from tandem.core.scheduler import Scheduler
from tandem.core.spec_decode_rule import SpecRuleStats, SpeculationRule
from tandem.core.spec_decode_stats import SpecDecodingStats
from tandem.engine.late_plan import StepClock, step_kind
from tandem.executor import Executor, create_executor
from tandem.executor.base import LaunchedStep
from tandem.layers.logits_processors import load_logits_processors
from tandem.layers.logits_processors.interface import processor_name
from tandem.loader import get_eos_token_ids, has_tokenizer_files, load_tokenizer
from tandem.loader.resolve import resolve_engine_config
from tandem.models.presets import has_random_weights
from tandem.request import EngineCoreRequest, Request, RequestStatus
from tandem.sampling_params import SamplingParamsError
from tandem.structured_output import StructuredOutputManager
from tandem.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# How often the engine reads its MoE layers' expert load from the device (EngineStats).
EXPERT_LOAD_PERIOD_S = 1.0


# Young-generation collections every 700 allocations cost more than the steps' own work at
# a thousand running requests (each step allocates lists and messages per request); engine
# processes collect after 50,000 instead. Measured on the CPU path: update_from_output
# 10.7 -> 3.5 ms per step at 1024 requests.
_GC_GEN0_THRESHOLD = 50_000


def _raise_gc_threshold() -> None:
    gen0, gen1, gen2 = gc.get_threshold()
    if gen0 and gen0 < _GC_GEN0_THRESHOLD:
        gc.set_threshold(_GC_GEN0_THRESHOLD, gen1, gen2)


# How long an idle step waits for a grammar compile when every request waits for one.
_GRAMMAR_WAIT_S = 0.005


class InvalidRequestError(ValueError):
    """A request the engine cannot run; the message names the problem."""


def check_prompt_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    """InvalidRequestError unless every id is in the vocabulary (non-empty `token_ids`)."""
    low, high = min(token_ids), max(token_ids)
    if low < 0 or high >= vocab_size:
        raise InvalidRequestError(
            f"prompt token ids must be in [0, {vocab_size}), got {low}..{high}"
        )


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_held: int
    num_reserved: int
    # Whether steps are planned while the previous one runs (steps next to a verify step
    # wait for it: see the module docstring).
    async_scheduling: bool = False
    # Speculative decoding (None without): drafts, accepted tokens, acceptance by position,
    # and the verify steps by how they ran (`num_verify_steps`).
    spec_decoding: SpecDecodingStats | None = None
    # The measured speculation rule's choices (None without it): steps by drafts per request.
    spec_decode_rule: SpecRuleStats | None = None
    # MoE models (None without): tokens routed to each expert of each MoE layer since start,
    # `[layers][experts]`, read from the device at most every EXPERT_LOAD_PERIOD_S.
    expert_load: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class PoolState:
    """Whether an engine holds anything: requests, held or reserved blocks (tests, drains)."""

    has_unfinished_requests: bool
    num_held: int
    num_reserved: int
    is_whole: bool

    @property
    def empty(self) -> bool:
        return (
            not self.has_unfinished_requests
            and not self.num_held
            and not self.num_reserved
            and self.is_whole
        )


class EngineCore:
    """Scheduler + executor (workers, model runners) of one worker.

    Disaggregation hooks: a prefill worker adds requests with `hold_kv=True`; when such a
    request finishes, its blocks stay allocated (`get_held_block_ids`) until
    `release_held`. A decode worker `reserve`s blocks for a request whose prompt KV arrives
    from elsewhere, then `add_prefilled_request` starts decoding it.
    """

    def __init__(self, config: EngineConfig) -> None:
        # Resolved once (a no-op when EngineArgs.create_engine_config() did it): model path,
        # HF config and max_model_len are read from it, never loaded or patched here.
        config = resolve_engine_config(config)
        self.config = config
        assert config.model.model_path is not None
        self.model_path: Path = config.model.model_path
        # The HF config was loaded once, by the resolution; the workers get it from here.
        hf_config = config.model.hf_config
        skip_tokenizer = config.model.skip_tokenizer_init
        eos_ids = get_eos_token_ids(self.model_path, use_tokenizer=not skip_tokenizer)
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        max_len = config.model.max_model_len
        self.max_model_len = max_len

        # Custom logits processor classes: a ConfigError here, before the model loads, when
        # one does not load; each request's params are checked by them (`validate_params`).
        self.logits_processor_classes = load_logits_processors(config.sampler.logits_processors)

        t0 = time.perf_counter()
        self.executor: Executor = create_executor(
            config, self.model_path, hf_config, max_len, self.eos_token_id
        )
        self.vocab_size = self.executor.vocab_size
        num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        self.block_size = config.cache.block_size
        num_spec_tokens = config.speculative.k
        self.kv_cache_spec = self.executor.kv_cache_spec
        mode = config.scheduler.async_scheduling
        pp_size = config.parallel.pipeline_parallel_size
        # auto: on CUDA (the host plans while the device runs), and under pipeline parallel
        # (a second step in flight keeps every stage busy).
        self.async_scheduling = mode in ("on", "late") or (
            mode == "auto" and (self.executor.device.type == "cuda" or pp_size > 1)
        )
        # Late planning: the caller waits until `plan_deadline()` before each step (taking
        # commands meanwhile); not with speculation, whose steps wait for each other anyway.
        self.step_clock: StepClock | None = (
            StepClock() if mode == "late" and not num_spec_tokens else None
        )
        concurrent_stages = self.async_scheduling and self.executor.device.type == "cpu"
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks,
            max_len,
            config.speculative,
            kv_cache_spec=self.kv_cache_spec,
            # Under pipeline parallel on the CPU the step in flight and the one planned hold
            # different requests, so the first stage runs the new one while the last runs the
            # other (a stage receives the sampled ids while it runs on: model_runner.py). On
            # CUDA a stage's stream still waits for the last stage's ids at each step's end,
            # so half batches would only cost there: one batch, as before.
            max_concurrent_batches=pp_size if concurrent_stages else 1,
        )
        self.num_spec_tokens = num_spec_tokens
        # Each step's drafts (0..k) decided from measured step times and acceptance, below
        # the `disable_by_batch_size` cap (None: every proposed draft is taken).
        self.spec_rule: SpeculationRule | None = None
        if num_spec_tokens and config.speculative.speculation_rule == "measured":
            self.spec_rule = SpeculationRule(num_spec_tokens)
        # When the last step's result landed (host clock; None after an idle step), and
        # whether the launched step proposes drafts for the next.
        self._last_result_at: float | None = None
        self._last_overlapped = False
        self._pending_proposes = False
        # None: the engine has a tokenizer for structured outputs; else why it has none. A
        # random-weight folder has one only when one was made or copied in (serving).
        self._no_tokenizer: str | None = None
        if skip_tokenizer:
            self._no_tokenizer = "skip_tokenizer_init is set"
        elif has_random_weights(self.model_path) and not has_tokenizer_files(self.model_path):
            self._no_tokenizer = "this random-weight model folder has none"
        self.structured = StructuredOutputManager(
            config.structured_outputs,
            lambda: load_tokenizer(self.model_path),
            self.vocab_size,
            config.scheduler.max_num_seqs,
            stop_token_ids=eos_ids,
            pin_memory=self.executor.device.type == "cuda",
        )
        text = getattr(hf_config, "text_config", None) or hf_config
        self._has_experts = bool(
            getattr(text, "num_local_experts", 0) or getattr(text, "num_experts", 0)
        )
        self._expert_load_total: tuple[tuple[int, ...], ...] | None = None
        self._expert_load_read_at = float("-inf")
        # The launched step whose tokens have not been applied yet (async scheduling only).
        self._pending: tuple[SchedulerOutput, LaunchedStep] | None = None
        # Whether the last `step()` launched or finished any work.
        self.last_step_idle = True
        self._shut_down = False
        _raise_gc_threshold()
        logger.info(
            "engine ready: %s on %s, %d KV blocks of %d tokens, KV cache size: %d tokens, "
            "maximum concurrency for %d tokens per request: %.2fx (decoding: %.2fx) (%.1fs)",
            self.model_path.name,
            self.executor.device,
            num_blocks,
            self.block_size,
            self.kv_cache_size_tokens,
            max_len,
            self.max_concurrency,
            self.kv_cache_spec.max_concurrency(num_blocks, max_len),
            time.perf_counter() - t0,
        )

    @property
    def max_concurrency(self) -> float:
        """How many requests of `max_model_len` tokens the KV cache holds at once at their
        peak, a prefill chunk of the token budget included (vLLM's "maximum concurrency";
        a sliding-window group counts only the blocks its window reads)."""
        budget = self.config.scheduler.max_num_batched_tokens
        return self.kv_cache_spec.max_concurrency(self.num_blocks, self.max_model_len, budget)

    @property
    def kv_cache_size_tokens(self) -> int:
        """The tokens of context the KV cache holds: `max_concurrency` times
        `max_model_len`, what vLLM logs as "GPU KV cache size" (for a model without sliding
        windows, every block's tokens)."""
        budget = self.config.scheduler.max_num_batched_tokens
        return self.kv_cache_spec.kv_cache_size_tokens(self.num_blocks, self.max_model_len, budget)

    @property
    def kv_cache(self) -> torch.Tensor:
        """Rank 0's KV cache tensor (`[num_blocks, layers, 2, block, heads, dim]`)."""
        kv_cache = self.executor.kv_cache
        if kv_cache is None:
            raise RuntimeError("the engine is shut down: it holds no KV cache")
        return kv_cache

    @property
    def model_runner(self) -> ModelRunner:
        """Rank 0's model runner (in this process)."""
        return self.executor.model_runner

    def shutdown(self) -> None:
        """Free the device memory: wait for launched steps, then drop the KV cache, CUDA
        graphs and weights (and empty the CUDA cache). Idempotent; steps, reservations and
        the KV cache are unavailable afterwards, while the scheduler's state stays readable."""
        if self._shut_down:
            return
        self._shut_down = True
        self._pending = None
        if self.step_clock is not None:
            self.step_clock.forget()
        self.structured.shutdown()
        self.executor.shutdown()

    # ----------------------------------------------------------------- requests

    def _validate(self, req: EngineCoreRequest) -> None:
        n = len(req.prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens; the model's context is {self.max_model_len} tokens, "
                "and at least one must remain for output"
            )
        check_prompt_token_ids(req.prompt_token_ids, self.vocab_size)
        blocks_needed = self.kv_cache_spec.max_blocks_per_request(
            n + 1, self.config.scheduler.max_num_batched_tokens
        )
        if blocks_needed > self.num_blocks:
            raise InvalidRequestError(
                f"prompt needs {blocks_needed} KV blocks; the cache holds {self.num_blocks}"
            )
        sched = self.scheduler
        if (
            req.request_id in sched.requests
            or req.request_id in sched.held
            or (req.request_id in sched.reserved)
        ):
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
        self._validate_logits_processors(req)
        if req.sampling_params.structured_outputs is not None and self._no_tokenizer:
            raise InvalidRequestError(
                f"structured_outputs need the model's tokenizer; {self._no_tokenizer}"
            )

    def _validate_logits_processors(self, req: EngineCoreRequest) -> None:
        params = req.sampling_params
        if params.bad_words and params.bad_words_token_ids is None:
            raise InvalidRequestError(
                "bad_words are not tokenized: call SamplingParams.update_from_tokenizer first"
            )
        try:
            params.check_vocab(self.vocab_size)
        except SamplingParamsError as exc:
            raise InvalidRequestError(str(exc)) from None
        for cls in self.logits_processor_classes:
            try:
                cls.validate_params(params)
            except ValueError as exc:
                raise InvalidRequestError(f"{processor_name(cls)}: {exc}") from None

    def _new_request(self, req: EngineCoreRequest) -> Request:
        """The engine's request for `req`; a grammar's compile starts here (on the pool)."""
        request = Request.from_engine_core_request(req)
        if req.sampling_params.structured_outputs is not None:
            request.grammar = self.structured.grammar_for(request)
        return request

    def add_request(self, req: EngineCoreRequest, hold_kv: bool = False) -> None:
        """Queue a request. Raises InvalidRequestError naming the problem. A structured-output
        spec that does not compile ends the request later, with finish reason "error"."""
        self._validate(req)
        request = self._new_request(req)
        request.hold_kv = hold_kv
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for req_id in ids:
            self.scheduler.release_held(req_id)
            self.scheduler.cancel_reservation(req_id)

    def has_unfinished_requests(self) -> bool:
        return self._pending is not None or self.scheduler.has_unfinished_requests()

    # ----------------------------------------------------------------- step

    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduling step and one forward pass; return what each request produced.

        Under async scheduling the outputs are those of the step launched by the previous
        call (see the module docstring)."""
        scheduler_output: SchedulerOutput | None = None
        scheduler = self.scheduler
        early: list[EngineCoreOutput] = []
        num_drafts, propose = (
            self._drafts_for_step() if scheduler.has_unfinished_requests() else (None, True)
        )
        if self._pending is not None and (
            self._pending[0].scheduled_spec_decode_tokens or (num_drafts and self._pending_proposes)
        ):
            # Speculation: this step's plan needs the launched step's tokens and drafts (see
            # the module docstring).
            early = self._apply_pending()
        plan_started = time.perf_counter()
        if scheduler.has_unfinished_requests():
            scheduler_output = scheduler.schedule(num_drafts, propose)
            if scheduler_output.is_empty:
                # Nothing runs, but the runner must still forget what finished or was
                # preempted since the last step (or it would hold their state forever).
                self.executor.drop_requests(
                    scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids
                )
                scheduler_output = None
        self.last_step_idle = scheduler_output is None and self._pending is None
        if self.last_step_idle:
            self._last_result_at = None  # the next interval would time the caller's pause
        outputs: list[EngineCoreOutput] = early + scheduler.take_error_outputs()
        if scheduler_output is None:
            if self.last_step_idle and not outputs and scheduler.has_unfinished_requests():
                self.structured.wait_any(_GRAMMAR_WAIT_S)  # all wait for a compile
            return outputs + self._apply_pending()
        if self._pending is not None and self.executor.needs_prior_tokens(scheduler_output):
            outputs += self._apply_pending()
        structured = scheduler_output.structured_req_ids
        source = None
        previous: tuple[SchedulerOutput, LaunchedStep] | None = None
        if structured:
            # Step N's tokens are applied inside, once this step's forward is launched.
            previous, self._pending = self._pending, None

            def source() -> GrammarBitmask:
                nonlocal previous
                if previous is not None:
                    (so, launched), previous = previous, None
                    outputs.extend(self._update(so, self._result(launched), overlapped=True))
                return self.structured.fill_bitmask(structured, scheduler.requests)

        step = self.executor.execute_async(scheduler_output, source)
        if self.step_clock is not None:
            now = time.perf_counter()
            self.step_clock.planned(now - plan_started)
            counts = scheduler_output.num_scheduled_tokens.values()
            prefill = sum(n for n in counts if n > 1)
            self.step_clock.launched(
                step_kind(scheduler_output.total_num_scheduled_tokens, prefill), now
            )
        self._pending_proposes = scheduler_output.propose_drafts
        if structured and previous is not None:  # a step that sampled nothing
            outputs += self._update(previous[0], self._result(previous[1]), overlapped=True)
        if not self.async_scheduling:
            return outputs + self._update(scheduler_output, self._result(step))
        previous, self._pending = self._pending, (scheduler_output, step)
        if previous is not None:
            outputs += self._update(previous[0], self._result(previous[1]), overlapped=True)
        if not scheduler.has_unfinished_requests():
            # Every request finished (the launched step only computes a dropped token): the
            # engine is idle once it lands, not one more call later.
            outputs += self._apply_pending()
        return outputs

    def _drafts_for_step(self) -> tuple[int | None, bool]:
        """(drafts per request for the step about to be planned, whether drafts are proposed
        after it): none at `disable_by_batch_size` running requests or more, else the
        measured rule's choice (`tandem.core.spec_decode_rule`), or up to k without it."""
        if not self.num_spec_tokens:
            return None, True
        batch_size = len(self.scheduler.running)
        limit = self.config.speculative.disable_by_batch_size
        if limit and batch_size >= limit:
            return 0, False
        if self.spec_rule is None:
            return self.num_spec_tokens, True
        if not batch_size:
            return 0, True  # prefills only: nothing to draft for, nothing to measure
        return self.spec_rule.decide(batch_size), self.spec_rule.propose

    def _update(
        self, so: SchedulerOutput, result: ModelRunnerOutput, overlapped: bool = False
    ) -> list[EngineCoreOutput]:
        """Apply a step's result; the measured rule learns the step's time (since the last
        result, decode-only steps) and its drafts' acceptance by position.

        `overlapped`: applied after the next step was launched (async). The time between two
        results is a step's cost only when both were applied the same way: a result taken
        before the next launch (a sync point next to a verify step) right after one taken
        after it is early by the host's planning of a step, and one taken after it right
        after one taken before is late by a whole step (a pipeline refill); both are
        dropped."""
        rule = self.spec_rule
        if rule is not None:
            now = time.perf_counter()
            last, self._last_result_at = self._last_result_at, now
            if overlapped != self._last_overlapped:
                last = None
            self._last_overlapped = overlapped
            rule.observe_output(so, result, None if last is None else now - last)
        return self.scheduler.update_from_output(so, result)

    def _apply_pending(self) -> list[EngineCoreOutput]:
        """Wait for the launched step's tokens and apply them."""
        if self._pending is None:
            return []
        (scheduler_output, step), self._pending = self._pending, None
        return self._update(scheduler_output, self._result(step))

    def _result(self, step: LaunchedStep) -> ModelRunnerOutput:
        """The launched step's result (the oldest launched: results go in launch order),
        its landing told to the step clock: when the device finished it, where the step can
        say (`wait_device`), else once its result is in."""
        if self.step_clock is None:
            return step.result()
        wait_device = getattr(step, "wait_device", None)
        if wait_device is not None:
            wait_device()
            self.step_clock.landed(time.perf_counter())
            return step.result()
        result = step.result()
        self.step_clock.landed(time.perf_counter())
        return result

    def plan_deadline(self) -> float | None:
        """Late planning: the `time.perf_counter()` time at which to plan the next step,
        shortly before the step in flight is predicted to end; None: plan now (not late
        planning, nothing in flight, or no prediction yet)."""
        if self.step_clock is None or self._pending is None:
            return None
        return self.step_clock.deadline()

    def in_flight_landed(self) -> bool:
        """Whether the launched step, if any, has finished on the device (a step that cannot
        tell counts as finished: plan now)."""
        if self._pending is None:
            return True
        is_ready = getattr(self._pending[1], "is_ready", None)
        return True if is_ready is None else bool(is_ready())

    # ----------------------------------------------------------------- stats

    def _expert_load(self) -> tuple[tuple[int, ...], ...] | None:
        """The totals of expert load, topped up from the device at most every
        EXPERT_LOAD_PERIOD_S (stats ride on every step's frame: reading each time would wait
        for the device every step)."""
        if not self._has_experts or self._shut_down:
            return self._expert_load_total
        now = time.monotonic()
        if now - self._expert_load_read_at >= EXPERT_LOAD_PERIOD_S:
            self._expert_load_read_at = now
            delta = self.executor.take_expert_load()
            if delta is not None:
                old = self._expert_load_total
                self._expert_load_total = tuple(
                    tuple(
                        a + b for a, b in zip(row, old[i] if old else [0] * len(row), strict=True)
                    )
                    for i, row in enumerate(delta)
                )
        return self._expert_load_total

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_free_blocks=s.num_free_blocks,
            num_blocks=s.num_blocks,
            kv_usage=s.kv_cache_usage,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            num_held=len(self.scheduler.held),
            num_reserved=len(self.scheduler.reserved),
            async_scheduling=self.async_scheduling,
            spec_decoding=s.spec_decoding,
            spec_decode_rule=self.spec_rule.stats.snapshot() if self.spec_rule else None,
            expert_load=self._expert_load(),
        )

    def pool_state(self) -> PoolState:
        sched = self.scheduler
        return PoolState(
            has_unfinished_requests=self.has_unfinished_requests(),
            num_held=len(sched.held),
            num_reserved=len(sched.reserved),
            is_whole=sched.kv_cache_manager.block_pool.is_whole,
        )

    def cached_block_hashes(self) -> list[bytes]:
        """The hashes of every block in the prefix cache (a directory's full resync)."""
        return self.scheduler.kv_cache_manager.published_block_hashes()

    # ----------------------------------------------------------------- disaggregation

    def get_held_block_ids(self, request_id: str) -> list[int]:
        """Block table of a finished `hold_kv` request (prompt KV in order)."""
        if request_id not in self.scheduler.held:
            raise KeyError(f"request {request_id!r} holds no KV")
        return self.scheduler.kv_cache_manager.get_block_ids(request_id)

    def release_held(self, request_id: str) -> None:
        self.scheduler.release_held(request_id)

    def reserve(self, req: EngineCoreRequest) -> tuple[list[int], int] | None:
        """Reserve blocks for a request whose prompt KV another worker computes.

        Returns (block ids, leading prompt tokens already cached here) or None when the pool
        is short: the interleaved tables of a cache of several groups, whose entries the
        hand-off writes are `kv_cache_spec.handoff_indices` (the others are cached here or
        null). Then write the KV into those blocks and call `add_prefilled_request`.
        """
        self._validate(req)
        reserved = self.scheduler.reserve(self._new_request(req))
        if reserved is not None and self.executor.may_write_blocks(
            self._handoff_block_ids(len(req.prompt_token_ids), *reserved)
        ):
            # A step still running writes KV into some of these blocks (freed since it was
            # planned: a request that stopped or was aborted); another process writes the
            # reserved blocks outside this engine's stream order, so let it finish before
            # their ids leave. Otherwise the reservation does not wait for the device.
            self.executor.synchronize()
        return reserved

    def _handoff_block_ids(
        self, num_prompt_tokens: int, block_ids: list[int], num_cached_tokens: int
    ) -> list[int]:
        """The reserved blocks a hand-off writes (a null entry's id 0 may be a real block)."""
        indices = self.kv_cache_spec.handoff_indices(num_prompt_tokens, num_cached_tokens)
        return [block_ids[i] for i in indices]

    def add_prefilled_request(
        self, request_id: str, first_token_id: int
    ) -> EngineCoreOutput | None:
        """Start decoding a reserved request; its prompt KV is in the reserved blocks."""
        return self.scheduler.add_prefilled(request_id, first_token_id)

"""A request inside one engine, and its states.

Token regions of a request (one rule covers chunked prefill, prefix hits and decode)::

    all_token_ids:  [ prompt tokens ........ | output tokens ... ]
                    |<-- num_computed_tokens -->|<- to compute ->|
                                                 ^ scheduler gives a chunk of this each step

`num_computed_tokens` only grows (except on preemption, where it drops to 0); the request
samples a token in a step whose chunk reaches `num_tokens`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tandem.core.outputs import FinishReason, Logprobs
from tandem.core.structured import GrammarState
from tandem.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    # The request could not run (its structured-output grammar is invalid or did not compile
    # in time); the stop reason is the error message.
    FINISHED_ERROR = 6

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self)


# Plain ints for hot loops (comparing through the enum class is much slower).
FIRST_FINISHED = int(RequestStatus.FINISHED_STOPPED)
RUNNING = int(RequestStatus.RUNNING)

FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass
class EngineCoreRequest:
    """What a client hands the engine: token ids and sampling parameters, nothing else."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None


class Request:
    """One request's state inside an engine (owned by the scheduler)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens scheduled to be sampled whose ids have not come back yet (async scheduling
        # plans step N+1 before step N's tokens are known; at most 2 are outstanding).
        self.num_output_placeholders = 0
        # Tokens found in the prefix cache the first time the request was scheduled (-1: not yet).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Hashes of the request's full blocks, in order; extended by the KV cache manager.
        self.block_hashes: list[bytes] = []
        # Disaggregated prefill: keep the blocks allocated after finishing, until released.
        self.hold_kv = False
        # The grammar of a request with structured outputs (set by the engine), else None.
        self.grammar: GrammarState | None = None
        # Speculative decoding: draft tokens proposed to follow `all_token_ids`, scheduled
        # (and verified) with the request's next step; never part of its tokens or hashes.
        self.spec_token_ids: list[int] = []
        # Verify steps in a row that accepted no draft, and steps left without drafts (the
        # scheduler backs off a request whose drafts keep failing).
        self.spec_num_misses = 0
        self.spec_skip_steps = 0
        # Whether its drafts for the next step were dropped by that backoff.
        self.spec_backed_off = False
        # Disaggregated decode: prompt tokens whose KV arrived from another worker, told to
        # the runner once (a proposer running a model computes its own KV for them).
        self.num_external_computed_tokens = 0
        # sampling_params.prompt_logprobs: entry p holds prompt token p + 1's, filled by
        # position as the prompt's chunks run; None once sent with the first output (or
        # never asked for).
        self.prompt_logprobs: list[Logprobs | None] | None = (
            [None] * max(len(self.prompt_token_ids) - 1, 0)
            if sampling_params.prompt_logprobs is not None
            else None
        )

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        # A plain int comparison: going through the enum class is ~50x slower, and this runs
        # for every request every step.
        return self.status >= FIRST_FINISHED

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )

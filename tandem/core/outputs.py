"""Messages between the scheduler, the model runner and the engine's callers.

Plain dataclasses, no torch: the scheduler builds a `SchedulerOutput`, the model runner
answers with a `ModelRunnerOutput`, and `Scheduler.update_from_output` turns that into one
`EngineCoreOutput` per request that produced something (or finished) this step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption.

    `block_ids` is the request's whole block table so far; `num_computed_tokens` counts the
    tokens whose KV is already in those blocks (prefix-cache hits).
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Of the computed tokens, the last ones whose KV another worker computed (disaggregated
    # decode); a proposer that runs a model computes its own KV for them.
    num_external_computed_tokens: int = 0


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only the blocks appended since last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    """One step's plan. Tokens scheduled for a request start at its `num_computed_tokens`."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests the runner must forget: finished, aborted or preempted since last step.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests with structured outputs that sample in this step, in scheduling order. Their
    # allowed tokens come to the runner at sampling time (`GrammarBitmaskSource`).
    structured_req_ids: list[str] = field(default_factory=list)
    # Speculative decoding: the draft tokens scheduled after a request's known tokens (its
    # last `len(drafts)` scheduled tokens); only requests with at least one draft appear.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Speculative decoding: scheduled requests whose drafts proposed after this step will not
    # be taken (backing off after rejected drafts): a proposer that runs a model only keeps
    # its KV cache in step for them.
    no_draft_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding: scheduled requests that take no drafts in this step because they
    # are backing off, in a step that allowed drafts: each counts as a rejected first draft
    # for the measured rule (`tandem.core.spec_decode_rule`), which otherwise would not see
    # the rejections that made them back off.
    spec_backoff_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding: whether drafts are proposed after this step (False when the next
    # step takes none: `tandem.core.spec_decode_rule`; every request is then in
    # `no_draft_req_ids`).
    propose_drafts: bool = True

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# What the runner calls once a step's forward is launched, right before it samples: the
# engine applies the previous step's tokens (matchers advanced) and fills the step's bitmask
# while the device computes the forward. In the engine's process only.
GrammarBitmaskSource = Callable[[], "GrammarBitmask"]


@dataclass
class GrammarBitmask:
    """The allowed next tokens of a step's structured rows: row i of `bitmask` (an int32 CPU
    tensor `[len(req_ids), ceil(vocab_size / 32)]`, bit j of word w set: token 32 w + j is
    allowed) belongs to `req_ids[i]`. Covers the logits' width (ids past the tokenizer's
    vocabulary are never allowed)."""

    req_ids: list[str]
    bitmask: Any


@dataclass
class Logprobs:
    """Logprobs of one sampled token: the sampled token first, then the top-k, with ranks."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


@dataclass
class ModelRunnerOutput:
    """Per scheduled request, the tokens sampled this step (empty for a partial prefill).

    With speculative decoding a request emits 1 + (accepted drafts) tokens in a step;
    `logprobs[i]` holds one `Logprobs` per emitted token (None where none were asked for),
    and `spec_token_ids[i]` the drafts proposed for its next step (empty: none; the list is
    empty without speculation)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[Logprobs] | None] = field(default_factory=list)
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # A step that verified drafts: how it ran ("eager", "piecewise_graph", "mixed_graph").
    spec_verify_path: str = ""
    # Requests asking for prompt logprobs whose prompt rows ran this step: (the position of
    # the first row, one entry per row: the logprobs of the prompt token after it).
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = field(default_factory=dict)


class FinishReason(enum.StrEnum):
    """Why a request, or one choice of it, ended: one enum from the engine to the wire.

    The values are the OpenAI API's `finish_reason` strings, so a member is what the HTTP
    responses write (a `str`: it JSON-encodes and compares as its value). The engine ends a
    request with STOP (EOS, a stop token; the frontend also for a stop string), LENGTH
    (max_tokens or the model's context), ABORT (a client's abort, or a failure), or ERROR
    (the request could not run: its `stop_reason` is the message naming the problem).
    TOOL_CALLS is the frontend's alone: a STOP whose text held tool calls. Where a finish
    reason crosses a boundary it crosses as this enum: a code in the engine's STEP frames
    (`tandem.engine.serial`), the proto's `FinishReason` at the services' edge (one mapping,
    `tandem_services.common.convert`).
    """

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    TOOL_CALLS = "tool_calls"


@dataclass(slots=True)
class EngineCoreOutput:
    """What one request produced in one step; `finish_reason` is None while it runs (see
    FinishReason; with ERROR, `stop_reason` is the message naming the problem)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # With the request's first tokens when it asked for prompt logprobs: those of prompt
    # tokens 1.. (the first has none), each the token's own first, then the top ones.
    prompt_logprobs: list[Logprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

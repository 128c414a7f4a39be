"""Sampling parameters of one request, validated on construction.

`SamplingParams` is plain Python (no torch) so the core, the services and the
offline API can all build and check it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """Raised for invalid sampling parameters; the message names the field."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's names): exactly one of

    - `json`: a JSON schema (a dict, or its JSON text) the output must validate against;
    - `regex`: a regular expression the whole output must match;
    - `choice`: the output is exactly one of these strings;
    - `grammar`: an EBNF (GBNF-style) grammar the output must derive from;
    - `json_object`: any JSON object.

    The spec is what crosses process and service boundaries; the grammar is compiled where it
    is used (compiled grammars are cached by the spec's `key`).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise SamplingParamsError("structured_outputs.choice must be a list of strings")
            if not self.choice:
                raise SamplingParamsError("structured_outputs.choice must not be empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = self._kinds()
        if len(kinds) != 1:
            raise SamplingParamsError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {kinds or 'none'}"
            )

    def _kinds(self) -> list[str]:
        set_: list[str] = []
        if self.json is not None:
            set_.append("json")
        if self.regex is not None:
            set_.append("regex")
        if self.choice is not None:
            set_.append("choice")
        if self.grammar is not None:
            set_.append("grammar")
        if self.json_object:
            set_.append("json_object")
        return set_

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        return self._kinds()[0]


@dataclass
class SamplingParams:
    """How to sample a request's output tokens.

    temperature == 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p == 1 and
    min_p == 0 disable those filters. Penalties follow the usual OpenAI semantics
    (presence / frequency over output tokens) and the multiplicative repetition penalty
    over prompt and output tokens. `logprobs` asks for that many top logprobs per output
    token (besides the sampled token's own); None asks for none.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.n, int) or self.n < 1:
            raise SamplingParamsError(f"n must be an integer >= 1, got {self.n!r}")
        if not (0.0 <= self.temperature <= 100.0):
            raise SamplingParamsError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k!r}")
        if self.top_k == 0:
            self.top_k = -1
        if not (0.0 <= self.min_p <= 1.0):
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise SamplingParamsError(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"
            )
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise SamplingParamsError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
            )
        if not (0.0 < self.repetition_penalty <= 2.0):
            raise SamplingParamsError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise SamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise SamplingParamsError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingParamsError(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise SamplingParamsError(f"seed must be an integer, got {self.seed!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty strings")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise SamplingParamsError("structured_outputs must be a StructuredOutputsParams")
        if self.temperature < _GREEDY_EPS:
            # Greedy: the filters are irrelevant; normalise so the sampler can batch.
            self.temperature = 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_output_history(self) -> bool:
        """Sampling reads the output so far (penalties, min_tokens): a step of such a request
        waits for the previous step's tokens instead of overlapping it."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
        )

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def clone(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

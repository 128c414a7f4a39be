"""Sampling parameters of one request, validated on construction.

`SamplingParams` is plain Python (no torch) so the core, the services and the
offline API can all build and check it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
# OpenAI's range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0
# Levels of maps and lists in `extra_args` (the map itself is one): they cross processes
# pickled and as JSON, both recursive, so a deep one fails there instead of here.
MAX_EXTRA_ARGS_DEPTH = 32


class _Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class SamplingParamsError(ValueError):
    """Raised for invalid sampling parameters; the message names the field."""


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether `value`'s maps and lists (tuples too) nest more than `limit` levels; walked
    without recursion, and no further than `limit + 1` levels."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


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
    token (besides the sampled token's own); None asks for none. `prompt_logprobs` likewise
    for each prompt token after the first (the logprob the model gave it from the tokens
    before it, its rank, and the top ones there): such a request computes its whole prompt,
    reading nothing from the prefix cache.

    Logits processors (vLLM's names; tandem.layers.logits_processors applies them):

    - `logit_bias`: token id -> a bias in [-100, 100] added to that token's logit (before
      penalties and temperature, as vLLM does: at temperature T a bias b weighs b / T);
    - `allowed_token_ids`: only these tokens may be sampled;
    - `bad_words`: words never generated. Each word is tokenized (by the frontend or `LLM`,
      `update_from_tokenizer`) with and without a leading space into `bad_words_token_ids`;
      a word's last token is banned whenever the output so far ends with the word's other
      tokens (a one-token word is always banned);
    - `extra_args`: free-form arguments for custom logits processors (`--logits-processors`).

    Token ids are checked against the vocabulary where it is known (the engine's
    `add_request`, the frontend's tokenizer).
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
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Set by `update_from_tokenizer`: each bad word's token sequences (one or two per word).
    bad_words_token_ids: list[list[int]] | None = None
    extra_args: dict[str, Any] | None = None

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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_LOGPROBS
            ):
                raise SamplingParamsError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise SamplingParamsError(f"seed must be an integer, got {self.seed!r}")
            if not -(2**63) <= self.seed < 2**63:
                # The engine seeds a generator from a 64-bit integer (and the wire's is int64).
                raise SamplingParamsError(f"seed must be in [-2**63, 2**63), got {self.seed}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty strings")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise SamplingParamsError("structured_outputs must be a StructuredOutputsParams")
        self._check_logits_processors()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the filters are irrelevant; normalise so the sampler can batch.
            self.temperature = 0.0

    def _check_logits_processors(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise SamplingParamsError("logit_bias must be a map of token id to bias")
            bias: dict[int, float] = {}
            for token, value in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise SamplingParamsError(
                        f"logit_bias keys must be non-negative token ids, got {token!r}"
                    )
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise SamplingParamsError(
                        f"logit_bias[{token}] must be a number, got {value!r}"
                    )
                if not (-MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
                    raise SamplingParamsError(
                        f"logit_bias[{token}] must be in [-100, 100], got {value}"
                    )
                bias[token] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, str | bytes) or not _is_id_list(ids):
                raise SamplingParamsError(
                    "allowed_token_ids must be a list of non-negative token ids"
                )
            if not ids:
                raise SamplingParamsError("allowed_token_ids must not be empty (leave it out)")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = self.bad_words
            if isinstance(words, str) or not all(isinstance(w, str) for w in words):
                raise SamplingParamsError("bad_words must be a list of strings")
            if any(not w.strip() for w in words):
                raise SamplingParamsError("bad_words must not contain empty words")
            self.bad_words = list(words) or None
        if self.bad_words_token_ids is not None:
            seqs = self.bad_words_token_ids
            if isinstance(seqs, str | bytes) or not all(
                not isinstance(q, str | bytes) and _is_id_list(q) and len(q) > 0 for q in seqs
            ):
                raise SamplingParamsError(
                    "bad_words_token_ids must be a list of non-empty token id lists"
                )
            self.bad_words_token_ids = [list(q) for q in seqs] or None
        if self.extra_args is not None:
            if not isinstance(self.extra_args, Mapping):
                raise SamplingParamsError("extra_args must be a map of names to values")
            if _nests_deeper(self.extra_args, MAX_EXTRA_ARGS_DEPTH):
                raise SamplingParamsError(
                    f"extra_args nests maps and lists deeper than {MAX_EXTRA_ARGS_DEPTH} levels"
                )

    def update_from_tokenizer(self, tokenizer: _Tokenizer) -> None:
        """Tokenize `bad_words` into `bad_words_token_ids` (no-op without bad words).

        A word is banned both at the start of a text and after a space: each word is
        tokenized as written (leading spaces stripped) and with one leading space, and each
        distinct sequence is kept (tokenizers that mark a word start, like GPT-2's BPE, give
        two)."""
        if not self.bad_words:
            return
        seqs: list[list[int]] = []
        for word in self.bad_words:
            bare = word.lstrip()
            for text in (bare, " " + bare):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        self.bad_words_token_ids = seqs or None

    def logits_token_ids(self) -> list[tuple[str, int]]:
        """Every token id the logits processors name, with the field naming it (to check
        against a vocabulary)."""
        named: list[tuple[str, int]] = []
        if self.logit_bias:
            named += [("logit_bias", t) for t in self.logit_bias]
        if self.allowed_token_ids:
            named += [("allowed_token_ids", t) for t in self.allowed_token_ids]
        if self.bad_words_token_ids:
            named += [("bad_words", t) for q in self.bad_words_token_ids for t in q]
        return named

    def check_vocab(self, vocab_size: int) -> None:
        """Raise SamplingParamsError naming the field of a token id outside [0, vocab_size)."""
        for name, token in self.logits_token_ids():
            if token >= vocab_size:
                raise SamplingParamsError(
                    f"{name}: token id {token} is outside the vocabulary [0, {vocab_size})"
                )

    @property
    def has_logits_rules(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad words apply to this request."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_output_history(self) -> bool:
        """Sampling reads the output so far (penalties, min_tokens, bad words of more than one
        token): a step of such a request waits for the previous step's tokens instead of
        overlapping it."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
            or any(len(q) > 1 for q in self.bad_words_token_ids or ())
        )

    @property
    def reads_output_counts(self) -> bool:
        """Penalties or min_tokens: the sampler reads the output's token counts or length,
        which a speculative verify step does not extend over the drafts (so such a request
        verifies none). Bad words follow the drafts (tandem.layers.logits_processors)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
        )

    def max_drafts(self, num_output_tokens: int, k: int) -> int:
        """The most draft tokens a request with `num_output_tokens` outputs verifies in its
        next step (speculative decoding): none for structured outputs or when sampling reads
        the output counts, none past max_tokens (a step emits up to 1 + drafts tokens)."""
        if self.structured_outputs is not None or self.reads_output_counts:
            return 0
        if self.max_tokens is not None:
            k = min(k, self.max_tokens - num_output_tokens - 1)
        return max(k, 0)

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def clone(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _is_id_list(values: Any) -> bool:
    try:
        return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in values)
    except TypeError:
        return False

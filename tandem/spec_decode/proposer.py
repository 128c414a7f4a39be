"""The proposer interface: drafts for each request that just sampled, on the host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tandem.config import EngineConfig

if TYPE_CHECKING:
    from tandem.models.interface import CausalLM, ModelContext


class ProposerState(Protocol):
    """What a proposer reads of a request (the runner's `CachedRequestState`)."""

    req_id: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    output_token_ids: list[int]


class Proposer(Protocol):
    """Drafts up to `num_speculative_tokens` tokens to follow each request's tokens.

    `propose` is called once per step, after the step's tokens were appended to the states,
    with the states of the requests that sampled; it returns one list per state (empty: no
    draft). Drafts are guesses: a wrong one costs a verified position, never correctness."""

    num_speculative_tokens: int

    def propose(self, states: Sequence[ProposerState]) -> list[list[int]]: ...


@dataclass(frozen=True)
class TargetInfo:
    """What a proposer that runs a model (draft model, EAGLE head) takes from the target's
    runner: its config, model, model context and KV cache dtype."""

    config: EngineConfig
    model: CausalLM
    model_context: ModelContext
    kv_dtype: Any
    max_model_len: int

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

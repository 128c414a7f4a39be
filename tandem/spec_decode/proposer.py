"""The proposer interface: drafts for each request that just sampled, on the host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tandem.config import ConfigError, SpeculativeConfig


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


def build_proposer(config: SpeculativeConfig, vocab_size: int) -> Proposer | None:
    """The proposer `config.method` names (None without speculation). ConfigError for a
    method whose proposer is not built yet."""
    if config.method is None:
        return None
    if config.method == "ngram":
        from tandem.spec_decode.ngram import NgramProposer

        return NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
    if config.method == "replay":
        from tandem.spec_decode.replay import ReplayProposer

        return ReplayProposer.from_file(
            config.replay_path,
            config.num_speculative_tokens,
            config.replay_acceptance,
            vocab_size,
            config.replay_seed,
        )
    raise ConfigError(
        f"speculative_config: method {config.method!r} is accepted but its proposer is not "
        "built yet (use ngram)"
    )

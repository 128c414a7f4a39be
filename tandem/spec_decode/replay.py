"""Replay proposer, for benchmarks only: acceptance under control on random weights.

It proposes the target's own greedy continuation, recorded by an earlier run without
speculation (JSON: a list of {"prompt_token_ids": [...], "output_token_ids": [...]}), for
the request with that prompt. Each draft token is kept with probability p and otherwise
replaced by a token the target does not pick (the recorded one + 1), so with greedy
sampling position j is accepted with probability p^(j+1).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tandem.config import ConfigError
from tandem.spec_decode.proposer import ProposerState


class ReplayProposer:
    def __init__(
        self,
        recorded: dict[tuple[int, ...], list[int]],
        num_speculative_tokens: int,
        acceptance: float,
        vocab_size: int,
        seed: int = 0,
    ) -> None:
        self.recorded = recorded
        self.num_speculative_tokens = num_speculative_tokens
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self._rng = np.random.default_rng(seed)

    @classmethod
    def from_file(
        cls, path: str, num_speculative_tokens: int, acceptance: float, vocab_size: int, seed: int
    ) -> ReplayProposer:
        try:
            entries = json.loads(Path(path).read_text())
            recorded = {tuple(e["prompt_token_ids"]): list(e["output_token_ids"]) for e in entries}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"speculative_config: replay_path {path!r}: {exc}") from None
        return cls(recorded, num_speculative_tokens, acceptance, vocab_size, seed)

    def propose(self, states: Sequence[ProposerState]) -> list[list[int]]:
        k = self.num_speculative_tokens
        # One draw for the whole step (numpy per request cost ~10 us each: 1 ms at batch 128,
        # paid in the timed runs of the benchmark this proposer serves).
        keep = (self._rng.random((len(states), k)) < self.acceptance).tolist()
        vocab = self.vocab_size
        drafts: list[list[int]] = []
        for state, kept in zip(states, keep, strict=True):
            record = self.recorded.get(tuple(state.prompt_token_ids))
            done = len(state.output_token_ids)
            # Off the record (a different continuation): nothing to replay.
            if record is None or (done and record[done - 1 : done] != state.output_token_ids[-1:]):
                drafts.append([])
                continue
            draft = record[done : done + k]  # shorter near the record's end
            pairs = zip(draft, kept, strict=False)
            drafts.append([t if ok else (t + 1) % vocab for t, ok in pairs])
        return drafts

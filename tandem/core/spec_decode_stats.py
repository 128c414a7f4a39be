"""Counters of speculative decoding, kept by the scheduler (no torch).

A request that had d > 0 draft tokens verified in a step and emitted e tokens accepted
e - 1 of them (the last emitted token is the target's own: the correction at the first
rejected position, or the bonus token after d accepted ones)::

    drafts     [d0][d1][d2][d3]          d = 4
    verified   [ok][ok][no]              accepted 2 -> positions 0 and 1 counted
    emitted    [d0][d1][t2]              e = 3 (t2: the target's token)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Running totals since start; `num_accepted_tokens_per_pos[j]` counts the verified
    drafts accepted at draft position j (acceptance by position = that / `num_drafts`)."""

    num_spec_tokens: int = 0
    # Request-steps that verified at least one draft.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Steps that verified drafts, by how the runner ran them: "eager", "piecewise_graph" or
    # "mixed_graph" (the decode CUDA graphs take one token per request: verify steps never
    # use them).
    num_verify_steps: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verification in one step."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted_tokens} of {num_draft_tokens} draft tokens")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for j in range(num_accepted_tokens):
            per_pos[j] += 1

    def snapshot(self) -> SpecDecodingStats:
        """A copy that later steps do not change (for stats snapshots)."""
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
            dict(self.num_verify_steps),
        )

    def observe_step(self, path: str) -> None:
        """One step that verified drafts, run by `path`."""
        self.num_verify_steps[path] = self.num_verify_steps.get(path, 0) + 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verifying request-step (1 + accepted drafts on average)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

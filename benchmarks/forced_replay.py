"""Benchmarks only: every sampled position takes the token recorded for it.

Random weights leave the 8B shape's greedy choice near a tie at most positions, and a verify
step (1 + k query rows through the prefill kernel, GEMMs of 1 + k rows) rounds differently from
a decode step (one row, the split-K kernel). So the target's greedy continuation drifts from
the one a run without speculation recorded, within a few tokens, and the replay proposer's
acceptance collapses whatever its p (measured on the H200: 0.33 at p = 1, batch 1, k = 4).

`ForceRecorded` is a batch-level logits processor (`LLM(logits_processors=[ForceRecorded])`)
that makes each request with `extra_args={"force_tokens": record}` sample `record[t]` at its
output position t: every other logit is -inf. The model runs exactly the work it would (the
same rows, kernels and graphs); only the choice is pinned, so the replay proposer's p is the
acceptance, and a run without speculation that carries the same processor is the baseline.

The position of a row is the request's output length (the live list the runner appends to)
plus the draft position j of this `apply` within the step (a verify step applies a processor
once per draft position, `tandem.layers.logits_processors.speculative`). Under async
scheduling that list may lag one token behind a plain step, so the benchmark runs forced
engines with synchronous steps.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from tandem.layers.logits_processors.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.config import EngineConfig


class ForceRecorded(LogitsProcessor):
    """Pins each forced request's sampled token to its record (see the module docstring)."""

    def __init__(self, config: EngineConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        # row -> (record, the request's live output list)
        self.rows: dict[int, tuple[list[int], list[int]]] = {}
        self.position_in_step = 0

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.position_in_step = 0
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.rows.pop(row, None)
        for row, params, _prompt, output in batch_update.added:
            record = (params.extra_args or {}).get("force_tokens")
            if record:
                self.rows[row] = (list(record), output)
            else:
                self.rows.pop(row, None)
        for a, b, how in batch_update.moved:
            first, second = self.rows.pop(a, None), self.rows.pop(b, None)
            if first is not None:
                self.rows[b] = first
            if how is MoveDirectionality.SWAP and second is not None:
                self.rows[a] = second

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        j = self.position_in_step
        self.position_in_step += 1
        rows: list[int] = []
        tokens: list[int] = []
        for row, (record, output) in self.rows.items():
            t = len(output) + j
            if row < logits.shape[0] and t < len(record):
                rows.append(row)
                tokens.append(record[t])
        if not rows:
            return logits
        index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        chosen = torch.tensor(tokens, dtype=torch.int64).to(self.device, non_blocking=True)
        pinned = torch.full(
            (len(rows), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device
        )
        pinned.scatter_(1, chosen[:, None], 0.0)
        logits.index_copy_(0, index, pinned)
        return logits


def forced_params(base: SamplingParams, records: list[list[int]]) -> list[SamplingParams]:
    """One copy of `base` per record, forcing that record."""
    return [dataclasses.replace(base, extra_args={"force_tokens": list(r)}) for r in records]

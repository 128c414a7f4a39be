"""Custom logits processors for the tests (loaded by `module:Class`, also by worker
processes: the launcher puts the repository root on their PYTHONPATH)."""

from __future__ import annotations

from typing import Any

import torch

from tandem.layers.logits_processors import BatchUpdate, LogitsProcessor, MoveDirectionality
from tandem.sampling_params import SamplingParams


class ForceTokenProcessor(LogitsProcessor):
    """Rows whose request has `extra_args={"force_token_id": t}` can only sample t.

    Keeps its rows by index through `update_state` (vLLM's row protocol), so a test that
    mixes forced and free requests finishing at different steps checks the BatchUpdates."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.forced: dict[int, int] = {}
        self.num_updates = 0

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        token = (sampling_params.extra_args or {}).get("force_token_id")
        if token is not None and (not isinstance(token, int) or token < 0):
            raise ValueError(f"force_token_id must be a token id, got {token!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self.num_updates += 1
        for row in batch_update.removed:
            self.forced.pop(row, None)
        for row, params, _, _ in batch_update.added:
            token = (params.extra_args or {}).get("force_token_id")
            if token is None:
                self.forced.pop(row, None)
            else:
                self.forced[row] = token
        for a, b, how in batch_update.moved:
            ta, tb = self.forced.pop(a, None), self.forced.pop(b, None)
            if ta is not None:
                self.forced[b] = ta
            if tb is not None and how is MoveDirectionality.SWAP:
                self.forced[a] = tb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.forced:
            return logits
        rows = torch.tensor(list(self.forced), device=logits.device)
        tokens = torch.tensor(list(self.forced.values()), device=logits.device)
        keep = logits[rows, tokens]
        logits[rows] = float("-inf")
        logits[rows, tokens] = keep
        return logits


class NotAProcessor:
    """Loads, but is no LogitsProcessor."""

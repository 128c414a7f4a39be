"""Prompt logprobs: for a request with `sampling_params.prompt_logprobs = k`, each prompt
token after the first gets the logprob the model gave it from the tokens before it, its rank,
and the top k there (vLLM's `prompt_logprobs`).

A step's rows are planned on the host (`plan_prompt_logprobs`): the row at position p of a
request's prompt predicts prompt token p + 1, for p + 1 < the prompt's length (the last prompt
row predicts the first output token, which the sampler handles). `compute_prompt_logprobs`
takes the step's hidden states after the forward, computes the logits of those rows only, in
chunks (a 128k vocabulary in fp32 is 0.5 MB a row), and returns host lists: a step that asks
waits for the device there. The scheduler gives such a request no prefix-cache hit, so every
prompt row runs (tandem.core.scheduler), and collects the chunks by position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.core.outputs import Logprobs
from tandem.layers.sampler import gather_logprobs, to_logprobs_lists
from tandem.worker.input_batch import StepInputs

# Rows whose logits are computed at a time.
_CHUNK_ROWS = 256


@dataclass(frozen=True)
class PromptLogprobRows:
    """One request's rows of a step that yield prompt logprobs: flat rows `[first_row,
    first_row + len(targets))` at prompt positions from `start`, each predicting its target
    (the prompt token after it); `num_top` top logprobs besides the target's own."""

    req_id: str
    start: int
    first_row: int
    targets: list[int]
    num_top: int


def plan_prompt_logprobs(inp: StepInputs) -> list[PromptLogprobRows]:
    """The step's rows that yield prompt logprobs (none for most steps: a host loop over the
    step's requests reading one attribute each)."""
    plan: list[PromptLogprobRows] = []
    for b, state in enumerate(inp.states):
        k = state.sampling_params.prompt_logprobs
        if k is None:
            continue
        first_row = int(inp.query_start_loc[b])
        num_rows = int(inp.query_start_loc[b + 1]) - first_row
        start = int(inp.positions[first_row])
        end = min(start + num_rows, state.num_prompt_tokens - 1)
        if end > start:
            plan.append(
                PromptLogprobRows(
                    state.req_id, start, first_row, state.token_ids[start + 1 : end + 1], k
                )
            )
    return plan


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    plan: list[PromptLogprobRows],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, tuple[int, list[Logprobs]]]:
    """Per planned request: (its first position, the prompt logprobs of its rows), from the
    step's hidden states `[total, hidden]`."""
    rows = np.concatenate(
        [np.arange(p.first_row, p.first_row + len(p.targets), dtype=np.int64) for p in plan]
    )
    targets = [t for p in plan for t in p.targets]
    num_top = [p.num_top for p in plan for _ in p.targets]
    widest = max(num_top)
    device = hidden.device
    entries: list[Logprobs] = []
    for lo in range(0, len(rows), _CHUNK_ROWS):
        idx = torch.from_numpy(rows[lo : lo + _CHUNK_ROWS]).to(device)
        logits = compute_logits(hidden.index_select(0, idx)).float()
        raw = torch.log_softmax(logits, dim=-1)
        chunk_targets = torch.tensor(targets[lo : lo + _CHUNK_ROWS], device=device)
        out = gather_logprobs(raw, chunk_targets, widest)
        # Every row asks (num_top is an int): no None entries.
        entries.extend(
            e for e in to_logprobs_lists(out, num_top[lo : lo + _CHUNK_ROWS]) if e is not None
        )
    result: dict[str, tuple[int, list[Logprobs]]] = {}
    at = 0
    for p in plan:
        result[p.req_id] = (p.start, entries[at : at + len(p.targets)])
        at += len(p.targets)
    return result

"""Logits processors in a speculative verify step: every processor at every verified row.

A verify step has k_b + 1 logits rows for request b (its draft positions, then the bonus
row); row j is the target's distribution for the token after the output and drafts d_0..d_{j-1}.
The rejection sampler must see each row as the request would sample it without speculation,
so each row is processed as if the drafts before it had been emitted:

- built-in rules (`logit_bias`, `allowed_token_ids`, bad words): one rules row per verified
  row; a bad word's tail is matched against the output followed by the drafts before the row,
  so a multi-token bad word that would complete inside the drafts is banned at that row
  (`verified_histories`);
- custom batch-level processors keep one row per request (their `BatchUpdate`s are the
  step's requests, as without speculation) and are applied once per draft position j =
  0..max_k to a `[num_requests, V]` batch whose row b is request b's verified row
  min(j, k_b); only the rows with j <= k_b are written back (`PerPositionProcessor`). A
  processor therefore runs up to max_k + 1 times per step on the same row indices; the live
  output list of an added request holds the output before the step's drafts at every
  position (drafts are not emitted until verified).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.layers.logits_processors.interface import BatchUpdate, LogitsProcessor


def verified_histories(
    outputs: Sequence[Sequence[int]], num_draft: Sequence[int], drafts: Sequence[int]
) -> list[list[int]]:
    """The output each verified row follows: request b's row j is `outputs[b]` followed by
    its first j drafts (`drafts`: every request's drafts in order, sum(num_draft) ids).
    Returns sum(k_b + 1) lists, in the verify step's row order."""
    assert len(drafts) == sum(num_draft), "one draft id per draft"
    histories: list[list[int]] = []
    d = 0
    for output, k in zip(outputs, num_draft, strict=True):
        own = list(drafts[d : d + k])
        base = list(output)
        histories.extend(base + own[:j] for j in range(k + 1))
        d += k
    return histories


class PerPositionProcessor(LogitsProcessor):
    """A request-row processor applied to a verify step's `[sum(k_b + 1), V]` logits, one
    draft position at a time (see the module docstring). Built per step; `update_state` is
    the wrapped processor's business and is not forwarded."""

    def __init__(self, processor: LogitsProcessor, num_draft: Sequence[int]) -> None:
        self.processor = processor
        self.num_draft = list(num_draft)

    def is_argmax_invariant(self) -> bool:
        return self.processor.is_argmax_invariant()

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        raise AssertionError("update the wrapped processor, once per step")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [sum(k_b + 1), V] -> the same rows after the processor (a new tensor)."""
        out = logits.clone()
        if not self.num_draft:
            return out
        device = logits.device
        starts = [0]
        for k in self.num_draft[:-1]:
            starts.append(starts[-1] + k + 1)
        for j in range(max(self.num_draft) + 1):
            rows = [s + min(j, k) for s, k in zip(starts, self.num_draft, strict=True)]
            index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
            processed = self.processor.apply(logits.index_select(0, index))
            live = [b for b, k in enumerate(self.num_draft) if j <= k]
            if len(live) == len(rows):
                out.index_copy_(0, index, processed)
            else:
                keep = torch.tensor(live, dtype=torch.int64).to(device, non_blocking=True)
                out.index_copy_(0, index[keep], processed[keep])
        return out

"""The built-in logits processors: `logit_bias`, `allowed_token_ids`, `bad_words`.

Each request's rules are turned into host tensors once (`RequestLogitsRules`, when it joins
the sampling rows); each step concatenates the rows' tensors into one `LogitsRules` batch
(one host-to-device copy per tensor) and `apply_logits_rules` applies it on the device in
three batched index operations, for the rows that use a rule::

    allowed_token_ids   every other token of the row -> -inf
    bad words           the banned tokens of the row -> -inf: one-token words always; a longer
                        word's last token when the output ends with the word's other tokens
    logit_bias          logits[row, token] += bias

A -inf stays -inf under a bias, so a token the grammar bitmask, allowed_token_ids or a bad
word removed cannot come back through a positive bias.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.sampling_params import SamplingParams


def _host(values: list, dtype: torch.dtype) -> torch.Tensor | None:
    return torch.tensor(values, dtype=dtype) if values else None


@dataclass(frozen=True)
class RequestLogitsRules:
    """One request's rules as host tensors (token ids outside the vocabulary are dropped)."""

    bias_ids: torch.Tensor | None  # [n] int64
    bias_values: torch.Tensor | None  # [n] float32
    allowed_ids: torch.Tensor | None  # [m] int64
    banned_ids: torch.Tensor | None  # one-token bad words, [b] int64
    # Longer bad words: (every token but the last, the last).
    bad_sequences: tuple[tuple[tuple[int, ...], int], ...]

    @classmethod
    def from_params(cls, params: SamplingParams, vocab_size: int) -> RequestLogitsRules | None:
        """The rules of `params`, or None when it has none."""
        if not params.has_logits_rules:
            return None
        bias = {t: b for t, b in (params.logit_bias or {}).items() if t < vocab_size}
        allowed = sorted({t for t in params.allowed_token_ids or () if t < vocab_size})
        banned: set[int] = set()
        sequences: list[tuple[tuple[int, ...], int]] = []
        for seq in params.bad_words_token_ids or ():
            if any(t >= vocab_size for t in seq):
                continue
            if len(seq) == 1:
                banned.add(seq[0])
            else:
                sequences.append((tuple(seq[:-1]), seq[-1]))
        return cls(
            bias_ids=_host(list(bias), torch.int64),
            bias_values=_host(list(bias.values()), torch.float32),
            allowed_ids=_host(allowed, torch.int64) if params.allowed_token_ids else None,
            banned_ids=_host(sorted(banned), torch.int64),
            bad_sequences=tuple(sequences),
        )

    @property
    def history_len(self) -> int:
        """How many of the output's last tokens the bad words read (0: none)."""
        return max((len(prefix) for prefix, _ in self.bad_sequences), default=0)

    def banned_after(self, output_token_ids: Sequence[int]) -> list[int]:
        """The last tokens of the longer bad words whose other tokens end the output."""
        banned = []
        n = len(output_token_ids)
        for prefix, last in self.bad_sequences:
            k = len(prefix)
            if n >= k and tuple(output_token_ids[n - k :]) == prefix:
                banned.append(last)
        return banned


@dataclass(frozen=True)
class LogitsRules:
    """One step's built-in rules, device tensors indexing the step's sampling rows."""

    # allowed_token_ids: the rows, and (position in allowed_rows, token) pairs they allow.
    allowed_rows: torch.Tensor | None
    allowed_index: tuple[torch.Tensor, torch.Tensor] | None
    # Bad words: (row, token) pairs to -inf.
    banned: tuple[torch.Tensor, torch.Tensor] | None
    # logit_bias: (row, token) pairs and their biases.
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None

    @classmethod
    def build(
        cls,
        rules: Sequence[RequestLogitsRules | None],
        output_token_ids: Sequence[Sequence[int]],
        device: torch.device,
    ) -> LogitsRules | None:
        """The step's rules (row i: `rules[i]`, its output so far `output_token_ids[i]`);
        None when no row has any. Loops over the rows, never over tokens."""
        allowed_rows: list[int] = []
        allowed_pos: list[torch.Tensor] = []
        allowed_ids: list[torch.Tensor] = []
        ban_rows: list[torch.Tensor] = []
        ban_ids: list[torch.Tensor] = []
        bias_rows: list[torch.Tensor] = []
        bias_ids: list[torch.Tensor] = []
        bias_values: list[torch.Tensor] = []
        for row, r in enumerate(rules):
            if r is None:
                continue
            if r.allowed_ids is not None:
                allowed_pos.append(torch.full_like(r.allowed_ids, len(allowed_rows)))
                allowed_ids.append(r.allowed_ids)
                allowed_rows.append(row)
            banned = r.banned_ids
            if r.bad_sequences:
                now = r.banned_after(output_token_ids[row])
                if now:
                    extra = torch.tensor(now, dtype=torch.int64)
                    banned = extra if banned is None else torch.cat([banned, extra])
            if banned is not None:
                ban_rows.append(torch.full_like(banned, row))
                ban_ids.append(banned)
            if r.bias_ids is not None:
                assert r.bias_values is not None
                bias_rows.append(torch.full_like(r.bias_ids, row))
                bias_ids.append(r.bias_ids)
                bias_values.append(r.bias_values)
        if not (allowed_rows or ban_rows or bias_rows):
            return None

        def dev(t: torch.Tensor) -> torch.Tensor:
            if device.type == "cpu":
                return t
            return t.pin_memory().to(device, non_blocking=True)

        return cls(
            allowed_rows=dev(torch.tensor(allowed_rows, dtype=torch.int64))
            if allowed_rows
            else None,
            allowed_index=(dev(torch.cat(allowed_pos)), dev(torch.cat(allowed_ids)))
            if allowed_rows
            else None,
            banned=(dev(torch.cat(ban_rows)), dev(torch.cat(ban_ids))) if ban_rows else None,
            bias=(dev(torch.cat(bias_rows)), dev(torch.cat(bias_ids)), dev(torch.cat(bias_values)))
            if bias_rows
            else None,
        )


def apply_logits_rules(logits: torch.Tensor, rules: LogitsRules) -> torch.Tensor:
    """`logits` [B, V] float32 under the step's rules (a new tensor; the input is untouched)."""
    logits = logits.clone()
    neg_inf = float("-inf")
    if rules.allowed_rows is not None:
        assert rules.allowed_index is not None
        keep = torch.zeros(
            rules.allowed_rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device
        )
        keep[rules.allowed_index] = True
        rows = rules.allowed_rows
        logits[rows] = logits[rows].masked_fill(~keep, neg_inf)
    if rules.banned is not None:
        logits.index_put_(
            rules.banned, torch.tensor(neg_inf, dtype=logits.dtype, device=logits.device)
        )
    if rules.bias is not None:
        rows, ids, values = rules.bias
        logits.index_put_((rows, ids), values, accumulate=True)
    return logits

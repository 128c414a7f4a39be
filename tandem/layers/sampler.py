"""The batched sampler: one row of logits per request that samples this step.

Order of operations on a row (each stage is skipped for the whole batch when no row needs it)::

    raw logits ──► log_softmax ─────────────────────────────► reported logprobs
        │
        ├─► allowed_token_ids, bad words, logit_bias (tandem.layers.logits_processors)
        ├─► custom logits processors (--logits-processors), in order
        ├─► min_tokens: eos / stop_token_ids -> -inf while len(output) < min_tokens
        ├─► repetition penalty (prompt + output tokens), frequency / presence (output tokens)
        ├─► greedy rows: argmax
        └─► other rows: / temperature -> top-k -> top-p -> min-p -> softmax -> sample

Sampling uses the exponential race: the token is `argmax(probs / q)` with `q ~ Exp(1)` drawn
per vocabulary entry, which picks token i with probability `probs[i] / sum(probs)` and needs
no normalisation. A row with its own `torch.Generator` (a seeded request) draws its `q` from
that generator only, exactly `vocab_size` numbers per step, so its samples depend on nothing
else in the batch. Rows without one share the sampler's generator (torch's default when None).

`SamplingMetadata.build` turns per-request `SamplingParams` and token histories into tensors
once per step; it loops over requests, never over tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tandem.core.outputs import Logprobs
from tandem.layers.logits_processors import LogitsProcessor, LogitsRules, apply_logits_rules
from tandem.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-step sampling inputs, one row per sampled request, tensors on the logits' device.

    Optional tensors are None when no row of the batch needs that stage, so the common
    batches (all greedy, no penalties, no filters) skip the work entirely.
    """

    num_reqs: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [B] float32; greedy rows hold 1.0 so the division is harmless. None when all greedy.
    temperature: torch.Tensor | None
    # [B] bool, True for greedy rows. None when no row is greedy or every row is.
    is_greedy: torch.Tensor | None
    # [B] int64, vocab_size where disabled; None when no row uses top-k.
    top_k: torch.Tensor | None
    max_top_k: int
    # [B] float32, 1.0 where disabled; None when no row uses top-p.
    top_p: torch.Tensor | None
    # [B] float32, 0.0 where disabled; None when no row uses min-p.
    min_p: torch.Tensor | None
    # Row index -> that row's generator, for seeded rows that sample (not greedy).
    generators: dict[int, torch.Generator]
    # [B] float32 each; None when no row uses that penalty.
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    # [B, V] int32 count of each token in the output; None without presence/frequency penalty.
    output_token_counts: torch.Tensor | None
    # [B, V] bool, token occurs in prompt or output; None without repetition penalty.
    seen_token_mask: torch.Tensor | None
    # (row, token id) pairs to mask to -inf for min_tokens; None when no row is below min_tokens.
    min_tokens_rows: torch.Tensor | None
    min_tokens_token_ids: torch.Tensor | None
    # Largest `logprobs` asked for by any row; None when no row asked for logprobs.
    max_num_logprobs: int | None
    # The rows' logit_bias / allowed_token_ids / bad words; None when no row has any.
    logits_rules: LogitsRules | None = None
    # Custom batch-level processors, applied to every row in order.
    logitsprocs: tuple[LogitsProcessor, ...] = ()

    @property
    def no_penalties(self) -> bool:
        return (
            self.presence_penalties is None
            and self.frequency_penalties is None
            and self.repetition_penalties is None
        )

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        eos_token_ids: Sequence[int | None],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
        logits_rules: LogitsRules | None = None,
        logitsprocs: Sequence[LogitsProcessor] = (),
    ) -> SamplingMetadata:
        """Build one step's metadata; every per-row argument has one entry per sampled row.

        `output_token_ids[i]` is row i's output so far (not counting the token sampled now).
        `generators[i]` is used only when row i is seeded and not greedy. `logits_rules` and
        `logitsprocs` come from `tandem.layers.logits_processors.LogitsProcessors.prepare`.
        """
        num_reqs = len(params)
        if not (
            len(prompt_token_ids)
            == len(output_token_ids)
            == len(eos_token_ids)
            == len(generators)
            == num_reqs
        ):
            raise ValueError("SamplingMetadata.build: all per-row arguments need one entry per row")
        device = torch.device(device)

        def to_dev(values: list, dtype: torch.dtype) -> torch.Tensor:
            t = torch.tensor(values, dtype=dtype)
            if device.type == "cpu":
                return t
            return t.pin_memory().to(device, non_blocking=True)

        greedy = [p.temperature == 0.0 for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)

        temperature = is_greedy = top_k = top_p = min_p = None
        max_top_k = vocab_size
        row_generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            temperature = to_dev(
                [p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32
            )
            if not all_random:
                is_greedy = to_dev(greedy, torch.bool)
            # Filters only matter on sampled rows; greedy rows get the "disabled" value.
            ks = [
                min(p.top_k, vocab_size) if (p.top_k > 0 and not g) else vocab_size
                for p, g in zip(params, greedy, strict=True)
            ]
            if any(k < vocab_size for k in ks):
                top_k = to_dev(ks, torch.int64)
                max_top_k = max(ks)
            ps = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
            if any(x < 1.0 for x in ps):
                top_p = to_dev(ps, torch.float32)
            mps = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
            if any(x > 0.0 for x in mps):
                min_p = to_dev(mps, torch.float32)
            for i, (g, gen) in enumerate(zip(greedy, generators, strict=True)):
                if gen is not None and not g:
                    row_generators[i] = gen

        presence = frequency = repetition = None
        counts: torch.Tensor | None = None
        seen: torch.Tensor | None = None
        if any(p.presence_penalty != 0.0 for p in params):
            presence = to_dev([p.presence_penalty for p in params], torch.float32)
        if any(p.frequency_penalty != 0.0 for p in params):
            frequency = to_dev([p.frequency_penalty for p in params], torch.float32)
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = to_dev([p.repetition_penalty for p in params], torch.float32)
        if presence is not None or frequency is not None:
            counts = torch.zeros(num_reqs * vocab_size, dtype=torch.int32, device=device)
            index = _flat_token_index(output_token_ids, vocab_size, device)
            counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.int32))
            counts = counts.view(num_reqs, vocab_size)
        if repetition is not None:
            histories = [
                itertools.chain(p, o)
                for p, o in zip(prompt_token_ids, output_token_ids, strict=True)
            ]
            lens = [
                len(p) + len(o) for p, o in zip(prompt_token_ids, output_token_ids, strict=True)
            ]
            seen = torch.zeros(num_reqs * vocab_size, dtype=torch.bool, device=device)
            seen.index_fill_(0, _flat_token_index(histories, vocab_size, device, lens), True)
            seen = seen.view(num_reqs, vocab_size)

        mt_rows: list[int] = []
        mt_tokens: list[int] = []
        rows = zip(params, output_token_ids, eos_token_ids, strict=True)
        for i, (p, out, eos) in enumerate(rows):
            if len(out) < p.min_tokens:
                stop_ids = list(p.stop_token_ids)
                if eos is not None and not p.ignore_eos:
                    stop_ids.append(eos)
                stop_ids = [t for t in stop_ids if t < vocab_size]
                mt_rows.extend([i] * len(stop_ids))
                mt_tokens.extend(stop_ids)
        mt_rows_t = mt_tokens_t = None
        if mt_rows:
            mt_rows_t = to_dev(mt_rows, torch.int64)
            mt_tokens_t = to_dev(mt_tokens, torch.int64)

        requested = [p.logprobs for p in params if p.logprobs is not None]
        max_num_logprobs = max(requested) if requested else None

        return cls(
            num_reqs=num_reqs,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=temperature,
            is_greedy=is_greedy,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            generators=row_generators,
            presence_penalties=presence,
            frequency_penalties=frequency,
            repetition_penalties=repetition,
            output_token_counts=counts,
            seen_token_mask=seen,
            min_tokens_rows=mt_rows_t,
            min_tokens_token_ids=mt_tokens_t,
            max_num_logprobs=max_num_logprobs,
            logits_rules=logits_rules,
            logitsprocs=tuple(logitsprocs),
        )


def _flat_token_index(
    token_ids: Sequence[Iterable[int]],
    vocab_size: int,
    device: torch.device,
    lens: Sequence[int] | None = None,
) -> torch.Tensor:
    """`row * vocab_size + token` for every token of every row, flattened (one int64 tensor)."""
    if lens is None:
        lens = [len(t) for t in token_ids]  # type: ignore[arg-type]
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.int64)
    rows = torch.repeat_interleave(
        torch.arange(len(lens), dtype=torch.int64), torch.tensor(lens, dtype=torch.int64)
    )
    return (rows * vocab_size + flat).to(device, non_blocking=True)


@dataclass(frozen=True)
class SamplerOutput:
    """One step's samples. The logprob fields are set only when some row asked for logprobs.

    `logprob_token_ids[:, 0]` / `logprobs[:, 0]` is the sampled token; columns 1..K are the
    row's K most likely tokens under the raw (unpenalised, temperature-1) distribution, K being
    the largest `logprobs` asked for in the batch. `sampled_ranks` is the sampled token's rank
    in that distribution (1 = most likely).
    """

    sampled_token_ids: torch.Tensor  # [B] int64
    logprob_token_ids: torch.Tensor | None = None  # [B, K + 1] int64
    logprobs: torch.Tensor | None = None  # [B, K + 1] float32
    sampled_ranks: torch.Tensor | None = None  # [B] int64


class Sampler(nn.Module):
    """Samples one token per row of `[B, V]` float32 logits under a `SamplingMetadata`.

    `generator` feeds the rows without a per-request generator (torch's default RNG if None).
    With `cpu_kernels` (the model runs the CPU step path), greedy rows of CPU float32 logits
    take their argmax from the C++ kernel (tandem_kernels/cpu; the same indices as torch's).
    """

    def __init__(self, generator: torch.Generator | None = None, cpu_kernels: bool = False) -> None:
        super().__init__()
        self.generator = generator
        self.cpu_kernels = cpu_kernels

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels and logits.device.type == "cpu" and logits.stride(-1) == 1:
            from tandem_kernels import cpu

            return cpu.argmax_rows(logits)
        return logits.argmax(dim=-1)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != metadata.num_reqs:
            raise ValueError(
                f"logits must be [num_reqs={metadata.num_reqs}, V], got {tuple(logits.shape)}"
            )
        if logits.shape[1] != metadata.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns, metadata vocab_size is "
                f"{metadata.vocab_size}"
            )
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        logits = self.process_logits(logits, metadata)
        if metadata.all_greedy:
            sampled = self._argmax(logits)
        else:
            probs = self._filtered_probs(logits, metadata)
            sampled = exponential_race(probs, metadata.generators, self.generator)
            if metadata.is_greedy is not None:
                sampled = torch.where(metadata.is_greedy, self._argmax(logits), sampled)

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        return gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)

    def process_logits(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Logits processors (built-in, then custom), min_tokens masking, then penalties;
        greedy rows take the argmax of the result. Argmax-invariant custom processors are
        skipped when every row is greedy. `logits` itself is never written."""
        if metadata.logits_rules is not None:
            logits = apply_logits_rules(logits, metadata.logits_rules)
        procs = [
            p for p in metadata.logitsprocs if not (metadata.all_greedy and p.is_argmax_invariant())
        ]
        if procs:
            if metadata.logits_rules is None:
                logits = logits.clone()  # processors may write in place
            for proc in procs:
                logits = proc.apply(logits)
        if metadata.min_tokens_rows is not None:
            logits = logits.clone()
            logits[metadata.min_tokens_rows, metadata.min_tokens_token_ids] = float("-inf")
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)
        return logits

    def sampling_probs(
        self, logits: torch.Tensor, metadata: SamplingMetadata, processed: bool = False
    ) -> torch.Tensor:
        """[B, V] the distribution each row samples from (one-hot at the argmax on greedy rows).
        `processed`: `logits` already went through `process_logits` (float32).

        For tests, diagnostics and the rejection sampler; `forward` never normalises after
        min-p.
        """
        logits = logits if processed else self.process_logits(logits.float(), metadata)
        greedy = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        if metadata.all_greedy:
            return greedy
        probs = self._filtered_probs(logits, metadata)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        if metadata.is_greedy is not None:
            probs = torch.where(metadata.is_greedy.unsqueeze(1), greedy, probs)
        return probs

    def _filtered_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, softmax, min-p. Rows are not renormalised after min-p."""
        assert metadata.temperature is not None
        logits = logits / metadata.temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.max_top_k, metadata.top_p)
        probs = torch.softmax(logits, dim=-1)
        if metadata.min_p is not None:
            probs = apply_min_p(probs, metadata.min_p)
        return probs


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens, then presence / frequency over output."""
    if metadata.repetition_penalties is not None:
        assert metadata.seen_token_mask is not None
        rp = metadata.repetition_penalties.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(metadata.seen_token_mask, penalised, logits)
    if metadata.frequency_penalties is not None or metadata.presence_penalties is not None:
        counts = metadata.output_token_counts
        assert counts is not None
        if metadata.frequency_penalties is not None:
            logits = logits - metadata.frequency_penalties.unsqueeze(1) * counts
        if metadata.presence_penalties is not None:
            logits = logits - metadata.presence_penalties.unsqueeze(1) * (counts > 0)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """Set the logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    top-k keeps exactly k tokens (ties at the k-th value broken by sort order). top-p keeps
    the smallest prefix of the descending-sorted (top-k renormalised) distribution whose
    mass reaches p: a token stays when the mass strictly before it is < p, so the most likely
    token always stays. Rows with top_p == 1 keep everything.
    """
    if top_k is None and top_p is None:
        return logits
    neg_inf = float("-inf")
    if top_p is None:
        assert top_k is not None
        values, indices = logits.topk(max_top_k, dim=-1)
        ranks = torch.arange(max_top_k, device=logits.device)
        values = values.masked_fill(ranks.unsqueeze(0) >= top_k.unsqueeze(1), neg_inf)
        return torch.full_like(logits, neg_inf).scatter_(1, indices, values)

    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks.unsqueeze(0) >= top_k.unsqueeze(1), neg_inf)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1.0)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, neg_inf)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens whose probability is below min_p times the row's largest probability."""
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def exponential_race(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """Sample one index per row with probability proportional to `probs` (need not sum to 1).

    Each row in `generators` draws its V float32 exponentials from its own generator, exactly
    what `torch.empty(V).exponential_(generator=g)` draws (a runner resuming a seeded request
    replays that many draws per output token); all other rows draw from `default_generator`.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_(generator=default_generator)
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    # Exp(1) draws are > 0 in torch; the clamp guards the division anyway.
    return (probs / q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> SamplerOutput:
    """The logprob, rank and top `num_logprobs` of each row's `sampled` token."""
    sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
    if num_logprobs > 0:
        top_lp, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)
        token_ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
        logprobs = torch.cat([sampled_lp, top_lp], dim=1)
    else:
        token_ids = sampled.unsqueeze(1)
        logprobs = sampled_lp
    return SamplerOutput(
        sampled_token_ids=sampled,
        logprob_token_ids=token_ids,
        logprobs=logprobs,
        sampled_ranks=ranks,
    )


def to_logprobs_lists(
    output: SamplerOutput, num_logprobs_per_row: Sequence[int | None]
) -> list[Logprobs | None]:
    """Per row, `Logprobs` with the sampled token and its first n top tokens (None where the
    row asked for none). One device-to-host copy per tensor."""
    if output.logprob_token_ids is None:
        if any(n is not None for n in num_logprobs_per_row):
            raise ValueError("a row asks for logprobs but the sampler computed none")
        return [None] * len(num_logprobs_per_row)
    assert output.logprobs is not None and output.sampled_ranks is not None
    ids = output.logprob_token_ids.tolist()
    lps = output.logprobs.tolist()
    ranks = output.sampled_ranks.tolist()
    result: list[Logprobs | None] = []
    for row, n in enumerate(num_logprobs_per_row):
        if n is None:
            result.append(None)
            continue
        result.append(
            Logprobs(
                token_ids=ids[row][: n + 1], logprobs=lps[row][: n + 1], sampled_rank=ranks[row]
            )
        )
    return result

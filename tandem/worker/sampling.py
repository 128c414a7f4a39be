"""The runner's side of sampling: per-step metadata, seeded generators, sampled ids to host.

`tandem.layers.sampler.Sampler` turns logits into token ids; this module feeds it and takes
its results back:

- `StepSampler.new_generator`: a request's own generator when it has a seed; one resumed after
  preemption continues its stream past the draws it already made (one exponential race of
  `vocab_size` draws per output token), so its tokens do not depend on preemption;
- `StepSampler.sample`: the metadata of the sampled rows (temperatures, top-k/p, penalties
  over prompt and output ids, generators, logits processors: tandem.layers.logits_processors),
  the grammar bitmask of the structured rows (copied to the device and applied to their
  logits first), the sampler, and on CUDA an asynchronous
  copy of the sampled ids into a pinned host buffer with an event after it;
- `StepSampler.sample_speculative`: a step that verifies draft tokens (k_i + 1 logits rows
  per sampled request): the distributions of every row (after the logits processors, each
  row as if the drafts before it had been emitted), the seeded requests' draws from their
  own generators, and `tandem.spec_decode.rejection_sampler` on the device;
- `PendingStep`: a launched step; `result()` waits for its ids only, appends them to the
  request states (1 + accepted drafts per request under speculation) and asks the proposer
  for the next step's drafts.

Seeded requests under speculation draw k + 1 rows of `vocab_size` exponentials and k
uniforms per step from their own generator, so their tokens reproduce run to run; unlike
without speculation, a seeded request resumed after preemption does not replay its stream
(its draws depend on the steps' draft counts).

Penalties and `min_tokens` read a request's whole output, so such a step needs the previous
step's tokens on the host first (`InputBatch.needs_prior_tokens`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.core.outputs import GrammarBitmask, Logprobs, ModelRunnerOutput
from tandem.layers.logits_processors import LogitsProcessors
from tandem.layers.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    gather_logprobs,
    to_logprobs_lists,
)
from tandem.layers.sampler_bitmask import apply_token_bitmask
from tandem.sampling_params import SamplingParams
from tandem.spec_decode.proposer import Proposer
from tandem.spec_decode.rejection_sampler import rejection_sample
from tandem.worker.input_batch import CachedRequestState

# Pinned host buffers for sampled ids in rotation (at most 2 steps are unresolved).
_NUM_HOST_BUFFERS = 4


@dataclass
class SampledStep:
    """What sampling a step's rows launched."""

    # Device ids, one per sampled row; under speculation `[B, max_k + 1]`, -1 padded.
    sampled: torch.Tensor
    # On CUDA: the pinned host buffer the ids are copied into and the event after the copy.
    host_sampled: torch.Tensor | None
    event: torch.cuda.Event | None
    # None on a pipeline stage that received the ids (no logprobs there). Under speculation
    # one row per verified position (sum(k_i + 1) rows), its token the emitted one.
    sampler_output: SamplerOutput | None
    # Speculation: drafts verified per sampled request (None: one token per request).
    num_draft: list[int] | None = None
    # A pipeline stage's receive of the ids still under way (CPU): call before reading them.
    wait: Callable[[], None] | None = None


class StepSampler:
    """Samples a step's rows on one device; owns the sampler and the pinned id buffers."""

    def __init__(
        self,
        device: torch.device,
        vocab_size: int,
        max_num_seqs: int,
        cpu_kernels: bool = False,
        logits_processors: LogitsProcessors | None = None,
    ) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.sampler = Sampler(cpu_kernels=cpu_kernels)
        self.logits_processors = logits_processors or LogitsProcessors((), None, device, vocab_size)
        self._host_sampled: list[torch.Tensor] = []
        self._host_slot = 0

    def new_generator(
        self, params: SamplingParams, num_output_tokens: int
    ) -> torch.Generator | None:
        """The request's generator (None without a seed), advanced past the draws of its
        `num_output_tokens` tokens already sampled (a request resumed after preemption)."""
        if params.seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed)
        if not params.is_greedy and num_output_tokens:
            for _ in range(num_output_tokens):
                torch.empty(self.vocab_size, device=self.device).exponential_(generator=generator)
        return generator

    def sample(
        self,
        logits: torch.Tensor,
        states: list[CachedRequestState],
        grammar: GrammarBitmask | None = None,
    ) -> SampledStep:
        """Sample one token for each of `states` (row i of `logits` is states[i]'s); the rows
        of `grammar`'s requests sample only the tokens its bitmask allows."""
        if grammar is not None and grammar.req_ids:
            logits = self.apply_grammar(logits, states, grammar)
        processors = self.logits_processors.prepare(states)
        meta = SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            eos_token_ids=[s.eos_token_id for s in states],
            generators=[s.generator for s in states],
            vocab_size=self.vocab_size,
            device=self.device,
            logits_rules=processors.rules,
            logitsprocs=processors.processors,
        )
        out = self.sampler(logits, meta)
        return self._to_host(out.sampled_token_ids, out)

    def sample_speculative(
        self,
        logits: torch.Tensor,
        states: list[CachedRequestState],
        num_draft: list[int],
        draft_token_ids: torch.Tensor,
        grammar: GrammarBitmask | None = None,
        host_draft_token_ids: Sequence[int] | None = None,
    ) -> SampledStep:
        """Verify drafts: `logits` has k_i + 1 rows for states[i] (k_i = num_draft[i]; the
        rows of its draft positions, then the bonus row), `draft_token_ids` the drafts in that
        order (`host_draft_token_ids`: the same on the host; read back when not given).
        Rejection sampling on the device (see `tandem.spec_decode.rejection_sampler`) of the
        processed distributions: every logits processor applies at every verified row, as if
        the drafts before it had been emitted (`LogitsProcessors.prepare_verify`); logprobs of
        every emitted token. `grammar`'s rows (structured requests, which never carry drafts:
        one row each) sample only the tokens its bitmask allows."""
        reps = [k + 1 for k in num_draft]
        if grammar is not None and grammar.req_ids:
            starts = itertools.accumulate(reps, initial=0)
            row_of = {s.req_id: r for s, r in zip(states, starts, strict=False)}
            logits = self.apply_grammar(logits, states, grammar, row_of)

        def per_row(values: Sequence) -> list:
            return [v for v, n in zip(values, reps, strict=True) for _ in range(n)]

        if host_draft_token_ids is None:
            host_draft_token_ids = draft_token_ids.tolist()
        processors = self.logits_processors.prepare_verify(states, num_draft, host_draft_token_ids)

        meta = SamplingMetadata.build(
            params=per_row([s.sampling_params for s in states]),
            prompt_token_ids=per_row([s.prompt_token_ids for s in states]),
            output_token_ids=per_row([s.output_token_ids for s in states]),
            eos_token_ids=per_row([s.eos_token_id for s in states]),
            generators=[None] * sum(reps),
            vocab_size=self.vocab_size,
            device=self.device,
            logits_rules=processors.rules,
            logitsprocs=processors.processors,
        )
        logits = logits.float()
        processed = self.sampler.process_logits(logits, meta)
        target_argmax = processed.argmax(dim=-1)
        probs = is_greedy = uniform = noise = None
        if not meta.all_greedy:
            probs = self.sampler.sampling_probs(processed, meta, processed=True)
            greedy = [s.sampling_params.is_greedy for s in states]
            is_greedy = (
                torch.tensor(greedy, dtype=torch.bool).to(self.device, non_blocking=True)
                if any(greedy)
                else None
            )
            uniform, noise = self._draws(states, num_draft, probs.shape)
        sampled = rejection_sample(
            num_draft, draft_token_ids, probs, target_argmax, is_greedy, uniform, noise
        )
        out: SamplerOutput | None = None
        if meta.max_num_logprobs is not None:
            # Each row's token: the one emitted at that position (rows past the last emitted
            # one are never read).
            # (request, column) of each row, built on the host, copied asynchronously (a
            # blocking copy from pageable memory syncs the stream: the host would wait here
            # for the step's forward).
            req = np.repeat(np.arange(len(states)), reps)
            col = np.arange(len(req)) - np.repeat(np.cumsum(reps) - reps, reps)
            index = torch.from_numpy(np.stack([req, col]))
            if self.device.type == "cuda":
                index = index.pin_memory().to(self.device, non_blocking=True)
            row_tokens = sampled[index[0], index[1]].clamp_min(0)
            raw = torch.log_softmax(logits, dim=-1)
            out = gather_logprobs(raw, row_tokens, meta.max_num_logprobs)
        step = self._to_host(sampled.flatten(), out)
        step.sampled = sampled
        step.num_draft = list(num_draft)
        return step

    def _draws(
        self, states: list[CachedRequestState], num_draft: list[int], shape: torch.Size
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniforms (one per draft) and Exp(1) noise (one row per verified position); a seeded
        request's from its own generator, the others' from torch's default one."""
        uniform = torch.rand(sum(num_draft), device=self.device)
        noise = torch.empty(shape, device=self.device).exponential_()
        row = d = 0
        for state, k in zip(states, num_draft, strict=True):
            gen = state.generator
            if gen is not None and not state.sampling_params.is_greedy:
                uniform[d : d + k] = torch.rand(k, device=self.device, generator=gen)
                noise[row : row + k + 1].exponential_(generator=gen)
            row += k + 1
            d += k
        return uniform, noise

    def received(self, sampled: torch.Tensor) -> SampledStep:
        """A step's ids sampled on another rank (pipeline parallel), already on this device:
        copied to the host as `sample` copies its own."""
        return self._to_host(sampled, None)

    def _to_host(self, sampled: torch.Tensor, out: SamplerOutput | None) -> SampledStep:
        host = event = None
        if self.device.type == "cuda":
            host = self._next_host_buffer(sampled.shape[0])
            host.copy_(sampled, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return SampledStep(sampled, host, event, out)

    def apply_grammar(
        self,
        logits: torch.Tensor,
        states: list[CachedRequestState],
        grammar: GrammarBitmask,
        row_of: dict[str, int] | None = None,
    ) -> torch.Tensor:
        """`logits` with each structured row's disallowed tokens at -inf (on the device).
        `row_of`: request id -> its logits row (default: row i is states[i]'s)."""
        if row_of is None:
            row_of = {s.req_id: j for j, s in enumerate(states)}
        rows = [row_of[rid] for rid in grammar.req_ids]
        bitmask = grammar.bitmask
        if self.device.type != "cuda":
            index = None if rows == list(range(logits.shape[0])) else torch.tensor(rows)
            return apply_token_bitmask(logits, bitmask.to(self.device), index)
        # CUDA: one Triton pass over a copy (the logits may be a CUDA graph's output buffer).
        from tandem_kernels.bitmask import apply_token_bitmask_

        bitmask = bitmask.to(self.device, non_blocking=True)
        index = torch.tensor(rows, dtype=torch.int64).pin_memory()
        return apply_token_bitmask_(
            logits.clone(), bitmask, index.to(self.device, non_blocking=True)
        )

    def clear(self) -> None:
        """Drop the pinned buffers (no step may be unresolved)."""
        self._host_sampled = []

    def _next_host_buffer(self, n: int) -> torch.Tensor:
        """A pinned int64 buffer of n ids, from the rotation."""
        if not self._host_sampled:
            size = max(self.max_num_seqs, 1)
            self._host_sampled = [
                torch.empty(size, dtype=torch.int64, pin_memory=True)
                for _ in range(_NUM_HOST_BUFFERS)
            ]
        slot = self._host_slot % _NUM_HOST_BUFFERS
        self._host_slot += 1
        buf = self._host_sampled[slot]
        if buf.numel() < n:
            buf = torch.empty(n, dtype=torch.int64, pin_memory=True)
            self._host_sampled[slot] = buf
        return buf[:n]


class PendingStep:
    """A launched step. `result()` waits for its sampled ids (not for later steps), appends
    them to the runner's request states and returns the `ModelRunnerOutput`; call it once,
    in launch order. Once it has waited, `on_done` (if any) is called: the device has
    finished this step and every step launched before it."""

    def __init__(
        self,
        req_ids: list[str],
        sampled_rows: list[int],
        states: list[CachedRequestState],
        sampled: SampledStep | None,
        on_done: Callable[[], None] | None = None,
        proposer: Proposer | None = None,
        spec_verify_path: str = "",
        prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] | None = None,
    ) -> None:
        self.req_ids = req_ids
        self._prompt_logprobs = prompt_logprobs or {}
        self.sampled_rows = sampled_rows
        self.states = states
        # Device ids, one per sampled row; a later step reads its inputs from here.
        self.sampled = sampled.sampled if sampled is not None else None
        self.row_of = {states[j].req_id: j for j in range(len(states))}
        self._host_sampled = sampled.host_sampled if sampled is not None else None
        self._event = sampled.event if sampled is not None else None
        self._sampler_output = sampled.sampler_output if sampled is not None else None
        self._num_logprobs = [s.sampling_params.logprobs for s in states]
        self._on_done = on_done
        self._num_draft = sampled.num_draft if sampled is not None else None
        self._wait = sampled.wait if sampled is not None else None
        self._proposer = proposer
        self._spec_verify_path = spec_verify_path
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def empty(cls) -> PendingStep:
        """A step that scheduled nothing."""
        return cls([], [], [], None)

    @property
    def is_async(self) -> bool:
        """Whether the ids reach the host by an asynchronous copy (CUDA)."""
        return self._event is not None

    def is_ready(self) -> bool:
        """Whether `result()` would return without waiting for the device."""
        if self._output is not None:
            return True
        return self._wait is None and (self._event is None or self._event.query())

    def wait_device(self) -> None:
        """Wait until the device has finished this step (not the host's work on its ids,
        which `result()` does after): the step clock's landing time."""
        if self._output is None and self._event is not None:
            self._event.synchronize()

    def wait_sampled(self) -> None:
        """Wait until `sampled` holds the step's ids (a pipeline stage receives them from the
        last stage while it runs its next step)."""
        if self._wait is not None:
            wait, self._wait = self._wait, None
            wait()

    def result(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        n = len(self.req_ids)
        sampled: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[Logprobs] | None] = [None] * n
        spec_token_ids: list[list[int]] = []
        if self.sampled_rows:
            if self._event is not None:
                assert self._host_sampled is not None
                self._event.synchronize()  # this step's ids only; later steps keep running
                tokens = self._host_sampled.tolist()
            else:
                assert self.sampled is not None
                self.wait_sampled()
                tokens = self.sampled.flatten().tolist()
            if self._on_done is not None:
                self._on_done()
            if self._num_draft is None:
                self._append_one(tokens, sampled, logprobs)
            else:
                self._append_verified(tokens, self._num_draft, sampled, logprobs)
            if self._proposer is not None:
                spec_token_ids = [[] for _ in range(n)]
                for row, draft in zip(
                    self.sampled_rows, self._proposer.propose(self.states), strict=True
                ):
                    spec_token_ids[row] = draft
        elif self._proposer is not None and self.req_ids:
            # No request sampled (prefill chunks only): a model proposer still writes its KV
            # for the step's tokens.
            self._proposer.propose([])
        self._sampler_output = None
        self._output = ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            spec_token_ids=spec_token_ids,
            spec_verify_path=self._spec_verify_path,
            prompt_logprobs=self._prompt_logprobs,
        )
        return self._output

    def _append_one(
        self,
        tokens: list[int],
        sampled: list[list[int]],
        logprobs: list[list[Logprobs] | None],
    ) -> None:
        """One token per sampled request."""
        lp_lists = (
            to_logprobs_lists(self._sampler_output, self._num_logprobs)
            if self._sampler_output is not None
            else [None] * len(self.states)
        )
        for row, state, token, lp in zip(
            self.sampled_rows, self.states, tokens, lp_lists, strict=True
        ):
            sampled[row] = [token]
            logprobs[row] = None if lp is None else [lp]
            state.token_ids.append(token)
            state.output_token_ids.append(token)

    def _append_verified(
        self,
        tokens: list[int],
        num_draft: list[int],
        sampled: list[list[int]],
        logprobs: list[list[Logprobs] | None],
    ) -> None:
        """1 + accepted drafts per sampled request (`tokens`: `[B, max_k + 1]` flattened,
        -1 padded); the logprobs rows are k_i + 1 per request."""
        width = max(num_draft) + 1
        lp_rows: list[Logprobs | None] = [None] * sum(k + 1 for k in num_draft)
        if self._sampler_output is not None:
            per_row = zip(self._num_logprobs, num_draft, strict=True)
            lp_rows = to_logprobs_lists(
                self._sampler_output, [n for n, k in per_row for _ in range(k + 1)]
            )
        start = 0
        for b, (row, state, k) in enumerate(
            zip(self.sampled_rows, self.states, num_draft, strict=True)
        ):
            emitted = [t for t in tokens[b * width : (b + 1) * width] if t >= 0]
            sampled[row] = emitted
            if self._num_logprobs[b] is not None:
                logprobs[row] = [lp for lp in lp_rows[start : start + len(emitted)] if lp]
            state.token_ids.extend(emitted)
            state.output_token_ids.extend(emitted)
            start += k + 1

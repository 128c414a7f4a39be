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
- `PendingStep`: a launched step; `result()` waits for its ids only and appends them to the
  request states.

Penalties and `min_tokens` read a request's whole output, so such a step needs the previous
step's tokens on the host first (`InputBatch.needs_prior_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.core.outputs import GrammarBitmask, Logprobs, ModelRunnerOutput
from tandem.layers.logits_processors import LogitsProcessors
from tandem.layers.sampler import Sampler, SamplerOutput, SamplingMetadata, to_logprobs_lists
from tandem.layers.sampler_bitmask import apply_token_bitmask
from tandem.sampling_params import SamplingParams
from tandem.worker.input_batch import CachedRequestState

# Pinned host buffers for sampled ids in rotation (at most 2 steps are unresolved).
_NUM_HOST_BUFFERS = 4


@dataclass
class SampledStep:
    """What sampling a step's rows launched."""

    # Device ids, one per sampled row.
    sampled: torch.Tensor
    # On CUDA: the pinned host buffer the ids are copied into and the event after the copy.
    host_sampled: torch.Tensor | None
    event: torch.cuda.Event | None
    # None on a pipeline stage that received the ids (no logprobs there).
    sampler_output: SamplerOutput | None


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
        self, logits: torch.Tensor, states: list[CachedRequestState], grammar: GrammarBitmask
    ) -> torch.Tensor:
        """`logits` with each structured row's disallowed tokens at -inf (on the device)."""
        row_of = {s.req_id: j for j, s in enumerate(states)}
        rows = [row_of[rid] for rid in grammar.req_ids]
        bitmask = grammar.bitmask
        if self.device.type != "cuda":
            index = None if rows == list(range(len(states))) else torch.tensor(rows)
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
    ) -> None:
        self.req_ids = req_ids
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
        return self._output is not None or self._event is None or self._event.query()

    def result(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        n = len(self.req_ids)
        sampled: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[Logprobs | None] = [None] * n
        if self.sampled_rows:
            if self._event is not None:
                assert self._host_sampled is not None
                self._event.synchronize()  # this step's ids only; later steps keep running
                tokens = self._host_sampled.tolist()
            else:
                assert self.sampled is not None
                tokens = self.sampled.tolist()
            if self._on_done is not None:
                self._on_done()
            lp_lists = (
                to_logprobs_lists(self._sampler_output, self._num_logprobs)
                if self._sampler_output is not None
                else [None] * len(self.states)
            )
            for row, state, token, lp in zip(
                self.sampled_rows, self.states, tokens, lp_lists, strict=True
            ):
                sampled[row] = [token]
                logprobs[row] = lp
                state.token_ids.append(token)
                state.output_token_ids.append(token)
        self._sampler_output = None
        self._output = ModelRunnerOutput(
            req_ids=self.req_ids, sampled_token_ids=sampled, logprobs=logprobs
        )
        return self._output

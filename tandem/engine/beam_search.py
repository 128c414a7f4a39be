"""Beam search over the engine (vLLM's `LLM.beam_search`): `beam_width` sequences kept per
prompt, each step extending every live beam by one token and keeping the best.

It runs on top of the engine, as vLLM's does: a step submits each live beam (prompt plus its
tokens) as a request of one token with the top `2 * beam_width` logprobs, and the prefix cache
gives each beam back its earlier blocks, so a step computes about one new token a beam. Of a
prompt's candidates (live beams times their top tokens) the `beam_width` best by cumulative
logprob go on; one ending in EOS (unless `ignore_eos`) is finished and set aside. At the end
the finished and the live beams are ranked by `cumulative logprob / length ** length_penalty`
(the length counting the prompt, not a final EOS), best first. A prompt stops early once
`beam_width` beams have finished and no live beam scores above the worst of them.

    [prompt] ─ step: each live beam + 1 token (top 2w) ─▶ best w live ─ ... ─▶ rank all ─▶ best w
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem.sampling_params import SamplingParams, SamplingParamsError


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's names. Beams are ranked by the model's own logprobs (the raw distribution the
    engine reports), so `temperature` is there for vLLM's signature and must be 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise SamplingParamsError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature != 0:
            raise SamplingParamsError(
                f"temperature must be 0 for beam search (beams follow the model's own "
                f"logprobs), got {self.temperature}"
            )


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` is the prompt's then the generated ones; `logprobs` one per
    generated token; `text` the generated tokens' text (when the model has a tokenizer)."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's `beam_width` best sequences, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    """The ranking score: cumulative logprob over length ** length_penalty (a final EOS not
    counted in the length)."""
    length = len(seq.tokens)
    if eos_token_id is not None and seq.tokens and seq.tokens[-1] == eos_token_id:
        length -= 1
    return seq.cum_logprob / (max(length, 1) ** length_penalty)


# Generates one token for each of a list of token-id prompts with the given params and
# returns, per prompt, its step's candidates: (token id, logprob) pairs.
StepFn = Callable[[list[list[int]], SamplingParams], list[list[tuple[int, float]]]]


class BeamSearch:
    """The search's state for a list of prompts, driven step by step by whoever runs the
    engine: `pending()` gives the live beams' token lists (empty when nothing is left),
    the driver generates one token for each with `step_params` and hands each beam's
    candidates to `advance`; `outputs()` ranks the result. `beam_search` drives it with a
    synchronous step (the offline LLM); the frontend drives it over the services."""

    def __init__(
        self, prompts: Sequence[list[int]], params: BeamSearchParams, eos_token_id: int | None
    ) -> None:
        self.params = params
        self.eos_token_id = eos_token_id
        self.prompt_lens = [len(p) for p in prompts]
        self.step_params = SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=2 * params.beam_width, ignore_eos=True
        )
        self._live = [[BeamSearchSequence(list(p))] for p in prompts]
        self._done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self._steps = 0
        self._flat: list[tuple[int, BeamSearchSequence]] = []

    def pending(self) -> list[list[int]]:
        if self._steps >= self.params.max_tokens:
            return []
        self._flat = [
            (i, beam)
            for i, beams in enumerate(self._live)
            if not self._settled(i)
            for beam in beams
        ]
        return [beam.tokens for _, beam in self._flat]

    def _score(self, seq: BeamSearchSequence) -> float:
        return beam_score(seq, self.eos_token_id, self.params.length_penalty)

    def _settled(self, i: int) -> bool:
        """Prompt `i` is done: `beam_width` beams finished and no live beam scores above the
        worst of them now (transformers' rule without early stopping)."""
        width = self.params.beam_width
        if len(self._done[i]) < width:
            return False
        worst = sorted(map(self._score, self._done[i]), reverse=True)[width - 1]
        return all(self._score(b) <= worst for b in self._live[i])

    def advance(self, candidates_of: Sequence[Sequence[tuple[int, float]]]) -> None:
        """Each pending beam's candidates, in `pending()`'s order."""
        width = self.params.beam_width
        grown: list[list[BeamSearchSequence]] = [[] for _ in self._live]
        for (i, beam), candidates in zip(self._flat, candidates_of, strict=True):
            for token, logprob in candidates:
                grown[i].append(
                    BeamSearchSequence(
                        [*beam.tokens, token],
                        [*beam.logprobs, logprob],
                        beam.cum_logprob + logprob,
                    )
                )
        for i, seqs in enumerate(grown):
            seqs.sort(key=lambda s: s.cum_logprob, reverse=True)
            kept: list[BeamSearchSequence] = []
            for seq in seqs:
                if len(kept) == width:
                    break
                if not self.params.ignore_eos and seq.tokens[-1] == self.eos_token_id:
                    seq.finish_reason = "stop"
                    self._done[i].append(seq)
                else:
                    kept.append(seq)
            self._live[i] = kept
        self._steps += 1

    def outputs(
        self, detokenize: Callable[[list[int]], str] | None = None
    ) -> list[BeamSearchOutput]:
        """Each prompt's `beam_width` best sequences, finished and live, best first."""
        outputs = []
        for i, prompt_len in enumerate(self.prompt_lens):
            for seq in self._live[i]:
                seq.finish_reason = "length"
            ranked = sorted(self._done[i] + self._live[i], key=self._score, reverse=True)
            ranked = ranked[: self.params.beam_width]
            if detokenize is not None:
                for seq in ranked:
                    seq.text = detokenize(seq.tokens[prompt_len:])
            outputs.append(BeamSearchOutput(ranked))
        return outputs


def beam_search(
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    step: StepFn,
    eos_token_id: int | None,
    detokenize: Callable[[list[int]], str] | None = None,
) -> list[BeamSearchOutput]:
    """Beam search for each of `prompts` (token ids); `step` runs the engine (LLM.beam_search
    passes its own generate)."""
    search = BeamSearch(prompts, params, eos_token_id)
    while batch := search.pending():
        search.advance(step(batch, search.step_params))
    return search.outputs(detokenize)

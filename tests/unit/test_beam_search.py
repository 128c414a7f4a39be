"""The beam search loop (tandem.engine.beam_search) on a scripted distribution: EOS ends a beam
and sets it aside, the best `beam_width` live beams go on, the finished and live ones are
ranked by length-normalised score at the end. (Against transformers on a real model:
tests/parity/test_beam_search.py.)"""

from __future__ import annotations

from tandem.engine.beam_search import BeamSearchParams, beam_search
from tandem.sampling_params import SamplingParams

EOS = 9
# A beam's last token -> its next-token candidates (token, logprob).
TABLE = {
    0: [(EOS, -0.05), (1, -0.1), (2, -0.5)],
    1: [(3, -1.0), (4, -2.0)],
    2: [(5, -0.1), (6, -3.0)],
}
LATE = [(7, -0.1), (8, -0.2)]


def _step(batch: list[list[int]], one: SamplingParams) -> list[list[tuple[int, float]]]:
    assert one.max_tokens == 1 and one.logprobs == 4  # 2 x beam_width
    return [TABLE.get(tokens[-1], LATE) for tokens in batch]


def test_eos_beams_are_set_aside_and_ranked_with_the_rest() -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    [out] = beam_search([[0]], params, _step, EOS, lambda ids: "".join(map(str, ids)))
    best, second = out.sequences
    # [0, EOS]: -0.05 over a length of 1 (EOS not counted); [0, 2, 5, 7]: -0.7 over 4.
    assert best.tokens == [0, EOS] and best.finish_reason == "stop" and best.text == "9"
    assert second.tokens == [0, 2, 5, 7] and second.finish_reason == "length"
    assert abs(second.cum_logprob + 0.7) < 1e-9 and second.logprobs == [-0.5, -0.1, -0.1]
    # Without length normalisation the finished beam still leads; ignoring EOS keeps it going.
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    [out] = beam_search([[0]], params, _step, EOS)
    best, second = out.sequences
    assert best.tokens == [0, EOS, 7, 7] and abs(best.cum_logprob + 0.25) < 1e-9
    # Two beams tie at -0.35 for second place.
    assert second.tokens in ([0, EOS, 7, 8], [0, EOS, 8, 7])
    assert abs(second.cum_logprob + 0.35) < 1e-9
    assert all(s.finish_reason == "length" and s.text is None for s in out.sequences)


def test_a_prompt_stops_once_its_finished_beams_cannot_be_beaten() -> None:
    """Width 1: [0, EOS] finishes at -0.05 (length 1); the live [0, 1] scores -0.1 / 2 =
    -0.05, no better, so no second step runs; with width 2 the search goes on to max_tokens."""
    calls: list[int] = []

    def step(batch: list[list[int]], one: SamplingParams) -> list[list[tuple[int, float]]]:
        calls.append(len(batch))
        return [TABLE.get(tokens[-1], LATE) for tokens in batch]

    [out] = beam_search([[0]], BeamSearchParams(beam_width=1, max_tokens=3), step, EOS)
    assert calls == [1] and [s.tokens for s in out.sequences] == [[0, EOS]]
    calls.clear()
    beam_search([[0]], BeamSearchParams(beam_width=2, max_tokens=3), step, EOS)
    assert calls == [1, 2, 2]

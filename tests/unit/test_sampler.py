"""The batched sampler against a plain numpy reference written row by row in float64."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from tandem.core.outputs import Logprobs
from tandem.layers.sampler import Sampler, SamplingMetadata, to_logprobs_lists
from tandem.sampling_params import SamplingParams

CPU = torch.device("cpu")

# A crafted distribution whose cumulative masses sit well away from the top-p values used.
CRAFTED_PROBS = np.array([0.02, 0.30, 0.005, 0.18, 0.12, 0.25, 0.075, 0.05])
CRAFTED_LOGITS = np.log(CRAFTED_PROBS) + 1.7  # a shift changes nothing


def build(
    params: list[SamplingParams],
    vocab_size: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    eos: list[int | None] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        eos if eos is not None else [None] * n,
        generators if generators is not None else [None] * n,
        vocab_size,
        CPU,
    )


def reference_probs(
    logits: np.ndarray,
    p: SamplingParams,
    prompt: list[int] = (),  # type: ignore[assignment]
    output: list[int] = (),  # type: ignore[assignment]
    eos: int | None = None,
) -> np.ndarray:
    """The distribution one row samples from, by the textbook definitions."""
    x = [float(v) for v in logits]
    vocab = len(x)
    if len(output) < p.min_tokens:
        banned = list(p.stop_token_ids) + ([eos] if eos is not None and not p.ignore_eos else [])
        for t in banned:
            x[t] = -math.inf
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    if p.temperature == 0.0:
        out = np.zeros(vocab)
        out[int(np.argmax(x))] = 1.0
        return out
    x = [v / p.temperature for v in x]
    order = sorted(range(vocab), key=lambda i: -x[i])
    if p.top_k > 0:
        order = order[: p.top_k]

    def normalised(ids: list[int]) -> dict[int, float]:
        m = max(x[i] for i in ids)
        w = {i: math.exp(x[i] - m) for i in ids}
        s = sum(w.values())
        return {i: v / s for i, v in w.items()}

    if p.top_p < 1.0:
        probs = normalised(order)
        nucleus, mass = [], 0.0
        for i in order:
            if mass >= p.top_p:
                break
            nucleus.append(i)
            mass += probs[i]
        order = nucleus
    probs = normalised(order)
    top = max(probs.values())
    probs = {i: v for i, v in probs.items() if v >= p.min_p * top}
    total = sum(probs.values())
    out = np.zeros(vocab)
    for i, v in probs.items():
        out[i] = v / total
    return out


FILTER_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0),
    SamplingParams(top_k=1),
    SamplingParams(top_k=3),
    SamplingParams(top_k=3, temperature=0.7),
    SamplingParams(top_p=0.5),
    SamplingParams(top_p=0.7),
    SamplingParams(top_p=0.9, temperature=1.5),
    SamplingParams(top_p=0.01),
    SamplingParams(min_p=0.3),
    SamplingParams(min_p=0.5, temperature=0.6),
    SamplingParams(top_k=4, top_p=0.8),
    SamplingParams(top_k=5, top_p=0.75, min_p=0.45),
    SamplingParams(top_k=100),
]


@pytest.mark.parametrize("params", FILTER_CASES, ids=repr)
def test_filtered_distribution_matches_reference(params: SamplingParams) -> None:
    vocab = len(CRAFTED_LOGITS)
    logits = torch.tensor(CRAFTED_LOGITS, dtype=torch.float32).unsqueeze(0)
    meta = build([params], vocab)
    got = Sampler().sampling_probs(logits, meta)[0].double().numpy()
    want = reference_probs(CRAFTED_LOGITS, params)
    assert set(np.flatnonzero(got)) == set(np.flatnonzero(want))
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_filter_supports_are_the_expected_sets() -> None:
    # Independent of the reference: sorted probs are 0.30(1) 0.25(5) 0.18(3) 0.12(4) ...
    logits = torch.tensor(CRAFTED_LOGITS, dtype=torch.float32).unsqueeze(0)
    expected = [
        (SamplingParams(top_k=2), {1, 5}),
        (SamplingParams(top_p=0.5), {1, 5}),  # mass before 3rd = 0.55 >= 0.5
        (SamplingParams(top_p=0.56), {1, 5, 3}),
        (SamplingParams(top_p=0.01), {1}),
        (SamplingParams(min_p=0.5), {1, 5, 3}),  # >= 0.15
        (SamplingParams(min_p=0.8), {1, 5}),  # >= 0.24
        (SamplingParams(min_p=0.9), {1}),  # >= 0.27
        (SamplingParams(top_k=3, top_p=0.6), {1, 5}),  # renormalised over top-3: 0.41, 0.34
    ]
    for params, support in expected:
        got = Sampler().sampling_probs(logits, build([params], logits.shape[1]))[0]
        assert set(torch.nonzero(got).flatten().tolist()) == support, params


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=4),
        SamplingParams(top_p=0.8),
        SamplingParams(min_p=0.3, temperature=1.3),
    ],
    ids=repr,
)
def test_empirical_frequencies(params: SamplingParams) -> None:
    num_draws = 20000
    vocab = len(CRAFTED_LOGITS)
    logits = torch.tensor(CRAFTED_LOGITS, dtype=torch.float32).expand(num_draws, vocab)
    meta = build([params] * num_draws, vocab)
    sampler = Sampler(generator=torch.Generator().manual_seed(1234))
    tokens = sampler(logits.contiguous(), meta).sampled_token_ids
    freq = torch.bincount(tokens, minlength=vocab).double().numpy() / num_draws
    want = reference_probs(CRAFTED_LOGITS, params)
    # Tokens outside the support are never drawn; the rest within ~5 standard deviations.
    assert np.all(freq[want == 0] == 0)
    np.testing.assert_allclose(freq, want, atol=5 * math.sqrt(0.25 / num_draws))


def test_greedy_rows_take_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    meta = build([SamplingParams(temperature=0.0)] * 6, 50)
    assert meta.all_greedy and meta.temperature is None
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))

    # Mixed batch: greedy rows still argmax, sampled rows sample (a peaked row at 1e-3 temp
    # and top_k=1 are deterministic too).
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.0, top_k=5, top_p=0.1),
        SamplingParams(temperature=1.0),
    ]
    meta = build(params, 50)
    assert not meta.all_greedy and not meta.all_random
    for _ in range(5):
        got = Sampler()(logits[:4], meta).sampled_token_ids
        assert got[:3].tolist() == logits[:3].argmax(-1).tolist()


def test_penalties_match_reference() -> None:
    rng = np.random.default_rng(0)
    vocab = 40
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(frequency_penalty=0.6),
        SamplingParams(presence_penalty=-1.1),
        SamplingParams(presence_penalty=0.5, frequency_penalty=-0.4, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0),
        SamplingParams(),
    ]
    prompts = [list(rng.integers(0, vocab, size=rng.integers(0, 12))) for _ in params]
    outputs = [list(rng.integers(0, 10, size=rng.integers(0, 15))) for _ in params]
    prompts = [[int(t) for t in p] for p in prompts]
    outputs = [[int(t) for t in o] for o in outputs]
    outputs[4] = [3, 3, 3, 7]
    logits = rng.normal(0, 2, size=(len(params), vocab))
    meta = build(params, vocab, prompts, outputs)
    got = Sampler().sampling_probs(torch.tensor(logits, dtype=torch.float32), meta).numpy()
    for row, p in enumerate(params):
        want = reference_probs(logits[row], p, prompts[row], outputs[row])
        np.testing.assert_allclose(got[row], want, atol=1e-5, err_msg=repr(p))


def test_penalties_change_the_greedy_pick() -> None:
    logits = torch.tensor([[3.0, 2.9, -1.0, -1.05]])
    # Output token 0 once: frequency 0.2 brings it to 2.8 < 2.9.
    meta = build([SamplingParams(temperature=0.0, frequency_penalty=0.2)], 4, outputs=[[0]])
    assert Sampler()(logits, meta).sampled_token_ids.item() == 1
    # Repetition over the prompt: 3.0 / 1.1 < 2.9.
    meta = build([SamplingParams(temperature=0.0, repetition_penalty=1.1)], 4, prompts=[[0]])
    assert Sampler()(logits, meta).sampled_token_ids.item() == 1
    # Negative logits are multiplied: -1.0 * 1.1 = -1.1 < -1.05.
    neg = torch.tensor([[-1.0, -1.05, -5.0, -6.0]])
    meta = build([SamplingParams(temperature=0.0, repetition_penalty=1.1)], 4, outputs=[[0]])
    assert Sampler()(neg, meta).sampled_token_ids.item() == 1
    # Presence counts once however often the token occurred.
    meta = build([SamplingParams(temperature=0.0, presence_penalty=0.05)], 4, outputs=[[0] * 9])
    assert Sampler()(logits, meta).sampled_token_ids.item() == 0


def test_output_token_counts_and_seen_mask() -> None:
    params = [SamplingParams(frequency_penalty=0.1, repetition_penalty=1.2)] * 3
    prompts = [[1, 2, 2], [], [9]]
    outputs = [[4, 4, 4, 0], [7], []]
    meta = build(params, 10, prompts, outputs)
    assert meta.output_token_counts is not None and meta.seen_token_mask is not None
    for row in range(3):
        want = Counter(outputs[row])
        assert meta.output_token_counts[row].tolist() == [want.get(t, 0) for t in range(10)]
        seen = set(prompts[row]) | set(outputs[row])
        assert meta.seen_token_mask[row].tolist() == [t in seen for t in range(10)]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    vocab = 6
    eos = 0
    logits = torch.tensor([[5.0, 1.0, 4.0, 3.0, 0.0, 0.0]] * 4)
    params = [
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2]),
    ]
    outputs = [[1, 1], [1], [], [1, 1, 1]]  # the last row reached min_tokens
    meta = build(params, vocab, outputs=outputs, eos=[eos] * 4)
    got = Sampler()(logits, meta).sampled_token_ids.tolist()
    assert got == [2, 3, 0, 0]
    for row, p in enumerate(params):
        want = reference_probs(logits[row].numpy(), p, output=outputs[row], eos=eos)
        assert int(np.argmax(want)) == got[row]

    # Sampled rows: eos and stop ids get zero probability while below min_tokens.
    p = SamplingParams(min_tokens=2, stop_token_ids=[3])
    meta = build([p, p], vocab, outputs=[[1], [1, 1]], eos=[eos, eos])
    probs = Sampler().sampling_probs(logits[:2], meta)
    assert probs[0, 0] == 0 and probs[0, 3] == 0 and probs[0, 2] > 0
    assert probs[1, 0] > 0 and probs[1, 3] > 0


def test_fast_paths_leave_stages_out() -> None:
    meta = build([SamplingParams(temperature=0.0)] * 3, 10)
    assert meta.all_greedy and meta.no_penalties
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.output_token_counts is None and meta.max_num_logprobs is None
    meta = build([SamplingParams(), SamplingParams(logprobs=3), SamplingParams(logprobs=0)], 10)
    assert meta.all_random and meta.is_greedy is None and meta.max_num_logprobs == 3
    assert meta.top_k is None and meta.top_p is None
    # Filters on greedy rows alone are irrelevant.
    meta = build([SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.2)], 10)
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None


def _seeded_samples(
    seed: int, steps: int, batch_before: int = 0, batch_after: int = 0, vocab: int = 1000
) -> list[int]:
    """Sample `steps` tokens for one seeded row at index `batch_before` in a larger batch."""
    gen = torch.Generator().manual_seed(seed)
    other_gen = torch.Generator().manual_seed(seed + 17)
    params = (
        [SamplingParams(top_p=0.9)] * batch_before
        + [SamplingParams(seed=seed, temperature=1.2)]
        + [SamplingParams(seed=seed + 17)] * batch_after
    )
    gens = [None] * batch_before + [gen] + [other_gen] * batch_after
    logits = torch.linspace(0, 3, vocab).expand(len(params), vocab).contiguous()
    sampler = Sampler()
    samples = []
    for _ in range(steps):
        meta = build(params, vocab, generators=gens)
        samples.append(int(sampler(logits, meta).sampled_token_ids[batch_before]))
    return samples


def test_seeded_rows_are_reproducible() -> None:
    torch.manual_seed(0)
    first = _seeded_samples(seed=7, steps=12)
    torch.manual_seed(1)  # the default generator does not matter
    assert _seeded_samples(seed=7, steps=12) == first
    assert _seeded_samples(seed=8, steps=12) != first
    # Other rows (seeded or not) around it change nothing.
    assert _seeded_samples(seed=7, steps=12, batch_before=3, batch_after=2) == first
    assert _seeded_samples(seed=7, steps=12, batch_before=1) == first


def test_seeded_row_consumes_one_vocab_of_draws_per_step() -> None:
    # A runner resuming a seeded request replays torch.empty(V).exponential_ per output token.
    vocab = 300
    p = SamplingParams(seed=3)
    logits = torch.randn(1, vocab)
    gen = torch.Generator().manual_seed(3)
    samples = [
        int(Sampler()(logits, build([p], vocab, generators=[gen])).sampled_token_ids[0])
        for _ in range(5)
    ]
    resumed = torch.Generator().manual_seed(3)
    for _ in range(3):
        torch.empty(vocab).exponential_(generator=resumed)
    again = [
        int(Sampler()(logits, build([p], vocab, generators=[resumed])).sampled_token_ids[0])
        for _ in range(2)
    ]
    assert again == samples[3:]


def test_unseeded_rows_follow_the_sampler_generator() -> None:
    logits = torch.zeros(8, 500)
    meta = build([SamplingParams()] * 8, 500)
    a = Sampler(torch.Generator().manual_seed(5))(logits, meta).sampled_token_ids
    b = Sampler(torch.Generator().manual_seed(5))(logits, meta).sampled_token_ids
    c = Sampler(torch.Generator().manual_seed(6))(logits, meta).sampled_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_logprobs_columns_and_ranks() -> None:
    torch.manual_seed(0)
    vocab = 30
    logits = torch.randn(4, vocab) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, logprobs=5, frequency_penalty=1.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_k=10, logprobs=0),
    ]
    outputs = [[], [1, 1], [], []]
    meta = build(params, vocab, outputs=outputs)
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    assert out.logprob_token_ids is not None and out.logprobs is not None
    assert out.sampled_ranks is not None
    assert out.logprob_token_ids.shape == (4, 6) and out.logprobs.shape == (4, 6)
    raw = np.log(np.exp(logits.double().numpy()).T / np.exp(logits.double().numpy()).sum(1)).T
    for row in range(4):
        tok = int(out.sampled_token_ids[row])
        assert int(out.logprob_token_ids[row, 0]) == tok
        # Raw logprobs: no penalties, no temperature.
        assert abs(float(out.logprobs[row, 0]) - raw[row, tok]) < 1e-5
        order = np.argsort(-raw[row])
        assert out.logprob_token_ids[row, 1:].tolist() == order[:5].tolist()
        np.testing.assert_allclose(out.logprobs[row, 1:].numpy(), raw[row, order[:5]], atol=1e-5)
        assert int(out.sampled_ranks[row]) == 1 + int((raw[row] > raw[row, tok]).sum())
    assert int(out.sampled_ranks[0]) == 1  # greedy picks the top token

    lists = to_logprobs_lists(out, [p.logprobs for p in params])
    assert lists[2] is None
    for row, n in [(0, 3), (1, 5), (3, 0)]:
        lp = lists[row]
        assert isinstance(lp, Logprobs)
        assert len(lp.token_ids) == len(lp.logprobs) == n + 1
        assert lp.token_ids == out.logprob_token_ids[row, : n + 1].tolist()
        assert lp.sampled_rank == int(out.sampled_ranks[row])


def test_no_logprobs_when_none_asked() -> None:
    meta = build([SamplingParams(), SamplingParams(temperature=0.0)], 10)
    out = Sampler()(torch.randn(2, 10), meta)
    assert out.logprob_token_ids is None and out.logprobs is None and out.sampled_ranks is None
    assert to_logprobs_lists(out, [None, None]) == [None, None]


def test_rejects_mismatched_shapes() -> None:
    meta = build([SamplingParams()] * 2, 10)
    with pytest.raises(ValueError):
        Sampler()(torch.randn(3, 10), meta)
    with pytest.raises(ValueError):
        Sampler()(torch.randn(2, 11), meta)
    with pytest.raises(ValueError):
        SamplingMetadata.build([SamplingParams()], [[]], [], [None], [None], 10, CPU)

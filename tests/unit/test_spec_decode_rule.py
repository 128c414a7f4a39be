"""The measured speculation rule (tandem.core.spec_decode_rule) on synthetic costs, and in the
engine with the replay proposer.

Synthetic: a step of n drafts per request costs `t0 * (1 + c * n)` (c small: memory-bound
decode, large: compute-bound), draft j is accepted with probability p^(j+1). At p = 0 the
rule must stay within 3% of plain decode's throughput; at high acceptance and cheap drafts
it must keep speculating and reach the best fixed choice's throughput; in between it picks
the n with the best E(n) / T(n); batch-size buckets decide apart.

Engine (tiny random model, replay proposer): every draft rejected (p = 0) turns speculation
off for most steps; every draft right (p = 1) keeps it on; greedy tokens equal the run
without speculation either way, with async scheduling on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tandem import SamplingParams
from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.core.spec_decode_rule import SpeculationRule
from tests.spec_decode_cases import RUN_DEFAULTS, run_engine, write_replay_record


def step_cost(t0: float, c: float, n: int) -> float:
    return t0 * (1 + c * n)


def simulate(
    rule: SpeculationRule, batch: int, c: float, p: float, steps: int, t0: float = 0.01
) -> tuple[float, list[int]]:
    """Run `steps` steps; returns (tokens per second, steps by drafts per request)."""
    tokens = 0.0
    seconds = 0.0
    chosen = [0] * (rule.k + 1)
    for _ in range(steps):
        n = rule.decide(batch)
        chosen[n] += 1
        t = step_cost(t0, c, n)
        accepted = [round(batch * p ** (j + 1)) for j in range(n)]
        rule.observe_step(batch, n, t)
        if n:
            rule.observe_acceptance(batch, accepted)
        tokens += batch + sum(accepted)
        seconds += t
    return tokens / seconds, chosen


def best_fixed_rate(batch: int, c: float, p: float, k: int, t0: float = 0.01) -> float:
    return max(
        (batch + sum(round(batch * p ** (j + 1)) for j in range(n))) / step_cost(t0, c, n)
        for n in range(k + 1)
    )


@pytest.mark.parametrize("c", [0.05, 0.3, 1.0])
@pytest.mark.parametrize("k", [2, 4])
def test_every_draft_rejected_costs_at_most_three_percent(c: float, k: int) -> None:
    rule = SpeculationRule(k)
    rate, chosen = simulate(rule, 32, c, 0.0, 3000)
    plain = 32 / 0.01
    assert rate >= 0.97 * plain
    assert chosen[0] > 0.95 * sum(chosen)


@pytest.mark.parametrize("k", [2, 4])
def test_high_acceptance_keeps_the_full_gain(k: int) -> None:
    for p in (1.0, 0.9):
        rule = SpeculationRule(k)
        rate, chosen = simulate(rule, 8, 0.05, p, 3000)
        assert chosen[k] > 0.9 * sum(chosen)
        assert rate >= 0.95 * best_fixed_rate(8, 0.05, p, k)


def test_picks_the_drafts_with_the_best_rate() -> None:
    # p = 0.6, c = 0.25: E(n) / T(n) peaks at n = 2 of 4 (1.6/1.25 < 1.96/1.5 > 2.18/1.75).
    rule = SpeculationRule(4)
    rate, chosen = simulate(rule, 16, 0.25, 0.6, 3000)
    rates = [
        (16 + sum(round(16 * 0.6 ** (j + 1)) for j in range(n))) / step_cost(0.01, 0.25, n)
        for n in range(5)
    ]
    assert int(np.argmax(rates)) == 2 == int(np.argmax(chosen))
    assert rate >= 0.95 * max(rates)


def test_batch_buckets_decide_apart() -> None:
    """Small batches (cheap verify) speculate, large ones (compute-bound) do not, at the same
    acceptance."""
    rule = SpeculationRule(4)
    costs = {1: 0.02, 128: 1.2}
    chosen = {b: [0] * 5 for b in costs}
    for i in range(4000):
        batch = 1 if i // 50 % 2 else 128  # the batch size changes every 50 steps
        n = rule.decide(batch)
        chosen[batch][n] += 1
        rule.observe_step(batch, n, step_cost(0.01, costs[batch], n))
        if n:
            rule.observe_acceptance(batch, [round(batch * 0.8 ** (j + 1)) for j in range(n)])
    assert chosen[1][0] < 0.1 * sum(chosen[1])
    assert chosen[128][0] > 0.9 * sum(chosen[128])


def test_acceptance_that_falls_turns_speculation_off() -> None:
    rule = SpeculationRule(3)
    simulate(rule, 4, 0.1, 1.0, 500)
    assert rule.decide(4) > 0 or rule.decide(4) > 0  # speculating (a probe may run)
    _, chosen = simulate(rule, 4, 0.1, 0.0, 1500)
    assert chosen[0] > 0.9 * sum(chosen)


@pytest.mark.parametrize(("p", "on"), [(0.0, False), (1.0, True)])
def test_one_sided_timing_noise_does_not_flip_the_decision(p: float, on: bool) -> None:
    """A shared host: one step in five is slowed by up to 2x (another process), whatever its
    drafts. At p = 0 speculation stays off (a verify step is never taken as cheaper than a
    plain one); at p = 1 it stays on."""
    rng = np.random.default_rng(3)
    rule = SpeculationRule(4)
    chosen = [0] * 5
    for _ in range(3000):
        n = rule.decide(8)
        chosen[n] += 1
        spike = 1 + rng.random() if rng.random() < 0.2 else 1.0
        rule.observe_step(8, n, step_cost(0.01, 0.1, n) * spike)
        if n:
            rule.observe_acceptance(8, [round(8 * p ** (j + 1)) for j in range(n)])
    share = 1 - chosen[0] / sum(chosen)
    assert share > 0.9 if on else share < 0.05


def test_observe_output_reads_times_and_acceptance_from_a_step() -> None:
    """A verify step of three decodes (drafts 3, 2 and none): its time counts under the
    drafts a request had on average (5 / 3, rounded: 2), acceptance by position over the
    requests that reached each position (a request without a draft there counts as
    rejected); a step with a prefill chunk is not timed."""
    rule = SpeculationRule(3, prior_weight=0.0)
    verify = SchedulerOutput(
        num_scheduled_tokens={"a": 4, "b": 3, "c": 1},
        total_num_scheduled_tokens=8,
        scheduled_spec_decode_tokens={"a": [1, 2, 3], "b": [4, 5]},
    )
    # a: 2 accepted (+ its own token), b: 0 accepted, c: its one token.
    result = ModelRunnerOutput(["a", "b", "c"], [[1, 2, 9], [7], [8]])
    rule.observe_output(verify, result, 0.02)
    assert rule._bucket(3).times == [None, None, 0.02, None]
    assert rule.step_time(3, 2) == 0.02 and rule.step_time(3, 0) is None
    assert rule.trials == pytest.approx([3, 1, 1]) and rule.accepted == pytest.approx([1, 1, 0])
    assert rule.conditional_acceptance() == pytest.approx([1 / 3, 1.0, 0.0])
    assert rule.expected_tokens(3) == pytest.approx(1 + 2 / 3)
    mixed = SchedulerOutput(num_scheduled_tokens={"a": 1, "d": 40}, total_num_scheduled_tokens=41)
    rule.observe_output(mixed, ModelRunnerOutput(["a", "d"], [[5], [6]]), 0.5)
    assert rule.step_time(2, 0) is None  # not a decode-only step: no time


def test_a_verify_step_is_timed_under_its_drafts_per_request() -> None:
    """A step decided with 4 drafts in which one request of 8 drafted (the others backed off)
    costs about a plain step: it is timed under 1 draft, so the verify line keeps its slope
    and, with nothing accepted, the cheapest drafting arm (1) is the one a probe would take."""
    rule = SpeculationRule(4)
    reqs = [f"r{i}" for i in range(8)]
    plain = SchedulerOutput(
        num_scheduled_tokens=dict.fromkeys(reqs, 1), total_num_scheduled_tokens=8
    )
    for _ in range(3):
        rule.observe_output(plain, ModelRunnerOutput(reqs, [[1]] * 8), 0.010)
    full = SchedulerOutput(
        num_scheduled_tokens=dict.fromkeys(reqs, 5),
        total_num_scheduled_tokens=40,
        scheduled_spec_decode_tokens={r: [1, 2, 3, 4] for r in reqs},
    )
    rule.observe_output(full, ModelRunnerOutput(reqs, [[9]] * 8), 0.02)  # the switch: dropped
    rule.observe_output(full, ModelRunnerOutput(reqs, [[9]] * 8), 0.014)
    one = SchedulerOutput(
        num_scheduled_tokens={**dict.fromkeys(reqs, 1), "r0": 5},
        total_num_scheduled_tokens=12,
        scheduled_spec_decode_tokens={"r0": [1, 2, 3, 4]},
        spec_backoff_req_ids=set(reqs[1:]),
    )
    rule.observe_output(one, ModelRunnerOutput(reqs, [[9]] * 8), 0.0105)
    assert rule._bucket(8).times == [0.010, 0.0105, None, None, 0.014]
    assert rule.step_time(8, 1) < rule.step_time(8, 2) < rule.step_time(8, 4)
    assert rule.best(8) == 0 and rule.best_drafting(8) == 1


def test_backed_off_requests_count_as_rejected_first_drafts() -> None:
    """A plain step in which a request was held back from drafting (its drafts kept failing)
    is a rejected first draft for that request; the other requests of a plain step are not
    trials; in a verify step the backed-off request counts once, as any request without
    drafts does."""
    rule = SpeculationRule(2, prior_weight=0.0, decay=1.0)
    plain = SchedulerOutput(
        num_scheduled_tokens={"a": 1, "b": 1},
        total_num_scheduled_tokens=2,
        spec_backoff_req_ids={"a"},
    )
    rule.observe_output(plain, ModelRunnerOutput(["a", "b"], [[3], [4]]), 0.01)
    assert rule.trials == pytest.approx([1, 0]) and rule.accepted == pytest.approx([0, 0])
    assert rule.step_time(2, 0) == 0.01  # still a plain step's time
    verify = SchedulerOutput(
        num_scheduled_tokens={"a": 1, "b": 3},
        total_num_scheduled_tokens=4,
        scheduled_spec_decode_tokens={"b": [7, 8]},
        spec_backoff_req_ids={"a"},
    )
    rule.observe_output(verify, ModelRunnerOutput(["a", "b"], [[5], [7, 8, 9]]), None)
    assert rule.trials == pytest.approx([3, 1]) and rule.accepted == pytest.approx([1, 1])
    none = SchedulerOutput(num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1)
    rule.observe_output(none, ModelRunnerOutput(["a"], [[6]]), 0.01)
    assert rule.trials == pytest.approx([3, 1])  # nothing drafted, nothing held back


def test_estimates_share_strength() -> None:
    """An unmeasured draft count has a step time from the line through the measured ones
    (through plain decode when only one is measured); an unseen position takes the pooled
    acceptance; with nothing seen every draft counts as accepted."""
    rule = SpeculationRule(4)
    assert rule.expected_tokens(4) == pytest.approx(5.0)
    for n, t in ((0, 5.0), (4, 7.0), (4, 7.0)):  # the first after a switch is dropped
        rule.observe_step(1, n, t)
    assert rule.step_time(1, 2) == pytest.approx(6.0)
    rule.observe_step(1, 2, 6.6)
    # Line through (2, 6.6) and (4, 7.0): 6.2 + 0.2 n, above plain decode's 5.0.
    assert rule.step_time(1, 1) == pytest.approx(6.4)
    assert rule.step_time(1, 3) == pytest.approx(6.8)
    for _ in range(20):  # two drafts, the first accepted 3 times in 4, the second never
        rule.observe_acceptance(4, [3, 0])
    c = rule.conditional_acceptance()
    # Positions 2 and 3 never ran: the pooled rate (3 of 7 trials, and half a pseudo-trial of 1).
    assert rule.accepted[0] / rule.trials[0] == pytest.approx(0.75)
    pooled = (sum(rule.accepted) + 0.5) / (sum(rule.trials) + 0.5)
    assert pooled == pytest.approx(3 / 7, abs=0.01)
    assert c[2] == c[3] == pytest.approx(pooled)
    # Measured positions: their own rate, shrunk toward the pooled one by 8 pseudo-trials.
    assert c[0] == pytest.approx((rule.accepted[0] + 8 * pooled) / (rule.trials[0] + 8))
    assert 0.7 < c[0] < 0.75 and c[1] < 0.1


# ---- the H200's costs (8B, batch 1 and 128; benchmarks/results/speculative_forced_h200_*) ----

# Batch 1: plain decode 5.06 ms, a verify step 6.5 ms at 2 drafts and 7.3 ms at 4.
H200_B1 = [5.06e-3] + [5.7e-3 + 0.4e-3 * n for n in range(1, 5)]
# Batch 128, compute-bound: a step's time grows with its rows (1 + n per request), so that a
# verify step of n drafts costs (1 + 0.8 n) plain steps.
H200_B128 = [10.2e-3 * (1 + 0.8 * n) for n in range(5)]


def simulate_random(
    rule: SpeculationRule, batch: int, costs: list[float], p: float, steps: int, seed: int
) -> tuple[float, list[int]]:
    """Steps with each draft kept with probability p until the first rejected one (the replay
    proposer's acceptance): returns (tokens per second, drafts per request by step)."""
    rng = np.random.default_rng(seed)
    tokens = seconds = 0.0
    chosen = []
    for _ in range(steps):
        n = rule.decide(batch)
        chosen.append(n)
        run = (rng.random((batch, n)) < p).cumprod(axis=1)  # drafts accepted, per request
        accepted = run.sum(axis=0).tolist()
        rule.observe_step(batch, n, costs[n])
        if n:
            rule.observe_acceptance(batch, accepted)
        tokens += batch + sum(accepted)
        seconds += costs[n]
    return tokens / seconds, chosen


def h200_rate(batch: int, costs: list[float], p: float, n: int) -> float:
    return batch * sum(p**j for j in range(n + 1)) / costs[n]


def test_h200_batch_one_at_p07_takes_four_drafts() -> None:
    """p = 0.7: E(4) = 2.77 tokens per 7.3 ms beats E(2) = 2.19 per 6.5 ms (and E(3) = 2.53
    per 6.9 ms, by 3%: a near tie that a few dozen draws at batch 1 cannot always settle).
    Over 20 runs of 30 steps (a 64-token run), the rule settles on 4 in nearly every run and
    after its first 10 steps takes 4 in most drafting steps, 1 or 2 almost never."""
    settled = 0
    shares_four = []
    shares_few = []
    for seed in range(20):
        rule = SpeculationRule(4)
        _, chosen = simulate_random(rule, 1, H200_B1, 0.7, 30, seed)
        settled += rule.best(1) == 4
        drafting = [n for n in chosen[10:] if n]
        shares_four.append(drafting.count(4) / len(drafting))
        shares_few.append(sum(n <= 2 for n in drafting) / len(drafting))
    assert settled >= 17
    assert np.mean(shares_four) >= 0.8
    assert np.mean(shares_few) < 0.05


def test_h200_batch_one_rates() -> None:
    """Over long runs the rule reaches the best fixed choice's rate at p = 1, 0.7 and 0
    (k, 4 and none)."""
    for p, n_best in ((1.0, 4), (0.7, 4), (0.0, 0)):
        best = h200_rate(1, H200_B1, p, n_best)
        assert best == max(h200_rate(1, H200_B1, p, n) for n in range(5))
        rule = SpeculationRule(4)
        rate, _ = simulate_random(rule, 1, H200_B1, p, 400, seed=1)
        assert rate >= 0.95 * best
        assert rule.best(1) == n_best


@pytest.mark.parametrize("seed", range(4))
def test_h200_batch_one_at_p0_stops_quickly(seed: int) -> None:
    rule = SpeculationRule(4)
    _, chosen = simulate_random(rule, 1, H200_B1, 0.0, 64, seed)
    # The first probe (a plain step, then 4 verify steps) tells, or at most two steps more:
    # plain decode after it, but for probes of 4 steps at doubling intervals (8, 16, ...).
    assert rule.best(1) == 0
    assert 0 in chosen[5:7]
    assert sum(1 for n in chosen[7:] if n) <= 8


@pytest.mark.parametrize("p", [1.0, 0.7])
def test_h200_batch_128_compute_bound_does_not_speculate(p: float) -> None:
    """Where a verify step costs more plain steps than it emits tokens (p = 0.7: 1.7 tokens
    for 1.8 steps at 1 draft, 2.77 for 4.2 at 4; p = 1: 5 for 4.2 at 4 pays), the rule stops
    speculating (p = 0.7) or keeps k (p = 1)."""
    rule = SpeculationRule(4)
    rate, _ = simulate_random(rule, 128, H200_B128, p, 400, seed=2)
    best_n = max(range(5), key=lambda n: h200_rate(128, H200_B128, p, n))
    assert best_n == (0 if p < 1 else 4)
    assert rule.best(128) == best_n
    assert rate >= 0.95 * h200_rate(128, H200_B128, p, best_n)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="num_spec_tokens"):
        SpeculationRule(0)
    with pytest.raises(ValueError, match="smoothing"):
        SpeculationRule(2, smoothing=0.0)


# ---- in the engine ------------------------------------------------------------------------


def test_engine_turns_speculation_off_when_every_draft_is_rejected(
    tiny_model_path, tmp_path: Path
) -> None:
    shares = rule_shares_in_engine(tiny_model_path("llama"), tmp_path)
    # p = 0: after the first probes, verify steps only as rare probes; p = 1: nearly all.
    assert shares[0.0] < 0.3
    assert shares[1.0] > 0.65


def rule_shares_in_engine(path: Path, tmp_path: Path, **engine: object) -> dict[float, float]:
    """The share of steps with drafts under the measured rule, for the replay proposer at
    p = 0 and p = 1 (async scheduling on); greedy tokens checked against the run without."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 512, size=12).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine = dict(
        max_num_seqs=4, num_gpu_blocks=128, max_model_len=512, async_scheduling="on", **engine
    )
    ref, _ = run_engine(path, prompts, params, **engine)
    record = write_replay_record(tmp_path / "replay.json", prompts, ref)
    shares = {}
    # p = 0 runs 100 steps of one token; p = 1 about 40 steps of five.
    for p, max_tokens in ((0.0, 100), (1.0, 200)):
        spec = {
            "method": "replay",
            "num_speculative_tokens": 4,
            "replay_path": str(record),
            "replay_acceptance": p,
        }
        run_params = params.clone(max_tokens=max_tokens)
        got, stats = run_engine(path, prompts, run_params, speculative_config=spec, **engine)
        assert [o.token_ids for o in got] == [o.token_ids[:max_tokens] for o in ref]
        assert stats.async_scheduling
        rule = stats.spec_decode_rule
        assert rule is not None
        steps = rule.steps_by_num_drafts
        shares[p] = 1 - steps[0] / sum(steps)
    return shares


def test_rule_sees_backoff_when_acceptance_falls_to_zero(tiny_model_path, tmp_path: Path) -> None:
    """One engine, the replay proposer's p moved from 1 to 0 between two batches (as the
    speculation benchmark does): at p = 0 every request soon backs off, so most steps carry
    no drafts; the rule must learn the rejections from the backoff and stop deciding drafts
    (it used to keep deciding them for the whole batch, the proposer running every step)."""
    from tandem import LLM
    from tandem.spec_decode.replay import ReplayProposer

    path = tiny_model_path("llama")
    rng = np.random.default_rng(5)
    first, prompt = (rng.integers(3, 512, size=12).tolist() for _ in range(2))
    params = SamplingParams(temperature=0.0, max_tokens=320, ignore_eos=True)
    engine = dict(max_num_seqs=2, num_gpu_blocks=128, max_model_len=512, async_scheduling="off")
    ref, _ = run_engine(path, [first, prompt], params, **engine)
    record = write_replay_record(tmp_path / "replay.json", [first, prompt], ref)
    spec = {
        "method": "replay",
        "num_speculative_tokens": 4,
        "replay_path": str(record),
        "replay_acceptance": 1.0,
    }
    settings = {**RUN_DEFAULTS, **engine}
    with LLM(model=str(path), speculative_config=spec, **settings) as llm:
        llm.generate([first], params.clone(max_tokens=60), use_tqdm=False)
        before = list(llm.engine.stats().spec_decode_rule.steps_by_num_drafts)
        proposer = llm.engine.model_runner.proposer
        assert isinstance(proposer, ReplayProposer)
        proposer.acceptance = 0.0
        out = llm.generate([prompt], params, use_tqdm=False)
        after = list(llm.engine.stats().spec_decode_rule.steps_by_num_drafts)
        assert llm.engine.scheduler.kv_cache_manager.block_pool.is_whole
    assert out[0].outputs[0].token_ids == ref[1].token_ids
    steps = [b - a for a, b in zip(before, after, strict=True)]
    # p = 1 first: the rule starts this batch believing in drafts; the backoff's rejections
    # turn it off within about 60 steps (the acceptance counts decay by 0.97 a step), then
    # only probes draft. Before the backoff was reported: [0, 0, 0, 0, 321].
    assert 1 - steps[0] / sum(steps) < 0.4, steps

"""Speculative decoding (issue 29): config, scheduler rollback, rejection sampler, n-gram.

- Config: `--speculative-config JSON` / `LLM(speculative_config={...})`; bad input (unknown
  method or key, k out of range, a draft model of another vocabulary) is a ConfigError naming
  it.
- Scheduler: drafts are scheduled with their request under the budget (lookahead slots),
  rejected positions are rolled back, only verified tokens are hashed, the pool stays whole.
- Rejection sampler: the device version equals the per-request reference; the emitted
  tokens keep the target distribution (chi-square on crafted p and q), which a sampler that
  accepts drafts blindly fails.
- Engine (tiny random models, SmolLM2): greedy output with n-gram speculation is the output
  without, with chunked prefill, forced preemption and prefix hits; seeded sampling
  reproduces; logprobs come per emitted token; the stats count drafts and acceptances.
- Logits processors in verify steps: every verified row is processed as if the drafts before
  it were emitted (a bad word completing inside the drafts is banned there; custom processors
  apply at every position); logit_bias, allowed_token_ids, bad words and a custom processor
  hold under n-gram speculation and give the tokens they give without it.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem import SamplingParams
from tandem.config import ConfigError, SchedulerConfig, SpeculativeConfig, add_engine_args
from tandem.core.outputs import ModelRunnerOutput
from tandem.engine_args import EngineArgs
from tandem.layers.logits_processors import LogitsProcessors
from tandem.request import Request, RequestStatus
from tandem.spec_decode.factory import build_proposer
from tandem.spec_decode.ngram import NgramProposer, ngram_draft
from tandem.spec_decode.rejection_sampler import rejection_sample, rejection_sample_reference
from tandem.worker.input_batch import CachedRequestState
from tandem.worker.sampling import StepSampler
from tests.logits_procs import ForceTokenProcessor
from tests.spec_decode_cases import (
    NGRAM,
    PARITY_CASES,
    SMOLLM2_CODE_ENGINE,
    SMOLLM2_CODE_PARAMS,
    SMOLLM2_CODE_PROMPT,
    parity_prompts,
    repetitive_prompts,
    run_engine,
    spec_scheduler,
    write_replay_record,
)

# ---- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "eagle3", "num_speculative_tokens": 2}, "unknown method 'eagle3'"),
        ({"method": "eagle", "num_speculative_tokens": 2}, '"model"'),
        ({"method": "magic", "num_speculative_tokens": 2}, "unknown method 'magic'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown keys"),
        ({"num_speculative_tokens": 2}, '"method"'),
        ({"method": "draft_model", "num_speculative_tokens": 2}, '"model"'),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_speculative_config_names_the_problem(spec: object, message: str) -> None:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig(speculative_config=text)
    parser = argparse.ArgumentParser()
    add_engine_args(parser, environ={})
    with pytest.raises(SystemExit):  # refused when the flags are read
        parser.parse_args(["--speculative-config", text])


def test_flag_and_dict_give_the_same_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, environ={})
    ns = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    from_flag = EngineArgs.from_cli_args(ns).create_engine_config(resolve=False).speculative
    from_dict = EngineArgs(speculative_config=NGRAM).create_engine_config(resolve=False)
    assert from_flag == from_dict.speculative
    assert (from_flag.method, from_flag.k) == ("ngram", 3)
    # One bound alone sets both (vLLM's rule).
    assert (from_flag.prompt_lookup_min, from_flag.prompt_lookup_max) == (3, 3)
    assert EngineArgs().create_engine_config(resolve=False).speculative.k == 0


def test_draft_model_of_another_vocabulary_is_refused(tiny_model_path, smollm2_path) -> None:
    spec = {
        "method": "draft_model",
        "model": str(tiny_model_path("llama")),
        "num_speculative_tokens": 2,
    }
    with pytest.raises(ConfigError, match="vocabulary of 512 tokens"):
        EngineArgs(model=str(smollm2_path), speculative_config=spec).create_engine_config()
    # Same vocabulary: accepted by the config; its proposer runs a model, so only the model
    # runner builds it (tests/unit/test_spec_model_proposers.py).
    same = EngineArgs(model=str(tiny_model_path("qwen2")), speculative_config=spec)
    config = same.create_engine_config()
    with pytest.raises(ConfigError, match="built by the model runner"):
        build_proposer(config.speculative, 512)


# ---- n-gram proposer ----------------------------------------------------------------------


def test_ngram_draft() -> None:
    t = np.array([1, 2, 3, 4, 5, 9, 9, 1, 2, 3], dtype=np.int64)
    assert ngram_draft(t, 3, 1, 3) == [4, 5, 9]  # "1 2 3" seen before, then 4 5 9
    assert ngram_draft(t, 2, 2, 3) == [4, 5]
    assert ngram_draft(np.array([7, 8, 9]), 3, 1, 3) == []  # nothing repeats
    # The latest occurrence with k tokens after it wins over older ones.
    t2 = np.array([1, 2, 5, 5, 5, 1, 2, 6, 6, 6, 0, 1, 2])
    assert ngram_draft(t2, 3, 2, 2) == [6, 6, 6]
    # Too close to the end for k tokens: the earliest occurrence.
    assert ngram_draft(np.array([4, 4, 4, 4]), 3, 1, 1) == [4, 4, 4]
    proposer = NgramProposer(2, 1, 2)

    class State:
        def __init__(self, ids: list[int]) -> None:
            self.token_ids = ids

    assert proposer.propose([State([1, 2, 3, 1, 2]), State([5])]) == [[3, 1], []]  # type: ignore[list-item]


# ---- scheduler --------------------------------------------------------------------------


def test_scheduler_schedules_drafts_and_rolls_back_rejections() -> None:
    sched = spec_scheduler(3, prompt_lookup_max=2)  # 4-token blocks
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    request = Request("r", list(range(10, 17)), params)  # 7 prompt tokens
    sched.add_request(request)
    kv = sched.kv_cache_manager
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 7} and not so.scheduled_spec_decode_tokens
    sched.update_from_output(so, ModelRunnerOutput(["r"], [[100]], spec_token_ids=[[1, 2, 3]]))
    assert request.spec_token_ids == [1, 2, 3]

    so = sched.schedule()  # 1 known + 3 drafts: positions 7..10, lookahead into block 2
    assert so.num_scheduled_tokens == {"r": 4}
    assert so.scheduled_spec_decode_tokens == {"r": [1, 2, 3]}
    assert len(kv.get_block_ids("r")) == 3 and request.num_computed_tokens == 11
    # Only verified tokens are hashed: 8 known tokens -> 2 full blocks.
    assert kv.num_cached_blocks["r"] == 2
    # The first draft accepted, the second rejected: emits [1, 50].
    outs = sched.update_from_output(so, ModelRunnerOutput(["r"], [[1, 50]], spec_token_ids=[[7]]))
    assert outs[0].new_token_ids == [1, 50]
    assert request.all_token_ids[-3:] == [100, 1, 50]
    assert request.num_computed_tokens == 9 == request.num_tokens - 1
    assert request.spec_token_ids == [7]
    stats = sched.stats().spec_decoding
    assert stats is not None
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]

    # A tight budget cuts drafts: 2 tokens -> the known one and one draft.
    sched.scheduler_config = SchedulerConfig(max_num_batched_tokens=2, max_num_seqs=4)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 2} and so.scheduled_spec_decode_tokens == {"r": [7]}
    sched.update_from_output(so, ModelRunnerOutput(["r"], [[7, 8]]))  # all accepted + bonus
    assert request.num_computed_tokens == request.num_tokens - 1 == 11
    assert kv.num_cached_blocks["r"] == 2  # tokens 0..10 known and computed: 2 full blocks
    # max_tokens bounds the drafts: 20 - 5 outputs - 1.
    sched.scheduler_config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(["r"], [[9]], spec_token_ids=[list(range(20))]))
    assert len(request.spec_token_ids) == 3
    # No drafts while disable_by_batch_size requests run.
    sched.spec_disable_by_batch_size = 1
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(["r"], [[9]], spec_token_ids=[[1, 2]]))
    assert request.spec_token_ids == []
    sched.finish_requests("r", request.status.FINISHED_ABORTED)
    kv.check_invariants()
    assert kv.block_pool.is_whole


# ---- rejection sampler ------------------------------------------------------------------


def _random_case(
    gen: torch.Generator, num_draft: list[int], vocab: int, greedy: list[bool], with_q: bool
) -> dict:
    rows = sum(num_draft) + len(num_draft)
    d = sum(num_draft)
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen) * 2, dim=-1)
    q = torch.softmax(torch.randn(d, vocab, generator=gen) * 2, dim=-1) if with_q else None
    drafts = (
        torch.multinomial(q, 1, generator=gen).squeeze(1)
        if q is not None
        else torch.randint(0, vocab, (d,), generator=gen)
    )
    # Make greedy rows agree with some drafts so acceptance runs are exercised.
    argmax = probs.argmax(dim=-1)
    row = di = 0
    for k in num_draft:
        for j in range(k):
            if (j + row) % 3:
                argmax[row + j] = drafts[di + j]
        row += k + 1
        di += k
    return dict(
        num_draft=num_draft,
        draft_token_ids=drafts,
        target_probs=None if all(greedy) else probs,
        target_argmax=argmax,
        is_greedy=None if all(greedy) or not any(greedy) else torch.tensor(greedy),
        uniform=torch.rand(d, generator=gen),
        noise=torch.empty(rows, vocab).exponential_(generator=gen),
        draft_probs=q,
    )


@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("greedy", ["all", "none", "mixed"])
def test_rejection_sampler_matches_its_reference(greedy: str, with_q: bool, uniform: bool) -> None:
    """Random draft counts, and (`uniform`) every request with the same count, 1 to 4 (all
    greedy: its own fast path)."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        num_draft = [int(x) for x in torch.randint(0, 5, (6,), generator=gen)]
        if uniform:
            num_draft = [trial % 4 + 1] * 6
        elif not any(num_draft):
            num_draft[0] = 2
        flags = {
            "all": [True] * 6,
            "none": [False] * 6,
            "mixed": [bool(i % 2) for i in range(6)],
        }[greedy]
        case = _random_case(gen, num_draft, 16, flags, with_q)
        got = rejection_sample(**case)
        want = rejection_sample_reference(**case)
        assert torch.equal(got, want), f"trial {trial}: {got} != {want}"
        emitted = (got >= 0).sum(dim=1)
        assert bool(((emitted >= 1) & (emitted <= torch.tensor(num_draft) + 1)).all())


CHI2_CRIT_DF7_P001 = 24.32  # chi-square critical value, 7 degrees of freedom, p = 0.001


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_sampling_keeps_the_target_distribution(with_q: bool) -> None:
    """Per position, the emitted token follows p: position 0 always, position 1 given the
    first draft was accepted (that conditional law is p_1 too). A blind acceptor fails."""
    gen = torch.Generator().manual_seed(1)
    n, vocab, k = 40_000, 8, 2
    p = torch.tensor(
        [
            [0.30, 0.05, 0.20, 0.05, 0.10, 0.10, 0.15, 0.05],
            [0.05, 0.40, 0.05, 0.10, 0.10, 0.05, 0.05, 0.20],
            [0.125] * 8,
        ]
    )
    q = torch.tensor(
        [
            [0.05, 0.30, 0.05, 0.20, 0.10, 0.10, 0.05, 0.15],
            [0.20, 0.10, 0.30, 0.05, 0.05, 0.10, 0.10, 0.10],
        ]
    )
    if with_q:
        drafts = torch.stack(
            [torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(k)], 1
        )
        draft_probs = q.repeat(n, 1)
    else:  # one-hot drafts (n-gram): always token 1, then token 2
        drafts = torch.tensor([1, 2]).repeat(n, 1)
        draft_probs = None
    out = rejection_sample(
        [k] * n,
        drafts.flatten(),
        p.repeat(n, 1),
        p.repeat(n, 1).argmax(dim=-1),
        None,
        torch.rand(n * k, generator=gen),
        torch.empty(n * (k + 1), vocab).exponential_(generator=gen),
        draft_probs,
    )
    first = torch.bincount(out[:, 0], minlength=vocab).float()
    assert _chi2(first, p[0]) < CHI2_CRIT_DF7_P001
    accepted_first = out[:, 0] == drafts[:, 0]
    second = torch.bincount(out[accepted_first, 1], minlength=vocab).float()
    assert _chi2(second, p[1]) < CHI2_CRIT_DF7_P001
    # The check has teeth: accepting every draft emits q (or the one-hot draft), not p.
    blind = torch.bincount(drafts[:, 0], minlength=vocab).float()
    assert _chi2(blind, p[0]) > 10 * CHI2_CRIT_DF7_P001


# ---- engine -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "case"),
    [
        ("llama", "roomy"),
        ("llama", "chunked"),
        ("llama", "preemption"),
        ("qwen2", "roomy"),
        ("llama", "async_mixed"),
    ],
)
def test_greedy_with_ngram_speculation_is_greedy_without(
    tiny_model_path, greedy_reference, arch: str, case: str
) -> None:
    path = tiny_model_path(arch)
    prompts = parity_prompts()  # the last one a prefix hit
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)
    ref = greedy_reference(arch, prompts, 48)
    extra = {"speculative_config": NGRAM, **PARITY_CASES[case]}
    got, stats = run_engine(path, prompts, params, **extra)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(got, ref, strict=True):
        assert len(a.logprobs) == len(a.token_ids)  # one entry per emitted token
        for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
            assert abs(la[t].logprob - lb[t].logprob) < 1e-4
    spec = stats.spec_decoding
    assert spec is not None
    assert stats.async_scheduling == (extra.get("async_scheduling") == "on")
    assert 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    assert set(spec.num_verify_steps) == {"eager"}  # the CPU runs verify steps eagerly
    assert stats.prefix_cache_hits > 0
    if "num_gpu_blocks" in extra:
        assert stats.num_preemptions > 0


def test_seeded_sampling_with_speculation_reproduces(tiny_model_path) -> None:
    """Seeded requests reproduce run to run; requests whose sampling reads their output
    (penalties, min_tokens) run beside them without drafts, with the tokens they get without
    speculation."""
    path = tiny_model_path("llama")
    prompts = repetitive_prompts(512, 5)
    params = [
        SamplingParams(temperature=0.3, top_k=3, seed=i, max_tokens=32, ignore_eos=True)
        for i in range(3)
    ] + [
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=32, min_tokens=8),
    ]
    # Sampled text on random weights rarely repeats a 3-gram: look up single tokens. Verify
    # rows draw from a request's generator unlike plain rows, and the measured rule's choices
    # follow timing: seeded runs reproduce under the "always" rule.
    loose = {**NGRAM, "prompt_lookup_min": 1, "speculation_rule": "always"}
    a, stats = run_engine(path, prompts, params, speculative_config=loose)
    b, _ = run_engine(path, prompts, params, speculative_config=loose)
    ref, _ = run_engine(path, prompts[3:], params[3:])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 32 for o in a[:4])
    assert [o.token_ids for o in a[3:]] == [o.token_ids for o in ref]
    # Only the seeded requests had drafts (the others read their output history).
    spec = stats.spec_decoding
    assert spec is not None and spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0


def test_smollm2_greedy_with_ngram_speculation(smollm2_path, smollm2_code_reference) -> None:
    for mode in ("off", "on"):
        got, stats = run_engine(
            smollm2_path,
            [SMOLLM2_CODE_PROMPT],
            SMOLLM2_CODE_PARAMS,
            speculative_config=NGRAM,
            async_scheduling=mode,
            **SMOLLM2_CODE_ENGINE,
        )
        assert got[0].token_ids == smollm2_code_reference.token_ids
        assert stats.spec_decoding is not None and stats.spec_decoding.num_accepted_tokens > 0
        assert stats.async_scheduling == (mode == "on")


def test_replay_proposer_controls_acceptance(
    tiny_model_path, greedy_reference, tmp_path: Path
) -> None:
    """p = 1 replays the target's own greedy tokens: every draft accepted; p = 0: none. The
    tokens are the run without speculation's either way."""
    path = tiny_model_path("qwen2")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (5, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = greedy_reference("qwen2", prompts, 24)
    record = write_replay_record(tmp_path / "replay.json", prompts, ref)
    for p, want_rate in ((1.0, 1.0), (0.0, 0.0)):
        spec = {
            "method": "replay",
            "num_speculative_tokens": 4,
            "replay_path": str(record),
            "replay_acceptance": p,
        }
        got, stats = run_engine(path, prompts, params, speculative_config=spec)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        s = stats.spec_decoding
        assert s is not None and s.num_draft_tokens > 0
        assert s.acceptance_rate == want_rate
    with pytest.raises(ConfigError, match="replay_path"):
        build_proposer(
            SpeculativeConfig(
                method="replay",
                num_speculative_tokens=2,
                replay_path=str(tmp_path / "missing.json"),
            ),
            512,
        )


def test_spec_stats_reach_the_metrics_families() -> None:
    from tandem.core.spec_decode_stats import SpecDecodingStats
    from tandem_services.worker.metrics import spec_decode_families

    stats = SpecDecodingStats(3)
    stats.observe(3, 2)
    stats.observe(2, 0)
    stats.observe_step("eager")
    snap = stats.snapshot()
    stats.observe(3, 3)  # a later step leaves the snapshot alone
    assert (snap.num_drafts, snap.num_draft_tokens, snap.num_accepted_tokens) == (2, 5, 2)
    assert snap.num_accepted_tokens_per_pos == [1, 1, 0]
    assert snap.mean_acceptance_length == 2.0
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in spec_decode_families(snap, {"role": "unified"})
        for s in family.samples
    }
    prefix = "tandem_worker_spec_decode"
    assert samples[(f"{prefix}_num_draft_tokens_total", None)] == 5
    assert samples[(f"{prefix}_num_accepted_tokens_total", None)] == 2
    assert samples[(f"{prefix}_num_accepted_tokens_per_pos_total", "1")] == 1


STRUCTURED_CHOICE = ("alpha beta", "gamma delta epsilon")


def _structured_params() -> list[SamplingParams]:
    """Two plain greedy requests and one held to STRUCTURED_CHOICE."""
    from tandem.sampling_params import StructuredOutputsParams

    choice = StructuredOutputsParams(choice=STRUCTURED_CHOICE)
    return [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=choice)
    ]


@pytest.fixture(scope="module")
def structured_reference(tiny_model_path) -> list:
    """The tiny Llama's outputs under `_structured_params` without speculation."""
    return run_engine(tiny_model_path("llama"), repetitive_prompts(512, 3), _structured_params())[0]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_structured_rows_beside_drafts_keep_their_grammar(
    tiny_model_path, structured_reference: list, async_scheduling: str
) -> None:
    """A structured-output request gets no drafts, and in a step where others verify drafts
    its row still samples under its bitmask: the run's tokens are the run without
    speculation's (with async scheduling too)."""
    path = tiny_model_path("llama")
    prompts = repetitive_prompts(512, 3)
    params = _structured_params()
    ref = structured_reference
    got, stats = run_engine(
        path, prompts, params, speculative_config=NGRAM, async_scheduling=async_scheduling
    )
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert got[2].text in STRUCTURED_CHOICE
    assert stats.async_scheduling == (async_scheduling == "on")
    assert stats.spec_decoding is not None and stats.spec_decoding.num_draft_tokens > 0


def test_async_plans_drop_stale_proposals_and_verify_fresh_ones() -> None:
    """Async scheduling at the scheduler: proposals that land while a later plain step of the
    request is planned are dropped (they follow a token no longer the last); once nothing is
    in flight the proposals are kept, verified, and rejections rolled back exactly."""
    sched = spec_scheduler(2, prompt_lookup_max=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    request = Request("r", list(range(10, 17)), params)  # 7 prompt tokens
    sched.add_request(request)
    s1 = sched.schedule()  # prefill: samples token 7
    s2 = sched.schedule()  # planned before s1 lands: decodes token 7 from its placeholder
    assert s2.num_scheduled_tokens == {"r": 1} and request.num_output_placeholders == 2
    sched.update_from_output(s1, ModelRunnerOutput(["r"], [[100]], spec_token_ids=[[1, 2]]))
    assert request.spec_token_ids == []  # stale: s2's token comes between
    sched.update_from_output(s2, ModelRunnerOutput(["r"], [[101]], spec_token_ids=[[5, 6]]))
    assert request.spec_token_ids == [5, 6] and request.num_output_placeholders == 0
    s3 = sched.schedule()
    assert s3.scheduled_spec_decode_tokens == {"r": [5, 6]}
    assert request.num_computed_tokens == 11  # 9 known + 2 drafts, as if both were right
    sched.update_from_output(s3, ModelRunnerOutput(["r"], [[5, 60]], spec_token_ids=[[8, 9]]))
    assert request.output_token_ids == [100, 101, 5, 60]
    assert request.num_computed_tokens == 10 == request.num_tokens - 1
    assert request.spec_token_ids == [8, 9]
    sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.block_pool.is_whole


def test_a_request_whose_drafts_keep_failing_backs_off() -> None:
    from tandem.core.scheduler import SPEC_BACKOFF_AFTER

    sched = spec_scheduler(2, prompt_lookup_max=1, num_blocks=32, max_model_len=128)
    request = Request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=60))
    sched.add_request(request)
    so = sched.schedule()
    drafted: list[bool] = []
    told: list[bool] = []  # the runner told its proposals after this step are dropped
    backed: list[bool] = []  # reported to the measured rule as held back from drafting
    token = 100
    for step in range(14):
        # Every draft is rejected until step 10, then every draft is accepted.
        drafts = so.scheduled_spec_decode_tokens.get("r", [])
        drafted.append(bool(drafts))
        told.append("r" in so.no_draft_req_ids)
        backed.append("r" in so.spec_backoff_req_ids)
        emitted = [*drafts, token] if step >= 10 else [token]
        sched.update_from_output(so, ModelRunnerOutput(["r"], [emitted], spec_token_ids=[[1, 2]]))
        assert request.num_computed_tokens == request.num_tokens - 1
        token += 1
        so = sched.schedule()
    # Drafts in steps 1 and 2 fail (misses 1, 2): skip 1 step; step 4 fails: skip 2; step 7
    # fails: skip 4 (steps 8-11); step 12's drafts are accepted: drafting goes on.
    assert SPEC_BACKOFF_AFTER == 2
    assert drafted[:12] == [False, True, True, False, True, False, False, True] + [False] * 4
    assert drafted[12:] == [True, True]  # accepted again: no more skipping
    # Steps planned while backing off tell the runner (a model proposer drafts nothing then).
    assert told == [False] * 5 + [True, False, False, True, True, True] + [False] * 3
    assert all(not drafted[i + 1] for i in range(13) if told[i])
    # Each step without drafts after the prefill is a backoff skip, and says so.
    assert backed == [i > 0 and not d for i, d in enumerate(drafted)]
    # A step that allows no drafts (the measured rule's plain decode) reports none.
    request.spec_backed_off = True
    assert sched.schedule(num_drafts=0).spec_backoff_req_ids == set()
    sched.finish_requests("r", request.status.FINISHED_ABORTED)
    assert sched.kv_cache_manager.block_pool.is_whole


# ---- logits processors in verify steps ------------------------------------------------------


def _state(req_id: str, output: list[int], params: SamplingParams) -> CachedRequestState:
    tokens = [1, *output]
    return CachedRequestState(
        req_id, tokens, 1, params, [], len(tokens), None, None, list(output), [1]
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_rows_follow_the_drafts_before_them(temperature: float) -> None:
    check_verify_rows(torch.device("cpu"), temperature)


def check_verify_rows(device: torch.device, temperature: float) -> None:
    """Each verified row is processed as if the drafts before it were emitted: the bad word
    (2, 3) completes inside the drafts and is banned at that row, as is (2, 3, 4) whose first
    token ends the output; the custom processor forces
    its request's token at every position (beside a request verifying no drafts);
    logit_bias and allowed_token_ids hold at every row."""
    vocab = 10
    procs = LogitsProcessors([ForceTokenProcessor], None, device, vocab)
    sampler = StepSampler(device, vocab, 4, logits_processors=procs)
    p = SamplingParams(temperature=temperature, seed=0, max_tokens=8)
    states = [
        _state("bad", [1], p.clone(bad_words_token_ids=[[2, 3]])),
        _state("force", [4], p.clone(extra_args={"force_token_id": 6})),
        _state("bias", [4], p.clone(logit_bias={7: 100})),
        _state("allowed", [4], p.clone(allowed_token_ids=[8, 9])),
        _state("span", [9, 5, 2], p.clone(bad_words_token_ids=[[2, 3, 4]])),
    ]
    num_draft = [3, 2, 0, 2, 2]
    drafts = [2, 3, 4, 6, 6, 8, 1, 3, 4]
    peak = {
        0: [(2, 50)],  # "bad": d0 = 2 accepted
        1: [(3, 50), (5, 40)],  # 3 would complete the bad word: 5 instead
        2: [(4, 50)],
        3: [(4, 50)],
        4: [(0, 50)],  # "force": argmax 0, forced to 6 at every row
        5: [(0, 50)],
        6: [(0, 50)],
        7: [(0, 50)],  # "bias": 7 by +100
        8: [(1, 50), (8, 40), (9, 30)],  # "allowed": d0 = 8 accepted
        9: [(1, 50), (9, 40), (8, 30)],  # d1 = 1 is not allowed: 9
        10: [(1, 50)],
        11: [(3, 50)],  # "span": the output's 2, then d0 = 3 accepted
        12: [(4, 50), (6, 40)],  # 4 would complete (2, 3, 4) across output and drafts: 6
        13: [(1, 50)],
    }
    logits = torch.zeros(sum(num_draft) + len(num_draft), vocab)
    for row, pairs in peak.items():
        for token, value in pairs:
            logits[row, token] = value
    for state in states:
        state.generator = sampler.new_generator(state.sampling_params, 0)
    logits, device_drafts = logits.to(device), torch.tensor(drafts, device=device)
    step = sampler.sample_speculative(
        logits, states, num_draft, device_drafts, host_draft_token_ids=drafts
    )
    emitted = [[t for t in row if t >= 0] for row in step.sampled.tolist()]
    assert emitted == [[2, 5], [6, 6, 6], [7], [8, 9], [3, 6]]
    # The device drafts are read back when the host copy is not given.
    again = sampler.sample_speculative(logits, states, num_draft, device_drafts)
    assert [[t for t in row if t >= 0] for row in again.sampled.tolist()] == emitted


def test_requests_with_logits_rules_get_drafts() -> None:
    """Logits rules apply at every verified row: such requests verify drafts; requests whose
    sampling reads their output counts (penalties, min_tokens) still do not."""
    sched = spec_scheduler(3, prompt_lookup_max=2)
    drafted = [
        SamplingParams(max_tokens=8),
        SamplingParams(max_tokens=8, logit_bias={5: 10.0}),
        SamplingParams(max_tokens=8, allowed_token_ids=[7, 8, 9]),
        SamplingParams(max_tokens=8, bad_words_token_ids=[[7, 8], [4]]),
        SamplingParams(max_tokens=8, extra_args={"force_token_id": 7}),
    ]
    for i, params in enumerate(drafted):
        assert sched._next_drafts(Request(f"d{i}", [1, 2, 3], params), [7, 8, 9]) == [7, 8, 9]
    for i, params in enumerate(
        [SamplingParams(max_tokens=8, repetition_penalty=1.2), SamplingParams(min_tokens=2)]
    ):
        assert sched._next_drafts(Request(f"n{i}", [1, 2, 3], params), [7, 8, 9]) == []


def test_logits_processors_under_speculation_match_the_run_without(tiny_model_path) -> None:
    """With n-gram speculation on: +100 bias forces its token, -100 bans it, allowed_token_ids
    holds, a two-token bad word never appears, the custom processor forces its token; every
    greedy output is the output of the same processors without speculation; the pool is
    whole (`run_engine`)."""
    path = tiny_model_path("llama")
    prompts = repetitive_prompts(512, 6)
    loose = {**NGRAM, "prompt_lookup_min": 1}
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    procs = {"logits_processors": ["tests.logits_procs:ForceTokenProcessor"]}
    free, _ = run_engine(path, prompts, greedy, **procs)
    free_ids = [list(o.token_ids) for o in free]
    # The most frequent bigram of the free output of prompt 4 (repeats: its drafts meet it).
    pairs = list(itertools.pairwise(free_ids[4]))
    bad = max(set(pairs), key=pairs.count)
    allowed = sorted(set(prompts[3]))[:4]
    params = [
        greedy,
        greedy.clone(logit_bias={77: 100}),
        greedy.clone(logit_bias=dict.fromkeys(free_ids[2], -100)),
        greedy.clone(allowed_token_ids=allowed),
        greedy.clone(bad_words_token_ids=[list(bad)]),
        greedy.clone(extra_args={"force_token_id": 42}),
    ]
    ref, _ = run_engine(path, prompts, params, **procs)
    got, stats = run_engine(path, prompts, params, speculative_config=loose, **procs)
    got_ids = [list(o.token_ids) for o in got]
    assert got_ids == [list(o.token_ids) for o in ref]
    assert got_ids[0] == free_ids[0]
    assert got_ids[1] == [77] * 24
    assert not set(got_ids[2]) & set(free_ids[2])
    assert set(got_ids[3]) <= set(allowed)
    assert bad not in set(itertools.pairwise(got_ids[4])) and got_ids[4] != free_ids[4]
    assert got_ids[5] == [42] * 24
    spec = stats.spec_decoding
    assert spec is not None and spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0


def test_replay_proposer_keeps_each_draft_with_probability_p() -> None:
    """The replay proposer (benchmarks only) proposes the record's continuation, each token
    kept with probability p and otherwise the record's + 1; nothing off the record, shorter
    drafts near its end."""
    from types import SimpleNamespace

    from tandem.spec_decode.replay import ReplayProposer

    record = list(range(10, 40))
    prompts = [[1, 2, i] for i in range(200)]
    proposer = ReplayProposer({tuple(p): record for p in prompts}, 4, 0.7, 1000, seed=3)
    states = [SimpleNamespace(prompt_token_ids=p, output_token_ids=record[:5]) for p in prompts]
    drafts = proposer.propose(states)
    pairs = [list(zip(draft, record[5:9], strict=True)) for draft in drafts]
    kept = np.array([[d == t for d, t in row] for row in pairs])
    assert all(d in (t, t + 1) for row in pairs for d, t in row)
    assert 0.6 < kept.mean() < 0.8  # 800 draws at p = 0.7
    off = SimpleNamespace(prompt_token_ids=prompts[0], output_token_ids=[99])
    near_end = SimpleNamespace(prompt_token_ids=prompts[0], output_token_ids=record[:28])
    proposer.acceptance = 1.0
    assert proposer.propose([off, near_end]) == [[], record[28:]]

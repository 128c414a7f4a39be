"""Speculative decoding on CUDA: the rejection sampler at real sizes against its reference,
and n-gram speculation with CUDA graphs and async scheduling on (verify steps through the
mixed-step graphs, reported in the stats) giving the tokens of the same engine without
speculation (fp32, so
batch shapes do not flip near-ties); logits processors at every verified row on the device,
and under n-gram speculation with CUDA graphs giving the tokens they give without it."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.spec_decode.rejection_sampler import rejection_sample, rejection_sample_reference
from tests.logits_procs import ForceTokenProcessor
from tests.unit.test_spec_decode import check_verify_rows

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("num_draft", "greedy"),
    [
        ([4, 0, 3, 4, 1, 2, 4, 4] * 8, False),
        ([4] * 64, False),  # the same drafts for every request: the [B, k + 1] view path
        ([4] * 64, True),  # and every row greedy: its own path
    ],
)
def test_rejection_sampler_on_cuda_matches_the_reference(
    num_draft: list[int], greedy: bool
) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab = 128_256
    rows, drafts = sum(num_draft) + len(num_draft), sum(num_draft)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 4
    probs = torch.softmax(logits, dim=-1)
    draft_ids = torch.randint(0, vocab, (drafts,), device="cuda", generator=gen)
    argmax = probs.argmax(dim=-1)
    if len(set(num_draft)) == 1:
        # Two drafts in three right (the target's argmax), so acceptance runs vary.
        k = num_draft[0]
        b, j = torch.meshgrid(torch.arange(len(num_draft)), torch.arange(k), indexing="ij")
        right = ((b + j) % 3 != 0).flatten().cuda()
        draft_ids = torch.where(right, argmax.view(-1, k + 1)[:, :k].flatten(), draft_ids)
    case = dict(
        num_draft=num_draft,
        draft_token_ids=draft_ids,
        target_probs=probs,
        target_argmax=argmax,
        is_greedy=torch.tensor([i % 3 == 0 for i in range(len(num_draft))], device="cuda"),
        uniform=torch.rand(drafts, device="cuda", generator=gen),
        noise=torch.empty(rows, vocab, device="cuda").exponential_(generator=gen),
    )
    if greedy:
        case.update(target_probs=None, is_greedy=None)
    got = rejection_sample(**case)
    want = rejection_sample_reference(
        **{k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()}
    )
    assert torch.equal(got.cpu(), want)


def test_ngram_speculation_with_cuda_graphs_keeps_greedy_tokens() -> None:
    text = (
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "Rewrite the code above with type hints, keeping the names.\n"
    )
    params = SamplingParams(temperature=0.0, max_tokens=64)
    kwargs = dict(device="cuda", dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3)
    prompts = [text, text.replace("add", "plus"), text.replace("sub", "minus")] * 4
    with LLM(**kwargs) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    with LLM(speculative_config=spec, **kwargs) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats()
        assert llm.engine.scheduler.kv_cache_manager.block_pool.is_whole
    assert got == ref
    s = stats.spec_decoding
    assert s is not None and s.num_accepted_tokens > 0 and stats.async_scheduling
    # Verify steps never use the one-token decode graphs; with cudagraph_mode full they run
    # as whole mixed-step graphs (eager past the largest size).
    assert "decode_graph" not in s.num_verify_steps and s.num_verify_steps.get("mixed_graph", 0) > 0
    print("spec stats:", s)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_rows_follow_the_drafts_before_them_on_cuda(temperature: float) -> None:
    check_verify_rows(torch.device("cuda"), temperature)


def test_logits_processors_under_speculation_with_cuda_graphs() -> None:
    """logit_bias, allowed_token_ids, a two-token bad word and the custom processor under
    n-gram speculation (CUDA graphs on) give the tokens of the same engine without it."""
    text = (
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "Rewrite the code above with type hints, keeping the names.\n"
    )
    kwargs = dict(
        device="cuda",
        dtype="float32",
        max_model_len=1024,
        gpu_memory_utilization=0.3,
        logits_processors=[ForceTokenProcessor],
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with LLM(**kwargs) as llm:
        free = llm.generate([text], greedy, use_tqdm=False)[0].outputs[0].token_ids
        pair = [free[4], free[5]]
        allowed = sorted(set(free))[:6]
        params = [
            greedy,
            greedy.clone(logit_bias={1000: 100}),
            greedy.clone(logit_bias=dict.fromkeys(free[:8], -100)),
            greedy.clone(allowed_token_ids=allowed),
            greedy.clone(bad_words_token_ids=[pair]),
            greedy.clone(extra_args={"force_token_id": 42}),
        ]
        ref = [o.outputs[0].token_ids for o in llm.generate([text] * 6, params, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    with LLM(speculative_config=spec, **kwargs) as llm:
        outs = llm.generate([text] * 6, params, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        stats = llm.engine.stats()
        assert llm.engine.scheduler.kv_cache_manager.block_pool.is_whole
    assert got == ref
    assert got[1] == [1000] * 48 and got[5] == [42] * 48
    assert not set(got[2]) & set(free[:8]) and set(got[3]) <= set(allowed)
    assert tuple(pair) not in set(zip(got[4], got[4][1:], strict=False))
    s = stats.spec_decoding
    assert s is not None and s.num_accepted_tokens > 0

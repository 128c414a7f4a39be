"""Speculative decoding on CUDA: the rejection sampler at real sizes against its reference,
and n-gram speculation with CUDA graphs on (verify steps through the mixed-step graphs,
reported in the stats) giving the tokens of the same engine without speculation (fp32, so
batch shapes do not flip near-ties)."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.spec_decode.rejection_sampler import rejection_sample, rejection_sample_reference

pytestmark = pytest.mark.gpu


def test_rejection_sampler_on_cuda_matches_the_reference() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab, num_draft = 128_256, [4, 0, 3, 4, 1, 2, 4, 4] * 8
    rows, drafts = sum(num_draft) + len(num_draft), sum(num_draft)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 4
    probs = torch.softmax(logits, dim=-1)
    draft_ids = torch.randint(0, vocab, (drafts,), device="cuda", generator=gen)
    argmax = probs.argmax(dim=-1)
    case = dict(
        num_draft=num_draft,
        draft_token_ids=draft_ids,
        target_probs=probs,
        target_argmax=argmax,
        is_greedy=torch.tensor([i % 3 == 0 for i in range(len(num_draft))], device="cuda"),
        uniform=torch.rand(drafts, device="cuda", generator=gen),
        noise=torch.empty(rows, vocab, device="cuda").exponential_(generator=gen),
    )
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
    assert s is not None and s.num_accepted_tokens > 0 and not stats.async_scheduling
    # Verify steps never use the one-token decode graphs; with cudagraph_mode full they run
    # as whole mixed-step graphs (eager past the largest size).
    assert "decode_graph" not in s.num_verify_steps and s.num_verify_steps.get("mixed_graph", 0) > 0
    print("spec stats:", s)

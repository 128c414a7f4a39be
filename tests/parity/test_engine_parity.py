"""Greedy generation through the whole engine equals Hugging Face transformers, token for token.

One batch of prompts of 1 to 700 tokens runs through `LLM.generate` at once; the reference is
transformers' `generate` on each prompt alone (no padding) on the same weights, in fp32.
The same outputs must come back when chunked prefill is forced (tiny token budget), when
preemption is forced (tiny KV pool) and when prompts share prefixes (cache hits).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.core import InvalidRequestError

NUM_NEW_TOKENS = 32
LOGPROB_TOL = 1e-4


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """12 prompts, 1 to 700 tokens, two pairs sharing long prefixes."""
    rng = random.Random(seed)
    lengths = [1, 3, 17, 40, 64, 100, 129, 250, 333, 512, 640, 700]
    prompts = [[rng.randrange(10, vocab_size) for _ in range(n)] for n in lengths]
    # Shared prefixes: prompt 8 starts with prompt 7 (250 tokens), prompt 11 with prompt 10.
    prompts[8] = prompts[7] + prompts[8][250:]
    prompts[11] = prompts[10][:600] + prompts[11][600:]
    return prompts


def hf_greedy(
    model_path: Path, prompts: list[list[int]], n: int
) -> list[tuple[list[int], list[float]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_path, torch_dtype=torch.float32, local_files_only=True
    )
    model.eval()
    # tandem's ignore_eos lets eos be chosen and continues; transformers' min_new_tokens would
    # mask eos instead, so the reference simply has no eos.
    model.generation_config.eos_token_id = None
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=n,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = out.sequences[0, len(ids) :].tolist()
            logprobs = [
                torch.log_softmax(step_logits[0].float(), dim=-1)[tok].item()
                for step_logits, tok in zip(out.logits, tokens, strict=True)
            ]
            results.append((tokens, logprobs))
    return results


def run_tandem(model_path: Path, prompts: list[list[int]], n: int, **engine_kwargs: object):
    llm = LLM(model=str(model_path), dtype="float32", device="cpu", **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.is_whole, "blocks leaked after generate"
    llm.shutdown()  # its memory goes now; the scheduler's stats stay readable
    return llm, outs


def assert_matches(outs, reference) -> None:
    for i, (out, (ref_tokens, ref_logprobs)) in enumerate(zip(outs, reference, strict=True)):
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens, f"prompt {i}: tokens differ"
        got = [comp.logprobs[j][tok].logprob for j, tok in enumerate(comp.token_ids)]
        diff = max(abs(a - b) for a, b in zip(got, ref_logprobs, strict=True))
        assert diff < LOGPROB_TOL, f"prompt {i}: logprob differs by {diff}"


@pytest.fixture(scope="module")
def smollm2_case(smollm2_path: Path):
    prompts = make_prompts(49152)
    return smollm2_path, prompts, hf_greedy(smollm2_path, prompts, NUM_NEW_TOKENS)


def test_smollm2_greedy_matches_transformers(smollm2_case) -> None:
    path, prompts, reference = smollm2_case
    _, outs = run_tandem(path, prompts, NUM_NEW_TOKENS)
    assert_matches(outs, reference)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_smollm2_chunked_prefill_same_tokens(smollm2_case, async_scheduling: str) -> None:
    path, prompts, reference = smollm2_case
    _, outs = run_tandem(
        path,
        prompts,
        NUM_NEW_TOKENS,
        max_num_batched_tokens=96,
        async_scheduling=async_scheduling,
    )
    assert_matches(outs, reference)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_smollm2_preemption_same_tokens(smollm2_case, async_scheduling: str) -> None:
    path, prompts, reference = smollm2_case
    # 60 blocks of 16 tokens: the 700-token prompt alone takes 47, so requests must be
    # preempted and recomputed to all finish.
    llm, outs = run_tandem(
        path,
        prompts,
        NUM_NEW_TOKENS,
        num_gpu_blocks=60,
        max_num_batched_tokens=512,
        max_model_len=960,
        async_scheduling=async_scheduling,
    )
    assert llm.engine.stats().num_preemptions > 0, "the pool was meant to force preemption"
    assert_matches(outs, reference)


def test_smollm2_prefix_cache_hits_same_tokens(smollm2_case) -> None:
    path, prompts, reference = smollm2_case
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=0)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # Run again: every prompt's full blocks are now cached.
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_matches(first, reference)
    assert_matches(again, reference)
    assert sum(o.num_cached_tokens for o in again) > 0.8 * sum(len(p) for p in prompts)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    # A prompt dict's cache_salt: under a new salt the prompts read only what they share with
    # each other (as the first, unsalted pass did), then their own blocks under it; the
    # tokens are the same every time.
    salted = [{"prompt_token_ids": p, "cache_salt": "s1"} for p in prompts]
    first_salted = llm.generate(salted, params, use_tqdm=False)
    shared = [o.num_cached_tokens for o in first]
    assert [o.num_cached_tokens for o in first_salted] == shared
    assert sum(shared) < 0.5 * sum(o.num_cached_tokens for o in again)
    again_salted = llm.generate(salted, params, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again_salted) > 0.8 * sum(len(p) for p in prompts)
    assert_matches(first_salted, reference)
    assert_matches(again_salted, reference)
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        llm.generate({"prompt_token_ids": prompts[0], "cache_salt": ""}, params)
    assert llm.engine.scheduler.kv_cache_manager.block_pool.is_whole
    llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_random_models_greedy_match(arch: str, tiny_model_path) -> None:
    path = tiny_model_path(arch)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path, local_files_only=True).vocab_size
    prompts = make_prompts(vocab, seed=1)
    reference = hf_greedy(path, prompts, NUM_NEW_TOKENS)
    _, outs = run_tandem(path, prompts, NUM_NEW_TOKENS, max_num_batched_tokens=256)
    assert_matches(outs, reference)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "mixtral"])
def test_new_families_greedy_match(arch: str, tiny_model_path) -> None:
    """Qwen3, Qwen3-MoE and Mixtral through the whole engine (CPU step path, chunked by a
    small token budget) against transformers' greedy generation: fewer, shorter prompts than
    above, as the families share the step path those cover."""
    path = tiny_model_path(arch)
    prompts = make_prompts(512, seed=2)[1:7]  # 3 to 129 tokens
    reference = hf_greedy(path, prompts, 12)
    _, outs = run_tandem(path, prompts, 12, max_num_batched_tokens=64)
    assert_matches(outs, reference)


@pytest.mark.parametrize("arch", ["phi3_longrope", "phi4_partial"])
def test_phi3_longrope_engine_matches_transformers_at_either_context(
    arch: str, tiny_model_path
) -> None:
    """LongRoPE through the whole engine (the CPU step path): capped at the 64-token original
    context it rotates with the short factors, as transformers does while a sequence stays
    within it; at the full context with the long ones, as transformers does for prompts past
    it. The runner hands the engine's max_model_len to the model. Phi-4-mini's partial
    rotary with it."""
    path = tiny_model_path(arch)
    within = [p[:40] for p in make_prompts(512, seed=3)[1:5]]
    reference = hf_greedy(path, within, 12)
    _, outs = run_tandem(path, within, 12, max_model_len=64, max_num_batched_tokens=64)
    assert_matches(outs, reference)
    past = [p for p in make_prompts(512, seed=4) if 64 < len(p) < 200][:3]
    assert past
    reference = hf_greedy(path, past, 12)
    _, outs = run_tandem(path, past, 12, max_num_batched_tokens=64)
    assert_matches(outs, reference)


@torch.inference_mode()
def hf_prompt_logprobs(model_path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, `[len - 1, vocab]` log-softmax of transformers' logits at positions
    0..len-2 (position p predicts prompt token p + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, local_files_only=True
    ).eval()
    return [
        torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
        for ids in prompts
    ]


def test_prompt_logprobs_match_transformers(tiny_model_path) -> None:
    """`prompt_logprobs=k`: for each prompt token after the first, its logprob, its rank and
    the top k under transformers' distribution at the position before it; prompts chunked
    over steps by a small token budget, a prompt that is a cached prefix of another computed
    whole (no prefix-cache hit for it), n = 2 (one set for the request), a one-token prompt
    (only the None entry), and the block pool whole after."""
    path = tiny_model_path("llama")
    prompts = make_prompts(256, seed=3)[:8]  # 1 to 250 tokens
    prompts.append(list(prompts[7]))  # the same prompt again: its blocks are cached by then
    reference = hf_prompt_logprobs(path, prompts)
    llm = LLM(
        model=str(path), dtype="float32", device="cpu", max_num_batched_tokens=64, max_num_seqs=4
    )
    k = 3
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (ids, out, ref) in enumerate(zip(prompts, outs, reference, strict=True)):
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(ids) and got[0] is None, f"prompt {i}"
        for p in range(1, len(ids)):
            entry, row = got[p], ref[p - 1]
            assert entry is not None, f"prompt {i}, position {p}"
            token = ids[p]
            assert abs(entry[token].logprob - row[token].item()) < LOGPROB_TOL, (i, p)
            assert entry[token].rank == int((row > row[token]).sum()) + 1, (i, p)
            for rank, top in enumerate(row.topk(k).indices.tolist(), start=1):
                assert entry[top].rank == rank, (i, p, rank)
    # Those requests read nothing from the prefix cache (prompt 8 is prompt 7 again).
    assert llm.engine.stats().prefix_cache_hits == 0
    # n = 2: one set of prompt logprobs for the request (its first child computes them).
    two = llm.generate([{"prompt_token_ids": prompts[5]}], params.clone(n=2), use_tqdm=False)
    pair = two[0].prompt_logprobs
    assert len(two[0].outputs) == 2 and pair is not None and pair[0] is None
    for a, b in zip(pair[1:], outs[5].prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < LOGPROB_TOL for t in a)
    # A plain request reads the cache and carries none.
    plain = llm.generate([{"prompt_token_ids": prompts[7]}], SamplingParams(max_tokens=1))
    assert plain[0].prompt_logprobs is None
    assert llm.engine.stats().prefix_cache_hits > 0
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    assert pool.is_whole
    llm.shutdown()

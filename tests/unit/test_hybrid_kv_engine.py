"""The engine with a KV cache group per attention kind, on the tiny Gemma 3 (layer 0 slides
with an 8-token window, layer 1 is global): greedy tokens equal transformers' and the same
engine's with every block kept (`disable_hybrid_kv_cache_manager`), through prefix hits,
chunked prefill and preemption; the sliding group holds at most cdiv(8, 4) + 1 blocks of a
decoding request, and the cache holds fewer layer-blocks at its peak."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.config import ConfigError
from tandem.core.hybrid_kv_cache_manager import NULL_BLOCK, HybridKVCacheManager
from tandem.request import EngineCoreRequest
from tests.parity.test_engine_parity import hf_greedy

BS = 4
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gemma3_case(tiny_model_path) -> tuple[Path, list[list[int]], list[list[int]]]:
    path = tiny_model_path("gemma3")
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(21)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 30, 45)]
    prompts += [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 60)]
    reference = [tokens for tokens, _ in hf_greedy(path, prompts, NEW_TOKENS)]
    return path, prompts, reference


def run(path: Path, prompts: list[list[int]], num_gpu_blocks: int, **kwargs: object):
    """Greedy tokens, the engine, the peak of blocks in use, and the most blocks the
    sliding group held for one decoding request."""
    llm = LLM(
        model=str(path),
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=128,
        block_size=BS,
        num_gpu_blocks=num_gpu_blocks,
        **kwargs,
    )
    sched = llm.engine.scheduler
    kv = sched.kv_cache_manager
    peak = [0, 0]
    schedule = sched.schedule

    def observed(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = schedule(*args, **kwargs)
        peak[0] = max(peak[0], kv.num_blocks - kv.num_free_blocks)
        if isinstance(kv, HybridKVCacheManager):
            G = kv.num_groups
            sliding = [g for g, group in enumerate(kv.spec.groups) if group.is_sliding]
            for request in sched.running:
                if request.num_computed_tokens > request.num_prompt_tokens:  # decoding
                    flat = kv.get_blocks(request.request_id)
                    for g in sliding:
                        held = sum(1 for b in flat[g::G] if b is not NULL_BLOCK)
                        peak[1] = max(peak[1], held)
        return out

    sched.schedule = observed  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    kv.check_invariants()
    assert kv.block_pool.is_whole
    return [o.outputs[0].token_ids for o in outs], llm, peak[0], peak[1]


def test_gemma3_hybrid_cache_matches_transformers_and_the_plain_cache(gemma3_case) -> None:
    path, prompts, reference = gemma3_case
    # The same memory twice: 120 blocks of one layer, or 60 blocks of both layers.
    tokens, llm, peak, sliding_peak = run(path, prompts, 120)
    spec = llm.engine.kv_cache_spec
    assert [g.sliding_window for g in spec.groups] == [None, 8]
    assert llm.engine.kv_cache.shape[1] == spec.layers_per_group == 1
    assert llm.engine.stats().prefix_cache_hits > 0
    assert tokens == reference
    assert 0 < sliding_peak <= -(-8 // BS) + 1
    plain_tokens, plain, plain_peak, _ = run(
        path, prompts, 60, disable_hybrid_kv_cache_manager=True
    )
    assert plain.engine.kv_cache_spec.is_plain and plain.engine.kv_cache.shape[1] == 2
    assert plain_tokens == reference
    # Layer-blocks in use at the peak: the sliding layer keeps a window's worth.
    assert peak < 2 * plain_peak
    print(f"peak layer-blocks in use: hybrid {peak}, every block kept {2 * plain_peak}")
    # Maximum concurrency at 128 tokens from the same memory, and the tokens of context the
    # cache holds, as vLLM reports them: a request's peak, a 32-token prefill chunk at the
    # window's end, takes 32 full blocks and cdiv(8 + 32 - 2, 4) + 1 = 11 sliding ones.
    assert llm.engine.max_concurrency == pytest.approx(120 / (32 + 11))
    assert plain.engine.max_concurrency == pytest.approx(60 / 32)
    assert llm.engine.kv_cache_size_tokens == 120 * 128 // (32 + 11)
    assert plain.engine.kv_cache_size_tokens == 60 * BS
    # (KV hand-off of these tables between engines: tests/parity/test_disagg_gemma3.py.)
    assert llm.engine.pool_state().empty
    check_reservations(llm)


def check_reservations(llm: LLM) -> None:
    """A decode engine's reservations for KV hand-offs take `num_blocks_needed(P, 0)` blocks
    (prompts around the window's and the blocks' ends; none cached here) until the pool is
    short; the one that does not fit is refused and leaves the pool as it was."""
    engine = llm.engine
    spec = engine.kv_cache_spec
    kv = engine.scheduler.kv_cache_manager
    params = SamplingParams(max_tokens=4)
    ids = []
    for i, n in enumerate([7, 8, 9, 12, 13, 20, 21, *[101] * 8]):
        prompt = [497 + (i + j) % 3 for j in range(n)]  # no block of it is cached here
        free = kv.num_free_blocks
        reserved = engine.reserve(EngineCoreRequest(f"rsv{i}", prompt, params, eos_token_id=None))
        if free < spec.num_blocks_needed(n, 0):
            assert reserved is None and kv.num_free_blocks == free
            break
        assert reserved is not None and reserved[1] == 0
        assert free - kv.num_free_blocks == spec.num_blocks_needed(n, 0)
        ids.append(f"rsv{i}")
    else:
        raise AssertionError("the pool never ran short")
    kv.check_invariants()
    engine.abort_requests(ids)
    assert engine.pool_state().empty


def test_gemma3_hybrid_cache_under_preemption(gemma3_case) -> None:
    path, prompts, reference = gemma3_case
    # Async scheduling: the next step is planned (windows moved, blocks freed) while one runs.
    tokens, llm, _, _ = run(path, prompts, 48, async_scheduling="on")
    assert llm.engine.async_scheduling
    assert llm.engine.stats().num_preemptions > 0, "the small pool was meant to preempt"
    assert tokens == reference


def test_gemma3_hybrid_cache_with_the_model_in_a_rank_process(gemma3_case) -> None:
    """The spec crosses the process boundary (MultiprocExecutor's RankInfo)."""
    path, prompts, reference = gemma3_case
    tokens, llm, _, _ = run(path, prompts, 120, distributed_executor_backend="mp")
    try:
        assert llm.engine.kv_cache_spec.num_groups == 2
        assert tokens == reference
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("arch", "windows"), [("mistral_swa", [8]), ("qwen2_swa", [None, 8])])
def test_llama_family_windows_through_the_hybrid_cache(
    arch: str, windows: list[int | None], tiny_model_path
) -> None:
    """Mistral slides on every layer (one sliding group), Qwen2 from max_window_layers on."""
    path = tiny_model_path(arch)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 30, 61)]
    reference = [tokens for tokens, _ in hf_greedy(path, prompts, NEW_TOKENS)]
    tokens, llm, _, sliding_peak = run(path, prompts, 120)
    assert [g.sliding_window for g in llm.engine.kv_cache_spec.groups] == windows
    assert 0 < sliding_peak <= -(-8 // BS) + 1
    assert tokens == reference


def test_gemma3_hybrid_cache_with_ngram_speculation(tiny_model_path) -> None:
    """Drafts take lookahead slots and rejected ones roll back: the window's blocks are freed
    by computed tokens only, so the tokens stay transformers'."""
    path = tiny_model_path("gemma3")
    rng = random.Random(11)
    prompts = []
    for i in range(4):
        motif = [rng.randrange(3, 500) for _ in range(4 + i)]
        prompts.append((motif * 8)[: 14 + 9 * i])
    reference = [tokens for tokens, _ in hf_greedy(path, prompts, NEW_TOKENS)]
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "speculation_rule": "always",  # every verify step exercises the hybrid rollback
    }
    tokens, llm, _, _ = run(path, prompts, 120, speculative_config=spec)
    stats = llm.engine.stats().spec_decoding
    assert stats is not None
    # Some drafts accepted, some rolled back.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert tokens == reference


def test_gemma3_hybrid_cache_refuses_a_model_proposer(tiny_model_path) -> None:
    """A draft model's cache follows one block table: with several groups it is refused at
    start, naming the way out."""
    path = tiny_model_path("gemma3")
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="disable-hybrid-kv-cache-manager"):
        LLM(str(path), device="cpu", dtype="float32", speculative_config=spec)

"""Prefill in one engine, decode in another: the same tokens as one unified engine.

The prefill engine runs each prompt with `hold_kv` and max_tokens=1; its held blocks are
copied into the blocks the decode engine reserved; the decode engine continues from the first
token. Greedy and seeded sampling must both match the unified engine token for token.
"""

from __future__ import annotations

import random

import pytest

from tandem import LLM, SamplingParams
from tandem.request import EngineCoreRequest

NUM_TOKENS = 12


@pytest.fixture(scope="module")
def engines(smollm2_path):
    kwargs = {
        "dtype": "float32",
        "device": "cpu",
        "kv_cache_memory_gb": 0.25,
        "max_model_len": 2048,
    }
    pair = LLM(str(smollm2_path), **kwargs), LLM(str(smollm2_path), **kwargs)
    yield pair
    for llm in pair:
        llm.shutdown()


def _drain(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=NUM_TOKENS, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_disaggregated_engines_match_unified(engines, params: SamplingParams) -> None:
    prefill_llm, decode_llm = engines
    pe, de = prefill_llm.engine, decode_llm.engine
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 49152) for _ in range(n)] for n in (5, 16, 40, 77)]
    eos = pe.eos_token_id

    # Unified reference on the decode engine.
    for i, p in enumerate(prompts):
        de.add_request(EngineCoreRequest(f"u{i}", p, params, eos_token_id=eos))
    unified = _drain(de)

    # Prefill side: first token, blocks held.
    for i, p in enumerate(prompts):
        req = EngineCoreRequest(f"d{i}", p, params.clone(max_tokens=1), eos_token_id=eos)
        pe.add_request(req, hold_kv=True)
    first = _drain(pe)
    assert pe.stats().num_held == len(prompts)

    # Decode side: reserve, copy the prompt's blocks, continue.
    for i, p in enumerate(prompts):
        rid = f"d{i}"
        reserved = de.reserve(EngineCoreRequest(rid, p, params, eos_token_id=eos))
        assert reserved is not None
        dst, num_cached = reserved
        src = pe.get_held_block_ids(rid)
        num_blocks = -(-len(p) // pe.block_size)
        for s, d in list(zip(src, dst, strict=False))[num_cached // de.block_size : num_blocks]:
            de.kv_cache[d].copy_(pe.kv_cache[s])
        pe.release_held(rid)
        assert de.add_prefilled_request(rid, first[rid][0]) is None
    rest = _drain(de)

    for i in range(len(prompts)):
        assert first[f"d{i}"] + rest[f"d{i}"] == unified[f"u{i}"], f"prompt {i} differs"
    for engine in (pe, de):
        pool = engine.scheduler.kv_cache_manager.block_pool
        pool.check_invariants()
        assert pool.is_whole


def test_reserve_waits_for_the_device_only_for_blocks_a_running_step_writes(
    smollm2_path,
) -> None:
    """A reservation hands its block ids to another process, which writes them outside this
    engine's stream order: it must wait for a launched step that still writes into one of
    them (a block freed after the step was planned), and for nothing else."""
    llm = LLM(
        str(smollm2_path),
        dtype="float32",
        device="cpu",
        num_gpu_blocks=8,
        max_model_len=128,
        async_scheduling="on",
    )
    engine = llm.engine
    assert engine.async_scheduling
    runner = engine.model_runner
    syncs: list[int] = []
    synchronize = runner.synchronize

    def counted() -> None:
        syncs.append(1)
        synchronize()

    runner.synchronize = counted  # an instrumented real runner: counts the waits
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    # 40 prompt tokens: blocks 0-2 (16 tokens each); its first decode writes position 40.
    engine.add_request(EngineCoreRequest("a", list(range(100, 140)), params, eos_token_id=None))
    engine.step()  # launches the prefill
    engine.step()  # applies it, launches the first decode (in flight from here on)
    a_blocks = engine.scheduler.kv_cache_manager.get_block_ids("a")
    assert len(a_blocks) == 3
    engine.abort_requests(["a"])  # its blocks go back to the pool; the decode still runs

    # Five blocks come from the free queue's head, before "a"'s: no wait.
    short = EngineCoreRequest("b", list(range(300, 370)), params, eos_token_id=None)
    reserved = engine.reserve(short)
    assert reserved is not None and not set(reserved[0]) & set(a_blocks)
    assert syncs == []
    engine.abort_requests(["b"])
    # All eight blocks: "a"'s last block, which the decode in flight writes, among them.
    whole = EngineCoreRequest("c", list(range(400, 520)), params, eos_token_id=None)
    reserved = engine.reserve(whole)
    assert reserved is not None and a_blocks[2] in reserved[0]
    assert syncs == [1]
    # Once the device is known done (the wait above), a second look needs no wait.
    assert not runner.may_write_blocks(reserved[0])
    engine.abort_requests(["c"])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.kv_cache_manager.block_pool.is_whole
    llm.shutdown()

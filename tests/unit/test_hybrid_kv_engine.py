"""The engine with a KV cache of several groups (one per attention kind): the runner's
per-group tables, slot mappings and cache layout give the same tokens as one group keeping
every block, the pool ends whole, and fewer blocks are held."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.layers.attention import layer as attention_layer


@pytest.fixture
def windowed_layers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every other Attention layer built (0, 2, ...) slides with window WINDOW."""
    init = attention_layer.Attention.__init__
    counter = itertools.count()

    def patched(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        if next(counter) % 2 == 0:
            self.sliding_window = WINDOW

    monkeypatch.setattr(attention_layer.Attention, "__init__", patched)
    yield


WINDOW = 4096


def run(path: Path, num_gpu_blocks: int, **kwargs: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        model=str(path),
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=48,
        max_model_len=160,
        block_size=4,
        async_scheduling="on",
        num_gpu_blocks=num_gpu_blocks,
        **kwargs,
    )
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(20)]
    prompts = [
        shared + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))] for _ in range(6)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.is_whole
    return [o.outputs[0].token_ids for o in outs], llm


def test_two_groups_give_the_one_group_tokens(tiny_model_path, windowed_layers) -> None:
    path = tiny_model_path("llama")
    # The same memory: 100 blocks of one layer, or 50 of both layers.
    hybrid_tokens, llm = run(path, 100)
    spec = llm.engine.kv_cache_spec
    assert [g.sliding_window for g in spec.groups] == [None, WINDOW]
    assert spec.layers_per_group == 1
    # A block holds one layer: the cache tensor's second dimension.
    assert llm.engine.kv_cache.shape[1] == 1
    assert llm.engine.stats().prefix_cache_hits > 0
    plain_tokens, plain = run(path, 50, disable_hybrid_kv_cache_manager=True)
    assert plain.engine.kv_cache_spec.is_plain
    assert plain.engine.kv_cache.shape[1] == 2
    assert hybrid_tokens == plain_tokens

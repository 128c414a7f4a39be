"""What the speculative-decoding tests share (tests/unit/test_spec_decode.py,
test_spec_decode_rule.py, test_spec_model_proposers.py and their GPU counterparts): the n-gram
config, the engine settings each parity case runs under, the repetitive prompts n-gram lookup
finds drafts in, a scheduler with speculation on, an engine run that checks the pool is whole
after it, and the replay proposer's record. The greedy references these runs are compared
with are session fixtures in tests/unit/conftest.py."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tandem import LLM, SamplingParams
from tandem.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tandem.core.scheduler import Scheduler

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}

# Engine settings beside speculation: each case must give the tokens of the run without it.
PARITY_CASES: dict[str, dict[str, object]] = {
    # Drafts mix with prefills; async scheduling (steps next to a verify step wait for it).
    "roomy": {"async_scheduling": "on"},
    # Chunked prefill; drafts cut by the budget.
    "chunked": {"max_num_batched_tokens": 8},
    # Forced preemption (recompute) in a tiny pool.
    "preemption": {"num_gpu_blocks": 16},
    # Async scheduling with chunked prefill and preemption, and speculation off at 3 or more
    # running requests (`disable_by_batch_size`): plain steps overlap, verify steps do not.
    "async_mixed": {
        "async_scheduling": "on",
        "max_num_batched_tokens": 16,
        "num_gpu_blocks": 16,
        "speculative_config": {**NGRAM, "disable_by_batch_size": 3},
    },
}

# SmolLM2 on code it can continue by copying (n-gram lookup and a self-draft both find drafts).
SMOLLM2_CODE_PROMPT = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "Rewrite the code above with type hints.\n"
)
SMOLLM2_CODE_ENGINE: dict[str, object] = {
    "max_num_batched_tokens": 256,
    "num_gpu_blocks": 64,
    "max_model_len": 512,
}
SMOLLM2_CODE_PARAMS = SamplingParams(temperature=0.0, max_tokens=32)


# The engine `run_engine` builds unless told otherwise.
RUN_DEFAULTS: dict[str, object] = {
    "device": "cpu",
    "dtype": "float32",
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "num_gpu_blocks": 48,
    "max_model_len": 256,
}


def repetitive_prompts(vocab: int, num: int = 6) -> list[list[int]]:
    """`num` prompts, each a short motif repeated (n-gram lookup finds drafts in them) and two
    random tokens; the same prompts every call."""
    rng = np.random.default_rng(3)
    prompts = []
    for i in range(num):
        motif = rng.integers(3, vocab, size=4 + i % 3).tolist()
        prompts.append((motif * (2 + i % 3))[: 10 + 4 * i] + rng.integers(3, vocab, 2).tolist())
    return prompts


def parity_prompts() -> list[list[int]]:
    """The parity cases' prompts: repetitive_prompts(512) and one sharing the last one's first
    20 tokens (a prefix hit on its blocks)."""
    prompts = repetitive_prompts(512)
    prompts.append([*prompts[-1][:20], 5, 6, 7])
    return prompts


def run_engine(path: Path | str, prompts: Sequence[Any], params: object, **kwargs: object) -> tuple:
    """Generate `prompts` with an `LLM` of RUN_DEFAULTS updated by `kwargs`; checks that the
    block pool is whole and nothing is left running afterwards. Returns (each prompt's first
    completion, the engine's stats)."""
    settings = {**RUN_DEFAULTS, **kwargs}
    with LLM(model=str(path), **settings) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        pool = llm.engine.scheduler.kv_cache_manager
        pool.check_invariants()
        assert pool.block_pool.is_whole and not llm.engine.has_unfinished_requests()
        stats = llm.engine.stats()
    return [o.outputs[0] for o in outs], stats


def spec_scheduler(
    k: int,
    prompt_lookup_max: int,
    num_blocks: int = 16,
    max_model_len: int = 64,
) -> Scheduler:
    """A scheduler with n-gram speculation of `k` drafts (n-grams of 1 to `prompt_lookup_max`
    tokens): 4-token blocks, a budget of 64 tokens and 4 sequences."""
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
        CacheConfig(block_size=4),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        speculative_config=SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=k,
            prompt_lookup_min=1,
            prompt_lookup_max=prompt_lookup_max,
        ),
    )


def write_replay_record(path: Path, prompts: Sequence[list[int]], outputs: Sequence[Any]) -> Path:
    """The replay proposer's record (`replay_path`): each prompt with the tokens `outputs`
    (completions, in the prompts' order) gave it."""
    record = [
        {"prompt_token_ids": p, "output_token_ids": list(o.token_ids)}
        for p, o in zip(prompts, outputs, strict=True)
    ]
    path.write_text(json.dumps(record))
    return path

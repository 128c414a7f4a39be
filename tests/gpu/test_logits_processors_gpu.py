"""Logits processors on the GPU: the built-in rules at the real size (256 rows of a
128,256-token vocabulary) equal the CPU's, and the engine on CUDA (async scheduling and CUDA
graphs on) keeps logit_bias, allowed_token_ids, a two-token bad word and a custom processor
(loaded by module:Class) on a tiny random model."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


class _Row:
    def __init__(self, params: SamplingParams, output: list[int]) -> None:
        self.req_id = str(id(self))
        self.sampling_params = params
        self.prompt_token_ids: list[int] = []
        self.output_token_ids = output


def test_rules_on_cuda_equal_the_cpus() -> None:
    from tandem.layers.logits_processors import LogitsProcessors, apply_logits_rules

    vocab, rng = 128256, random.Random(0)
    rows = []
    for i in range(256):
        kind = i % 4
        ids = rng.sample(range(vocab), 64)
        if kind == 0:
            params = SamplingParams()
        elif kind == 1:
            params = SamplingParams(logit_bias={t: rng.uniform(-100, 100) for t in ids})
        elif kind == 2:
            params = SamplingParams(allowed_token_ids=ids)
        else:
            params = SamplingParams(bad_words_token_ids=[ids[:1], ids[1:3], [7, ids[4]]])
        rows.append(_Row(params, [rng.randrange(vocab) for _ in range(5)] + [ids[1]]))
    logits = torch.randn(256, vocab, generator=torch.Generator().manual_seed(0))
    outs = []
    for device in ("cpu", "cuda"):
        inputs = LogitsProcessors((), None, torch.device(device), vocab).prepare(rows)
        assert inputs.rules is not None
        outs.append(apply_logits_rules(logits.to(device), inputs.rules).cpu())
    assert torch.equal(outs[0], outs[1])


def test_engine_on_cuda_keeps_every_processor(tiny_model_path: Callable[[str], Path]) -> None:
    from tandem import LLM

    llm = LLM(
        str(tiny_model_path("llama")),
        device="cuda",
        dtype="float32",
        num_gpu_blocks=256,
        logits_processors=["tests.logits_procs:ForceTokenProcessor"],
    )
    assert llm.engine.async_scheduling
    prompts = [{"prompt_token_ids": [1, 50 + i, 60, 70]} for i in range(16)]
    x, y = (llm.tokenizer.encode(c, add_special_tokens=False)[0] for c in "xy")
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=40, ignore_eos=True)
    mixed = []
    for i in range(16):
        kind = i % 4
        if kind == 0:
            mixed.append(params.clone(logit_bias={77: 100}))
        elif kind == 1:
            # Near uniform over x and y (a bias is divided by the temperature; a ban is not).
            mixed.append(params.clone(temperature=20.0, allowed_token_ids=[x, y], bad_words=["xy"]))
        elif kind == 2:
            mixed.append(params.clone(extra_args={"force_token_id": 99}))
        else:
            mixed.append(params.clone(logit_bias={t: -100 for t in range(100, 400)}))
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, mixed, use_tqdm=False)]
    for i, ids in enumerate(outs):
        kind = i % 4
        assert len(ids) == 40
        if kind == 0:
            assert ids == [77] * 40
        elif kind == 1:
            assert set(ids) <= {x, y} and (x, y) not in itertools.pairwise(ids), ids
        elif kind == 2:
            assert ids == [99] * 40
        else:
            assert not any(100 <= t < 400 for t in ids), ids
    for _ in range(2):  # a dropped step launched past a stop is applied by the next
        if llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert llm.engine.scheduler.kv_cache_manager.block_pool.is_whole
    llm.shutdown()

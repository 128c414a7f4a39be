"""bf16 on the CPU step path against fp32, under the top-5 rule of the GPU bf16 test.

Each prompt's bf16 greedy tokens either equal fp32's, or at the first position where they
differ each side's token is in the other's top-5 (after a near-tie the continuations may part;
the rule checks the divergence point). The embedded SmolLM2 weights, both through the C++
kernels (tandem_kernels/cpu) with the dtype given explicitly.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.worker.cpu_threads import cpu_supports_bf16
from tandem_kernels import cpu

NEW_TOKENS = 16

pytestmark = pytest.mark.skipif(
    not (cpu.available() and cpu_supports_bf16()), reason="needs the CPU kernels and native bf16"
)


def _run(path: Path, dtype: str, prompts: list[list[int]]):
    llm = LLM(model=str(path), dtype=dtype, device="cpu", attention_backend="cpu")
    want = torch.bfloat16 if dtype == "auto" else getattr(torch, dtype)
    assert llm.engine.model_runner.dtype == want
    assert llm.engine.model_runner.kv_dtype == want
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.kv_cache_manager.block_pool.is_whole
    llm.shutdown()
    return outs


_rng = random.Random(3)
PROMPTS = [[_rng.randrange(10, 49152) for _ in range(n)] for n in (5, 16, 33, 120)]


@pytest.fixture(scope="module")
def fp32_outputs(smollm2_path: Path):
    return _run(smollm2_path, "float32", PROMPTS)


@pytest.mark.parametrize("dtype", ["bfloat16", "auto"])
def test_bf16_greedy_within_fp32_top5(smollm2_path: Path, fp32_outputs, dtype: str) -> None:
    """`auto` is bf16 on this CPU (it has native bf16: the module's skip condition)."""
    prompts, ref = PROMPTS, fp32_outputs
    got = _run(smollm2_path, dtype, prompts)
    exact = 0
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        ours, theirs = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert len(ours) == len(theirs) == NEW_TOKENS
        if ours == theirs:
            exact += 1
            continue
        j = next(k for k, (x, y) in enumerate(zip(ours, theirs, strict=True)) if x != y)
        assert ours[j] in b.outputs[0].logprobs[j], f"prompt {i} step {j}: not in fp32 top-5"
        assert theirs[j] in a.outputs[0].logprobs[j], f"prompt {i} step {j}: not in bf16 top-5"
    print(f"{exact}/{len(prompts)} prompts identical in bf16 and fp32 for {NEW_TOKENS} tokens")

"""CPU emulation of tests/gpu/test_fp8_gpu.py's FP8-against-bf16 comparison: the embedded
SmolLM2 in bf16 against its FP8 self through the FP8 reference paths (weights quantized at
load, activations quantized per tensor or per token, then dequantize-then-matmul), the same 16
prompts, greedy, top-20 logprobs. The engine refuses FP8 on the CPU; this lifts that check for
the model runner only. It tells a kernel bug (the GPU diverges, the reference does not) from
the model's own FP8 precision (both diverge at the same step).

Names: a `--quantization` value (`ptpc_fp8`, `fp8`), `kv` (`--kv-cache-dtype fp8`) or
`fp8+kv` (both, the GPU test's `test_fp8_weights_and_kv_cache_together`). The FP8 cache runs
on the torch attention backend (the CPU one has none), which writes `key / k_scale` rounded to
e4m3 and reads it back widened; its bf16 reference runs on the same backend.

    PYTHONPATH=. python scripts/fp8_cpu_emulation.py ptpc_fp8 fp8 kv fp8+kv
"""

from __future__ import annotations

import sys
from typing import Any

import tandem.worker.model_runner as runner_module
from tandem import LLM, SamplingParams
from tandem.layers import quantization
from tests.gpu.test_fp8_gpu import _TOPICS, NEW_TOKENS, _in_top5, _top

_resolve = quantization.resolve_quant_config


def _resolve_anywhere(name: str, hf: Any, device: Any, **kwargs: Any) -> Any:
    return _resolve(name, hf, device, check_device=False)


def _engine_kwargs(name: str) -> dict[str, Any]:
    """The LLM arguments of one emulated configuration (module docstring)."""
    quant, _, kv = name.partition("+")
    if quant == "kv":
        quant, kv = "", "kv"
    kwargs: dict[str, Any] = {"quantization": quant} if quant else {}
    if kv:
        kwargs.update(kv_cache_dtype="fp8", attention_backend="torch")
    return kwargs


def _run(prompts: list[str], **kwargs: Any) -> list[Any]:
    with LLM(model="default", dtype="bfloat16", device="cpu", max_model_len=1024, **kwargs) as llm:
        params = SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=20
        )
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _compare(name: str, ref: list[Any], outs: list[Any]) -> None:
    identical, gaps, outside = 0, [], []
    for i, (a, b) in enumerate(zip(ref, outs, strict=True)):
        pairs = zip(a.token_ids, b.token_ids, strict=True)
        diff = next((j for j, (x, y) in enumerate(pairs) if x != y), None)
        for j in range(len(a.token_ids) if diff is None else diff):
            tok = a.token_ids[j]
            gaps.append(abs(a.logprobs[j][tok].logprob - b.logprobs[j][tok].logprob))
        if diff is None:
            identical += 1
            continue
        ta, tb = a.token_ids[diff], b.token_ids[diff]
        ok = _in_top5(ta, b.logprobs[diff]) and _in_top5(tb, a.logprobs[diff])
        in_a, in_b = a.logprobs[diff].get(tb), b.logprobs[diff].get(ta)
        print(f"{name} prompt {i} step {diff}: bf16 {ta}, {name} {tb}: "
              f"{'ok' if ok else 'OUTSIDE TOP 5'}")  # fmt: skip
        print(f"  {name}'s token in bf16 {in_a and round(in_a.logprob, 3)}, "
              f"bf16's in {name} {in_b and round(in_b.logprob, 3)}")  # fmt: skip
        print(f"  bf16 top {_top(a.logprobs[diff])}\n  {name} top {_top(b.logprobs[diff])}")
        if not ok:
            outside.append(i)
    print(f"{name}: {identical}/{len(ref)} identical, mean gap {sum(gaps) / max(len(gaps), 1):.4f}"
          f" over {len(gaps)} tokens, outside top 5 at prompts {outside}")  # fmt: skip


def main() -> None:
    runner_module.resolve_quant_config = _resolve_anywhere
    runner_module.check_fp8_device = lambda device, what: None
    prompts = [f"Write a short explanation of {t}." for t in _TOPICS[:16]]
    refs: dict[str | None, list[Any]] = {}  # bf16 references, by attention backend
    for name in sys.argv[1:] or ["ptpc_fp8", "fp8"]:
        kwargs = _engine_kwargs(name)
        backend = kwargs.get("attention_backend")
        if backend not in refs:
            refs[backend] = _run(prompts, **({"attention_backend": backend} if backend else {}))
        _compare(name, refs[backend], _run(prompts, **kwargs))


if __name__ == "__main__":
    main()

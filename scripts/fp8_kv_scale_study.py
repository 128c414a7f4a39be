"""How much a calibrated per-tensor scale would help the FP8 KV cache on the embedded SmolLM2:
each layer's K (after rotary) and V over tests/gpu/test_fp8_gpu.py's 16 prompts (bf16 on the
CPU, 8 new tokens each), their largest magnitudes, the share below e4m3's smallest normal
(2^-6, at scale 1.0), and the relative L2 error of rounding them to e4m3 at scale 1.0 (what
the engine uses without checkpoint scales) against amax / 448 (a calibrated scale).

    PYTHONPATH=. python scripts/fp8_kv_scale_study.py
"""

from __future__ import annotations

from typing import Any

import torch

from tandem import LLM, SamplingParams
from tandem.layers.attention import cpu_backend
from tests.gpu.test_fp8_gpu import _prompts

_seen: list[tuple[torch.Tensor, torch.Tensor]] = []
_attend = cpu_backend.CpuAttentionBackend.attend


def _recording_attend(self: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                      metadata: Any, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    n = metadata.num_actual_tokens
    _seen.append((key[:n].float().clone(), value[:n].float().clone()))
    return _attend(self, query, key, value, kv_cache, metadata, *args, **kwargs)


def _rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def main() -> None:
    cpu_backend.CpuAttentionBackend.attend = _recording_attend
    with LLM(model="default", dtype="bfloat16", device="cpu", max_model_len=1024) as llm:
        num_layers = llm.engine.config.model.hf_config.num_hidden_layers
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        llm.generate(_prompts(), params, use_tqdm=False)
    print("layer |K|max |V|max K<2^-6 V<2^-6 | K rel err s=1 / amax/448 | V, same")
    for layer in range(num_layers):
        calls = _seen[layer::num_layers]
        row: list[float] = []
        tensors = [torch.cat([c[i].flatten() for c in calls]) for i in (0, 1)]
        row += [t.abs().max().item() for t in tensors]
        row += [(t.abs() < 2**-6).float().mean().item() for t in tensors]
        for t in tensors:
            for scale in (1.0, t.abs().max().item() / 448):
                row.append(((_rounded(t, scale) - t).norm() / t.norm()).item())
        k_max, v_max, k_low, v_low, k1, kc, v1, vc = row
        print(
            f"{layer:5d} {k_max:6.2f} {v_max:6.3f} {k_low:6.3f} {v_low:6.3f} | "
            f"{k1:.4f} / {kc:.4f} | {v1:.4f} / {vc:.4f}"
        )


if __name__ == "__main__":
    main()

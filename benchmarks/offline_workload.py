"""What the offline benchmarks share: their random token-id prompts and the transformers peer
(`run_transformers`: one timed batched greedy `generate`)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(num)]


def run_transformers(
    model_path: Path,
    prompts: list[list[int]],
    output_len: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> dict[str, Any]:
    from tandem.models.presets import load_transformers_model

    model = load_transformers_model(model_path, dtype, device, seed)
    model.eval()
    max_len = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), max_len, dtype=torch.long)
    mask = torch.zeros(len(prompts), max_len, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, max_len - len(p) :] = torch.tensor(p)
        mask[i, max_len - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0
    )
    with torch.inference_mode():
        model.generate(
            ids[:2], attention_mask=mask[:2], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4}
        )
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    n_out = (out.shape[1] - max_len) * len(prompts)
    n_in = sum(len(p) for p in prompts)
    return {
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_out + n_in) / elapsed,
    }

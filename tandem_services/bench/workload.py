"""What `tandem bench serve` sends and when: prompts, output lengths and arrival times.

The random dataset follows vLLM's bench serve: input lengths uniform in
[floor(L * (1 - r)), floor(L * (1 + r))] for `--random-input-len L --random-range-ratio r`
(1000 and 0.5: 500..1500 tokens), output lengths the same way from `--random-output-len`,
token ids uniform over the vocabulary above the first 100 ids. Arrivals are a gamma process at
`rate` requests/s with shape `burstiness` (1: Poisson, exponential gaps). Everything is drawn
from `seed`, so two runs (or two systems) get the same prompts at the same offsets.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Workload:
    """One prompt (token ids) and one output length per request."""

    prompts: list[list[int]]
    output_lens: list[int]

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens):
            raise ValueError("one output length per prompt")

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    def subset(self, indices: list[int]) -> Workload:
        """The requests at `indices`, in that order."""
        return Workload([self.prompts[i] for i in indices], [self.output_lens[i] for i in indices])


def length_range(n: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive range the random dataset draws a length around `n` from."""
    return max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))


def random_workload(
    num: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int
) -> Workload:
    """`num` random token-id prompts of about `input_len` tokens, about `output_len` out."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def draw(n: int) -> int:
        return rng.randint(*length_range(n, range_ratio))

    prompts = [[rng.randrange(100, vocab) for _ in range(draw(input_len))] for _ in range(num)]
    return Workload(prompts, [draw(output_len) for _ in range(num)])


def file_workload(path: Path, tokenizer: Any, num: int, output_len: int, seed: int) -> Workload:
    """One prompt per line (.txt) or per JSON line with a "prompt" field (.jsonl)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    texts = [json.loads(ln)["prompt"] for ln in lines] if path.suffix == ".jsonl" else lines
    rng = random.Random(seed)
    chosen = [texts[rng.randrange(len(texts))] for _ in range(num)]
    prompts = [list(tokenizer(t, add_special_tokens=True).input_ids) for t in chosen]
    return Workload(prompts, [output_len] * num)


def arrival_times(num: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds from the start at which each request is sent: a gamma process of mean rate
    `rate`/s and shape `burstiness` (1.0: Poisson); all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be positive, got {rate}, {burstiness}")
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        # Shape 1 keeps the exponential draws (the schedules of earlier reports).
        if burstiness == 1.0:
            t += rng.expovariate(rate)
        else:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out

"""Model forward through the paged cache equals Hugging Face transformers on the same weights.

Several prompts of different lengths run as one flattened prefill with shuffled block ids;
each prompt's logits must match transformers run on that prompt alone. Then one decode step
(one token per request) through the cache must match transformers' logits at the next
position, and a chunked prefill mixed with decodes must too.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.layers.attention import get_attention_backend
from tandem.layers.quantization import resolve_quant_config
from tandem.loader import build_model, load_hf_config
from tandem.models.interface import ModelContext
from tests.conftest import build_attn_metadata

LOGPROB_TOL = 1e-4
BLOCK_SIZE = 16


def hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    return model.eval()


@torch.inference_mode()
def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Logprobs within LOGPROB_TOL for every token that could be sampled (logprob > -10);
    raw logits within fp32 noise everywhere (the far tail of a 49k vocab drifts ~1e-4)."""
    ours_lp, ref_lp = ours.log_softmax(-1), ref.log_softmax(-1)
    plausible = ref_lp > -10.0
    assert plausible.any(dim=-1).all()
    diff = (ours_lp - ref_lp).abs()[plausible].max().item()
    assert diff < LOGPROB_TOL, f"{what}: logprobs differ by {diff}"
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=5e-4, msg=what)


class PagedRun:
    """Drives a tandem model through steps over one paged KV cache with shuffled block ids."""

    def __init__(self, model: Any, max_tokens: list[int], seed: int) -> None:
        rng = random.Random(seed)
        needed = [-(-n // BLOCK_SIZE) for n in max_tokens]
        num_blocks = sum(needed) + 3
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        self.block_tables = []
        for n in needed:
            self.block_tables.append(ids[:n])
            ids = ids[n:]
        self.model = model
        self.kv = torch.zeros(
            num_blocks, model.num_layers, 2, BLOCK_SIZE, model.num_kv_heads, model.head_size
        )
        self.kv_views = [self.kv[:, i] for i in range(model.num_layers)]

    @torch.inference_mode()
    def step(self, chunks: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
        """Request r computes tokens `chunks[r]` at positions starts[r]...; logits per request."""
        query_lens = [len(c) for c in chunks]
        seq_lens = [s + len(c) for s, c in zip(starts, chunks, strict=True)]
        md = build_attn_metadata(query_lens, seq_lens, self.block_tables, BLOCK_SIZE)
        input_ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
        positions = torch.cat(
            [torch.arange(s, s + len(c)) for s, c in zip(starts, chunks, strict=True)]
        )
        hidden = self.model(input_ids, positions, self.kv_views, md)
        assert hidden.shape == (len(input_ids), self.model.hidden_size)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return list(logits.split(query_lens))


def build_cpu_model(path: Path, backend: str = "torch", max_model_len: int | None = None) -> Any:
    """The tandem model of `path`: fp32, CPU, one rank (the torch attention backend unless
    `backend` names another), built for `max_model_len` tokens (None: the config's), with
    the checkpoint's quantization config as the runner resolves it."""
    ctx = ModelContext.single(torch.float32, torch.device("cpu"), get_attention_backend(backend))
    quant = resolve_quant_config("auto", load_hf_config(path), torch.device("cpu"))
    return build_model(
        path, dataclasses.replace(ctx, max_model_len=max_model_len, quant_config=quant)
    )


def load_both(path: Path) -> tuple[Any, Any]:
    """(tandem model, transformers model) on the same folder, fp32, CPU."""
    return build_cpu_model(path), hf_model(path)


def check_prefill_then_decode(models: tuple[Any, Any], prompts: list[list[int]], seed: int) -> None:
    model, ref_model = models
    run = PagedRun(model, [len(p) + 1 for p in prompts], seed)

    prefill = run.step(prompts, [0] * len(prompts))
    next_tokens = []
    for i, (ours, ids) in enumerate(zip(prefill, prompts, strict=True)):
        assert_logits_close(ours, hf_logits(ref_model, ids), f"prefill of prompt {i}")
        next_tokens.append(int(ours[-1].argmax()))

    decode = run.step([[t] for t in next_tokens], [len(p) for p in prompts])
    for i, (ours, ids, tok) in enumerate(zip(decode, prompts, next_tokens, strict=True)):
        ref = hf_logits(ref_model, [*ids, tok])[-1:]
        assert_logits_close(ours, ref, f"decode of prompt {i}")


def check_chunked_prefill_mixed_with_decode(models: tuple[Any, Any], seed: int) -> None:
    """Step 1: A whole, B's first 7 tokens. Step 2: A decodes, B's next 20, C whole."""
    model, ref_model = models
    rng = random.Random(seed)
    vocab = model.vocab_size
    a, b, c = ([rng.randrange(3, vocab) for _ in range(n)] for n in (11, 27, 5))
    run = PagedRun(model, [len(a) + 1, len(b), len(c)], seed)
    first = run.step([a, b[:7], []], [0, 0, 0])
    assert_logits_close(first[0], hf_logits(ref_model, a), "A prefill")
    assert_logits_close(first[1], hf_logits(ref_model, b[:7]), "B chunk 1")
    tok = int(first[0][-1].argmax())
    second = run.step([[tok], b[7:], c], [len(a), 7, 0])
    assert_logits_close(second[0], hf_logits(ref_model, [*a, tok])[-1:], "A decode")
    assert_logits_close(second[1], hf_logits(ref_model, b)[7:], "B chunk 2")
    assert_logits_close(second[2], hf_logits(ref_model, c), "C prefill")


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        "llama3",
        "qwen2",
        "mistral",
        "qwen3",
        "qwen3_moe",
        "mixtral",
        "gemma3",
        "mistral_swa",
        "qwen2_swa",
        "phi3",
        "granite",
        "llama_yarn",
    ],
)
def test_tiny_model_prefill_and_decode_match_hf(arch: str, tiny_model_path) -> None:
    path = tiny_model_path(arch)
    prompts = random_prompts(512, [1, 5, 16, 17, 40, 100], seed=11)
    check_prefill_then_decode(load_both(path), prompts, seed=12)


@pytest.mark.parametrize(
    "arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3", "granite"]
)
def test_tiny_model_chunked_prefill_mixed_with_decode(arch: str, tiny_model_path) -> None:
    check_chunked_prefill_mixed_with_decode(load_both(tiny_model_path(arch)), seed=13)


@pytest.mark.parametrize("arch", ["phi3_longrope", "phi4_partial"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_phi3_longrope_takes_the_short_or_long_factors_by_the_context(
    backend: str, arch: str, tiny_model_path
) -> None:
    """Phi-3.5's LongRoPE against transformers, which takes the long factors once a forward
    call's last position passes the original 64-token context: an engine built for that
    context (short factors) matches on prompts within it, one built for the full 1,024
    (long factors) on prompts past it; the attention factor scales both. Phi-4-mini's
    partial rotary too (its q and k dims reordered at load for the full-head kernels)."""
    path = tiny_model_path(arch)
    ref = hf_model(path)
    short = build_cpu_model(path, backend, max_model_len=64)
    check_prefill_then_decode((short, ref), random_prompts(512, [1, 17, 40, 63], seed=21), seed=22)
    full = build_cpu_model(path, backend)
    check_prefill_then_decode((full, ref), random_prompts(512, [65, 100], seed=23), seed=24)
    # The two sets differ: the short-context engine is not transformers on a long prompt.
    long_prompt = random_prompts(512, [100], seed=23)[0]
    run = PagedRun(short, [len(long_prompt)], seed=25)
    ours = run.step([long_prompt], [0])[0]
    assert (ours - hf_logits(ref, long_prompt)).abs().max() > 1e-2


def test_qwen2_tiny_model_has_qkv_bias(tiny_model_path) -> None:
    model = build_cpu_model(tiny_model_path("qwen2"))
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.qkv_proj.bias.abs().sum() > 0
    assert attn.o_proj.bias is None
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.fixture(scope="module")
def smollm2_models(smollm2_path: Path) -> tuple[Any, Any]:
    return load_both(smollm2_path)


def test_smollm2_batch_prefill_and_decode_match_hf(smollm2_models, smollm2_tokenizer) -> None:
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        "Hi",
        "Write a short poem about the sea, the wind and the long grey evenings of "
        "November, when the boats come home and the harbour lights are lit one by one.",
    ]
    prompts = [smollm2_tokenizer(t).input_ids for t in texts]
    prompts.append(
        smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 2 + 2?"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    assert len({len(p) for p in prompts}) == len(prompts)
    check_prefill_then_decode(smollm2_models, prompts, seed=14)


def test_smollm2_chunked_prefill_mixed_with_decode(smollm2_models) -> None:
    check_chunked_prefill_mixed_with_decode(smollm2_models, seed=15)


@pytest.mark.parametrize(("arch", "windows"), [("mistral_swa", [8, 8]), ("qwen2_swa", [None, 8])])
def test_llama_family_sliding_windows(
    arch: str, windows: list[int | None], tiny_model_path
) -> None:
    """Parity above runs these past their windows; here: the windows each layer got."""
    model = build_cpu_model(tiny_model_path(arch))
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == windows

"""Speculative decoding with proposers that run a model (issue 29): the draft model and EAGLE.

- Draft model: greedy output with a tiny random Llama drafting for a different tiny random
  Llama is the output without speculation, with chunked prefill, forced preemption, prefix
  hits and async scheduling asked for (the n-gram tests' cases); a model drafting for itself
  has every draft accepted (tiny Llama: exactly; SmolLM2: > 0.9); seeded sampling reproduces;
  the pool is whole after each run (`run_engine`).
- Bad input: a draft of another vocabulary (both sizes named), another TP, k out of range.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tandem import LLM, SamplingParams
from tandem.config import ConfigError
from tandem.engine_args import EngineArgs
from tests.conftest import write_tiny_model
from tests.spec_decode_cases import (
    PARITY_CASES,
    SMOLLM2_CODE_ENGINE,
    SMOLLM2_CODE_PARAMS,
    SMOLLM2_CODE_PROMPT,
    parity_prompts,
    repetitive_prompts,
    run_engine,
)


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama of the fixture's shape and vocabulary, other weights."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-draft"), "llama", seed=7)


def _draft(model: Path | str, k: int = 3) -> dict[str, object]:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


def _parity_reference(greedy_reference: Any) -> list[list[int]]:
    """The tiny Llama's greedy tokens for parity_prompts(), 40 of them: the first 40 of the
    n-gram parity cases' 48-token reference (every request runs to max_tokens, so the first
    40 steps are those of a 40-token run)."""
    return [list(o.token_ids[:40]) for o in greedy_reference("llama", parity_prompts(), 48)]


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_greedy_with_a_draft_model_is_greedy_without(
    tiny_model_path, greedy_reference, other_llama: Path, case: str
) -> None:
    path = tiny_model_path("llama")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = _parity_reference(greedy_reference)
    extra = dict(PARITY_CASES[case])
    # The case's disable_by_batch_size, on the draft model.
    cap = extra.pop("speculative_config", {}).get("disable_by_batch_size", 0)
    spec_config = {**_draft(other_llama), "disable_by_batch_size": cap}
    got, stats = run_engine(path, parity_prompts(), params, speculative_config=spec_config, **extra)
    assert [list(o.token_ids) for o in got] == ref
    spec = stats.spec_decoding
    assert spec is not None and spec.num_draft_tokens > 0
    assert stats.async_scheduling == (extra.get("async_scheduling") == "on")
    assert stats.prefix_cache_hits > 0
    if "num_gpu_blocks" in extra:
        assert stats.num_preemptions > 0
    if case == "roomy":  # speculation off by batch size: the draft keeps its KV, drafts nothing
        off = {**_draft(other_llama), "disable_by_batch_size": 1}
        got, stats = run_engine(path, parity_prompts(), params, speculative_config=off, **extra)
        assert [list(o.token_ids) for o in got] == ref
        assert stats.spec_decoding is not None and stats.spec_decoding.num_draft_tokens == 0
    # The same model drafting for itself: every draft is the target's own greedy token.
    if case == "chunked":
        draft = _draft(path)
        got, stats = run_engine(path, parity_prompts(), params, speculative_config=draft, **extra)
        assert [list(o.token_ids) for o in got] == ref
        spec = stats.spec_decoding
        assert spec is not None and spec.num_draft_tokens > 100
        assert spec.num_accepted_tokens == spec.num_draft_tokens


def test_a_draft_that_keeps_failing_stops_drafting(
    tiny_model_path, greedy_reference, other_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another model's drafts are nearly always rejected: requests back off (the scheduler
    says so in `no_draft_req_ids`) and the proposer then runs no draft steps for them, only
    its KV catch-up; the tokens are the run without speculation's."""
    from tandem.spec_decode.model_proposer import ModelProposer

    path = tiny_model_path("llama")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = _parity_reference(greedy_reference)
    rows = {"sampled": 0, "drafted": 0}
    propose_step, draft = ModelProposer.propose_step, ModelProposer._draft

    def counting_step(self: Any, inp: Any, *args: Any) -> list[list[int]]:
        rows["sampled"] += len(inp.sampled_rows)
        return propose_step(self, inp, *args)

    def counting_draft(self: Any, sampled_rows: list[int], *args: Any) -> list[list[int]]:
        rows["drafted"] += len(sampled_rows)
        return draft(self, sampled_rows, *args)

    monkeypatch.setattr(ModelProposer, "propose_step", counting_step)
    monkeypatch.setattr(ModelProposer, "_draft", counting_draft)
    got, stats = run_engine(path, parity_prompts(), params, speculative_config=_draft(other_llama))
    assert [list(o.token_ids) for o in got] == ref
    spec = stats.spec_decoding
    assert spec is not None and spec.num_accepted_tokens < spec.num_draft_tokens / 4
    assert 0 < rows["drafted"] < rows["sampled"] / 2


def test_seeded_sampling_with_a_draft_model_reproduces(tiny_model_path, other_llama) -> None:
    """Sampling requests verify greedy drafts (q one-hot: the rejection sampler's exact
    rule for them) and reproduce run to run with their seeds."""
    path = tiny_model_path("llama")
    prompts = repetitive_prompts(512, 4)
    params = [
        SamplingParams(temperature=0.2, seed=i, max_tokens=24, ignore_eos=True) for i in range(4)
    ]
    spec = {**_draft(path, 2), "speculation_rule": "always"}  # see the n-gram test
    a, stats = run_engine(path, prompts, params, speculative_config=spec)
    b, _ = run_engine(path, prompts, params, speculative_config=spec)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 24 for o in a)
    spec = stats.spec_decoding
    assert spec is not None and spec.num_accepted_tokens > 0


def test_smollm2_drafting_for_itself_accepts_nearly_every_draft(
    smollm2_path, smollm2_code_reference
) -> None:
    spec = _draft(smollm2_path, 4)
    got, stats = run_engine(
        smollm2_path,
        [SMOLLM2_CODE_PROMPT],
        SMOLLM2_CODE_PARAMS,
        speculative_config=spec,
        **SMOLLM2_CODE_ENGINE,
    )
    assert got[0].token_ids == smollm2_code_reference.token_ids
    s = stats.spec_decoding
    assert s is not None and s.num_draft_tokens > 0
    assert s.acceptance_rate > 0.9


def test_bad_draft_models_are_refused(tiny_model_path, smollm2_path) -> None:
    path = tiny_model_path("llama")
    with pytest.raises(ConfigError, match="vocabulary of 49152 tokens, the target's has 512"):
        EngineArgs(model=str(path), speculative_config=_draft(smollm2_path)).create_engine_config()
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineArgs(model=str(path), speculative_config=_draft(path, 17)).create_engine_config()
    other_tp = {**_draft(path), "draft_tensor_parallel_size": 2}
    with pytest.raises(ConfigError, match="draft_tensor_parallel_size 2 differs"):
        LLM(model=str(path), device="cpu", num_gpu_blocks=16, speculative_config=other_tp)
    # The flag takes the same JSON.
    args = EngineArgs(model=str(path), speculative_config=json.dumps(_draft(path)))
    assert args.create_engine_config().speculative.method == "draft_model"


def test_draft_kv_cache_shares_the_block_budget(tiny_model_path, other_llama) -> None:
    """The draft's KV is sized from the same memory budget: a block id costs the target's
    bytes plus the draft's, so the pool holds fewer blocks than without a draft."""
    path = tiny_model_path("llama")
    kwargs = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.01, max_model_len=256)
    with LLM(model=str(path), **kwargs) as llm:
        plain = llm.engine.scheduler.kv_cache_manager.num_blocks
    with LLM(model=str(path), speculative_config=_draft(other_llama), **kwargs) as llm:
        shared = llm.engine.scheduler.kv_cache_manager.num_blocks
    assert shared == pytest.approx(plain / 2, abs=1)  # same shape: half the blocks each
    assert np.isfinite(shared)


# ---- EAGLE --------------------------------------------------------------------------------


def write_tiny_eagle_head(folder: Path, target: Path, seed: int = 0) -> Path:
    """An EAGLE-1 head for the tiny Llama `target` in the HF layout: config.json (one layer)
    and model.safetensors (fc with its bias, one decoder layer without input norm)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 1
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    h, inter = config["hidden_size"], config["intermediate_size"]
    hd = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {
        "fc.weight": (h, 2 * h),
        "fc.bias": (h,),
        "layers.0.self_attn.q_proj.weight": (q, h),
        "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h),
        "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.post_attention_layernorm.weight": (h,),
        "layers.0.mlp.gate_proj.weight": (inter, h),
        "layers.0.mlp.up_proj.weight": (inter, h),
        "layers.0.mlp.down_proj.weight": (h, inter),
    }
    gen = torch.Generator().manual_seed(seed)
    weights = {
        name: ("norm" in name) + 0.15 * torch.randn(shape, generator=gen)
        for name, shape in shapes.items()
    }
    save_file(weights, str(folder / "model.safetensors"))
    return folder


class EagleReference:
    """EAGLE-1 drafting from scratch in torch/transformers on the same weights: the target's
    hidden states of the whole sequence (transformers), the head as a one-layer transformers
    LlamaModel without its input and final norms, recomputed over every entry per draft."""

    def __init__(self, target: Path, head: Path) -> None:
        import torch
        import transformers
        from safetensors.torch import load_file

        self.torch = torch
        self.target = transformers.AutoModelForCausalLM.from_pretrained(
            target, dtype=torch.float32
        ).eval()
        weights = load_file(str(head / "model.safetensors"))
        config = transformers.AutoConfig.from_pretrained(head)
        self.head = transformers.LlamaModel(config).eval()
        self.head.layers[0].input_layernorm = torch.nn.Identity()
        self.head.norm = torch.nn.Identity()
        state = {k: v for k, v in weights.items() if k.startswith("layers.")}
        missing = self.head.load_state_dict(state, strict=False).missing_keys
        assert set(missing) == {"embed_tokens.weight"}
        self.fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size)
        self.fc.load_state_dict({"weight": weights["fc.weight"], "bias": weights["fc.bias"]})

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        torch = self.torch
        with torch.no_grad():
            ids = torch.tensor([tokens])
            hidden = self.target.model(ids).last_hidden_state[0]  # after the final norm
            embed = self.target.model.embed_tokens
            entries = self.fc(torch.cat([embed(ids[0, 1:]), hidden[:-1]], dim=-1))
            out: list[int] = []
            for _ in range(k):
                n = entries.shape[0]
                f = self.head(inputs_embeds=entries[None], position_ids=torch.arange(n)[None])
                last = f.last_hidden_state[0, -1]
                draft = int(self.target.lm_head(last).argmax())
                out.append(draft)
                step = self.fc(torch.cat([embed(torch.tensor([draft])), last[None]], dim=-1))
                entries = torch.cat([entries, step])
        return out


def test_eagle_head_drafts_as_its_reference_and_keeps_greedy_tokens(
    tiny_model_path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_model_path("llama")
    matched = check_eagle_drafts(path, tmp_path, monkeypatch, max_num_batched_tokens=12)
    assert matched == 1.0


def check_eagle_drafts(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **engine: object
) -> float:
    """A saved tiny EAGLE head in the HF layout loads and drafts, at every step, what the
    from-scratch reference drafts on the same tokens (returns the share of steps where it
    does): the target's hidden states reach the head for the accepted positions, and its KV
    cache follows the target's. A random head's drafts are all rejected, so the drafts
    handed to the scheduler are replaced by the target's own continuation with every third
    token wrong (the head's are still checked): verify steps accept some drafts and reject
    others. Greedy output equals the run without speculation (with chunked prefill the head
    catches up over every chunk)."""
    from tandem.spec_decode.eagle import EagleProposer

    head = write_tiny_eagle_head(tmp_path / "eagle", path)
    prompts = repetitive_prompts(512, 3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref, _ = run_engine(path, prompts, params, **engine)
    full = [[*p, *o.token_ids] for p, o in zip(prompts, ref, strict=True)]
    seen: list[tuple[list[int], list[int]]] = []
    propose_step = EagleProposer.propose_step

    def recording(self: Any, inp: Any, *args: Any) -> list[list[int]]:
        drafts = propose_step(self, inp, *args)
        handed = []
        for row, draft in zip(inp.sampled_rows, drafts, strict=True):
            tokens = list(inp.states[row].token_ids)
            whole = next(f for f in full if f[: len(tokens)] == tokens)
            # No drafts where max_tokens leaves no room for them (the scheduler drops them).
            assert bool(draft) == (len(tokens) < len(whole) - 1)
            seen.append((tokens, draft))
            truth = whole[len(tokens) :][:3]
            handed.append(
                [t if (len(tokens) + j) % 3 else (t + 1) % 512 for j, t in enumerate(truth)]
            )
        return handed

    monkeypatch.setattr(EagleProposer, "propose_step", recording)
    # Every step drafts (the rule that measures would skip some).
    spec = {
        "method": "eagle",
        "model": str(head),
        "num_speculative_tokens": 3,
        "speculation_rule": "always",
    }
    got, stats = run_engine(path, prompts, params, speculative_config=spec, **engine)
    monkeypatch.undo()
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    s = stats.spec_decoding
    assert s is not None and 0 < s.num_accepted_tokens < s.num_draft_tokens
    reference = EagleReference(path, head)
    seen = [(tokens, draft) for tokens, draft in seen if draft]
    assert len(seen) > 8
    same = [draft == reference.drafts(tokens, 3) for tokens, draft in seen]
    return sum(same) / len(same)


def test_random_eagle_head_of_the_8b_shape_builds(tmp_path: Path) -> None:
    """`random:eagle-llama-3.1-8b`: one decoder layer of the 8B's shape and fc, under the
    HF layout's names (the target's embedding and LM head are shared)."""
    import torch

    from tandem.loader import load_hf_config, resolve_model_path
    from tandem.spec_decode.eagle import random_eagle_weights

    folder = resolve_model_path("random:eagle-llama-3.1-8b", tmp_path)
    config = load_hf_config(folder)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (1, 4096, 128256)
    config.hidden_size, config.intermediate_size = 64, 128  # its names, at a small size
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 16
    names = {n for n, _ in random_eagle_weights(config, torch.float32, torch.device("cpu"))}
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n or "input_layernorm" in n for n in names)


def test_eagle_head_from_a_bin_with_its_own_embedding(
    tiny_model_path, greedy_reference, tmp_path: Path
) -> None:
    """A head published as pytorch_model.bin with its own `embed_tokens.weight` loads; the
    head's embedding is used (not the target's) and greedy tokens are unchanged."""
    import torch
    from safetensors.torch import load_file

    from tandem.spec_decode.eagle import EagleProposer

    path = tiny_model_path("llama")
    folder = write_tiny_eagle_head(tmp_path / "st", path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    weights["embed_tokens.weight"] = torch.randn(
        512, 64, generator=torch.Generator().manual_seed(3)
    )
    torch.save(weights, bin_dir / "pytorch_model.bin")
    prompts = repetitive_prompts(512, 2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {"method": "eagle", "model": str(bin_dir), "num_speculative_tokens": 2}
    ref = greedy_reference("llama", prompts, 12)
    kwargs = dict(device="cpu", dtype="float32", num_gpu_blocks=32, max_model_len=256)
    with LLM(model=str(path), speculative_config=spec, **kwargs) as llm:
        proposer = llm.engine.executor.driver_worker.model_runner.proposer
        assert isinstance(proposer, EagleProposer) and proposer.head is not None
        assert proposer.embed_tokens is proposer.head.embed_tokens
        got = llm.generate(prompts, params, use_tqdm=False)
        embed = proposer.head.embed_tokens.weight
        assert torch.equal(embed.cpu(), weights["embed_tokens.weight"])
    assert [o.outputs[0].token_ids for o in got] == [o.token_ids for o in ref]


def test_disaggregated_decode_with_a_draft_model(tiny_model_path, greedy_reference) -> None:
    """The decode worker speculates: prompt KV copied in from a prefill engine is the
    target's only, so the draft computes its own over those positions on the request's first
    step (`num_external_computed_tokens`). The tiny Llama drafting for itself then has every
    draft accepted, and the tokens are the unified engine's."""
    from tandem.request import EngineCoreRequest

    path = tiny_model_path("llama")
    kwargs = dict(device="cpu", dtype="float32", num_gpu_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = repetitive_prompts(512, 3)

    def drain(engine: Any) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens

    ref = greedy_reference("llama", prompts, 16)
    with (
        LLM(model=str(path), **kwargs) as prefill,
        LLM(model=str(path), speculative_config=_draft(path), **kwargs) as decode,
    ):
        pe, de = prefill.engine, decode.engine
        for i, p in enumerate(prompts):
            req = EngineCoreRequest(f"d{i}", p, params.clone(max_tokens=1))
            pe.add_request(req, hold_kv=True)
        first = drain(pe)
        for i, p in enumerate(prompts):
            rid = f"d{i}"
            dst, num_cached = de.reserve(EngineCoreRequest(rid, p, params))
            src = pe.get_held_block_ids(rid)
            num_blocks = -(-len(p) // pe.block_size)
            for s, d in list(zip(src, dst, strict=False))[num_cached // de.block_size : num_blocks]:
                de.kv_cache[d].copy_(pe.kv_cache[s])
            pe.release_held(rid)
            assert de.add_prefilled_request(rid, first[rid][0]) is None
        rest = drain(de)
        stats = de.stats().spec_decoding
        for engine in (pe, de):
            assert engine.scheduler.kv_cache_manager.block_pool.is_whole
    for i, o in enumerate(ref):
        assert first[f"d{i}"] + rest[f"d{i}"] == list(o.token_ids)
    assert stats is not None and stats.num_draft_tokens > 20
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_tensor_parallel_draft_model(tiny_model_path, greedy_reference) -> None:
    """TP = 2 (rank processes, gloo): the draft runs on every rank with the target's TP, its
    forwards' collectives in step order on every rank (also where nobody reads the step's
    result); the tiny Llama drafting for itself gives one rank's tokens, every draft
    accepted."""
    path = tiny_model_path("llama")
    prompts = repetitive_prompts(512, 3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = greedy_reference("llama", prompts, 16)
    spec = _draft(path)
    got, stats = run_engine(path, prompts, params, speculative_config=spec, tensor_parallel_size=2)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    s = stats.spec_decoding
    assert s is not None and s.num_draft_tokens > 20
    assert s.num_accepted_tokens == s.num_draft_tokens

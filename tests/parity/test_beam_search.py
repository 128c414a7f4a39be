"""`LLM.beam_search` (vLLM's) against transformers' beam search on the same weights: the same
beams, in the same order, with the same cumulative logprobs."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, BeamSearchParams, SamplingParams
from tandem.sampling_params import SamplingParamsError
from tests.parity.test_engine_parity import make_prompts

WIDTH = 3
NEW_TOKENS = 6


def test_beam_search_matches_transformers(tiny_model_path) -> None:
    """Beam width 3, six tokens, EOS ignored (transformers' reference has none): each
    prompt's three beams equal transformers' `num_beams=3` sequences, in order, cumulative
    logprobs within 1e-4; width 1 is greedy; the pool is whole after (every step's one-token
    requests ended); bad parameters are refused by name."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_path("llama")
    prompts = [p for p in make_prompts(256, seed=11) if 2 <= len(p) <= 40][:4]
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)

    hf = AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, local_files_only=True
    ).eval()
    hf.generation_config.eos_token_id = None
    for i, (ids, out) in enumerate(zip(prompts, outs, strict=True)):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                num_beams=WIDTH,
                num_return_sequences=WIDTH,
                do_sample=False,
                early_stopping=False,
                length_penalty=1.0,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        assert len(out.sequences) == WIDTH, f"prompt {i}"
        for rank, seq in enumerate(out.sequences):
            assert seq.tokens == ref.sequences[rank].tolist(), (i, rank)
            assert len(seq.logprobs) == NEW_TOKENS and seq.finish_reason == "length"
            # transformers' score: the beam's logprob sum over its generated length.
            score = ref.sequences_scores[rank].item() * NEW_TOKENS
            assert abs(seq.cum_logprob - score) < 1e-4, (i, rank)
            assert abs(sum(seq.logprobs) - seq.cum_logprob) < 1e-5

    greedy = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    one = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts],
        BeamSearchParams(beam_width=1, max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    for g, b in zip(greedy, one, strict=True):
        assert b.sequences[0].tokens[len(g.prompt_token_ids) :] == g.outputs[0].token_ids
    assert llm.engine.scheduler.kv_cache_manager.block_pool.is_whole
    for bad, name in (
        (dict(beam_width=0, max_tokens=2), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=2, temperature=0.5), "temperature"),
    ):
        with pytest.raises(SamplingParamsError, match=name):
            BeamSearchParams(**bad)
    with pytest.raises(SamplingParamsError, match="beam_width"):
        llm.beam_search([1, 2], BeamSearchParams(beam_width=11, max_tokens=2))
    llm.shutdown()

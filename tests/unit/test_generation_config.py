"""Default sampling parameters from a model's generation_config.json (vLLM's
`--generation-config`): read from the folder (auto), another folder, or not at all (vllm);
filled in for the fields a request leaves out on both HTTP endpoints and gRPC, and by the
offline `LLM` when given no SamplingParams."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.loader import sampling_defaults
from tandem_protos.v1 import common_pb2, frontend_pb2
from tandem_services.frontend.config import config_from_args
from tandem_services.frontend.grpc_api import parse_generate
from tandem_services.frontend.limits import RequestLimits
from tandem_services.frontend.openai_protocol import parse_chat, parse_completion

STORED = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "do_sample": True,
    "eos_token_id": 2,
    "max_new_tokens": 300,
}


def _folder(path: Path, stored: dict[str, object]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(stored))
    return path


def test_defaults_are_read_from_the_folder_another_folder_or_not_at_all(tmp_path: Path) -> None:
    model = _folder(tmp_path / "model", STORED)
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 300}
    assert sampling_defaults(model) == want
    assert sampling_defaults(model, "vllm") == {}
    other = _folder(tmp_path / "other", {"repetition_penalty": 1.1, "min_p": 0.05})
    assert sampling_defaults(model, str(other)) == {"repetition_penalty": 1.1, "min_p": 0.05}
    assert sampling_defaults(tmp_path / "nothing-here") == {}
    with pytest.raises(ValueError, match="is not a folder"):
        sampling_defaults(model, str(tmp_path / "missing"))
    bad = _folder(tmp_path / "bad", {"temperature": "hot"})
    with pytest.raises(ValueError, match="temperature 'hot' is not a number"):
        sampling_defaults(bad)
    zero = _folder(tmp_path / "zero", {"max_new_tokens": 0})
    with pytest.raises(ValueError, match="max_new_tokens 0 is not a positive integer"):
        sampling_defaults(zero)


def test_requests_take_the_defaults_for_what_they_leave_out() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, defaults=defaults)
    p = chat.params
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)
    given = parse_chat(
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "top_k": 3},
        defaults=defaults,
    ).params
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 0.95, 3)
    completion = parse_completion({"prompt": "hi", "top_p": 0.5}, defaults=defaults).params
    assert (completion.temperature, completion.top_p) == (0.6, 0.5)
    plain = parse_completion({"prompt": "hi"}).params
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, -1)
    request = frontend_pb2.GenerateRequest(
        text="hi", sampling_params=common_pb2.SamplingParams(top_p=0.5)
    )
    generate = parse_generate(request, RequestLimits(), defaults).params
    assert (generate.temperature, generate.top_p, generate.top_k) == (0.6, 0.5, 20)


def test_frontend_flag() -> None:
    assert config_from_args(["--frontend-id", "f"]).generation_config == "auto"
    config = config_from_args(["--frontend-id", "f", "--generation-config", "vllm"])
    assert config.generation_config == "vllm"


def test_offline_llm_uses_the_models_defaults_without_params(tiny_model_path, tmp_path) -> None:
    """A tiny model whose generation_config.json says temperature 0: `generate` without
    SamplingParams is greedy (the same tokens as an explicit greedy request); with
    generation_config="vllm" SamplingParams' own defaults apply."""
    src = tiny_model_path("llama")
    model = tmp_path / "model"
    model.mkdir()
    for f in src.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    _folder(model, {"temperature": 0.0, "top_k": 7, "max_new_tokens": 9})
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with LLM(model=str(model), device="cpu", num_gpu_blocks=64) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 7, 9)
        unset = llm.generate(prompts, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in unset] == [9, 9]
        greedy = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=9), use_tqdm=False
        )
        assert [o.outputs[0].token_ids for o in unset] == [o.outputs[0].token_ids for o in greedy]
    with LLM(model=str(model), device="cpu", num_gpu_blocks=64, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params().temperature == 1.0

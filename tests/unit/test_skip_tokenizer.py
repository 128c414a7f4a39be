"""Models without tokenizers: `skip_tokenizer_init` runs token-id prompts from a folder with no
tokenizer files and refuses text prompts clearly; random presets get their stand-in id
tokenizer on first use (what `tandem serve --model random:<shape>` needs); a folder without a
tokenizer is refused in one line naming the fix, by the loader and by `tandem serve`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.core import InvalidRequestError
from tandem.loader import (
    TokenizerNotFoundError,
    has_tokenizer_files,
    load_tokenizer,
    prepare_tokenizer,
)
from tandem.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def no_tokenizer_folder(tiny_model_path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("no-tokenizer")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_model_path("qwen3") / name, folder / name)
    assert not has_tokenizer_files(folder)
    return folder


def test_skip_tokenizer_init_runs_token_ids_and_refuses_text(no_tokenizer_folder: Path) -> None:
    llm = LLM(
        model=str(no_tokenizer_folder),
        skip_tokenizer_init=True,
        dtype="float32",
        device="cpu",
        num_gpu_blocks=16,
        max_model_len=128,
        max_num_batched_tokens=128,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        with pytest.raises(InvalidRequestError, match=r"skip_tokenizer_init is set.*token ids"):
            llm.generate("hello", params, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="chat needs a tokenizer"):
            llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)
        grammar = SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+")
        )
        with pytest.raises(InvalidRequestError, match=r"structured_outputs need.*skip_tokenizer"):
            llm.generate([[5, 6]], grammar, use_tqdm=False)
    finally:
        llm.shutdown()


def test_a_folder_without_tokenizer_is_refused_in_one_line(no_tokenizer_folder: Path) -> None:
    with pytest.raises(TokenizerNotFoundError, match="--skip-tokenizer-init") as info:
        load_tokenizer(no_tokenizer_folder)
    assert "\n" not in str(info.value)
    with pytest.raises(TokenizerNotFoundError, match="no tokenizer files"):
        prepare_tokenizer(str(no_tokenizer_folder))


def test_tandem_serve_refuses_a_folder_without_tokenizer(
    no_tokenizer_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem_services.launcher.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(no_tokenizer_folder)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "has no tokenizer files" in err[-1]


def test_random_preset_gets_its_id_tokenizer_on_first_use(tmp_path: Path) -> None:
    from tandem.loader import resolve_model_path

    folder = resolve_model_path("random:qwen3-8b", tmp_path)
    assert not has_tokenizer_files(folder)
    tok = load_tokenizer(folder)  # what the frontend calls
    assert len(tok) == 151936
    assert tok.decode([5, 151935]) == "t5 t151935"
    mtime = (folder / "tokenizer.json").stat().st_mtime_ns
    prepare_tokenizer("random:qwen3-8b", tmp_path)  # what `tandem serve` calls: kept
    assert (folder / "tokenizer.json").stat().st_mtime_ns == mtime

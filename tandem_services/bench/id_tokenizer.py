"""A stand-in tokenizer for `random:<shape>` models, so that `tandem serve` and
`tandem bench serve` run them with no download: token i is the word `t<i>` (a WordLevel
tokenizer over the model's whole vocabulary, split on whitespace). Benchmarks send token ids,
so the only text it makes is the detokenized output ("t17 t4 ..."), which nobody reads.

    python -m tandem_services.bench.id_tokenizer random:llama-3.2-1b  # writes into the model folder
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "model_max_length": 1 << 20,
    "unk_token": "t0",
    "clean_up_tokenization_spaces": False,
}


def write_id_tokenizer(folder: Path, vocab_size: int) -> Path:
    """Write tokenizer.json and tokenizer_config.json into `folder` (kept if already there
    for this vocabulary size); returns the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = folder / "tokenizer.json"
    marker = folder / "ID_TOKENIZER"
    if path.is_file() and marker.is_file() and marker.read_text().strip() == str(vocab_size):
        return folder
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, "t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    marker.write_text(f"{vocab_size}\n")
    return folder


def main(argv: list[str] | None = None) -> int:
    from tandem.config import add_engine_args
    from tandem.loader import load_hf_config, resolve_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="random:<shape>")
    # The engine's --cache-dir (TANDEM_CACHE_DIR): the folder the workers resolve the model in.
    add_engine_args(p, only=("cache_dir",))
    ns = p.parse_args(argv)
    if not ns.model.startswith("random:"):
        p.error("only random:<shape> models get a stand-in tokenizer")
    folder = resolve_model_path(ns.model, ns.cache_dir or None)
    vocab = int(load_hf_config(folder).vocab_size)
    write_id_tokenizer(folder, vocab)
    print(f"id tokenizer ({vocab} tokens) in {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

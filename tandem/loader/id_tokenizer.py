"""A stand-in tokenizer for `random:<shape>` models, so that `tandem serve` and
`tandem bench serve` run them with no download: token i is the word `t<i>` (a WordLevel
tokenizer over the model's whole vocabulary, split on whitespace). Benchmarks send token ids,
so the only text it makes is the detokenized output ("t17 t4 ..."), which nobody reads.

`load_tokenizer` makes it in a random-weight folder on first use; `python -m
tandem_services.bench.id_tokenizer random:<shape>` makes it ahead of time.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "model_max_length": 1 << 20,
    "unk_token": "t0",
    "clean_up_tokenization_spaces": False,
}
MARKER = "ID_TOKENIZER"


def has_id_tokenizer(folder: Path, vocab_size: int) -> bool:
    marker = folder / MARKER
    return (
        (folder / "tokenizer.json").is_file()
        and marker.is_file()
        and marker.read_text().strip() == str(vocab_size)
    )


def write_id_tokenizer(folder: Path, vocab_size: int) -> Path:
    """Write tokenizer.json and tokenizer_config.json into `folder` (kept if already there
    for this vocabulary size); returns the folder. Each file is replaced atomically, so
    processes making it at once (a frontend and a benchmark) never read a partial one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = Path(folder)
    if has_id_tokenizer(folder, vocab_size):
        return folder
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, "t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    _write_atomic(folder / "tokenizer.json", tokenizer.to_str())
    _write_atomic(folder / "tokenizer_config.json", json.dumps(TOKENIZER_CONFIG, indent=2))
    _write_atomic(folder / MARKER, f"{vocab_size}\n")
    return folder


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

"""Make the stand-in tokenizer of a `random:<shape>` model ahead of time
(tandem.loader.id_tokenizer; `tandem serve` also makes it on first use).

    python -m tandem_services.bench.id_tokenizer random:llama-3.2-1b  # writes into the model folder
"""

from __future__ import annotations

import argparse

from tandem.loader.id_tokenizer import write_id_tokenizer


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

"""The stand-in tokenizer for random:<shape> models loads through the same path as a real one
(`load_tokenizer`) and maps token i <-> "t<i>"."""

from __future__ import annotations

from pathlib import Path

from tandem.loader import load_tokenizer
from tandem.loader.id_tokenizer import write_id_tokenizer


def test_id_tokenizer_round_trip(tmp_path: Path) -> None:
    write_id_tokenizer(tmp_path, 100)
    tok = load_tokenizer(tmp_path)
    assert len(tok) == 100
    assert tok.decode([5, 17, 99]) == "t5 t17 t99"
    assert tok("t3 t9 t42", add_special_tokens=True).input_ids == [3, 9, 42]
    mtime = (tmp_path / "tokenizer.json").stat().st_mtime_ns
    write_id_tokenizer(tmp_path, 100)  # same vocabulary: kept
    assert (tmp_path / "tokenizer.json").stat().st_mtime_ns == mtime

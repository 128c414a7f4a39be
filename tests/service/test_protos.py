"""The committed stubs in tandem_protos/ match what scripts/gen_protos.py makes from protos/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gen_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stubs_not_stale() -> None:
    problems = _gen_module().stale_files(ROOT / "tandem_protos")
    assert not problems, "run `python scripts/gen_protos.py`:\n" + "\n".join(problems)


def test_stale_check_sees_an_edit(tmp_path: Path) -> None:
    gen = _gen_module()
    out = tmp_path / "tandem_protos"
    gen.generate(out)
    assert gen.stale_files(out) == []
    worker = out / "v1" / "worker_pb2.pyi"
    worker.write_text(worker.read_text() + "\n# hand edit\n")
    (out / "v1" / "extra_pb2.py").write_text("")
    problems = gen.stale_files(out)
    assert any(p.startswith("stale: v1/worker_pb2.pyi") for p in problems)
    assert "not generated from any proto: v1/extra_pb2.py" in problems


def test_stub_imports_are_package_relative() -> None:
    from tandem_protos.v1 import scheduler_pb2, worker_pb2

    run = worker_pb2.KVBlockRun(request_id="r", first_block_id=3, num_blocks=2, data=b"xy")
    assert worker_pb2.KVBlockRun.FromString(run.SerializeToString()) == run
    field = scheduler_pb2.SubmitRequest.DESCRIPTOR.fields_by_name["request"]
    assert field.message_type.full_name == "tandem.v1.EngineRequest"

"""The house rules on imports, checked on the source: `tandem/` never imports `tandem_services/`
and speaks no gRPC, protobuf or Redis, a service never imports another service,
`tandem_kernels/` imports only torch and triton (and the standard library), `tandem/config.py`
imports no other part of tandem."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {p.name for p in (ROOT / "tandem_services").iterdir() if (p / "__init__.py").exists()}
# Shared service code (the prefix-cache directory among it) and the programs that start
# services (by design they import them).
SHARED = {"common", "directory", "worker", "launcher", "bench"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_tandem_never_imports_services() -> None:
    offenders = {
        str(p.relative_to(ROOT)): sorted(
            n for n in _imports(p) if n.split(".")[0] == "tandem_services"
        )
        for p in (ROOT / "tandem").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_tandem_knows_no_grpc_protos_or_redis() -> None:
    """The engine library is transport-free: channels, protos and the Redis directory are the
    services' (`tandem_services/common/channels.py`, `tandem_services/directory/`)."""
    wire = ("grpc", "grpc_health", "tandem_protos", "redis")
    offenders = {
        str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.split(".")[0] in wire)
        for p in (ROOT / "tandem").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_a_service_never_imports_another_service() -> None:
    bad: dict[str, list[str]] = {}
    for name in SERVICES - SHARED:
        for p in (ROOT / "tandem_services" / name).rglob("*.py"):
            others = sorted(
                n
                for n in _imports(p)
                if n.split(".")[0] == "tandem_services"
                and len(n.split(".")) > 1
                and n.split(".")[1] not in SHARED | {name}
            )
            if others:
                bad[str(p.relative_to(ROOT))] = others
    assert bad == {}


def test_kernels_import_only_torch_and_triton() -> None:
    allowed = {"torch", "triton", "tandem_kernels", "__future__", *sys.stdlib_module_names}
    bad = {
        str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.split(".")[0] not in allowed)
        for p in (ROOT / "tandem_kernels").rglob("*.py")
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_kv_transfer_knows_no_grpc_and_no_protos() -> None:
    """The byte movers stay transport-free: the hand-off session protocol (ConnectKV, WriteKV,
    ReceiveKV) lives in the worker service. Catches imports inside functions too."""
    offenders = {
        str(p.relative_to(ROOT)): sorted(
            n for n in _imports(p) if n.split(".")[0] in ("grpc", "grpc_health", "tandem_protos")
        )
        for p in (ROOT / "tandem" / "kv_transfer").rglob("*.py")
    }
    assert offenders, "no modules found under tandem/kv_transfer"
    assert {k: v for k, v in offenders.items() if v} == {}


def test_distributed_imports_nothing_above_it() -> None:
    """`tandem/distributed` sits below layers, models, workers and executors: of tandem it
    imports only itself."""
    offenders = {
        str(p.relative_to(ROOT)): sorted(
            n
            for n in _imports(p)
            if n.split(".")[0] == "tandem" and not n.startswith("tandem.distributed")
        )
        for p in (ROOT / "tandem" / "distributed").rglob("*.py")
    }
    assert offenders, "no modules found under tandem/distributed"
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_model_names_an_attention_backend() -> None:
    """Models build `tandem.layers.attention.Attention` layers; the backend is the runner's
    choice (`ModelContext.attn_backend`), never imported by a model."""
    backends = {
        f"tandem.layers.attention.{p.stem}"
        for p in (ROOT / "tandem" / "layers" / "attention").glob("*_backend.py")
    }
    assert backends, "no attention backend modules found"
    offenders = {
        str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n in backends)
        for p in (ROOT / "tandem" / "models").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_config_is_plain_data() -> None:
    """`tandem/config.py` imports no other part of tandem (lazily neither): the resolution that
    reads a checkpoint lives in `tandem/loader/resolve.py`, `EngineArgs` in
    `tandem/engine_args.py`, so no layer that reads its config imports its own loader back."""
    names = _imports(ROOT / "tandem" / "config.py")
    assert sorted(n for n in names if n.split(".")[0] in ("tandem", "tandem_kernels")) == []

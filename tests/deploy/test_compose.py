"""compose.yaml, compose.cpu.yaml, the Dockerfile and the container entry point, checked
without a Docker engine: the files parse as compose reads them, every command is a real
entry point that accepts its flags, and the image is built the way the deployment needs."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem_services.common.entrypoint import SERVICES, GpuSlotError, claim_gpu, reachable_address
from tests.deploy.compose_local import (
    COMPOSE_FILES,
    CPU_COMPOSE_FILES,
    ROOT,
    ComposeError,
    interpolate,
    load_compose,
    local_service,
    variables,
)

TANDEM_SERVICES = ("scheduler", "frontend", "prefill", "decode")
WORKERS = ("prefill", "decode")


def test_compose_has_the_topology() -> None:
    services = load_compose()["services"]
    assert set(services) == {"redis", *TANDEM_SERVICES}
    assert services["scheduler"]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name in ("frontend", *WORKERS):
        assert services[name]["depends_on"]["scheduler"]["condition"] == "service_healthy"
        assert "model-cache:/cache" in services[name]["volumes"]
    assert "model-cache" in load_compose()["volumes"]
    assert services["prefill"]["command"][0] == "prefill-worker"
    assert services["decode"]["command"][0] == "decode-worker"


def test_every_variable_has_a_default() -> None:
    """With nothing set, every file interpolates (a variable without a default raises)."""
    for files in (COMPOSE_FILES, CPU_COMPOSE_FILES):
        load_compose(files, {})
    with pytest.raises(ComposeError):
        interpolate("${NOT_SET}", {})
    assert interpolate("a$${B}${C:-c}${D-d}", {"D": ""}) == "a${B}c"


def test_pool_sizes_gpus_model_and_ports_come_from_variables() -> None:
    env = {
        "PREFILL_REPLICAS": "3",
        "DECODE_REPLICAS": "5",
        "PREFILL_GPUS": "0,1,2",
        "DECODE_GPUS": "3,4,5,6,7",
        "MODEL": "/cache/models/llama",
        "HTTP_PORT": "18000",
        "SCHEDULER_PORT": "15050",
    }
    services = load_compose(COMPOSE_FILES, env)["services"]
    for role, replicas, gpus in (("prefill", "3", "0,1,2"), ("decode", "5", "3,4,5,6,7")):
        deploy = services[role]["deploy"]
        assert deploy["replicas"] == replicas
        (device,) = deploy["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "device_ids": [gpus], "capabilities": ["gpu"]}
        command = services[role]["command"]
        assert command[command.index("--model") + 1] == "/cache/models/llama"
        assert command[command.index("--scheduler") + 1] == "scheduler:15050"
        # Replicas share the pool's GPUs and claim one each through the shared lock dir.
        assert "gpu-slots:/run/tandem/gpu-slots" in services[role]["volumes"]
        assert services[role]["environment"]["TANDEM_GPU_SLOT_DIR"] == "/run/tandem/gpu-slots"
    assert services["frontend"]["ports"][0] == "18000:8000"
    assert (
        services["scheduler"]["command"][services["scheduler"]["command"].index("--port") + 1]
        == "15050"
    )


def test_cpu_override_drops_gpu_reservations_and_builds_the_cpu_image() -> None:
    gpu = load_compose(COMPOSE_FILES)["services"]
    cpu = load_compose(CPU_COMPOSE_FILES)["services"]
    for role in WORKERS:
        assert gpu[role]["deploy"]["resources"]["reservations"]["devices"]
        assert "devices" not in cpu[role]["deploy"]["resources"]["reservations"]
        assert cpu[role]["command"] == gpu[role]["command"]
    for name in TANDEM_SERVICES:
        # Debian 12: its Python 3.11 fits the cp311 CPU wheels.
        assert cpu[name]["build"]["args"]["BASE_IMAGE"] == "debian:bookworm-slim"
        assert "cpu" in cpu[name]["build"]["args"]["TORCH_INDEX_URL"]
        assert cpu[name]["image"] == "tandem:cpu"
        assert "nvidia/cuda" in gpu[name]["build"]["args"]["BASE_IMAGE"]


def test_health_checks_probe_grpc_health_on_each_services_port() -> None:
    env = {"SCHEDULER_PORT": "1001", "WORKER_PORT": "1002", "FRONTEND_GRPC_PORT": "1003"}
    for name, port_flag in (
        ("scheduler", "--port"),
        ("prefill", "--port"),
        ("decode", "--port"),
        ("frontend", "--grpc-port"),
    ):
        local = local_service(COMPOSE_FILES, name, 0, env)
        assert local.healthcheck[1:4] == ["-m", "tandem_services.common.entrypoint", "health"]
        port = local.argv[local.argv.index(port_flag) + 1]
        assert local.healthcheck[4] == f"127.0.0.1:{port}"


@functools.cache
def help_flags() -> dict[str, set[str]]:
    """Per service command, the flags `entrypoint <command> --help` (the image's entry point)
    lists; the four start at once."""
    procs = {
        command: subprocess.Popen(
            [sys.executable, "-m", "tandem_services.common.entrypoint", command, "--help"],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for command in SERVICES
    }
    flags = {}
    for command, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, command
        flags[command] = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out))
    return flags


@pytest.mark.parametrize("files", [COMPOSE_FILES, CPU_COMPOSE_FILES], ids=["gpu", "cpu"])
def test_every_command_is_an_entry_point_that_accepts_its_flags(files: tuple[Path, ...]) -> None:
    services = load_compose(files)["services"]
    for name in TANDEM_SERVICES:
        command = [str(a) for a in services[name]["command"]]
        assert command[0] in SERVICES, f"{name}: {command[0]} is not an entry point command"
        known = help_flags()[command[0]]
        used = {a for a in command[1:] if a.startswith("--")}
        assert used and used <= known, f"{name}: unknown flags {used - known}"
        # And the service's own parser takes the whole command (types included).
        module = SERVICES[command[0]]
        if module == "tandem_services.scheduler":
            from tandem_services.scheduler.config import build_parser

            build_parser().parse_args(command[1:])
        elif module == "tandem_services.frontend":
            from tandem_services.frontend.config import build_parser as frontend_parser

            frontend_parser().parse_args(command[1:])
        else:
            from tandem_services.worker.config import build_parser as worker_parser

            worker_parser(module.split(".")[1], name).parse_args(command[1:])  # type: ignore[arg-type]


def test_unknown_flag_is_refused() -> None:
    """The check above can fail: a service refuses a flag it does not have."""
    proc = subprocess.run(
        [sys.executable, "-m", "tandem_services.common.entrypoint", "scheduler", "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "--no-such-flag" in proc.stderr


def test_compose_variables_are_documented_in_a_comment_or_used_consistently() -> None:
    names = variables(COMPOSE_FILES)
    for required in ("MODEL", "PREFILL_REPLICAS", "DECODE_REPLICAS", "PREFILL_GPUS", "DECODE_GPUS"):
        assert required in names
    assert {"HTTP_PORT", "GRPC_PORT", "SCHEDULER_PORT", "WORKER_PORT", "METRICS_PORT"} <= names


# ----------------------------------------------------------------------------- Dockerfile


def dockerfile_lines() -> list[str]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_dockerfile_one_image_cuda_base_non_root_cache_volume() -> None:
    lines = dockerfile_lines()
    base = next(line for line in lines if line.startswith("ARG BASE_IMAGE="))
    assert base.split("=", 1)[1].startswith("nvidia/cuda:")
    # The runtime stage (the last FROM) runs as a non-root user.
    last_from = max(i for i, line in enumerate(lines) if line.startswith("FROM "))
    user = [line for line in lines[last_from:] if line.startswith("USER ")]
    assert user and user[-1].split()[1].split(":")[0] not in ("0", "root")
    assert 'VOLUME ["/cache"]' in lines
    env = " ".join(line for line in lines if line.startswith("ENV "))
    assert "TANDEM_CACHE_DIR=/cache/" in env and "HF_HOME=/cache/" in env
    entry = json.loads(next(line for line in lines if line.startswith("ENTRYPOINT "))[11:])
    assert entry == ["python", "-m", "tandem_services.common.entrypoint"]
    cmd = json.loads(next(line for line in lines if line.startswith("CMD "))[4:])
    assert cmd[0] == "serve"


def test_dockerfile_copies_every_package_and_nothing_ignored() -> None:
    lines = dockerfile_lines()
    copied = {
        line.split()[1] for line in lines if line.startswith("COPY ") and "--from=" not in line
    } | {
        src
        for line in lines
        if line.startswith("COPY ") and "--from=" not in line
        for src in line.split()[1:-1]
    }
    for package in (
        "tandem",
        "tandem_kernels",
        "tandem_services",
        "tandem_protos",
        "pyproject.toml",
    ):
        assert package in copied, package
        assert (ROOT / package).exists()
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "tests"} <= ignored
    assert not copied & ignored


# ----------------------------------------------------------------------------- entrypoint


_HOLD = """
import sys, time
from pathlib import Path
from tandem_services.common.entrypoint import claim_gpu
claim = claim_gpu(sys.argv[2].split(","), Path(sys.argv[1]), float(sys.argv[3]))
print(claim.device_id, flush=True)
time.sleep(60)
"""


def hold(slot_dir: Path, ids: str, wait_s: float = 0.0) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(slot_dir), ids, str(wait_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def test_replicas_claim_different_gpus_and_a_dead_ones_gpu_frees_up(tmp_path: Path) -> None:
    a = hold(tmp_path, "GPU-a,GPU-b")
    b = hold(tmp_path, "GPU-a,GPU-b")
    try:
        assert a.stdout is not None and b.stdout is not None
        got = {a.stdout.readline().strip(), b.stdout.readline().strip()}
        assert got == {"GPU-a", "GPU-b"}
        # A third replica finds none free.
        with pytest.raises(GpuSlotError):
            claim_gpu(["GPU-a", "GPU-b"], tmp_path, wait_s=0.0)
        # One dies: a waiting replica gets its GPU.
        c = hold(tmp_path, "GPU-a,GPU-b", wait_s=30.0)
        time.sleep(0.5)
        a.kill()
        a.wait()
        assert c.stdout is not None
        assert c.stdout.readline().strip() in got
        c.kill()
        c.wait()
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_wildcard_bind_advertises_an_address_others_can_dial() -> None:
    import socket

    assert reachable_address("10.1.2.3", 5) == "10.1.2.3:5"
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        address = reachable_address("0.0.0.0", server.getsockname()[1])
        host, port = address.rsplit(":", 1)
        assert host not in ("0.0.0.0", "")
        with socket.create_connection((host, int(port)), timeout=5):
            pass


def test_health_probe_fails_on_nothing_listening() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [
            sys.executable, "-m", "tandem_services.common.entrypoint", "health",
            f"127.0.0.1:{port}", "--timeout-s", "1",
        ],
        capture_output=True,
        timeout=60,
        cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 1


# ----------------------------------------------------------------------------- TLS


def test_compose_tls_override_mounts_the_certificates_in_every_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """compose.tls.yaml: every tandem service mounts the three secrets, and the environment
    it sets names them where each service's parser (and the health check) reads its flags."""
    files = (*COMPOSE_FILES, ROOT / "compose.tls.yaml")
    model = load_compose(files, {"TLS_DIR": "/etc/tandem-certs"})
    secrets = model["secrets"]
    assert {s["file"] for s in secrets.values()} == {
        "/etc/tandem-certs/tls.crt", "/etc/tandem-certs/tls.key", "/etc/tandem-certs/ca.crt",
    }  # fmt: skip
    from tandem_services.frontend.config import build_parser as frontend_parser
    from tandem_services.scheduler.config import build_parser as scheduler_parser
    from tandem_services.worker.config import build_parser as worker_parser

    parsers = {
        "scheduler": scheduler_parser,
        "frontend": frontend_parser,
        "prefill": lambda: worker_parser("prefill_worker", "prefill"),
        "decode": lambda: worker_parser("decode_worker", "decode"),
    }
    for name in TANDEM_SERVICES:
        svc = model["services"][name]
        assert set(svc["secrets"]) == set(secrets), name
        env = svc["environment"]
        for key in ("TANDEM_TLS_CERT", "TANDEM_TLS_KEY", "TANDEM_TLS_CA"):
            mounted = env[key].removeprefix("/run/secrets/")
            assert mounted in svc["secrets"], (name, key)
            monkeypatch.setenv(key, env[key])
        monkeypatch.setenv("TANDEM_TLS_SERVER_NAME", env["TANDEM_TLS_SERVER_NAME"])
        ns = parsers[name]().parse_args([])
        assert ns.tls_cert == "/run/secrets/tandem-tls-cert" and ns.tls_ca.endswith("-ca")
        assert ns.tls_server_name == "tandem.internal"
    # The base file's environment is kept (merged, not replaced).
    assert model["services"]["decode"]["environment"]["TANDEM_GPU_SLOT_DIR"]


def test_a_parallel_worker_claims_as_many_gpus_as_ranks(tmp_path: Path) -> None:
    from tandem.config import world_size_from_argv
    from tandem_services.common.entrypoint import claim_gpus

    count = world_size_from_argv(["--model", "m", "-tp", "2", "--pipeline-parallel-size", "1"])
    assert count == 2
    first = claim_gpus(["GPU-a", "GPU-b", "GPU-c"], count, tmp_path, wait_s=0.0)
    try:
        assert len({c.device_id for c in first}) == 2
        # One GPU is left: a second two-rank replica holds none and says why.
        with pytest.raises(GpuSlotError, match="fewer than 2 GPUs"):
            claim_gpus(["GPU-a", "GPU-b", "GPU-c"], 2, tmp_path, wait_s=0.0)
        left = claim_gpus(["GPU-a", "GPU-b", "GPU-c"], 1, tmp_path, wait_s=0.0)
        assert {left[0].device_id} | {c.device_id for c in first} == {"GPU-a", "GPU-b", "GPU-c"}
        with pytest.raises(GpuSlotError, match="needs 4 GPUs; the pool has 3"):
            claim_gpus(["GPU-a", "GPU-b", "GPU-c"], 4, tmp_path, wait_s=0.0)
    finally:
        for claim in first:
            os.close(claim.fd)

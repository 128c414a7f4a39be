"""What scripts/compose_e2e.sh relies on, checked without a container engine: the compose
files start under every compose implementation and on hosts with no registry, the host's pip
sources reach the build, and the script skips cleanly where no engine can be had. The run
itself (image built, `compose up`, workload, `compose down`) is the script, run by
`make test` after this suite."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from scripts.container_build_env import (
    CA_IN_BUILD,
    CPU_TORCH_INDEX,
    build_args,
    parse_pip_config,
    pip_conf,
)
from tests.deploy.compose_e2e_workload import metric
from tests.deploy.compose_local import COMPOSE_FILES, CPU_COMPOSE_FILES, ROOT, load_compose

WORKERS = ("prefill", "decode")


def test_replicas_are_declared_so_every_compose_honours_them() -> None:
    """podman-compose reads deploy.replicas only with mode: replicated."""
    for files in (COMPOSE_FILES, CPU_COMPOSE_FILES):
        services = load_compose(files, {"PREFILL_REPLICAS": "2", "DECODE_REPLICAS": "3"})
        for role, n in (("prefill", "2"), ("decode", "3")):
            deploy = services["services"][role]["deploy"]
            assert deploy["mode"] == "replicated" and deploy["replicas"] == n


def test_redis_accepts_the_other_containers_whatever_its_image() -> None:
    """Debian's redis-server without a config file starts in protected mode."""
    command = [str(a) for a in load_compose(CPU_COMPOSE_FILES)["services"]["redis"]["command"]]
    assert command[0] == "redis-server"
    assert command[command.index("--protected-mode") + 1] == "no"
    image = load_compose(COMPOSE_FILES, {"REDIS_IMAGE": "localhost/r:1"})["services"]["redis"]
    assert image["image"] == "localhost/r:1"
    dockerfile = (ROOT / "scripts" / "redis.Dockerfile").read_text()
    assert "redis-server" in dockerfile and "ARG BASE_IMAGE=debian:bookworm" in dockerfile


def test_workers_get_shared_memory() -> None:
    """The engine process shares its KV cache with the worker through /dev/shm: GPU workers
    use the host's (ipc: host, where no size can be set), CPU workers get their own."""
    gpu = load_compose(COMPOSE_FILES)["services"]
    cpu = load_compose(CPU_COMPOSE_FILES, {"WORKER_SHM_SIZE": "3gb"})["services"]
    for role in WORKERS:
        assert gpu[role]["ipc"] == "host" and "shm_size" not in gpu[role]
        assert cpu[role]["ipc"] == "private" and cpu[role]["shm_size"] == "3gb"
    assert load_compose(CPU_COMPOSE_FILES)["services"]["decode"]["shm_size"] == "2gb"


def test_base_image_and_torch_source_are_arguments() -> None:
    services = load_compose(
        CPU_COMPOSE_FILES, {"TANDEM_CPU_BASE_IMAGE": "localhost/base:12", "TORCH_INDEX_URL": ""}
    )["services"]
    for name in ("scheduler", "frontend", *WORKERS):
        args = services[name]["build"]["args"]
        assert args == {"BASE_IMAGE": "localhost/base:12", "TORCH_INDEX_URL": ""}


# ----------------------------------------------------------------------- host pip sources

PIP_CONFIG_LIST = """\
global.extra-index-url='file:///srv/pypi/simple https://example.org/simple'
global.find-links='/srv/global-wheels'
user.find-links='/srv/user-wheels'
env.constraint='/srv/constraints.txt'
:env:.find-links='/srv/env-wheels'
:env:.cert='/srv/ca.pem'
global.timeout='10'
"""


def test_pip_config_precedence_variables_then_files() -> None:
    sources = parse_pip_config(PIP_CONFIG_LIST)
    assert sources.settings == {
        "extra-index-url": "file:///srv/pypi/simple https://example.org/simple",
        "find-links": "/srv/env-wheels",
        "constraint": "/srv/constraints.txt",
        "cert": "/srv/ca.pem",
    }


def _write_pip_config(tmp: Path, with_torch: bool) -> tuple[Path, dict[str, str]]:
    wheels = tmp / "wheels"
    index = tmp / "pypi" / "simple"
    wheels.mkdir()
    index.mkdir(parents=True)
    if with_torch:
        (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    constraints = tmp / "constraints.txt"
    constraints.write_text("torch<=2.14.1\n")
    config = tmp / "pip.conf"
    config.write_text(
        "[global]\n"
        f"find-links = {wheels}\n"
        f"extra-index-url = file://{index}\n"
        f"constraint = {constraints}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = str(config)
    return config, env


def test_build_env_mounts_the_hosts_local_sources(tmp_path: Path) -> None:
    """Run as the script does, on a real pip configuration file."""
    _, env = _write_pip_config(tmp_path, with_torch=True)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "scripts/container_build_env.py", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    args = (out / "build-args").read_text().splitlines()
    mounts = [args[i + 1] for i, a in enumerate(args) if a == "-v"]
    # Local folders keep their path inside the build; an index comes with its parent,
    # whose ../../files its pages link to.
    assert f"{tmp_path / 'wheels'}:{tmp_path / 'wheels'}:ro" in mounts
    assert f"{tmp_path / 'pypi'}:{tmp_path / 'pypi'}:ro" in mounts
    assert f"{tmp_path / 'constraints.txt'}:{tmp_path / 'constraints.txt'}:ro" in mounts
    assert f"{out.resolve() / 'pip.conf'}:/etc/pip.conf:ro" in mounts
    assert any(m.endswith(f":{CA_IN_BUILD}:ro") for m in mounts)
    # The host's own torch wheel: no PyTorch index.
    assert "TORCH_INDEX_URL=" in args
    conf = (out / "pip.conf").read_text()
    assert f"find-links = {tmp_path / 'wheels'}" in conf
    assert f"cert = {CA_IN_BUILD}" in conf


def test_without_a_local_torch_wheel_the_cpu_index_is_used(tmp_path: Path) -> None:
    _, env = _write_pip_config(tmp_path, with_torch=False)
    sources = parse_pip_config(
        subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=True,
        ).stdout
    )
    assert not sources.has_local_torch()
    args = build_args(sources, None, tmp_path)
    assert f"TORCH_INDEX_URL={CPU_TORCH_INDEX}" in args
    assert "cert" not in pip_conf(sources, None)


# ----------------------------------------------------------------------- the script


def test_script_skips_cleanly_where_no_engine_can_be_had(tmp_path: Path) -> None:
    """No docker, no podman, no apt-get: one "skipped: <why>" line and exit 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in (
        "bash", "dirname", "mktemp", "date", "rm", "mkdir", "id", "tail", "grep", "sed",
        "cat", "timeout", "sort", "tr", "awk", "python3", "env", "wc", "tee",
    ):  # fmt: skip
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    proc = subprocess.run(
        [str(bin_dir / "bash"), "scripts/compose_e2e.sh"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PATH": str(bin_dir), "HOME": str(tmp_path), "TANDEM_E2E_PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("compose_e2e:")]
    assert len(lines) == 1 and lines[0].startswith("compose_e2e: skipped: no container engine")
    assert "passed" not in proc.stdout


def test_script_is_valid_bash() -> None:
    proc = subprocess.run(
        ["bash", "-n", "scripts/compose_e2e.sh"], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr


def test_metric_parsing_reads_labelled_samples() -> None:
    page = (
        "# TYPE tandem_scheduler_workers gauge\n"
        'tandem_scheduler_workers{role="decode",state="ready"} 2.0\n'
        'tandem_scheduler_workers{role="prefill",state="ready"} 1.0\n'
        'tandem_scheduler_workers{role="prefill",state="draining"} 1.0\n'
        'tandem_worker_prefix_cache_hit_tokens_total{role="prefill"} 320.0\n'
    )
    assert metric(page, "tandem_scheduler_workers", role="prefill", state="ready") == 1.0
    assert metric(page, "tandem_scheduler_workers", role="prefill") == 2.0
    assert metric(page, "tandem_worker_prefix_cache_hit_tokens_total") == 320.0
    assert metric(page, "tandem_worker_prefix_cache_hit_tokens") == 0.0

"""TLS and mutual TLS between the services: a throwaway CA and certificates made with the
`openssl` CLI; a deployment under mutual TLS serves a request (the KV hand-off streams go
through the same credentials); the scheduler refuses a caller, a worker registering included,
without a valid client certificate; plaintext is refused."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem_protos.v1 import (
    common_pb2,
    frontend_pb2,
    frontend_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tandem_services.common.channels import TlsConfig, TlsConfigError, sync_channel
from tandem_services.common.entrypoint import health
from tandem_services.common.tls import tls_argv
from tandem_services.launcher import (
    Deployment,
    ServeConfig,
    Service,
    spawn_service,
    start_deployment,
    wait_ready,
)

from .conftest import GRACE_S, MAX_TOKENS, PROMPTS, SCHEDULER_ARGS, WORKER_ARGS, Reference

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI"),
]


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path  # signed by ca; serverAuth + clientAuth; localhost / 127.0.0.1
    key: Path
    rogue_cert: Path  # the same names, signed by another CA
    rogue_key: Path

    @property
    def mutual(self) -> TlsConfig:
        return TlsConfig(str(self.cert), str(self.key), str(self.ca))


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _make_ca(d: Path, name: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
             "-days", "2", "-subj", f"/CN={name}")  # fmt: skip
    return cert, key


def _make_leaf(d: Path, name: str, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    key, csr, cert, ext = (d / f"{name}{s}" for s in (".key", ".csr", ".pem", ".ext"))
    ext.write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "basicConstraints=CA:FALSE\n"
    )
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
             "-subj", f"/CN={name}")  # fmt: skip
    _openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
             "-out", cert, "-days", "2", "-extfile", ext)  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca = _make_ca(d, "tandem-test-ca")
    rogue_ca = _make_ca(d, "rogue-ca")
    cert, key = _make_leaf(d, "tandem", ca)
    rogue_cert, rogue_key = _make_leaf(d, "rogue", rogue_ca)
    return Pki(ca[0], cert, key, rogue_cert, rogue_key)


def test_tls_config_is_checked(pki: Pki) -> None:
    with pytest.raises(TlsConfigError, match="go together"):
        TlsConfig(cert_file=str(pki.cert))
    with pytest.raises(TlsConfigError, match="needs --tls-cert"):
        TlsConfig(ca_file=str(pki.ca))
    with pytest.raises(TlsConfigError, match="not found"):
        TlsConfig(str(pki.cert), str(pki.key), "/nonexistent/ca.pem")
    assert tls_argv(pki.mutual) == [
        "--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-ca", str(pki.ca),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def mtls_scheduler(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("mtls-scheduler")
    config = ServeConfig(log_dir=str(tmp))
    scheduler = spawn_service(
        config, "scheduler", "tandem_services.scheduler",
        ["--port", "0", *tls_argv(pki.mutual)], Path(tmp),
    )  # fmt: skip
    try:
        wait_ready([scheduler], time.monotonic() + 120)
        yield scheduler.info["grpc"]
    finally:
        _stop(scheduler)


def _stop(service: Service) -> None:
    if service.process.poll() is None:
        service.process.send_signal(signal.SIGTERM)
    service.process.wait(timeout=30)


def _register(channel: grpc.Channel) -> None:
    scheduler_pb2_grpc.SchedulerStub(channel).RegisterWorker(
        scheduler_pb2.RegisterWorkerRequest(
            worker_id="impostor", address="127.0.0.1:1", role=common_pb2.WORKER_ROLE_UNIFIED
        ),
        timeout=10,
    )


def test_scheduler_under_mtls_refuses_a_worker_without_a_valid_client_certificate(
    pki: Pki, mtls_scheduler: str
) -> None:
    address = mtls_scheduler
    ca = pki.ca.read_bytes()
    refused = {
        "plaintext": grpc.insecure_channel(address),
        "no client certificate": grpc.secure_channel(
            address, grpc.ssl_channel_credentials(root_certificates=ca)
        ),
        "certificate of another CA": grpc.secure_channel(
            address,
            grpc.ssl_channel_credentials(
                ca, pki.rogue_key.read_bytes(), pki.rogue_cert.read_bytes()
            ),
        ),
    }
    for what, channel in refused.items():
        with channel, pytest.raises(grpc.RpcError) as info:
            _register(channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, what
    # Nothing got registered; a client with a valid certificate is served.
    with sync_channel(address, pki.mutual) as channel:
        listed = scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=10
        )
        assert list(listed.workers) == []
    # The container probe speaks the same TLS.
    assert health(address, "", 5.0, pki.mutual)
    assert not health(address, "", 2.0)


@pytest.fixture(scope="module")
def mtls_deployment(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    config = ServeConfig(
        http_port=0,
        grpc_port=0,
        unified=False,  # prefill + decode: the KV hand-off crosses a TLS channel
        worker_args=WORKER_ARGS,
        scheduler_args=SCHEDULER_ARGS,
        grace_period_s=GRACE_S,
        log_dir=str(tmp_path_factory.mktemp("mtls-deployment")),
        startup_timeout_s=300.0,
        tls=pki.mutual,
    )
    dep = start_deployment(config)
    try:
        yield dep
    finally:
        dep.stop(timeout_s=GRACE_S + 10)


def test_a_deployment_under_mtls_serves_a_request(
    pki: Pki, mtls_deployment: Deployment, reference: Reference
) -> None:
    dep = mtls_deployment
    creds = grpc.ssl_channel_credentials(
        pki.ca.read_bytes(), pki.key.read_bytes(), pki.cert.read_bytes()
    )

    async def run() -> list[int]:
        async with grpc.aio.secure_channel(dep.grpc_address, creds) as channel:
            stub = frontend_pb2_grpc.FrontendStub(channel)
            params = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
            ids: list[int] = []
            async for msg in stub.Generate(
                frontend_pb2.GenerateRequest(text=PROMPTS[0], sampling_params=params)
            ):
                for choice in msg.choices:
                    ids.extend(choice.token_ids)
            return ids

    # Greedy, through prefill -> KV hand-off -> decode, all over mutual TLS.
    assert asyncio.run(asyncio.wait_for(run(), 120)) == reference.token_ids[0]
    # Every service port speaks TLS only.
    for name in ("scheduler", "prefill", "decode", "frontend"):
        with grpc.insecure_channel(dep.address(name)) as channel, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert health(dep.address(name), "", 5.0, pki.mutual), name

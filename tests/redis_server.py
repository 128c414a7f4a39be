"""A real redis-server for tests: loopback only, a free port, no persistence.

    with RedisServer() as server:      # starts redis-server on 127.0.0.1:<free port>
        server.url                     # "redis://127.0.0.1:<port>/0"
        server.stop()                  # the server goes away (clients see connection errors)
        server.start()                 # a fresh, empty server on the same port

`tls_cert=(certfile, keyfile)` serves TLS only (the certificate is its own CA).
The binary comes from PATH (or /usr/bin, /usr/sbin); `scripts/install_redis.sh` installs
Debian's package when it is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from tests.ports import free_port

SEARCH_DIRS = ("/usr/bin", "/usr/sbin", "/usr/local/bin")


class RedisServerError(RuntimeError):
    """redis-server is missing or did not come up."""


def find_redis_server() -> str | None:
    """Path of the redis-server binary, or None."""
    found = shutil.which("redis-server")
    if found:
        return found
    for d in SEARCH_DIRS:
        candidate = Path(d) / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the test process dies (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _ping(port: int, password: str | None, tls: bool, timeout_s: float = 0.2) -> bool:
    try:
        with contextlib.ExitStack() as stack:
            s = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout_s))
            if tls:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
                s = stack.enter_context(ctx.wrap_socket(s))
            if password is not None:
                s.sendall(f"AUTH {password}\r\n".encode())
                if not s.recv(64).startswith(b"+OK"):
                    return False
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process on 127.0.0.1; start/stop/start again keeps the port."""

    def __init__(
        self,
        port: int | None = None,
        password: str | None = None,
        executable: str | None = None,
        extra_args: tuple[str, ...] = (),
        tls_cert: tuple[str, str] | None = None,
    ) -> None:
        exe = executable or find_redis_server()
        if exe is None:
            raise RedisServerError(
                "redis-server not found; run scripts/install_redis.sh (Debian: apt-get install "
                "redis-server)"
            )
        self.executable = exe
        self.password = password
        self.extra_args = extra_args
        self.tls_cert = tls_cert
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        self._dir = tempfile.mkdtemp(prefix="tandem-redis-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = False  # started once: later starts keep the port

    @property
    def url(self) -> str:
        """URL of database 0 (without the password); `rediss://` when serving TLS."""
        scheme = "rediss" if self.tls_cert else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start (or start again, on the same port) an empty server; wait until it answers."""
        if self.running:
            return self
        # A first start may move to another free port if its own was taken meanwhile; a
        # restart never does (the clients under test know the old one): it tries the same
        # port again after a pause. Moving silently left a restarted server where no worker
        # looked (a CI run's Redis-outage test waited 20 s on connection refused).
        keep_port = self._fixed_port or self._started
        for attempt in range(3):
            if attempt and keep_port:
                time.sleep(0.2)
            elif attempt:
                self.port = free_port()
            if self._spawn(timeout_s):
                self._started = True
                return self
        raise RedisServerError(f"redis-server did not start on port {self.port}: {self._log()}")

    def stop(self) -> None:
        """Kill the server at once (no persistence, nothing to save)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _spawn(self, timeout_s: float) -> bool:
        args = [
            self.executable,
            "--port", "0" if self.tls_cert else str(self.port),  # TLS: no plain port
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir,
            "--daemonize", "no",
            "--logfile", "redis.log",
            "--loglevel", "warning",
            *self.extra_args,
        ]  # fmt: skip
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.tls_cert is not None:
            certfile, keyfile = self.tls_cert
            args += ["--tls-port", str(self.port), "--tls-cert-file", certfile]
            args += ["--tls-key-file", keyfile, "--tls-ca-cert-file", certfile]
            args += ["--tls-auth-clients", "no"]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self._dir, "redis.log"))
        self._proc = subprocess.Popen(
            args,
            cwd=self._dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                return False
            if _ping(self.port, self.password, self.tls_cert is not None):
                return True
            time.sleep(0.01)
        self.stop()
        return False

    def _log(self) -> str:
        try:
            return Path(self._dir, "redis.log").read_text()[-2000:]
        except OSError:
            return "(no log)"

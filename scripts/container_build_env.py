"""The host's package sources, made visible to a container build.

A machine behind a TLS-intercepting proxy, or one whose pip installs from local folders
(find-links, file:// indexes), builds images only when the build sees the same pip
configuration and CA bundle as the host. This reads both at run time (`pip config list` and
Python's `ssl`), never from paths written into the project, and writes:

    <out>/pip.conf     the effective pip settings, CA path rewritten to CA_IN_BUILD
    <out>/build-args   one `podman build` argument per line:
                           -v <host path>:<same path>:ro     every local folder/file pip names
                                                             (a local index: its parent)
                           -v <out>/pip.conf:/etc/pip.conf:ro
                           -v <host CA bundle>:CA_IN_BUILD:ro
                           --build-arg TORCH_INDEX_URL=...   empty when a local folder holds a
                                                             torch wheel (the host's own source)

Local paths keep their host path inside the build, so the pip.conf needs no rewriting of
them. Usage: python scripts/container_build_env.py OUT_DIR [--torch-index-url URL]
"""

from __future__ import annotations

import argparse
import re
import ssl
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

CA_IN_BUILD = "/etc/ssl/certs/tandem-build-ca.crt"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"

# `pip config list` scopes, highest precedence first: PIP_* variables, then the
# PIP_CONFIG_FILE file, then site, user and global files.
_SCOPES = (":env:", "env", "site", "user", "global")
_KEYS = ("index-url", "extra-index-url", "find-links", "constraint", "cert", "default-timeout")
_LINE = re.compile(r"^(?P<scope>[^.]*)\.(?P<key>[a-z-]+)='(?P<value>.*)'$")


@dataclass(frozen=True)
class PipSources:
    """The effective pip settings that decide where packages come from."""

    settings: dict[str, str] = field(default_factory=dict)

    def values(self, key: str) -> list[str]:
        """The whitespace-separated values of `key` (find-links and extra-index-url hold
        several)."""
        return self.settings.get(key, "").split()

    def local_paths(self) -> list[Path]:
        """Every local file or folder the settings name, existing ones only. A local index
        (`file:///x/simple`) is mounted with its parent: its pages link to `../../files/...`."""
        out: list[Path] = []
        for key in ("index-url", "extra-index-url", "find-links", "constraint"):
            for value in self.values(key):
                path = _local_path(value)
                if path is None or not path.exists():
                    continue
                if key.endswith("index-url") and path.parent != path:
                    path = path.parent
                if path not in out:
                    out.append(path)
        return out

    def has_local_torch(self) -> bool:
        """A find-links folder holds a torch wheel: the host installs torch from it."""
        for value in self.values("find-links"):
            path = _local_path(value)
            if path is not None and path.is_dir() and any(path.glob("torch-*.whl")):
                return True
        return False


def _local_path(value: str) -> Path | None:
    if value.startswith("file:"):
        return Path(unquote(urlparse(value).path))
    if "://" in value:
        return None
    return Path(value)


def parse_pip_config(text: str) -> PipSources:
    """`pip config list` output -> the effective value of each key we care about."""
    found: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        scope = m.group("scope") if m.group("scope") == ":env:" else m.group("scope").split("/")[0]
        key = m.group("key")
        if key in _KEYS:
            found.setdefault(key, {})[scope] = m.group("value")
    settings = {}
    for key, by_scope in found.items():
        for scope in (*_SCOPES, *by_scope):
            if scope in by_scope:
                settings[key] = by_scope[scope]
                break
    return PipSources(settings)


def read_pip_config(python: str = sys.executable) -> PipSources:
    """The host's pip settings, as `python -m pip config list` reports them."""
    proc = subprocess.run(
        [python, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return parse_pip_config(proc.stdout)


def host_ca_bundle(sources: PipSources) -> Path | None:
    """The CA bundle the host trusts: pip's `cert`, else OpenSSL's default file, else
    certifi's."""
    candidates = [sources.settings.get("cert", ""), ssl.get_default_verify_paths().cafile or ""]
    try:
        import certifi

        candidates.append(certifi.where())
    except ImportError:
        pass
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def pip_conf(sources: PipSources, ca: Path | None) -> str:
    """The pip.conf a build uses: the host's settings, the CA bundle at CA_IN_BUILD."""
    lines = ["[global]"]
    for key in _KEYS:
        if key == "cert":
            continue
        if key in sources.settings:
            lines.append(f"{key} = {sources.settings[key]}")
    if ca is not None:
        lines.append(f"cert = {CA_IN_BUILD}")
    return "\n".join(lines) + "\n"


def build_args(
    sources: PipSources, ca: Path | None, out: Path, torch_index_url: str = CPU_TORCH_INDEX
) -> list[str]:
    """The `podman build` arguments that show the build the host's sources."""
    args: list[str] = []
    for path in sources.local_paths():
        args += ["-v", f"{path}:{path}:ro"]
    args += ["-v", f"{out / 'pip.conf'}:/etc/pip.conf:ro"]
    if ca is not None:
        args += ["-v", f"{ca}:{CA_IN_BUILD}:ro"]
    index = "" if sources.has_local_torch() else torch_index_url
    args += ["--build-arg", f"TORCH_INDEX_URL={index}"]
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for pip.conf and build-args")
    parser.add_argument("--torch-index-url", default=CPU_TORCH_INDEX)
    parser.add_argument("--python", default=sys.executable, help="whose pip config to read")
    args = parser.parse_args(argv)
    sources = read_pip_config(args.python)
    ca = host_ca_bundle(sources)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pip.conf").write_text(pip_conf(sources, ca))
    lines = build_args(sources, ca, args.out.resolve(), args.torch_index_url)
    (args.out / "build-args").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""compose.yaml without Docker: load it as compose does (variables, `!reset`, override files)
and turn its services into local processes on 127.0.0.1.

A service's command goes through the image's ENTRYPOINT (read from the Dockerfile), so a
local process runs exactly what the container would, with three changes that stand in for
the container network: `0.0.0.0` binds become `127.0.0.1`, `<service>:<port>` addresses
become `127.0.0.1:<port>`, and each process gets its own ports through the compose
variables that set them (containers each have their own network namespace; local processes
share one).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = (ROOT / "compose.yaml",)
CPU_COMPOSE_FILES = (ROOT / "compose.yaml", ROOT / "compose.cpu.yaml")

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class ComposeError(ValueError):
    pass


class _Reset:
    """`!reset`: remove the key from what earlier files set."""


RESET = _Reset()


@dataclass(frozen=True)
class _Override:
    """`!override`: replace, do not merge."""

    value: Any


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!reset", lambda loader, node: RESET)
_Loader.add_constructor(
    "!override",
    lambda loader, node: _Override(
        loader.construct_mapping(node, deep=True)
        if isinstance(node, yaml.MappingNode)
        else loader.construct_sequence(node, deep=True)
        if isinstance(node, yaml.SequenceNode)
        else loader.construct_scalar(node)
    ),
)


def load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=_Loader)


def variables(paths: tuple[Path, ...]) -> set[str]:
    """Every variable the files refer to."""
    names = set()
    for path in paths:
        for m in _VARIABLE.finditer(path.read_text()):
            name = m.group("braced") or m.group("bare")
            if name:
                names.add(name)
    return names


def interpolate(value: Any, env: Mapping[str, str], strict: bool = True) -> Any:
    """Compose variable substitution: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default},
    ${VAR:?error}, ${VAR?error}. `strict`: a variable with no value and no default raises."""
    if isinstance(value, dict):
        return {k: interpolate(v, env, strict) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env, strict) for v in value]
    if isinstance(value, _Override):
        return _Override(interpolate(value.value, env, strict))
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("braced") or m.group("bare")
        op, arg = m.group("op"), m.group("arg") or ""
        present = name in env
        nonempty = present and env[name] != ""
        if op == ":-":
            return env[name] if nonempty else arg
        if op == "-":
            return env[name] if present else arg
        if op in (":?", "?") and not (nonempty if op == ":?" else present):
            raise ComposeError(f"variable {name} is required: {arg}")
        if not present:
            if strict:
                raise ComposeError(f"variable {name} has no value and no default")
            return ""
        return env[name]

    return _VARIABLE.sub(sub, value)


def merge(base: Any, override: Any) -> Any:
    """Compose's merge of an override file, for the shapes our files use: mappings merge
    key by key, anything else (command lists, scalars) is replaced."""
    if isinstance(override, _Override):
        return override.value
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if value is RESET:
                out.pop(key, None)
            elif key in out:
                out[key] = merge(out[key], value)
            else:
                out[key] = value.value if isinstance(value, _Override) else value
        return out
    return override


def _strip_markers(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_markers(v) for k, v in value.items() if v is not RESET}
    if isinstance(value, list):
        return [_strip_markers(v) for v in value if v is not RESET]
    if isinstance(value, _Override):
        return _strip_markers(value.value)
    return value


def load_compose(
    paths: tuple[Path, ...] = COMPOSE_FILES, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The merged, interpolated model of `paths` (later files override earlier ones)."""
    model: Any = {}
    for path in paths:
        model = merge(model, interpolate(load_yaml(path), env or {}))
    model = _strip_markers(model)
    return {k: v for k, v in model.items() if not k.startswith("x-")}


def image_entrypoint(dockerfile: Path = ROOT / "Dockerfile") -> list[str]:
    """The image's ENTRYPOINT (exec form), with `python` as this interpreter."""
    entry = None
    for line in dockerfile.read_text().splitlines():
        if line.startswith("ENTRYPOINT "):
            entry = json.loads(line.removeprefix("ENTRYPOINT "))
    if entry is None:
        raise ComposeError("the Dockerfile has no exec-form ENTRYPOINT")
    return [sys.executable if entry[0] in ("python", "python3") else entry[0], *entry[1:]]


@dataclass(frozen=True)
class LocalService:
    """One compose service replica as a local process."""

    name: str
    replica: int
    argv: list[str]
    env: dict[str, str]
    healthcheck: list[str] = field(default_factory=list)


def localize(text: str, service_names: set[str]) -> str:
    if text == "0.0.0.0":
        return "127.0.0.1"
    names = "|".join(sorted(map(re.escape, service_names)))
    return re.sub(rf"(?<![\w.-])(?:{names})(?=:\d)", "127.0.0.1", text)


def local_service(
    paths: tuple[Path, ...], name: str, replica: int, env: Mapping[str, str]
) -> LocalService:
    """Service `name` of the compose files as a local process (variables from `env`)."""
    model = load_compose(paths, env)
    services = model["services"]
    svc = services[name]
    names = set(services)
    command = [localize(str(a), names) for a in svc["command"]]
    environment = svc.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    proc_env = {k: localize(str(v), names) for k, v in environment.items()}
    test = (svc.get("healthcheck") or {}).get("test") or []
    health: list[str] = []
    if test and test[0] == "CMD":
        health = [localize(str(a), names) for a in test[1:]]
        if health[0] in ("python", "python3"):
            health[0] = sys.executable
    return LocalService(name, replica, [*image_entrypoint(), *command], proc_env, health)

"""The frontend's configuration: flags and environment, read once in `__main__`."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.config import DEFAULT_MODEL, add_engine_args
from tandem.sampling_params import MAX_LOGPROBS
from tandem_services.common.channels import PLAINTEXT, TlsConfig, TlsConfigError
from tandem_services.common.server import env_default
from tandem_services.common.tls import add_tls_args, tls_config_from
from tandem_services.frontend.limits import RequestLimits
from tandem_services.frontend.tool_parsers import AUTO_TOOL_PARSERS

# The per-request limits (RequestLimits' fields), each a flag --max-... and an env
# TANDEM_FRONTEND_MAX_...; defaults are RequestLimits' own.
_LIMIT_HELP = {
    "max_n": "most choices per request (n)",
    "max_best_of": "largest best_of",
    "max_logprobs": "most top logprobs per token (logprobs / top_logprobs; vLLM's max_logprobs)",
    "max_stop_sequences": "most stop strings per request",
    "max_stop_sequence_len": "longest stop string, in characters",
    "max_tools": "most tools per request",
    "max_tool_schema_bytes": "largest tool definition, in bytes of JSON",
    "max_prompt_tokens_times_n": "most prompt tokens x n per request (summed over prompts)",
}


class FrontendConfigError(ValueError):
    pass


@dataclass(frozen=True)
class FrontendConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    scheduler_address: str = "127.0.0.1:50050"
    # The model the workers serve (for the tokenizer and chat template).
    model: str = "default"
    # Where requests' default sampling parameters come from (the engine's --generation-config:
    # auto, vllm or a folder; tandem.loader.sampling_defaults).
    generation_config: str = "auto"
    # Names clients may use for it (first: the one reported); default: the model argument.
    served_model_names: tuple[str, ...] = ()
    cache_dir: str = ""
    api_key: str = ""
    max_body_bytes: int = 1024 * 1024
    grace_period_s: float = 10.0
    # How many times one choice may move to another worker when its worker is lost (vLLM /
    # Dynamo's --migration-limit); 0: it fails with the worker's error.
    migration_limit: int = 3
    # Before announcing itself ready (ready file), wait up to this long for workers that can
    # serve a request (a unified one, or a prefill and a decode one).
    wait_for_workers_s: float = 0.0
    frontend_id: str = ""
    # Prometheus /metrics port (0: any free port, -1: off).
    metrics_port: int = -1
    ready_file: str = ""
    log_level: str = "info"
    # TLS to the scheduler and workers, and on the frontend's gRPC port
    # (tandem_services/common/channels.py).
    tls: TlsConfig = PLAINTEXT
    # Per-request limits, checked before a request is queued (limits.py).
    max_n: int = RequestLimits.max_n
    max_best_of: int = RequestLimits.max_best_of
    max_logprobs: int = RequestLimits.max_logprobs
    max_stop_sequences: int = RequestLimits.max_stop_sequences
    max_stop_sequence_len: int = RequestLimits.max_stop_sequence_len
    max_tools: int = RequestLimits.max_tools
    max_tool_schema_bytes: int = RequestLimits.max_tool_schema_bytes
    max_prompt_tokens_times_n: int = RequestLimits.max_prompt_tokens_times_n
    # tool_choice "auto" (vLLM's flags): on only with a parser for the model's call format.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str = ""
    # Responses API: how many responses this frontend keeps for `previous_response_id` and
    # retrieval (response_store.py; 0: none, `store` answered false).
    responses_store_size: int = 1024

    def __post_init__(self) -> None:
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not (0 <= port < 65536):
                raise FrontendConfigError(f"{name} must be in [0, 65535], got {port}")
        if not (-1 <= self.metrics_port < 65536):
            raise FrontendConfigError(
                f"metrics_port must be in [-1, 65535], got {self.metrics_port}"
            )
        if self.max_body_bytes < 1024:
            raise FrontendConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.grace_period_s < 0:
            raise FrontendConfigError("grace_period_s must be >= 0")
        if self.migration_limit < 0:
            raise FrontendConfigError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if not self.frontend_id:
            raise FrontendConfigError("frontend_id must not be empty")
        try:
            self.request_limits  # noqa: B018 (validates)
        except ValueError as exc:
            raise FrontendConfigError(str(exc)) from None
        if self.tool_call_parser and self.tool_call_parser not in AUTO_TOOL_PARSERS:
            raise FrontendConfigError(
                f"tool_call_parser must be one of {', '.join(AUTO_TOOL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise FrontendConfigError("enable_auto_tool_choice needs a tool_call_parser")
        if self.responses_store_size < 0:
            raise FrontendConfigError(
                f"responses_store_size must be >= 0, got {self.responses_store_size}"
            )
        if self.max_logprobs > MAX_LOGPROBS:
            raise FrontendConfigError(
                f"max_logprobs must be <= {MAX_LOGPROBS} (the engine's limit), "
                f"got {self.max_logprobs}"
            )

    @property
    def request_limits(self) -> RequestLimits:
        return RequestLimits(**{name: getattr(self, name) for name in _LIMIT_HELP})

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser tool_choice "auto" uses; None when "auto" is off."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    @property
    def model_ids(self) -> list[str]:
        return list(self.served_model_names) or [self.model]


def build_parser() -> argparse.ArgumentParser:
    d = FrontendConfig.__dataclass_fields__
    p = argparse.ArgumentParser(
        prog="tandem frontend",
        description="gRPC and OpenAI-compatible HTTP frontend. Flags also read "
        "TANDEM_FRONTEND_<FLAG>; the API key also TANDEM_API_KEY.",
    )

    def env(name: str, default: object) -> str:
        return env_default(f"TANDEM_FRONTEND_{name.upper()}", str(default))

    p.add_argument("--host", default=env("host", d["host"].default))
    p.add_argument("--grpc-port", type=int, default=env("grpc_port", d["grpc_port"].default))
    p.add_argument("--http-port", type=int, default=env("http_port", d["http_port"].default))
    p.add_argument(
        "--scheduler",
        default=env("scheduler", os.environ.get("TANDEM_SCHEDULER_ADDRESS", "127.0.0.1:50050")),
    )
    # The engine's --model, --cache-dir (TANDEM_CACHE_DIR) and --generation-config, as the
    # workers declare them; the model's default is also read from TANDEM_FRONTEND_MODEL.
    add_engine_args(p, only=("model", "cache_dir", "generation_config"))
    p.set_defaults(model=env("model", DEFAULT_MODEL))
    add_api_args(p, env)
    p.add_argument("--api-key", default=env("api_key", os.environ.get("TANDEM_API_KEY", "")))
    p.add_argument(
        "--grace-period-s", type=float, default=env("grace_period_s", d["grace_period_s"].default)
    )
    p.add_argument(
        "--migration-limit",
        type=int,
        default=env("migration_limit", d["migration_limit"].default),
        help="times one request may move to another worker when its worker is lost (0: fail)",
    )
    p.add_argument("--wait-for-workers-s", type=float, default=env("wait_for_workers_s", 0.0))
    p.add_argument("--frontend-id", default=env("frontend_id", ""))
    p.add_argument(
        "--metrics-port",
        type=int,
        default=env("metrics_port", d["metrics_port"].default),
        help="serve Prometheus /metrics here (0: any free port, -1: off)",
    )
    p.add_argument("--ready-file", default=env("ready_file", ""))
    p.add_argument("--log-level", default=env("log_level", "info"))
    add_tls_args(p)
    return p


def _no_env(name: str, default: Any) -> Any:
    return default


# The API flags' destinations (add_api_args), in the order they are declared.
_API_DESTS = (
    "served_model_name", "max_body_bytes", "enable_auto_tool_choice", "tool_call_parser",
    "responses_store_size", *_LIMIT_HELP,
)  # fmt: skip


def add_api_args(p: argparse.ArgumentParser, env: Callable[[str, object], str] = _no_env) -> None:
    """The frontend's API flags, declared once for its own parser and `tandem serve`'s (which
    forwards those given: `api_argv`): the names clients may use for the model, the body size,
    tool calling (vLLM's flags) and the per-request limits. `env(name, default)`: a flag's
    default (the frontend's own parser reads TANDEM_FRONTEND_<NAME>)."""
    d = FrontendConfig.__dataclass_fields__
    p.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        help="a name clients may use for the model (repeatable)",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=env("max_body_bytes", d["max_body_bytes"].default)
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        default=env("enable_auto_tool_choice", "").lower() in ("1", "true", "yes"),
        help='allow tool_choice "auto" (the default with tools): calls parsed from the output',
    )
    p.add_argument(
        "--tool-call-parser",
        default=env("tool_call_parser", ""),
        choices=["", *AUTO_TOOL_PARSERS],
        help="the tool-call format of the model's output (hermes and qwen: <tool_call> tags; "
        "llama3_json: Llama 3 JSON calls; mistral: [TOOL_CALLS]; granite: <|tool_call|>)",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        default=env("responses_store_size", d["responses_store_size"].default),
        help="Responses API: responses kept for previous_response_id and retrieval, least "
        "recently used dropped first (in memory, per frontend; 0: none stored)",
    )
    for name, help_ in _LIMIT_HELP.items():
        p.add_argument(
            "--" + name.replace("_", "-"), type=int, default=env(name, d[name].default), help=help_
        )


def api_argv(p: argparse.ArgumentParser, ns: argparse.Namespace) -> list[str]:
    """The API flags `ns` sets away from `p`'s defaults, as the frontend's arguments (so a
    flag not given leaves the frontend's own default and TANDEM_FRONTEND_* alone)."""
    argv: list[str] = []
    for dest in _API_DESTS:
        value = getattr(ns, dest)
        if value == p.get_default(dest):
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag)
        elif isinstance(value, list):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def config_from_args(argv: list[str]) -> FrontendConfig:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        tls = tls_config_from(ns)
    except TlsConfigError as exc:
        parser.error(str(exc))
    return FrontendConfig(
        host=ns.host,
        grpc_port=ns.grpc_port,
        http_port=ns.http_port,
        scheduler_address=ns.scheduler,
        model=ns.model,
        generation_config=ns.generation_config,
        served_model_names=tuple(ns.served_model_name),
        cache_dir=ns.cache_dir,
        api_key=ns.api_key,
        max_body_bytes=ns.max_body_bytes,
        grace_period_s=ns.grace_period_s,
        migration_limit=ns.migration_limit,
        wait_for_workers_s=ns.wait_for_workers_s,
        frontend_id=ns.frontend_id or f"frontend-{socket.gethostname()}-{os.getpid()}",
        metrics_port=ns.metrics_port,
        ready_file=ns.ready_file,
        log_level=ns.log_level,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_call_parser=ns.tool_call_parser,
        responses_store_size=ns.responses_store_size,
        tls=tls,
        **{name: getattr(ns, name) for name in _LIMIT_HELP},
    )

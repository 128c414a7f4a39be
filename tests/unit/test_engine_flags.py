"""Every entry point takes every engine flag from the one definition (tandem.config), and each
value reaches the EngineConfig the engine is built from.

The walk: for each entry point, parse one command line that sets every engine flag to a value
other than its default, follow it as the program does (the launcher and `bench serve --launch`
forward flags to worker command lines, which the worker service then parses), and compare the
resulting EngineConfig field by field."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks import offline_throughput, prefix_routing, profile_step, step_breakdown
from tandem.config import (
    SERVING_ENGINE_DEFAULTS,
    ConfigError,
    EngineConfig,
    add_engine_args,
    engine_argv,
    engine_flags,
)
from tandem.engine_args import EngineArgs
from tandem.entrypoints.generate import build_parser as generate_parser
from tandem_services.bench.serve import build_parser as bench_parser
from tandem_services.launcher import ServeConfig, worker_commands
from tandem_services.launcher import build_parser as serve_parser
from tandem_services.worker.config import config_from_args

REPO_ROOT = Path(__file__).resolve().parents[2]

# A value other than the default for every engine flag (the model is given per test). A flag
# added without a value here fails `test_every_flag_has_a_test_value`.
NON_DEFAULT: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 200,
    "cache_dir": "/tmp/tandem-flags-cache",
    "generation_config": "vllm",
    "hf_overrides": '{"rope_scaling": {"rope_type": "linear", "factor": 2.0}}',
    "block_size": 32,
    "num_gpu_blocks": 7,
    "kv_cache_memory_gb": 0.5,
    "gpu_memory_utilization": 0.5,
    "enable_prefix_caching": False,
    "disable_hybrid_kv_cache_manager": True,
    "kv_cache_dtype": "float16",
    "max_num_batched_tokens": 300,
    "max_num_seqs": 3,
    "policy": "priority",
    "enable_chunked_prefill": False,
    "long_prefill_token_threshold": 64,
    "async_scheduling": "off",
    "device": "cpu",
    "attention_backend": "torch",
    "enforce_eager": True,
    "enable_pdl": True,
    "cuda_graph_sizes": (1, 3),
    "cudagraph_mode": "full_decode_only",
    "piecewise_cuda_graph_sizes": (8, 24),
    "num_threads": 1,
    "disable_any_whitespace": True,
    "compile_timeout_s": 5.0,
    "compile_threads": 3,
    "bitmask_threads": 2,
    "grammar_cache_size": 17,
    "cpu_cores": "0",
    "cpu_gemm": "onednn",
    "cpu_adaptive_threads": False,
    # Only the form is checked until an engine loads it.
    "logits_processors": ("some.module:SomeProcessor", "other.module:Other"),
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 2,
    "distributed_executor_backend": "mp",
    "master_addr": "127.0.0.2",
    "master_port": 29511,
    "quantization": "fp8",
    "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}',
    "skip_tokenizer_init": True,
    "enable_expert_parallel": True,
}
# Flags kept at their defaults here: several hosts are for unified workers only (the flag
# tests build prefill and decode workers too), and a node rank needs several hosts.
ONLY_DEFAULT = {"nnodes", "node_rank"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder with only config.json: enough to resolve (no weights are loaded here)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("flags-model")
    LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ).save_pretrained(path)
    return path


def full_argv() -> list[str]:
    """Every engine flag but --model, each set to its NON_DEFAULT value."""
    return engine_argv(NON_DEFAULT | {"model": "x"} | _defaults(ONLY_DEFAULT))


def _defaults(names: set[str]) -> dict[str, Any]:
    return {f.dest: f.default for f in engine_flags() if f.dest in names}


def assert_reaches(config: EngineConfig, model: str) -> None:
    """Every NON_DEFAULT value is in `config`, in the section its field is declared in."""
    seen = {}
    sections = (
        "model",
        "cache",
        "scheduler",
        "parallel",
        "device",
        "speculative",
        "structured_outputs",
        "sampler",
        "quantization",
    )
    for section in sections:
        part = getattr(config, section)
        for name in NON_DEFAULT:
            if hasattr(part, name) and not (section == "scheduler" and name == "max_model_len"):
                seen[name] = getattr(part, name)
    assert seen == NON_DEFAULT
    assert config.model.model == model


def test_every_flag_has_a_test_value() -> None:
    declared = {f.dest for f in engine_flags()} - {"model"}
    assert declared == set(NON_DEFAULT) | ONLY_DEFAULT
    argv = full_argv()
    for name in NON_DEFAULT:
        flag = next(f.option for f in engine_flags() if f.dest == name)
        if NON_DEFAULT[name] is False:
            flag = "--no-" + flag[2:]
        assert argv.count(flag) == 1, flag


def _via_workers(argv_to_worker_args: Callable[[list[str]], list[str]], model: str) -> None:
    """Worker command lines planned by the launcher from `worker_args`, parsed by the worker
    service's own config: each worker's EngineConfig carries every value."""
    worker_args = argv_to_worker_args(full_argv())
    for unified in (False, True):
        plan = worker_commands(
            ServeConfig(model=model, worker_args=tuple(worker_args), unified=unified), "127.0.0.1:1"
        )
        assert plan
        for cmd in plan:
            service = "prefill_worker" if cmd.module.endswith("prefill_worker") else "decode_worker"
            role = "prefill" if service == "prefill_worker" else "decode"
            config = config_from_args(service, role, list(cmd.args))
            assert config.engine.is_resolved
            assert config.engine.scheduler.max_model_len == NON_DEFAULT["max_model_len"]
            assert_reaches(config.engine, model)


def test_generate(model_dir: Path) -> None:
    ns = generate_parser().parse_args(["hello", "--model", str(model_dir), *full_argv()])
    assert ns.prompt == ["hello"]
    assert_reaches(EngineArgs.from_cli_args(ns).create_engine_config(), str(model_dir))


def test_serve_forwards_every_flag_to_the_workers(model_dir: Path) -> None:
    def forward(argv: list[str]) -> list[str]:
        ns = serve_parser().parse_args(["--model", str(model_dir), *argv])
        return engine_argv(ns)

    _via_workers(forward, str(model_dir))


def test_bench_serve_launch_forwards_every_flag(model_dir: Path) -> None:
    def forward(argv: list[str]) -> list[str]:
        ns = bench_parser().parse_args(["--launch", "--model", str(model_dir), *argv])
        assert ns.launch
        return engine_argv(ns)

    _via_workers(forward, str(model_dir))
    # Its --compare-offline engine is built from the same flags.
    ns = bench_parser().parse_args(["--launch", "--model", str(model_dir), *full_argv()])
    assert_reaches(EngineArgs.from_cli_args(ns).create_engine_config(), str(model_dir))


@pytest.mark.parametrize(
    ("service", "role"), [("prefill_worker", "prefill"), ("decode_worker", "decode")]
)
def test_worker_services(model_dir: Path, service: str, role: str) -> None:
    config = config_from_args(service, role, ["--model", str(model_dir), *full_argv()])  # type: ignore[arg-type]
    assert config.role == role
    assert_reaches(config.engine, str(model_dir))


@pytest.mark.parametrize(
    "benchmark",
    [offline_throughput, step_breakdown, profile_step],
    ids=lambda m: m.__name__.rsplit(".", 1)[-1],
)
def test_engine_benchmarks(model_dir: Path, benchmark: Any) -> None:
    """The benchmarks that build an engine take every engine flag; they build it from the
    parsed flags (`LLM(model=ns.model, **engine_kwargs_from(ns))`)."""
    ns = benchmark.build_parser().parse_args(["--model", str(model_dir), *full_argv()])
    if benchmark is offline_throughput:
        assert not offline_throughput.on_cuda_defaults(ns)  # --device cpu: nothing to fill in
    assert_reaches(EngineArgs.from_cli_args(ns).create_engine_config(), str(model_dir))


def test_benchmarks_keep_their_engine_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_DTYPE", raising=False)  # the suite's float32 (tests/conftest.py)
    ns = offline_throughput.build_parser().parse_args([])
    assert not offline_throughput.on_cuda_defaults(ns)
    assert (ns.device, ns.dtype, ns.max_num_seqs, ns.max_num_batched_tokens) == (
        "cpu",
        "float32",
        256,
        2048,
    )
    ns = offline_throughput.build_parser().parse_args(["--device", "cuda", "--threads", "3"])
    assert offline_throughput.on_cuda_defaults(ns)
    assert (ns.dtype, ns.max_num_seqs, ns.max_num_batched_tokens, ns.num_threads) == (
        "bfloat16",
        1024,
        8192,
        3,
    )
    ns = step_breakdown.build_parser().parse_args([])
    assert (ns.model, ns.device, ns.max_num_seqs, ns.max_num_batched_tokens) == (
        "random:llama-3.1-8b",
        "cuda",
        512,
        8192,
    )
    ns = profile_step.build_parser().parse_args([])
    assert (ns.max_num_seqs, ns.max_num_batched_tokens, ns.max_model_len) == (512, 8192, 4096)
    ns = prefix_routing.build_parser().parse_args([])
    assert sorted(prefix_routing.worker_args(ns)) == sorted(
        ["--num-threads", "1", "--max-model-len", "1024", "--num-gpu-blocks", "192"]
    )
    ns = prefix_routing.build_parser().parse_args(["--prefill-blocks", "64"])
    assert ns.num_gpu_blocks == 64


def test_prefix_routing_forwards_every_flag(model_dir: Path) -> None:
    def forward(argv: list[str]) -> list[str]:
        ns = prefix_routing.build_parser().parse_args(["--model", str(model_dir), *argv])
        return list(prefix_routing.worker_args(ns))

    _via_workers(forward, str(model_dir))


def test_the_frontend_declares_model_and_cache_dir_as_the_engine_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The frontend's --model / --cache-dir are the engine's declarations (help, default,
    TANDEM_CACHE_DIR), not a copy; TANDEM_FRONTEND_MODEL still gives the model's default."""
    from tandem_services.frontend.config import build_parser as frontend_parser

    engine = argparse.ArgumentParser()
    add_engine_args(engine, environ={})
    declared = {a.dest: a.help for a in engine._actions}
    frontend = {a.dest: a.help for a in frontend_parser()._actions}
    for dest in ("model", "cache_dir"):
        assert frontend[dest] == declared[dest]
    ns = frontend_parser().parse_args(["--model", "m", "--cache-dir", "/c"])
    assert (ns.model, ns.cache_dir) == ("m", "/c")
    monkeypatch.setenv("TANDEM_FRONTEND_MODEL", "from-env")
    monkeypatch.setenv("TANDEM_CACHE_DIR", "/cache-env")
    ns = frontend_parser().parse_args([])
    assert (ns.model, ns.cache_dir) == ("from-env", "/cache-env")


def test_defaults_forward_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_DTYPE", raising=False)  # the suite's float32 (tests/conftest.py)
    # The served entry points forward against the workers' (served) defaults.
    for parser, defaults in (
        (serve_parser(), SERVING_ENGINE_DEFAULTS),
        (bench_parser(), SERVING_ENGINE_DEFAULTS),
        (generate_parser(), None),
    ):
        ns = parser.parse_args([])
        assert engine_argv(ns, exclude=("model", "cache_dir"), defaults=defaults) == []


def test_vllm_names_and_the_old_alias() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p, environ={})
    assert p.parse_args([]).enable_prefix_caching is True
    for argv in (["--no-prefix-caching"], ["--no-enable-prefix-caching"]):
        assert p.parse_args(argv).enable_prefix_caching is False
    ns = p.parse_args(
        ["--num-gpu-blocks-override", "9", "--scheduling-policy", "priority", "-tp", "1"]
    )
    assert (ns.num_gpu_blocks, ns.policy, ns.tensor_parallel_size) == (9, "priority", 1)
    assert p.parse_args(["--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"


def test_env_default_is_read_only_from_the_given_environment() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p, environ={"TANDEM_CACHE_DIR": "/from/env"})
    assert p.parse_args([]).cache_dir == "/from/env"
    assert p.parse_args(["--cache-dir", "/flag"]).cache_dir == "/flag"


def _refused_by_cli(command: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """`tandem COMMAND ARGV` run to its end; it must exit 2 (a refusal)."""
    out = subprocess.run(
        [sys.executable, "-m", "tandem.cli", command, *argv],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    return out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tensor-parallel-size", "0"], "tensor_parallel_size must be >= 1"),
        (["-pp", "2", "--nnodes", "2"], "several hosts (nnodes > 1) need --master-port"),
    ],
)
def test_bad_parallel_flags_are_refused_before_anything_starts(
    argv: list[str], message: str
) -> None:
    """`tandem serve` with a parallel setting that cannot work exits at once with one line
    naming it (no child starts: the engine flags are checked without resolving the model)."""
    out = _refused_by_cli("serve", argv)
    assert message in out.stderr
    assert "starting" not in out.stdout


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 2.5}, "max_num_seqs must be an integer, got 2.5"),
        ({"block_size": True}, "block_size must be an integer, got True"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"seed": 2**64}, "seed must be in [-2**63, 2**63)"),
        ({"kv_cache_memory_gb": float("nan")}, "kv_cache_memory_gb must be a finite number"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be true or false"),
        ({"cuda_graph_sizes": 8}, "cuda_graph_sizes must be a list of integers"),
        ({"num_threads": -1}, "num_threads must be >= 0"),
    ],
)
def test_engine_arguments_of_a_wrong_type_are_refused_by_name(
    kwargs: dict[str, Any], message: str
) -> None:
    """`LLM(...)` passes its keywords as given (the command line's parser types its own): a
    value of the wrong type is a ConfigError naming the argument, not a TypeError (or a
    silently truthy string) from deep inside the engine's set-up."""
    with pytest.raises(ConfigError) as info:
        EngineArgs(**kwargs).create_engine_config(resolve=False)
    assert message in str(info.value)
    # The same values of the right type pass.
    good = EngineArgs(max_num_seqs=2, block_size=16, seed=-1, cuda_graph_sizes=[8, 16])
    good.create_engine_config(resolve=False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["hi", "--max-tokens", "0"], "max_tokens must be >= 1, got 0"),
        (["hi", "--temperature", "nan"], "temperature must be in [0, 100], got nan"),
        (["hi", "--max-num-seqs", "0"], "max_num_seqs must be >= 1, got 0"),
    ],
)
def test_generate_refuses_a_bad_value_in_one_line_before_loading(
    argv: list[str], message: str
) -> None:
    """`tandem generate` with a bad sampling value or engine flag exits 2 with one line
    naming it (was a traceback after the model had loaded)."""
    out = _refused_by_cli("generate", argv)
    assert out.stderr.strip() == f"tandem generate: error: {message}"

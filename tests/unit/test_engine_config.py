"""The config set, resolved once: the model path, its HF config and max_model_len are decided
in `tandem.loader.resolve` (called by `EngineArgs.create_engine_config()` and the engine), and
the engine reads them instead of loading or patching its own."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.config import (
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    QuantizationConfig,
    SamplerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from tandem.engine_args import EngineArgs
from tandem.loader.resolve import resolve_engine_config, resolve_model_config

CONTEXT = 512


@pytest.fixture(scope="module")
def config_only_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("resolve-model")
    LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
    ).save_pretrained(path)
    return path


def test_max_model_len_from_the_model(config_only_model: Path) -> None:
    config = EngineArgs(model=str(config_only_model)).create_engine_config()
    assert config.is_resolved
    assert config.model.model_path == config_only_model
    assert config.model.hf_config.max_position_embeddings == CONTEXT
    assert config.model.max_model_len == CONTEXT
    assert config.scheduler.max_model_len == CONTEXT


def test_the_users_max_model_len_is_kept(config_only_model: Path) -> None:
    config = EngineArgs(model=str(config_only_model), max_model_len=100).create_engine_config()
    assert (config.model.max_model_len, config.scheduler.max_model_len) == (100, 100)


def test_a_too_long_max_model_len_is_refused_naming_it(config_only_model: Path) -> None:
    args = EngineArgs(model=str(config_only_model), max_model_len=CONTEXT + 1)
    with pytest.raises(ConfigError, match=rf"max_model_len {CONTEXT + 1} exceeds .*\({CONTEXT}\)"):
        args.create_engine_config()


def test_without_chunked_prefill_the_budget_is_checked_against_the_decided_length(
    config_only_model: Path,
) -> None:
    args = EngineArgs(
        model=str(config_only_model), enable_chunked_prefill=False, max_num_batched_tokens=256
    )
    args.create_engine_config(resolve=False)  # the length is not known yet
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be >= max_model_len"):
        args.create_engine_config()


def test_resolution_happens_once(config_only_model: Path) -> None:
    unresolved = EngineArgs(model=str(config_only_model)).create_engine_config(resolve=False)
    assert not unresolved.is_resolved and unresolved.model.hf_config is None
    assert unresolved.model.max_model_len == 0 and unresolved.scheduler.max_model_len == 0
    resolved = resolve_engine_config(unresolved)
    assert resolve_engine_config(resolved) is resolved
    assert resolve_model_config(resolved.model) is resolved.model


def test_resolved_config_pickles(config_only_model: Path) -> None:
    config = EngineArgs(model=str(config_only_model), max_num_seqs=5).create_engine_config()
    back = pickle.loads(pickle.dumps(config))
    assert back == config and back.is_resolved
    assert back.model.hf_config.to_dict() == config.model.hf_config.to_dict()
    assert resolve_engine_config(back) is back  # nothing is loaded again on the other side


def test_parallel_config_sizes_backends_and_hosts() -> None:
    assert ParallelConfig().world_size == 1 and not ParallelConfig().uses_multiproc
    two = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert two.world_size == 6 and two.uses_multiproc and two.ranks_per_node == 6
    assert ParallelConfig(distributed_executor_backend="mp").uses_multiproc
    with pytest.raises(ConfigError, match="pipeline_parallel_size must be >= 1"):
        ParallelConfig(pipeline_parallel_size=0)
    with pytest.raises(ConfigError, match="uni runs one rank"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ConfigError, match="do not split evenly over nnodes 2"):
        ParallelConfig(tensor_parallel_size=3, nnodes=2, master_port=1234)
    with pytest.raises(ConfigError, match="node_rank 2 outside"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1234)
    hosts = ParallelConfig(tensor_parallel_size=4, nnodes=2, master_port=1234)
    assert hosts.ranks_per_node == 2


def test_parallel_split_is_checked_against_the_model(config_only_model: Path) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(config_only_model)
    heads, kv = hf.num_attention_heads, hf.num_key_value_heads
    ParallelConfig(tensor_parallel_size=heads).check_model(hf)  # KV heads replicated
    with pytest.raises(ConfigError, match=f"num_attention_heads {heads} is not divisible"):
        EngineArgs(
            model=str(config_only_model), tensor_parallel_size=heads + 1
        ).create_engine_config()
    if kv > 1:
        assert heads % kv == 0
    with pytest.raises(ConfigError, match="exceeds the model's"):
        ParallelConfig(pipeline_parallel_size=hf.num_hidden_layers + 1).check_model(hf)


def test_kv_cache_dtype_is_validated_and_settable() -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp4")  # type: ignore[arg-type]
    assert CacheConfig(kv_cache_dtype="fp8_e4m3").is_fp8_kv_cache
    config = EngineArgs(kv_cache_dtype="bfloat16").create_engine_config(resolve=False)
    assert config.cache.kv_cache_dtype == "bfloat16"


def test_engine_args_are_the_config_fields_with_the_same_defaults() -> None:
    """EngineArgs is generated from the config classes: same names, same defaults, no extras."""
    import dataclasses

    expected: dict[str, object] = {}
    for cls in (
        ModelConfig,
        CacheConfig,
        SchedulerConfig,
        ParallelConfig,
        DeviceConfig,
        SpeculativeConfig,
        StructuredOutputsConfig,
        SamplerConfig,
        QuantizationConfig,
    ):
        for f in dataclasses.fields(cls):
            if f.init and not f.metadata.get("resolved"):
                expected[f.name] = f.default
    args = EngineArgs()
    assert {name: getattr(args, name) for name in EngineArgs.field_names()} == expected
    assert "extra" not in EngineArgs.field_names()
    built = args.create_engine_config(resolve=False)
    assert built == EngineConfig(
        ModelConfig(), CacheConfig(), SchedulerConfig(), DeviceConfig(), ParallelConfig()
    )


def test_the_engine_reads_the_resolved_config(
    tiny_model_path: Callable[[str], Path],
) -> None:
    """The engine, its runner and the model all hold the one HF config object resolution
    loaded, and the one max_model_len it decided."""
    from tandem.engine.core import EngineCore

    config = EngineArgs(
        model=str(tiny_model_path("llama")),
        max_model_len=96,
        device="cpu",
        num_gpu_blocks=16,
        num_threads=1,
    ).create_engine_config()
    engine = EngineCore(config)
    hf_config = config.model.hf_config
    assert engine.model_runner.hf_config is hf_config
    assert engine.model_runner.model.hf_config is hf_config
    assert engine.model_path == config.model.model_path
    assert engine.max_model_len == engine.model_runner.max_model_len == 96
    assert engine.scheduler.max_model_len == 96

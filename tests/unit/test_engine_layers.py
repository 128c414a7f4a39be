"""The engine's layers on the CPU: EngineCore -> Executor -> Worker -> ModelRunner, the input
batch's block table and slot mapping, the attention backend's tuning hook, and shutdown
freeing the KV cache and the weights."""

from __future__ import annotations

import contextlib
import gc
import json
import shutil
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tandem.engine.core import EngineCore
from tandem.engine_args import EngineArgs
from tandem.executor import UniprocExecutor
from tandem.layers.attention.torch_backend import TorchAttentionBackend
from tandem.loader import load_hf_config
from tandem.request import EngineCoreRequest
from tandem.worker.input_batch import InputBatch
from tandem.worker.worker import Worker

ENGINE_ARGS: dict[str, object] = dict(
    device="cpu", dtype="float32", num_gpu_blocks=32, max_model_len=256, max_num_seqs=8
)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_path) -> Path:
    return tiny_model_path("llama")


def params(n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


# ----------------------------------------------------------------- layering


def test_engine_drives_one_worker_through_the_executor(tiny_llama: Path) -> None:
    with LLM(model=str(tiny_llama), **ENGINE_ARGS) as llm:
        engine = llm.engine
        assert isinstance(engine.executor, UniprocExecutor)
        worker = engine.executor.driver_worker
        assert engine.model_runner is worker.model_runner
        assert engine.kv_cache is worker.model_runner.kv_cache
        assert worker.num_blocks == engine.num_blocks == 32
        m = worker.model_runner.model
        assert tuple(engine.kv_cache.shape) == (
            32,
            m.num_layers,
            2,
            engine.block_size,
            m.num_kv_heads,
            m.head_size,
        )
        # Each layer's cache is a view of the one tensor.
        for view in worker.model_runner.kv_caches:
            assert view.untyped_storage().data_ptr() == engine.kv_cache.untyped_storage().data_ptr()
        out = llm.generate([[5, 6, 7, 8]], params(), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 6


def test_kv_sizing_on_cpu_follows_kv_cache_memory_gb(tiny_llama: Path) -> None:
    config = EngineArgs(
        model=str(tiny_llama), device="cpu", dtype="float32", kv_cache_memory_gb=0.001
    ).create_engine_config()
    worker = Worker(config, tiny_llama, load_hf_config(tiny_llama), 256, None)
    per_block = worker.model_runner.kv_bytes_per_block()
    assert per_block == 4 * int(np.prod(worker.model_runner.kv_cache_shape(1)))
    assert worker.determine_num_blocks() == max(int(0.001 * (1 << 30) // per_block), 1) > 1
    worker.shutdown()


def test_profile_run_compiles_long_and_continued_prefills_on_start_up(
    tiny_model_path, tmp_path: Path
) -> None:
    """Beside the largest step, the start-up forwards run one fresh request past 1,024 tokens
    and decodes beside a chunk continuing a cached prefix, so their kernels do not compile in
    a served request's time to first token; each forward writes only blocks of its scratch
    cache, whose size `profile_num_blocks` gives, and the outputs stay finite."""
    path = tmp_path / "tiny-llama-4k"
    shutil.copytree(tiny_model_path("llama"), path)
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(hf, max_position_embeddings=4096)))
    args = dict(ENGINE_ARGS, max_model_len=4096, max_num_batched_tokens=1536)
    config = EngineArgs(model=str(path), **args).create_engine_config()
    worker = Worker(config, path, load_hf_config(path), 4096, None)
    runner = worker.model_runner
    planned: list[list[tuple[int, int]]] = []
    plan_step = runner.attn_backend.plan_step

    def recording_plan_step(metadata, *args, **kwargs):  # type: ignore[no-untyped-def]
        qsl = metadata.query_start_loc_cpu
        queries = [qsl[i + 1] - qsl[i] for i in range(metadata.num_reqs)]
        planned.append(list(zip(queries, metadata.seq_lens_cpu, strict=True)))
        return plan_step(metadata, *args, **kwargs)

    runner.attn_backend.plan_step = recording_plan_step  # type: ignore[method-assign]
    steps = runner.profile_steps()
    assert steps[0] == [(1024, 0), (512, 0)]
    assert steps[1] == [(1536, 0)]
    assert steps[2] == [(1, 1024)] * 4 + [(512, 1024)]
    blocks = runner.profile_num_blocks()
    bs = runner.block_size
    assert blocks == max(sum(-(-(q + c) // bs) for q, c in reqs) for reqs in steps)
    scratch = torch.zeros(runner.kv_cache_shape(blocks + 1))
    scratch[blocks].fill_(float("nan"))  # one block past the scratch: never read or written
    runner.profile_run(scratch)
    assert planned == [[(q, q + c) for q, c in reqs] for reqs in steps]
    assert torch.isfinite(scratch[:blocks]).all()
    assert torch.isnan(scratch[blocks]).all()
    # Small limits: no request past them, the mixed step fits the budget and the model length.
    small = EngineArgs(model=str(path), **ENGINE_ARGS).create_engine_config()
    small_runner = Worker(small, path, load_hf_config(path), 256, None).model_runner
    for reqs in small_runner.profile_steps():
        assert sum(q for q, _ in reqs) <= small.scheduler.max_num_batched_tokens
        assert len(reqs) <= small.scheduler.max_num_seqs
        assert all(q + c <= 256 for q, c in reqs)
    worker.shutdown()


class _TuneProbe(TorchAttentionBackend):
    """The torch backend, recording the tuning hooks' calls."""

    def __init__(self) -> None:
        self.tuned: list[tuple[torch.Tensor, dict[str, int]]] = []
        self.startup_runs = 0

    def startup_tuning(self) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def run() -> Iterator[None]:
            self.startup_runs += 1
            yield

        return run()

    def tune(
        self, kv_cache: torch.Tensor, *, num_heads: int, max_num_reqs: int, max_seq_len: int
    ) -> str | None:
        self.tuned.append(
            (
                kv_cache,
                dict(num_heads=num_heads, max_num_reqs=max_num_reqs, max_seq_len=max_seq_len),
            )
        )
        return "probe"


def test_kernel_tuning_goes_through_the_backend_on_the_engines_cache(tiny_llama: Path) -> None:
    """The runner hands the backend one layer's view of the engine's own KV cache, with the
    engine's limits, once the cache exists; the profile forward runs inside startup_tuning."""
    config = EngineArgs(model=str(tiny_llama), **ENGINE_ARGS).create_engine_config()
    worker = Worker(config, tiny_llama, load_hf_config(tiny_llama), 200, None)
    runner = worker.model_runner
    probe = _TuneProbe()
    runner.attn_backend = probe
    scratch = torch.zeros(runner.kv_cache_shape(runner.profile_num_blocks()))
    runner.profile_run(scratch)
    assert probe.startup_runs == 1
    assert probe.tuned == []
    worker.initialize_kv_cache(12)
    assert len(probe.tuned) == 1
    kv, limits = probe.tuned[0]
    assert runner.kv_cache is not None
    assert kv.untyped_storage().data_ptr() == runner.kv_cache.untyped_storage().data_ptr()
    assert tuple(kv.shape) == tuple(runner.kv_cache[:, 0].shape)
    assert limits == dict(num_heads=runner.model.num_heads, max_num_reqs=8, max_seq_len=200)
    worker.shutdown()


# ----------------------------------------------------------------- input batch


def _new(req_id: str, n_prompt: int, block_ids: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(range(100, 100 + n_prompt)),
        output_token_ids=[],
        sampling_params=params(),
        block_ids=block_ids,
        num_computed_tokens=computed,
    )


def test_input_batch_slot_mapping_and_rows() -> None:
    batch = InputBatch(block_size=4, max_num_seqs=2)
    a = batch.add_request(_new("a", 6, [7, 3]), None, None)
    b = batch.add_request(_new("b", 3, [5], computed=1), None, None)
    so = SchedulerOutput(num_scheduled_tokens={"a": 6, "b": 2}, total_num_scheduled_tokens=8)
    inp = batch.prepare(so, ["a", "b"], {})
    assert inp.input_ids.tolist() == [100, 101, 102, 103, 104, 105, 101, 102]
    assert inp.positions.tolist() == [0, 1, 2, 3, 4, 5, 1, 2]
    # block_table[pos // 4] * 4 + pos % 4
    assert inp.slot_mapping.tolist() == [28, 29, 30, 31, 12, 13, 21, 22]
    assert inp.query_start_loc.tolist() == [0, 6, 8]
    assert inp.seq_lens.tolist() == [6, 3]
    assert inp.sampled_rows == [0, 1]
    assert inp.fill_dst == [] and not inp.is_decode_only
    # A running request's new block lands in its row; a dropped request's row is reused.
    batch.update_cached([CachedRequestData("a", [9], 6)])
    assert a.block_ids == [7, 3, 9]
    assert batch.block_table_rows[a.row, :3].tolist() == [7, 3, 9]
    batch.drop_requests(["b"])
    assert "b" not in batch.requests
    c = batch.add_request(_new("c", 2, [1]), None, None)
    assert c.row == b.row
    # More requests than rows: the table grows and keeps the rows it had.
    d = batch.add_request(_new("d", 2, [2, 4, 6, 8, 10]), None, None)
    assert batch.block_table_rows.shape[0] >= 3
    assert batch.block_table_rows[a.row, :3].tolist() == [7, 3, 9]
    assert batch.block_table_rows[d.row, :5].tolist() == [2, 4, 6, 8, 10]


def test_input_batch_decode_reads_the_previous_steps_ids() -> None:
    """A token the previous step samples is filled on the device: its row is listed."""
    batch = InputBatch(block_size=4, max_num_seqs=4)
    batch.add_request(_new("a", 3, [2], computed=2), None, None)
    batch.add_request(_new("b", 2, [6], computed=2), None, None)
    so = SchedulerOutput(num_scheduled_tokens={"a": 1, "b": 1}, total_num_scheduled_tokens=2)
    inp = batch.prepare(so, ["a", "b"], {"b": 3})
    assert inp.is_decode_only
    assert inp.input_ids.tolist() == [102, 0]
    assert (inp.fill_dst, inp.fill_src) == ([1], [3])
    assert inp.slot_mapping.tolist() == [10, 26]
    with pytest.raises(RuntimeError, match="not sampled by the previous step"):
        batch.prepare(so, ["a", "b"], {})


# ----------------------------------------------------------------- shutdown


def test_shutdown_frees_the_kv_cache_and_the_weights(tiny_llama: Path) -> None:
    llm = LLM(model=str(tiny_llama), async_scheduling="on", **ENGINE_ARGS)
    engine = llm.engine
    engine.add_request(EngineCoreRequest("r", [5, 6, 7], params(20), eos_token_id=None))
    engine.step()
    engine.step()  # a step in flight, as when a server stops mid-request
    kv = weakref.ref(engine.kv_cache)
    weights = [weakref.ref(p) for p in engine.model_runner.model.parameters()]
    assert weights
    llm.shutdown()
    gc.collect()
    assert kv() is None, "the KV cache outlived shutdown"
    assert all(w() is None for w in weights), "weights outlived shutdown"
    assert engine.model_runner.cuda_graphs.graphs == {}
    llm.shutdown()  # idempotent
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        _ = engine.kv_cache
    engine.stats()  # the scheduler stays readable
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()


def test_llm_context_manager_and_engine_core_shutdown(tiny_llama: Path) -> None:
    with LLM(model=str(tiny_llama), **ENGINE_ARGS) as llm:
        kv = weakref.ref(llm.engine.kv_cache)
        llm.generate([[3, 4, 5]], params(), use_tqdm=False)
    gc.collect()
    assert kv() is None
    core = EngineCore(EngineArgs(model=str(tiny_llama), **ENGINE_ARGS).create_engine_config())
    kv = weakref.ref(core.kv_cache)
    core.shutdown()
    gc.collect()
    assert kv() is None

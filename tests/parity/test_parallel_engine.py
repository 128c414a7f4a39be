"""Tensor and pipeline parallel through the MultiprocExecutor on the CPU (gloo): one rank
process per rank, real torch.distributed groups. Greedy and seeded tokens must equal one
rank's, logprobs (and one request's prompt logprobs) within 1e-4; a SIGKILLed rank fails the
engine at once with a clear error and leaves no process behind; a split the model cannot take
is refused before anything starts.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.config import ConfigError
from tandem.executor.multiproc import MultiprocExecutor, RankFailedError
from tests.ports import free_port

PROMPTS = [[5, 9, 33, 7, 100, 41, 8], list(range(40, 75)), [300, 2, 3, 17]]
MAX_TOKENS = 10


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(
        temperature=0.9, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1
    )
    # The 35-token prompt's logprobs too: its chunks' rows through every rank layout.
    return [greedy, seeded.clone(prompt_logprobs=2), greedy]


def _llm(path: Path, **kwargs: Any) -> LLM:
    # A 16-token budget: the 35-token prompt is chunked beside the others' decodes.
    defaults: dict[str, Any] = {
        "device": "cpu",
        "dtype": "float32",
        "num_gpu_blocks": 64,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 4,
        "max_model_len": 1024,
    }
    return LLM(str(path), **{**defaults, **kwargs})


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    got = []
    for o, prompt in zip(outs, PROMPTS, strict=True):
        c = o.outputs[0]
        chosen = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [], strict=True)]
        if o.prompt_logprobs is not None:  # each prompt token's logprob after the first
            chosen += [e[t].logprob for t, e in zip(prompt[1:], o.prompt_logprobs[1:], strict=True)]
        got.append((list(c.token_ids), chosen))
    return got


def _assert_pool_whole(llm: LLM) -> None:
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    assert pool.is_whole
    pool.check_invariants()


def _assert_same(ours: list[Any], ref: list[Any]) -> None:
    for (tokens, lps), (ref_tokens, ref_lps) in zip(ours, ref, strict=True):
        assert tokens == ref_tokens
        assert len(tokens) == MAX_TOKENS
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < 1e-4


def _run(path: Path, base: dict[str, Any] | None = None, **kwargs: Any) -> list[Any]:
    llm = _llm(path, **(base or {}), **kwargs)
    try:
        if kwargs:
            assert isinstance(llm.engine.executor, MultiprocExecutor)
        got = _generate(llm)
        _assert_pool_whole(llm)
        return got
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("arch", "layouts"),
    [
        ("llama", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}]),
        ("qwen2", [{"tensor_parallel_size": 2, "pipeline_parallel_size": 2}]),
        ("llama3", [{"distributed_executor_backend": "mp"}]),
        # Sliding and global layers: one KV cache group per kind on every rank (a block
        # holds one group's layers: twice the blocks for the same tokens).
        ("gemma3", [{"tensor_parallel_size": 2}]),
    ],
)
def test_parallel_layouts_equal_one_rank(
    arch: str, layouts: list[dict[str, Any]], tiny_model_path
) -> None:
    path = tiny_model_path(arch)
    base = {"num_gpu_blocks": 160} if arch == "gemma3" else None
    ref = _run(path, base)
    for layout in layouts:
        _assert_same(_run(path, base, **layout), ref)


def test_smollm2_tensor_parallel_equals_one_rank(smollm2_path: Path) -> None:
    # 9 query heads, 3 KV heads: TP = 3 (each rank one KV head); PP = 2 splits 30 layers.
    ref = _run(smollm2_path)
    _assert_same(_run(smollm2_path, tensor_parallel_size=3), ref)


def test_killed_rank_fails_the_engine_and_leaves_nothing(tiny_model_path) -> None:
    llm = _llm(tiny_model_path("llama"), tensor_parallel_size=2)
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor)
    pids = executor.rank_pids
    assert len(pids) == 2 and all(pids)
    try:
        _generate(llm)  # the ranks serve
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 .*SIGKILL"):
            _generate(llm)
        assert time.monotonic() - t0 < 5.0
        # Every rank process is gone and reaped; the engine refuses further work clearly.
        for pid in pids:
            with pytest.raises(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        with pytest.raises(RankFailedError, match="rank 1"):
            _generate(llm)
        _assert_pool_whole(llm)
    finally:
        llm.shutdown()


def test_rank_that_fails_to_start_is_named(tiny_model_path) -> None:
    # Rank 1 is given a core this process may not use: its worker refuses to bind.
    cores = sorted(os.sched_getaffinity(0))
    with pytest.raises(RankFailedError, match=r"rank 1 failed to start: .*cpu_cores"):
        _llm(
            tiny_model_path("llama"),
            tensor_parallel_size=2,
            cpu_cores=f"{cores[0]},{max(cores) + 1000}",
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 3}, "num_attention_heads 4 is not divisible"),
        ({"pipeline_parallel_size": 3}, "pipeline_parallel_size 3 exceeds the model's 2 layers"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "use mp"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
    ],
)
def test_bad_splits_are_refused_before_start(
    kwargs: dict[str, Any], message: str, tiny_model_path
) -> None:
    with pytest.raises(ConfigError, match=message):
        _llm(tiny_model_path("llama"), **kwargs)


def test_more_gpu_ranks_than_devices_is_refused(tiny_model_path) -> None:
    import torch

    from tandem.executor.multiproc import check_devices

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError, match=r"needs \d+ GPUs, but \d+ are visible"):
        check_devices("cuda", None, count + 1)


def test_two_hosts_meet_at_the_rendezvous(tiny_model_path) -> None:
    """Node 1's ranks run in a process tree of their own (`tandem rank-host`), as on another
    host; they meet node 0's executor at the c10d rendezvous."""
    import subprocess
    import sys

    path = tiny_model_path("llama")
    ref = _run(path)
    port = free_port()
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    flags = ["--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32"]
    flags += ["--num-gpu-blocks", "64", "--max-num-batched-tokens", "16", "--max-num-seqs", "4"]
    flags += ["--max-model-len", "1024"]
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "rank-host",
            "--model",
            str(path),
            "--node-rank",
            "1",
            *common,
            *flags,
        ],
        start_new_session=True,
    )
    try:
        llm = _llm(
            path,
            tensor_parallel_size=2,
            nnodes=2,
            node_rank=0,
            master_addr="127.0.0.1",
            master_port=port,
        )
        try:
            executor = llm.engine.executor
            assert isinstance(executor, MultiprocExecutor)
            assert executor.rank_pids[1] is None  # not this host's
            _assert_same(_generate(llm), ref)
            _assert_pool_whole(llm)
        finally:
            llm.shutdown()
        assert follower.wait(timeout=30) == 0  # its rank stopped with the engine
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()


@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2}])
def test_expert_load_counts_every_routed_token(layout: dict[str, Any], tiny_model_path) -> None:
    """Engine stats carry the tokens routed to each expert of each MoE layer: every forwarded
    token goes to top_k experts of every layer (the prompts, then each output token but the
    last), in one rank or read from the ranks of a TP engine."""
    from transformers import AutoConfig

    path = tiny_model_path("mixtral")
    hf = AutoConfig.from_pretrained(path)
    llm = _llm(path, **layout)
    try:
        assert llm.engine.stats().expert_load == tuple(
            (0,) * hf.num_local_experts for _ in range(hf.num_hidden_layers)
        )
        _generate(llm)
        llm.engine._expert_load_read_at = float("-inf")  # read now, not a second later
        load = llm.engine.stats().expert_load
        assert load is not None and len(load) == hf.num_hidden_layers
        forwarded = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (MAX_TOKENS - 1)
        for row in load:
            assert len(row) == hf.num_local_experts
            assert sum(row) == hf.num_experts_per_tok * forwarded
    finally:
        llm.shutdown()
    dense = _llm(tiny_model_path("llama"))
    try:
        assert dense.engine.stats().expert_load is None
    finally:
        dense.shutdown()

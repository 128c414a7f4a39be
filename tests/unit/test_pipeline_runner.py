"""Pipeline parallel in the model runner, over gloo on the CPU: two processes, one stage each
(the tiny models' two layers split one and one), each a ModelRunner with a ParallelState made
from torch.distributed groups. The last stage is the driver: it runs the scheduler with async
scheduling (step N+1 launched before step N's result) and sends each SchedulerOutput to the
first stage, which only launches steps (it never asks for a result: the runner resolves them
itself). Greedy and seeded tokens and logprobs must equal one rank's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.distributed import GroupCoordinator, ParallelState
from tandem.engine_args import EngineArgs
from tandem.request import Request
from tandem.sampling_params import SamplingParams
from tests.ports import free_port

PROMPTS = [[5, 9, 33, 7, 100, 41, 8], list(range(40, 75)), [300, 2, 3]]
MAX_TOKENS = 12


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(
        temperature=0.9, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    return [greedy, seeded, greedy]


def _config(path: Path) -> Any:
    # A 16-token budget: the 35-token prompt is chunked beside the others' decodes.
    return EngineArgs(
        model=str(path),
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_gpu_blocks=64,
        block_size=16,
    ).create_engine_config()


def _runner(config: Any, parallel: ParallelState | None) -> Any:
    from tandem.worker.model_runner import ModelRunner

    m = config.model
    runner = ModelRunner(
        config, torch.device("cpu"), m.model_path, m.hf_config, m.max_model_len, None, parallel
    )
    runner.initialize_kv_cache(torch.zeros(runner.kv_cache_shape(config.cache.num_gpu_blocks)))
    return runner


def _drive(config: Any, runner: Any, send: Any = None) -> dict[str, Any]:
    """The engine's async loop: schedule N+1 and launch it before taking N's result. `send`
    hands each SchedulerOutput to the other stages first (None at the end)."""
    from tandem.core.scheduler import Scheduler

    sched = Scheduler(config.scheduler, config.cache, config.cache.num_gpu_blocks, 1024)
    for i, (prompt, params) in enumerate(zip(PROMPTS, _params(), strict=True)):
        sched.add_request(Request(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    logprobs: dict[str, list[Any]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    pending = None
    steps = 0
    while True:
        so = sched.schedule()
        step = None
        if not so.is_empty:
            if send is not None:
                send(so)
            step = runner.execute_async(so)
            steps += 1
        if pending is not None:
            out = pending[1].result()
            for rid, ids, lp in zip(out.req_ids, out.sampled_token_ids, out.logprobs, strict=True):
                tokens[rid] += ids
                if lp is not None:
                    logprobs[rid].extend(lp)
            sched.update_from_output(pending[0], out)
        pending = (so, step) if step is not None else None
        if pending is None and not sched.has_unfinished_requests():
            break
    if send is not None:
        send(None)
    runner.shutdown()
    return {"tokens": tokens, "logprobs": logprobs, "steps": steps}


def _stage_main(rank: int, port: int, path: Path, results: Any) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        cpu = torch.device("cpu")
        pair = GroupCoordinator([0, 1], rank, cpu, dist.new_group([0, 1]), dist.new_group([0, 1]))
        alone = GroupCoordinator([rank], rank, cpu)
        parallel = ParallelState(world=pair, tp=alone, pp=pair, ep=alone)
        config = _config(path)
        runner = _runner(config, parallel)
        stage = {
            "layer_range": runner.model.layer_range,
            "kv_shape": tuple(runner.kv_cache.shape),
            "driver": parallel.is_driver,
        }
        if rank == 1:
            result = _drive(config, runner, send=lambda so: pair.send_object(so, dst=0))
        else:
            steps = 0
            while (so := pair.recv_object(src=1)) is not None:
                runner.execute_async(so)
                steps += 1
            runner.shutdown()
            result = {"steps": steps}
        results.put((rank, {**stage, **result}))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_stages_equal_one_rank(arch: str, tiny_model_path) -> None:
    path = tiny_model_path(arch)
    config = _config(path)
    single = _drive(config, _runner(config, None))

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_stage_main, args=(r, port, path, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        assert "error" not in got[rank], got[rank]["error"]
    first, last = got[0], got[1]
    assert first["layer_range"] == (0, 1) and last["layer_range"] == (1, 2)
    # [num_blocks, stage_layers, 2, block, kv_heads, head_size]: one layer each.
    assert first["kv_shape"] == last["kv_shape"] == (64, 1, 2, 16, 2, 16)
    assert last["driver"] and not first["driver"]
    assert first["steps"] == last["steps"] == single["steps"] > MAX_TOKENS
    assert last["tokens"] == single["tokens"]
    assert all(len(t) == MAX_TOKENS for t in single["tokens"].values())
    for rid, ref in single["logprobs"].items():
        ours = last["logprobs"][rid]
        assert len(ours) == len(ref)
        for a, b in zip(ours, ref, strict=True):
            assert abs(a.logprobs[0] - b.logprobs[0]) < 1e-4

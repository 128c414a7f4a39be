"""A worker's bookkeeping stays paired with its engine when an abort overtakes an admission.

The servicer tracks a request in `EngineHost`, then asks the engine thread to add (prefill) or
reserve (decode) it. An abort handled between the two used to reach the engine first (a no-op
there), after which the add or reserve ran and its blocks were never freed. These tests play
that order on a real engine-core process with the SmolLM2 model and a real `EngineHost`, and check
that the engine ends with no request and a whole block pool.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tandem.core.outputs import EngineCoreOutput
from tandem.engine.core_client import AsyncMPClient
from tandem.engine.serial import Piggyback
from tandem.engine_args import EngineArgs
from tandem.request import EngineCoreRequest
from tandem.sampling_params import SamplingParams
from tandem_services.worker import engine_host as m
from tandem_services.worker.roles import worker_role


async def _worker(model: Path, role: str) -> tuple[AsyncMPClient, m.EngineHost]:
    holder: list[m.EngineHost] = []

    def on_step(outputs: list[EngineCoreOutput], pig: Piggyback) -> None:
        holder[0].tell(m.Step(outputs, pig.held_block_ids))

    args = EngineArgs(
        model=str(model), dtype="float32", device="cpu", kv_cache_memory_gb=0.05,
        max_model_len=512, num_threads=1,
    )  # fmt: skip
    thread = AsyncMPClient(
        args.create_engine_config(),
        on_step,
        worker_role(role).engine_options(publish_cache_events=False),
        name=f"engine-{role}",
    )
    engine = await thread.start()
    host = m.EngineHost(
        f"w-{role}", thread, engine.block_size, engine.max_model_len, 30.0, 5.0, worker_role(role)
    )
    holder.append(host)
    host.start()
    return thread, host


async def _engine_is_empty(thread: AsyncMPClient) -> bool:
    for _ in range(200):
        if (await thread.pool_state()).empty:
            return True
        await asyncio.sleep(0.02)
    return False


def _request(rid: str, max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(rid, list(range(10, 90)), params, eos_token_id=None)


async def _abort_before_add(model: Path, role: str) -> None:
    thread, host = await _worker(model, role)
    try:
        rid = f"{role}-1"
        tracked = await host.ask(
            m.Track(
                m.WorkerRequest(
                    rid, "frontend", role, "running", num_prompt_tokens=80, max_tokens=4,
                    admitted=False,
                )
            )
        )  # fmt: skip
        assert tracked
        # The abort overtakes the servicer's engine call.
        assert await host.ask(m.Abort([rid])) == 1
        req = _request(rid, 1 if role == "prefill" else 4)
        await thread.add_request(req, hold_kv=role == "prefill")
        host.tell(m.Admitted(rid))
        assert await _engine_is_empty(thread), "the aborted request kept engine state or blocks"
        assert await host.ask(m.Inflight()) == []
    finally:
        await host.close()
        await thread.shutdown()


def test_abort_before_prefill_admission_frees_everything(smollm2_path: Path) -> None:
    asyncio.run(_abort_before_add(smollm2_path, "prefill"))


def test_abort_before_unified_admission_frees_everything(smollm2_path: Path) -> None:
    asyncio.run(_abort_before_add(smollm2_path, "unified"))


async def _abort_before_reserve(model: Path) -> None:
    thread, host = await _worker(model, "decode")
    try:
        rid = "decode-1"
        tracked = await host.ask(
            m.Track(
                m.WorkerRequest(
                    rid, "frontend", "decode", "reserving", num_prompt_tokens=80, max_tokens=4,
                    num_emitted=1,
                )
            )
        )  # fmt: skip
        assert tracked
        assert await host.ask(m.Abort([rid])) == 1
        req = _request(rid, 4)
        result = await thread.reserve(req)
        assert result is not None
        host.tell(m.Reserved(rid, list(result[0])))
        assert await _engine_is_empty(thread), "the aborted reservation kept its blocks"
        assert await host.ask(m.Inflight()) == []
    finally:
        await host.close()
        await thread.shutdown()


def test_abort_before_reserve_frees_the_reservation(smollm2_path: Path) -> None:
    asyncio.run(_abort_before_reserve(smollm2_path))

"""One strategy object per worker role: everything a worker does differently by role.

`worker_role(config.role)` is called once, in `app.serve`; the servicer and `EngineHost` ask
the object and never test the role themselves. What a role decides:

===================  ===========================  ==========================  ================
                     UnifiedRole                  PrefillRole                 DecodeRole
===================  ===========================  ==========================  ================
role-specific RPCs   Prefill (no hand-off)        Prefill (with a hand-off)   Reserve,
                                                                              ReceiveKV,
                                                                              ConnectKV, WriteKV
admission            as asked                     max_tokens=1, hold_kv       (Reserve)
a step's output      emit                         first token, then hand-off  emit
an abort also        nothing                      aborts the remote           nothing
                                                  reservation
engine process       own KV cache                 shares its KV cache,        shares its KV
                                                  reports held blocks         cache
KV connector         none                         sender                      receiver
prefix publishing    yes                          yes                         no
===================  ===========================  ==========================  ================

RPCs every role serves (AddPrefilled, Abort, Stats, StreamOutputs) are not listed: the
worker's request state answers them (AddPrefilled finds no reservation except on a decode
worker). A role-specific RPC on the wrong role is refused with FAILED_PRECONDITION and the
text of `WorkerRole.refusal`.

The prefill hand-off (send the blocks, then AddPrefilled at the decode worker, releasing the
held blocks in every case) belongs to `PrefillRole`; its methods run on `EngineHost`'s event
loop, inside the engine host's message handling, and change its state through it.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import grpc

from tandem.core.outputs import EngineCoreOutput, FinishReason
from tandem.engine.core_proc import EngineProcOptions
from tandem.engine.ops import EngineOps
from tandem.kv_transfer.base import KVDestination
from tandem.request import EngineCoreRequest
from tandem_protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tandem_services.common.convert import output_to_proto
from tandem_services.worker.engine_host import EngineHost, HandoffDone, WorkerRequest, abort_output
from tandem_services.worker.states import Phase, Role, move

logger = logging.getLogger(__name__)

ROLE_TO_PROTO: dict[Role, common_pb2.WorkerRole.ValueType] = {
    Role.PREFILL: common_pb2.WORKER_ROLE_PREFILL,
    Role.DECODE: common_pb2.WORKER_ROLE_DECODE,
    Role.UNIFIED: common_pb2.WORKER_ROLE_UNIFIED,
}

# RPCs that only some roles serve.
ROLE_SPECIFIC_RPCS = frozenset({"Prefill", "Reserve", "ReceiveKV", "ConnectKV", "WriteKV"})
_DECODE_RPCS = frozenset({"Reserve", "ReceiveKV", "ConnectKV", "WriteKV"})

Batches = dict[str, list[worker_pb2.RequestOutput]]


class WorkerRole:
    """What differs between a unified, a prefill and a decode worker.

    Invariant: a worker has one role for its life, and each of its requests has that role as
    its `kind`.
    """

    role: ClassVar[Role]
    # The role-specific RPCs this role serves (a subset of ROLE_SPECIFIC_RPCS).
    rpcs: ClassVar[frozenset[str]]
    # The details of a FAILED_PRECONDITION refusal of an RPC this role does not serve.
    refusal_text: ClassVar[str]
    # Whether this worker moves KV blocks (and so builds a KV connector).
    has_kv_connector: ClassVar[bool]
    # Whether its prefix cache is worth publishing to the directory (routed by prefix).
    publishes_prefixes: ClassVar[bool]

    @property
    def proto(self) -> common_pb2.WorkerRole.ValueType:
        """The role as the protos name it."""
        return ROLE_TO_PROTO[self.role]

    def serves(self, rpc: str) -> bool:
        """Whether this role answers `rpc` (every RPC outside ROLE_SPECIFIC_RPCS: yes)."""
        return rpc not in ROLE_SPECIFIC_RPCS or rpc in self.rpcs

    def refusal(self, rpc: str) -> str | None:
        """The FAILED_PRECONDITION details for `rpc` on this role; None when it serves it."""
        return None if self.serves(rpc) else self.refusal_text

    def engine_options(self, publish_cache_events: bool) -> EngineProcOptions:
        """The engine-core process's options for this role."""
        return EngineProcOptions(
            report_held_blocks=self.hold_kv,
            publish_cache_events=publish_cache_events,
            share_kv_cache=self.has_kv_connector,
        )

    # ------------------------------------------------------------------ admission (Prefill)

    # Whether a Prefill call must carry a KV hand-off target (and only then may).
    needs_handoff: ClassVar[bool] = False
    # Whether the engine keeps a finished request's blocks until the worker releases them.
    hold_kv: ClassVar[bool] = False

    def admit(self, req: EngineCoreRequest) -> EngineCoreRequest:
        """The request as this role's engine runs it (a Prefill call's request)."""
        return req

    # ------------------------------------------------------------------ requests in flight

    def on_output(
        self, host: EngineHost, r: WorkerRequest, out: EngineCoreOutput,
        held: dict[str, list[int]], batches: Batches,
    ) -> None:  # fmt: skip
        """One step's output for `r` (tracked, not aborted): emit it to `r`'s destination.

        `held`: the held block ids of this step's finished `hold_kv` requests."""
        batches[r.destination].append(output_to_proto(out, r.num_emitted))
        r.num_emitted += len(out.new_token_ids)
        if out.finished:
            host.finish(r)

    def on_aborted(self, host: EngineHost, r: WorkerRequest) -> None:
        """`r` was aborted and has left the engine: what else its abort must do."""

    def on_handoff_done(self, host: EngineHost, msg: HandoffDone) -> None:
        """A KV hand-off ended (only a prefill worker starts them)."""


class UnifiedRole(WorkerRole):
    """Prefill and decode in one engine: outputs go straight to the destination."""

    role = Role.UNIFIED
    refusal_text = "not a decode worker"
    rpcs = frozenset({"Prefill"})
    has_kv_connector = False
    publishes_prefixes = True


class DecodeRole(WorkerRole):
    """Reserves blocks, receives a prefill worker's KV, then decodes (AddPrefilled)."""

    role = Role.DECODE
    refusal_text = "this is a decode worker"
    rpcs = _DECODE_RPCS
    has_kv_connector = True
    publishes_prefixes = False


class PrefillRole(WorkerRole):
    """Samples the first token with `max_tokens=1` and `hold_kv`, then hands the prompt's KV
    to the decode worker the call names and starts it there (AddPrefilled)."""

    role = Role.PREFILL
    refusal_text = "not a decode worker"
    rpcs = frozenset({"Prefill"})
    has_kv_connector = True
    publishes_prefixes = True
    needs_handoff = True
    hold_kv = True

    def admit(self, req: EngineCoreRequest) -> EngineCoreRequest:
        params = req.sampling_params
        req.sampling_params = params.clone(max_tokens=1, min_tokens=min(params.min_tokens, 1))
        return req

    def on_output(
        self, host: EngineHost, r: WorkerRequest, out: EngineCoreOutput,
        held: dict[str, list[int]], batches: Batches,
    ) -> None:  # fmt: skip
        if out.finish_reason == FinishReason.ABORT or not out.new_token_ids:
            if out.finished:
                # ERROR: the engine's message (the request's spec failed) goes as it is.
                failed = out.finish_reason == FinishReason.ERROR
                error = "" if failed else "aborted by the prefill engine"
                batches[r.destination].append(output_to_proto(out, r.num_emitted, error))
                host.finish(r)
                self.abort_remote_reservation(host, r)
            return
        # The prefill ran with max_tokens=1, so it always finishes here. It ends the request
        # for real on a stop (eos, stop token), at the caller's max_tokens, or at the context.
        really_done = (
            out.finish_reason == FinishReason.STOP
            or r.max_tokens == 1
            or r.num_prompt_tokens + 1 >= host.max_model_len
        )
        if really_done:
            batches[r.destination].append(output_to_proto(out, 0))
            host.finish(r)
            host.engine.tell(EngineOps.release_held, r.request_id)
            self.abort_remote_reservation(host, r)
            return
        first = EngineCoreOutput(
            out.request_id,
            out.new_token_ids,
            out.new_logprobs,
            num_cached_tokens=out.num_cached_tokens,
            prompt_logprobs=out.prompt_logprobs,
        )
        batches[r.destination].append(output_to_proto(first, 0))
        r.num_emitted = 1
        r.first_token_id = out.new_token_ids[0]
        move(r, Phase.HANDING_OFF)
        src = held.get(r.request_id)
        if src is None:
            self.on_handoff_done(host, HandoffDone(r.request_id, "the prefill engine kept no KV"))
            return
        host.spawn(self._handoff(host, r, src))

    def on_aborted(self, host: EngineHost, r: WorkerRequest) -> None:
        self.abort_remote_reservation(host, r)

    async def _handoff(self, host: EngineHost, r: WorkerRequest, src_block_ids: list[int]) -> None:
        handoff = r.handoff
        assert handoff is not None and host.connector is not None
        try:
            # The entries of the tables to move, by position (each group's, the window's
            # blocks alone in a sliding group): the same on both sides, one spec.
            indices = host.kv_cache_spec.handoff_indices(
                r.num_prompt_tokens, handoff.num_cached_tokens
            )
            dst = KVDestination(
                handoff.decode_worker_id,
                handoff.decode_address,
                tuple(handoff.block_ids[i] for i in indices),
                handoff.transport or "tcp",
            )
            src = [src_block_ids[i] for i in indices]
            await host.connector.send_blocks(r.request_id, src, dst)
            if r.aborted:
                host.tell(HandoffDone(r.request_id, "aborted"))
                return
            stub = worker_pb2_grpc.WorkerStub(host.channel(handoff.decode_address))
            await stub.AddPrefilled(
                worker_pb2.AddPrefilledRequest(
                    request_id=r.request_id, first_token_id=r.first_token_id
                ),
                timeout=host.rpc_timeout_s,
            )
            host.tell(HandoffDone(r.request_id))
        except Exception as exc:
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            host.tell(
                HandoffDone(
                    r.request_id,
                    f"KV hand-off to {handoff.decode_worker_id} failed: {detail}",
                )
            )

    def on_handoff_done(self, host: EngineHost, msg: HandoffDone) -> None:
        r = host.requests.get(msg.request_id)
        if r is None or r.phase != Phase.HANDING_OFF:
            return
        host.finish(r)
        host.engine.tell(EngineOps.release_held, r.request_id)
        if msg.error or r.aborted:
            self.abort_remote_reservation(host, r)
        if msg.error and not r.aborted:
            logger.warning("%s: %s", r.request_id, msg.error)
            host.emit({r.destination: [abort_output(r, msg.error)]})

    def abort_remote_reservation(self, host: EngineHost, r: WorkerRequest) -> None:
        """Free the blocks the decode worker reserved for `r` (no-op without a hand-off)."""
        if r.handoff is not None:
            host.spawn(self._remote_abort(host, r.handoff.decode_address, r.request_id))

    async def _remote_abort(self, host: EngineHost, address: str, request_id: str) -> None:
        stub = worker_pb2_grpc.WorkerStub(host.channel(address))
        try:
            await stub.Abort(
                common_pb2.AbortRequest(request_ids=[request_id]), timeout=host.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            logger.warning("abort of %s on %s failed: %s", request_id, address, exc.code().name)


_ROLES: dict[Role, type[WorkerRole]] = {
    Role.UNIFIED: UnifiedRole,
    Role.PREFILL: PrefillRole,
    Role.DECODE: DecodeRole,
}


def worker_role(role: Role | str) -> WorkerRole:
    """The strategy object for `role` (chosen once per worker)."""
    return _ROLES[Role(role)]()

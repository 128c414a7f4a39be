"""Proto <-> dataclass conversion at the edge of each service.

Inside a service everything is a tandem dataclass (SamplingParams, EngineCoreRequest,
EngineCoreOutput); protos exist only on the wire.
"""

from __future__ import annotations

import json
from typing import Any

from tandem.core.outputs import EngineCoreOutput, FinishReason, Logprobs
from tandem.request import EngineCoreRequest
from tandem.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from tandem_protos.v1 import common_pb2, worker_pb2

_OPTIONAL_PARAMS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
)

# The one mapping between the engine's FinishReason and the proto's. ERROR travels as ABORT
# with `invalid_request` set (output_to_proto); TOOL_CALLS, the frontend's own, never leaves
# as a proto (gRPC Generate sends STOP for it).
FINISH_TO_PROTO: dict[FinishReason | None, int] = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ABORT,
    FinishReason.TOOL_CALLS: common_pb2.FINISH_REASON_STOP,
}
FINISH_FROM_PROTO: dict[int, FinishReason | None] = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}


def structured_outputs_to_proto(spec: StructuredOutputsParams) -> common_pb2.StructuredOutputs:
    """The spec on the wire (a JSON schema given as a dict travels as its JSON text)."""
    kind = spec.kind
    if kind == "json":
        text = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        return common_pb2.StructuredOutputs(json=text)
    if kind == "choice":
        return common_pb2.StructuredOutputs(
            choice=common_pb2.Choices(choices=list(spec.choice or ()))
        )
    if kind == "json_object":
        return common_pb2.StructuredOutputs(json_object=True)
    return common_pb2.StructuredOutputs(**{kind: getattr(spec, kind)})


def structured_outputs_from_proto(msg: common_pb2.StructuredOutputs) -> StructuredOutputsParams:
    """Raises SamplingParamsError when no kind is set."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise SamplingParamsError(
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object"
        )
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(msg.choice.choices))
    return StructuredOutputsParams(**{kind: getattr(msg, kind)})


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )
    for name in _OPTIONAL_PARAMS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if params.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_outputs_to_proto(params.structured_outputs))
    if params.logit_bias:
        msg.logit_bias.update(params.logit_bias)
    if params.allowed_token_ids:
        msg.allowed_token_ids.extend(params.allowed_token_ids)
    if params.bad_words:
        msg.bad_words.extend(params.bad_words)
    for seq in params.bad_words_token_ids or ():
        msg.bad_words_token_ids.add(token_ids=seq)
    if params.extra_args:
        msg.extra_args_json = json.dumps(params.extra_args)
    return msg


def sampling_params_kwargs(msg: common_pb2.SamplingParams) -> dict[str, Any]:
    """The fields set in `msg`, as SamplingParams keyword arguments (unset: the default)."""
    kwargs: dict[str, Any] = {
        "stop": list(msg.stop),
        "stop_token_ids": list(msg.stop_token_ids),
        "ignore_eos": msg.ignore_eos,
        "include_stop_str_in_output": msg.include_stop_str_in_output,
    }
    for name in _OPTIONAL_PARAMS:
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(msg.structured_outputs)
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(msg.allowed_token_ids)
    if msg.bad_words:
        kwargs["bad_words"] = list(msg.bad_words)
    if msg.bad_words_token_ids:
        kwargs["bad_words_token_ids"] = [list(q.token_ids) for q in msg.bad_words_token_ids]
    if msg.extra_args_json:
        try:
            kwargs["extra_args"] = json.loads(msg.extra_args_json)
        except json.JSONDecodeError as exc:
            raise SamplingParamsError(f"extra_args_json is not JSON: {exc}") from None
        except RecursionError:
            raise SamplingParamsError("extra_args_json nests too deeply") from None
    return kwargs


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises SamplingParamsError (a ValueError) naming an invalid field."""
    return SamplingParams(**sampling_params_kwargs(msg))


def engine_request_to_proto(req: EngineCoreRequest) -> common_pb2.EngineRequest:
    msg = common_pb2.EngineRequest(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling_params=sampling_params_to_proto(req.sampling_params),
        priority=req.priority,
    )
    if req.eos_token_id is not None:
        msg.eos_token_id = req.eos_token_id
    if req.cache_salt is not None:
        msg.cache_salt = req.cache_salt
    return msg


def engine_request_from_proto(msg: common_pb2.EngineRequest) -> EngineCoreRequest:
    """Raises ValueError naming the problem."""
    return EngineCoreRequest(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling_params=sampling_params_from_proto(msg.sampling_params),
        eos_token_id=msg.eos_token_id if msg.HasField("eos_token_id") else None,
        priority=msg.priority,
        cache_salt=msg.cache_salt if msg.HasField("cache_salt") else None,
    )


def logprobs_to_proto(lp: Logprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_ids=lp.token_ids, logprobs=lp.logprobs, sampled_rank=lp.sampled_rank
    )


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> Logprobs:
    return Logprobs(
        token_ids=list(msg.token_ids), logprobs=list(msg.logprobs), sampled_rank=msg.sampled_rank
    )


def output_to_proto(
    out: EngineCoreOutput, output_index: int, error: str = ""
) -> worker_pb2.RequestOutput:
    """An engine output on the wire. Finish reason ERROR (the request's own spec failed)
    travels as ABORT with `invalid_request` and the engine's message as `error`."""
    invalid = out.finish_reason == FinishReason.ERROR
    if invalid and not error:
        error = str(out.stop_reason or "the request is invalid")
    msg = worker_pb2.RequestOutput(
        request_id=out.request_id,
        output_index=output_index,
        new_token_ids=out.new_token_ids,
        finish_reason=FINISH_TO_PROTO[out.finish_reason],
        num_cached_tokens=max(out.num_cached_tokens, 0),
        error=error,
        invalid_request=invalid,
    )
    if out.new_logprobs:
        msg.logprobs.extend(logprobs_to_proto(lp) for lp in out.new_logprobs)
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(logprobs_to_proto(lp) for lp in out.prompt_logprobs)
    if isinstance(out.stop_reason, int):
        msg.stop_token_id = out.stop_reason
    return msg

"""The whole system as real processes, disaggregated and unified (one deployment each).

Tests run in file order per deployment; the last ones stop workers and services on purpose.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import grpc
import httpx
import openai
import pytest

from tandem_protos.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tandem_services.launcher import Deployment
from tests.service.conftest import (
    BEAM_TOKENS,
    BEAM_WIDTH,
    CHAT,
    CONTINUE,
    CONTINUED,
    GRACE_S,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    PROMPT_LOGPROBS,
    PROMPTS,
    SEEDED,
    Reference,
    assert_pools_whole,
    interrupt_a_stream,
    list_workers,
    wait_until,
    worker_names,
)

pytestmark = pytest.mark.timeout(600)


def _client(dep: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{dep.http_address}/v1", api_key="unused", max_retries=0)


def _greedy(max_tokens: int = MAX_TOKENS) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens)


async def _grpc_generate(
    address: str, request: frontend_pb2.GenerateRequest
) -> tuple[str, list[int], list[frontend_pb2.GenerateResponse]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)
        responses = [r async for r in stub.Generate(request)]
    text = "".join(c.text for r in responses for c in r.choices)
    ids = [t for r in responses for c in r.choices for t in c.token_ids]
    return text, ids, responses


# ----------------------------------------------------------------------------- parity


def test_grpc_greedy_matches_offline(deployment: Deployment, reference: Reference) -> None:
    async def run() -> list[tuple[str, list[int], list[frontend_pb2.GenerateResponse]]]:
        return await asyncio.gather(
            *(
                _grpc_generate(
                    deployment.grpc_address,
                    frontend_pb2.GenerateRequest(text=p, sampling_params=_greedy()),
                )
                for p in PROMPTS
            )
        )

    for i, (text, ids, responses) in enumerate(asyncio.run(run())):
        assert ids == reference.token_ids[i], PROMPTS[i]
        assert text == reference.texts[i]
        last = responses[-1]
        assert last.usage.completion_tokens == len(ids)
        assert last.choices[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        # Streamed: more than one response per request.
        assert len(responses) > 1


def test_grpc_seeded_sampling_matches_offline(deployment: Deployment, reference: Reference) -> None:
    params = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, **SEEDED)

    async def run() -> list[tuple[str, list[int], list[frontend_pb2.GenerateResponse]]]:
        return await asyncio.gather(
            *(
                _grpc_generate(
                    deployment.grpc_address,
                    frontend_pb2.GenerateRequest(text=p, sampling_params=params),
                )
                for p in PROMPTS
            )
        )

    for i, (_, ids, _) in enumerate(asyncio.run(run())):
        assert ids == reference.seeded_token_ids[i], PROMPTS[i]


def test_grpc_chat_and_final_only(deployment: Deployment, reference: Reference) -> None:
    request = frontend_pb2.GenerateRequest(
        chat=frontend_pb2.Chat(
            messages=[frontend_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT]
        ),
        sampling_params=_greedy(),
        output_kind=frontend_pb2.OUTPUT_KIND_FINAL_ONLY,
    )
    text, ids, responses = asyncio.run(_grpc_generate(deployment.grpc_address, request))
    assert len(responses) == 1
    assert ids == reference.chat_token_ids
    assert text == reference.chat_text


def test_openai_completions_match_offline(deployment: Deployment, reference: Reference) -> None:
    client = _client(deployment)
    batch = client.completions.create(
        model="default", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0
    )
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == reference.texts
    assert batch.usage is not None
    assert batch.usage.completion_tokens == sum(len(t) for t in reference.token_ids)
    # Streamed deltas concatenate to the full text.
    stream = client.completions.create(
        model="default",
        prompt=PROMPTS[1],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference.texts[1]
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"


def test_completions_echo_the_prompt(deployment: Deployment, reference: Reference) -> None:
    """echo: the prompt's text (token ids decoded) before the output, streamed or not."""
    client = _client(deployment)
    kwargs = dict(model="default", max_tokens=MAX_TOKENS, temperature=0, echo=True)
    full = client.completions.create(prompt=PROMPTS[0], **kwargs)
    assert full.choices[0].text == PROMPTS[0] + reference.texts[0]
    stream = client.completions.create(prompt=PROMPTS[1], stream=True, **kwargs)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == PROMPTS[1] + reference.texts[1]
    ids = reference.token_ids[2][:3]
    echoed = client.completions.create(prompt=ids, **{**kwargs, "max_tokens": 2})
    plain = client.completions.create(prompt=ids, **{**kwargs, "max_tokens": 2, "echo": False})
    detok = httpx.post(f"http://{deployment.http_address}/detokenize", json={"tokens": ids})
    assert echoed.choices[0].text == detok.json()["prompt"] + plain.choices[0].text


def _same_prompt_logprobs(got: list[Any], ref: list[Any]) -> None:
    """vLLM's `prompt_logprobs` JSON against the offline LLM's, within 1e-4, rank for rank."""
    assert len(got) == len(ref) and got[0] is None and ref[0] is None
    for p, (g, r) in enumerate(zip(got[1:], ref[1:], strict=True), start=1):
        assert {int(t) for t in g} == set(r), p
        for t, entry in g.items():
            assert abs(entry["logprob"] - r[int(t)].logprob) < 1e-4, (p, t)
            assert entry["rank"] == r[int(t)].rank, (p, t)


def test_prompt_logprobs_match_offline(deployment: Deployment, reference: Reference) -> None:
    """The prompt's logprobs served as the offline LLM computes them (within 1e-4, ranks
    equal; the prefill worker computes them where disaggregated): completions'
    `prompt_logprobs`, chat's, echo with logprobs streamed to two choices (each headed by
    the prompt's tokens), and gRPC Generate's (on one response)."""
    client = _client(deployment)
    ids, ref, top = reference.prompt_ids, reference.prompt_logprobs, PROMPT_LOGPROBS
    greedy = dict(model="default", max_tokens=2, temperature=0)
    full = client.completions.create(
        prompt=PROMPTS[1], **greedy, extra_body={"prompt_logprobs": top}
    )
    _same_prompt_logprobs(full.choices[0].model_extra["prompt_logprobs"], ref)
    chat = client.chat.completions.create(
        messages=CHAT, **greedy, extra_body={"prompt_logprobs": top}
    )
    _same_prompt_logprobs(chat.model_extra["prompt_logprobs"], reference.chat_prompt_logprobs)

    stream = client.completions.create(
        prompt=ids, n=2, logprobs=top, echo=True, stream=True, **greedy
    )
    firsts: dict[int, Any] = {}
    for chunk in stream:
        for c in chunk.choices:
            firsts.setdefault(c.index, c.logprobs)
    assert sorted(firsts) == [0, 1]
    for lp in firsts.values():
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.tokens) >= len(ids) and lp.text_offset[0] == 0
        for p in range(1, len(ids)):
            assert abs(lp.token_logprobs[p] - ref[p][ids[p]].logprob) < 1e-4, p
            want = sorted(e.logprob for e in ref[p].values() if e.rank <= top)
            assert sorted(lp.top_logprobs[p].values()) == pytest.approx(want, abs=1e-4), p

    # echo with max_tokens 0 (vLLM's, what scoring harnesses send): the prompt alone.
    scored_text = client.completions.create(
        prompt=PROMPTS[1], echo=True, logprobs=0, **{**greedy, "max_tokens": 0}
    ).choices[0]
    assert scored_text.text == PROMPTS[1]
    assert len(scored_text.logprobs.tokens) == len(ids)
    got = scored_text.logprobs.token_logprobs
    assert got[0] is None
    assert got[1:] == pytest.approx([ref[p][ids[p]].logprob for p in range(1, len(ids))], abs=1e-4)

    request = frontend_pb2.GenerateRequest(
        token_ids=frontend_pb2.TokenIds(ids=ids),
        sampling_params=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=2, prompt_logprobs=top
        ),
    )
    _, _, responses = asyncio.run(_grpc_generate(deployment.grpc_address, request))
    [scored] = [r for r in responses if r.prompt_logprobs]
    assert len(scored.prompt_logprobs) == len(ids) - 1
    for p, lp in enumerate(scored.prompt_logprobs, start=1):
        assert lp.token_ids[0] == ids[p] and lp.sampled_rank == ref[p][ids[p]].rank
        assert abs(lp.logprobs[0] - ref[p][ids[p]].logprob) < 1e-4
    assert_pools_whole(deployment)


def test_cache_salt_and_prompt_truncation(deployment: Deployment, reference: Reference) -> None:
    """cache_salt: a repeated prompt reads its cached blocks only under the same salt (usage's
    cached tokens), over HTTP and gRPC, and a salted prompt's blocks are not an unsalted one's.
    truncate_prompt_tokens: the prompt's last k tokens, as a request of those alone gives
    (echoed as cut); -1 keeps a prompt within the context; more than the context is a 400."""
    client = _client(deployment)
    long = " ".join(reversed(PROMPTS)) * 3

    def cached(**extra: Any) -> int:
        r = client.completions.create(
            model="default", prompt=long, max_tokens=1, temperature=0, extra_body=extra
        )
        details = r.usage.prompt_tokens_details if r.usage else None
        return (details.cached_tokens or 0) if details else 0

    assert cached(cache_salt="alpha") == 0
    assert cached(cache_salt="alpha") > 0
    assert cached(cache_salt="beta") == 0
    assert cached() == 0
    request = frontend_pb2.GenerateRequest(
        text=long, sampling_params=_greedy(1), cache_salt="alpha"
    )
    _, _, responses = asyncio.run(_grpc_generate(deployment.grpc_address, request))
    assert responses[-1].usage.cached_tokens > 0

    ids = reference.prompt_ids
    k = len(ids) // 2
    greedy = dict(model="default", max_tokens=4, temperature=0, echo=True)
    cut = client.completions.create(prompt=ids, **greedy, extra_body={"truncate_prompt_tokens": k})
    alone = client.completions.create(prompt=ids[-k:], **greedy)
    assert cut.usage is not None and cut.usage.prompt_tokens == k
    assert cut.choices[0].text == alone.choices[0].text
    whole = client.completions.create(
        prompt=ids, **greedy, extra_body={"truncate_prompt_tokens": -1}
    )
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            prompt=ids, **greedy, extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN + 1}
        )
    assert "truncate_prompt_tokens" in str(info.value)
    assert_pools_whole(deployment)


def test_return_token_ids(deployment: Deployment, reference: Reference) -> None:
    """return_token_ids (vLLM's): the prompt's token ids and each choice's beside the text,
    on both endpoints; streamed, the prompt's once (the first chunk) and the choice's chunk
    by chunk. return_tokens_as_token_ids: logprobs' tokens written "token_id:<id>"."""
    client = _client(deployment)
    greedy = dict(model="default", max_tokens=MAX_TOKENS, temperature=0)
    ids = {"return_token_ids": True}
    full = client.completions.create(prompt=PROMPTS[1], **greedy, extra_body=ids)
    extra = full.choices[0].model_extra or {}
    assert extra["prompt_token_ids"] == reference.prompt_ids
    assert extra["token_ids"] == reference.token_ids[1]
    stream = client.completions.create(prompt=PROMPTS[1], stream=True, **greedy, extra_body=ids)
    chunks = [c.choices[0].model_extra or {} for c in stream if c.choices]
    assert chunks[0]["prompt_token_ids"] == reference.prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == reference.token_ids[1]

    chat = client.chat.completions.create(messages=CHAT, **greedy, extra_body=ids)
    assert (chat.choices[0].model_extra or {})["token_ids"] == reference.chat_token_ids
    chat_prompt = (chat.model_extra or {})["prompt_token_ids"]
    assert chat.usage is not None and len(chat_prompt) == chat.usage.prompt_tokens
    tokenized = httpx.post(f"http://{deployment.http_address}/tokenize", json={"messages": CHAT})
    assert chat_prompt == tokenized.json()["tokens"]
    streamed = list(
        client.chat.completions.create(messages=CHAT, stream=True, **greedy, extra_body=ids)
    )
    assert (streamed[0].model_extra or {})["prompt_token_ids"] == chat_prompt
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in streamed[1:])
    # The role chunk that opens a choice has no tokens.
    got = [
        t for c in streamed for ch in c.choices for t in (ch.model_extra or {}).get("token_ids", [])
    ]
    assert got == reference.chat_token_ids

    as_ids = (
        client.completions.create(
            prompt=PROMPTS[1], logprobs=2, **greedy, extra_body={"return_tokens_as_token_ids": True}
        )
        .choices[0]
        .logprobs
    )
    assert as_ids is not None and as_ids.tokens == [f"token_id:{t}" for t in reference.token_ids[1]]
    assert all(k.startswith("token_id:") for top in as_ids.top_logprobs or [] for k in top)


def test_continuous_usage_stats(deployment: Deployment, reference: Reference) -> None:
    """stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far,
    its completion tokens those sent, up to the final usage chunk's."""
    stream = _client(deployment).chat.completions.create(
        model="default",
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == len(reference.chat_token_ids)
    assert len({c.usage.prompt_tokens for c in chunks if c.usage is not None}) == 1
    sent = 0
    for c in chunks:
        sent += sum(1 for ch in c.choices if ch.delta.content)  # each holds a token or more
        assert c.usage is not None and c.usage.completion_tokens >= sent
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert text == reference.chat_text


_WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def test_responses_api_matches_chat(deployment: Deployment, reference: Reference) -> None:
    """OpenAI's Responses API through the official client: plain, streamed (raw events and
    the client's stream helper), cut by max_output_tokens, a conversation with instructions
    and a function call's round trip, a named tool, text.format, a stored response
    retrieved, continued by previous_response_id (whole and streamed) and deleted: each the
    chat completion of the same conversation; refusals are 400s naming the field, an
    unknown previous response a 404; pools whole."""
    client = _client(deployment)
    greedy = dict(model="default", temperature=0)
    question = CHAT[0]["content"]
    out = client.responses.create(input=question, max_output_tokens=MAX_TOKENS, **greedy)
    assert out.id.startswith("resp_") and out.status == "completed"
    assert [item.type for item in out.output] == ["message"]
    assert out.output_text == reference.chat_text
    assert out.usage is not None and out.usage.output_tokens == len(reference.chat_token_ids)
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens

    events = list(
        client.responses.create(
            input=[{"role": "user", "content": [{"type": "input_text", "text": question}]}],
            max_output_tokens=MAX_TOKENS,
            stream=True,
            **greedy,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == reference.chat_text == events[-1].response.output_text
    with client.responses.stream(input=question, max_output_tokens=MAX_TOKENS, **greedy) as s:
        assert s.get_final_response().output_text == reference.chat_text

    # The text's logprobs (include), as chat's for the same conversation.
    with_logprobs = client.responses.create(
        input=question,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        max_output_tokens=MAX_TOKENS,
        **greedy,
    )
    chat_lp = (
        client.chat.completions.create(
            messages=CHAT, logprobs=True, top_logprobs=2, max_tokens=MAX_TOKENS, **greedy
        )
        .choices[0]
        .logprobs
    )
    assert chat_lp is not None and chat_lp.content is not None
    got_lp = with_logprobs.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert got_lp is not None and len(got_lp) == len(reference.chat_token_ids)
    for mine, theirs in zip(got_lp, chat_lp.content, strict=True):
        assert mine.token == theirs.token and abs(mine.logprob - theirs.logprob) < 1e-5
        assert [t.token for t in mine.top_logprobs] == [t.token for t in theirs.top_logprobs]

    cut = client.responses.create(input=question, max_output_tokens=3, **greedy)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage is not None and cut.usage.output_tokens == 3
    assert reference.chat_text.startswith(cut.output_text)

    call = '{"city": "Paris"}'
    items: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": call},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    ]
    messages: list[Any] = [
        {"role": "system", "content": "Be brief."},
        items[0],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    chat_tool = {"type": "function", "function": {k: v for k, v in _WEATHER.items() if k != "type"}}
    turn = client.responses.create(
        instructions="Be brief.", input=items, tools=[_WEATHER], tool_choice="none",
        max_output_tokens=MAX_TOKENS, **greedy,
    )  # fmt: skip
    want = client.chat.completions.create(
        messages=messages, tools=[chat_tool], tool_choice="none", max_tokens=MAX_TOKENS, **greedy
    )
    assert turn.output_text == want.choices[0].message.content
    assert turn.usage is not None and want.usage is not None
    assert turn.usage.input_tokens == want.usage.prompt_tokens

    named = {"type": "function", "name": "get_weather"}
    for stream in (False, True):
        kw = dict(input="Weather in Paris?", tools=[_WEATHER], tool_choice=named, **greedy)
        if stream:
            evs = list(client.responses.create(max_output_tokens=40, stream=True, **kw))
            assert "response.function_call_arguments.done" in [e.type for e in evs]
            got = evs[-1].response
        else:
            got = client.responses.create(max_output_tokens=40, **kw)
        assert got.status == "completed" and [o.type for o in got.output] == ["function_call"]
        fn = got.output[0]
        assert fn.name == "get_weather" and isinstance(json.loads(fn.arguments)["city"], str)

    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema}}
    shaped = client.responses.create(input=question, text=fmt, max_output_tokens=40, **greedy)
    json_schema = {"name": "answer", "schema": schema}
    chat_shaped = client.chat.completions.create(
        messages=CHAT,
        response_format={"type": "json_schema", "json_schema": json_schema},
        max_tokens=40,
        **greedy,
    )
    assert shaped.output_text == chat_shaped.choices[0].message.content
    assert json.loads(shaped.output_text)["capital"] in ("Paris", "Rome")

    # Stored: retrieved as sent, continued by previous_response_id as the chat completion
    # of the whole conversation (the earlier instructions not carried over), then deleted.
    assert out.store is True
    assert client.responses.retrieve(out.id).output_text == out.output_text
    follow_up = "And of Italy?"
    nxt = client.responses.create(
        input=follow_up, previous_response_id=out.id, max_output_tokens=MAX_TOKENS, **greedy
    )
    assert nxt.previous_response_id == out.id
    whole = [*CHAT, {"role": "assistant", "content": out.output_text}]
    whole.append({"role": "user", "content": follow_up})
    want_next = client.chat.completions.create(messages=whole, max_tokens=MAX_TOKENS, **greedy)
    assert nxt.output_text == want_next.choices[0].message.content
    assert nxt.usage is not None and want_next.usage is not None
    assert nxt.usage.input_tokens == want_next.usage.prompt_tokens
    with client.responses.stream(
        input=follow_up, previous_response_id=out.id, max_output_tokens=MAX_TOKENS, **greedy
    ) as s:
        streamed = s.get_final_response()
    assert streamed.output_text == nxt.output_text
    assert client.responses.retrieve(streamed.id).output_text == nxt.output_text
    unstored = client.responses.create(input=question, store=False, max_output_tokens=3, **greedy)
    assert unstored.store is False
    client.responses.delete(out.id)
    for gone in (out.id, unstored.id):
        with pytest.raises(openai.NotFoundError, match="not found"):
            client.responses.retrieve(gone)
    url = f"http://{deployment.http_address}/v1/responses"
    r = httpx.post(
        url, json={"model": "default", "input": "x", "previous_response_id": out.id}, timeout=30
    )
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    for body, field in (
        ({"input": question, "previous_response_id": 7}, "previous_response_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": question, "messages": CHAT}, "messages"),
        ({"input": question, "tools": [{"type": "web_search"}]}, "tools"),
        ({}, "input"),
    ):
        r = httpx.post(url, json={"model": "default", **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    assert_pools_whole(deployment)


def test_beam_search_matches_offline(deployment: Deployment, reference: Reference) -> None:
    """use_beam_search (`n` beams) on both endpoints: the offline LLM.beam_search's beams, in
    order; each step's one-token requests leave the pools whole."""
    client = _client(deployment)
    beams = dict(model="default", n=BEAM_WIDTH, max_tokens=BEAM_TOKENS, temperature=0)
    extra = {"use_beam_search": True}
    out = client.completions.create(prompt=PROMPTS[1], **beams, extra_body=extra)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == reference.beams
    assert out.usage is not None and out.usage.prompt_tokens == len(reference.prompt_ids)
    chat = client.chat.completions.create(messages=CHAT, **beams, extra_body=extra)
    got = [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)]
    assert got == reference.chat_beams
    assert_pools_whole(deployment)


def test_openai_chat_matches_offline(deployment: Deployment, reference: Reference) -> None:
    client = _client(deployment)
    full = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert full.choices[0].message.content == reference.chat_text
    stream = client.chat.completions.create(
        model="default", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reference.chat_text


def test_stop_logprobs_n_seed(deployment: Deployment, reference: Reference) -> None:
    client = _client(deployment)
    # A stop string cuts the text before it; the request ends with finish_reason "stop".
    target = reference.texts[0]
    stop = target[len(target) // 2 : len(target) // 2 + 3]
    out = client.completions.create(
        model="default", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == target[: target.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    # Logprobs: one entry per token, the top ones sorted, the greedy token first among them.
    out = client.completions.create(
        model="default", prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 4 and len(lp.top_logprobs) == 4
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and max(top.values()) == pytest.approx(chosen, abs=1e-5)
    # n with a seed: n choices, reproducible.
    kwargs = dict(model="default", prompt=PROMPTS[2], max_tokens=6, temperature=1.0, n=2, seed=7)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert out.usage is not None and out.usage.completion_tokens == 4


def test_models_and_tokenize(deployment: Deployment) -> None:
    client = _client(deployment)
    models = client.models.list()
    assert [m.id for m in models.data] == ["default"]
    # OpenAI's retrieve (GET /v1/models/{model}): the same card, or a 404 naming the model.
    card = client.models.retrieve("default")
    assert card.id == "default" and card.model_dump() == models.data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="'nope' is not served"):
        client.models.retrieve("nope")

    async def run() -> tuple[frontend_pb2.ListModelsResponse, frontend_pb2.TokenizeResponse]:
        async with grpc.aio.insecure_channel(deployment.grpc_address) as channel:
            stub = frontend_pb2_grpc.FrontendStub(channel)
            listed = await stub.ListModels(frontend_pb2.ListModelsRequest())
            tok = await stub.Tokenize(frontend_pb2.TokenizeRequest(text=PROMPTS[0]))
            return listed, tok

    listed, tok = asyncio.run(run())
    assert listed.models[0].id == "default" and listed.models[0].max_model_len == MAX_MODEL_LEN
    assert tok.count == len(tok.token_ids) > 0


def test_http_tokenize_detokenize_and_chat_template_options(
    deployment: Deployment, reference: Reference
) -> None:
    """vLLM's /tokenize, /detokenize and /version, and a chat continuing its final message:
    served over HTTP and gRPC as the offline `LLM.chat` continues it, and /tokenize renders the
    conversation as the chat endpoint does (a completion of those ids is the same text)."""
    base = f"http://{deployment.http_address}"
    tok = httpx.post(f"{base}/tokenize", json={"prompt": PROMPTS[0]}, timeout=30).json()

    async def grpc_tokenize() -> frontend_pb2.TokenizeResponse:
        async with grpc.aio.insecure_channel(deployment.grpc_address) as channel:
            stub = frontend_pb2_grpc.FrontendStub(channel)
            return await stub.Tokenize(frontend_pb2.TokenizeRequest(text=PROMPTS[0]))

    assert tok["tokens"] == list(asyncio.run(grpc_tokenize()).token_ids)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(f"{base}/detokenize", json={"tokens": tok["tokens"]}, timeout=30)
    assert back.json() == {"prompt": PROMPTS[0]}
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [-1]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(f"{base}/version", timeout=30).json()["version"]

    client = _client(deployment)
    chat = client.chat.completions.create(
        model="default",
        messages=CONTINUED,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=CONTINUE,
    )
    assert chat.choices[0].message.content == reference.continued_text
    request = frontend_pb2.GenerateRequest(
        chat=frontend_pb2.Chat(
            messages=[frontend_pb2.ChatMessage(**m) for m in CONTINUED], **CONTINUE
        ),
        sampling_params=_greedy(),
    )
    text, _, _ = asyncio.run(_grpc_generate(deployment.grpc_address, request))
    assert text == reference.continued_text
    ids = httpx.post(f"{base}/tokenize", json={"messages": CONTINUED, **CONTINUE}, timeout=30)
    assert chat.usage is not None and chat.usage.prompt_tokens == ids.json()["count"]
    completion = client.completions.create(
        model="default", prompt=ids.json()["tokens"], max_tokens=MAX_TOKENS, temperature=0
    )
    assert completion.choices[0].text == reference.continued_text
    # Without the options the conversation ends with the assistant's turn opened after it.
    plain = httpx.post(f"{base}/tokenize", json={"messages": CONTINUED}, timeout=30).json()
    assert plain["count"] > ids.json()["count"]


def test_every_service_serves_health_and_reflection(deployment: Deployment) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    expected = {
        "frontend": "tandem.v1.Frontend",
        "scheduler": "tandem.v1.Scheduler",
        **{name: "tandem.v1.Worker" for name in worker_names(deployment)},
    }
    for name, service in expected.items():
        address = deployment.grpc_address if name == "frontend" else deployment.address(name)
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            answer = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))
            listed = {s.name for s in answer.list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= listed, (name, listed)


# ----------------------------------------------------------------------------- load


def test_64_concurrent_streams_complete(deployment: Deployment, reference: Reference) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str, str | None]:
        stream = await client.completions.create(
            model="default",
            prompt=PROMPTS[i % len(PROMPTS)],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
        return i, text, finish

    async def run() -> list[tuple[int, str, str | None]]:
        async with openai.AsyncOpenAI(
            base_url=f"http://{deployment.http_address}/v1",
            api_key="unused",
            max_retries=0,
            timeout=300,
            http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=100)),
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64
    for i, text, finish in results:
        assert finish in ("length", "stop")
        # Batched differently than the offline run: allow a late greedy flip, not garbage.
        ref = reference.texts[i % len(PROMPTS)]
        assert text and (text == ref or ref.startswith(text[: len(ref) // 2]))
    exact = sum(text == reference.texts[i % len(PROMPTS)] for i, text, _ in results)
    assert exact >= 60
    assert_pools_whole(deployment)


# ----------------------------------------------------------------------------- aborts


def test_http_disconnect_mid_stream_frees_blocks(deployment: Deployment) -> None:
    body = {
        "model": "default",
        "prompt": PROMPTS[3] * 20,
        "max_tokens": 1000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", f"http://{deployment.http_address}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
            if seen >= 3:
                break
    # The connection is closed: the request must end on every worker.
    assert_pools_whole(deployment, timeout_s=30)


def test_grpc_cancel_mid_stream_frees_blocks(deployment: Deployment) -> None:
    async def run() -> int:
        async with grpc.aio.insecure_channel(deployment.grpc_address) as channel:
            stub = frontend_pb2_grpc.FrontendStub(channel)
            params = common_pb2.SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
            call = stub.Generate(
                frontend_pb2.GenerateRequest(text=PROMPTS[0], sampling_params=params)
            )
            n = 0
            async for _ in call:
                n += 1
                if n == 3:
                    call.cancel()
                    break
            return n

    assert asyncio.run(run()) == 3
    assert_pools_whole(deployment, timeout_s=30)


# ----------------------------------------------------------------------------- bad input


def test_bad_http_input_gets_400_and_service_keeps_serving(deployment: Deployment) -> None:
    url = f"http://{deployment.http_address}/v1"
    good = {"model": "default", "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0}
    chat = {"model": "default", "messages": CHAT, "max_tokens": 4}
    cases: list[tuple[str, object, str]] = [
        ("completions", {**good, "temperature": -1}, "temperature"),
        ("completions", {**good, "top_p": 0}, "top_p"),
        ("completions", {**good, "n": 0}, "n must"),
        ("completions", {**good, "max_tokens": 0}, "max_tokens"),
        ("completions", {**good, "max_tokens": "ten"}, "max_tokens"),
        ("completions", {**good, "logprobs": 99}, "logprobs"),
        ("completions", {**good, "prompt": ""}, "empty"),
        ("completions", {**good, "prompt": [1] * (MAX_MODEL_LEN + 10)}, "context"),
        ("completions", {**good, "max_tokens": MAX_MODEL_LEN}, "context"),
        ("completions", {**good, "model": "gpt-9"}, "not served"),
        ("completions", b'{"prompt": "unterminated', "malformed JSON"),
        ("completions", b"[1, 2]", "object"),
        ("completions", b"[" * 100_000 + b"]" * 100_000, "nest too deeply"),
        ("completions", {**good, "prompt": "x" * (3 * 1024 * 1024)}, "limit"),
        ("chat/completions", {"model": "default", "messages": []}, "messages"),
        ("chat/completions", {"model": "default", "messages": [{"content": "hi"}]}, "role"),
        ("completions", {**good, "n": 100000}, "--max-n"),
        (
            "completions",
            {**good, "structured_outputs": {"regex": "a+", "choice": ["a"]}},
            "structured_outputs",
        ),
        ("chat/completions", {**chat, "messages": [{"role": "wizard", "content": "hi"}]}, "wizard"),
        ("chat/completions", {**chat, "messages": [{"role": "user"}]}, "content"),
        (
            "chat/completions",
            {**chat, "response_format": {"type": "json_objekt"}},
            "response_format",
        ),
        ("chat/completions", {**chat, "tools": [{"type": "function"}]}, "tools"),
        # Past the wire field's width (was a 500 from the conversion to protobuf).
        ("completions", {**good, "top_k": 2**31}, "top_k must be in"),
        ("completions", {**good, "seed": 2**63}, "seed must be in"),
        ("completions", {**good, "stop_token_ids": [10**10]}, "stop_token_ids must hold"),
        # A lone UTF-16 surrogate is not text (was a 500 from the tokenizer, or a reset).
        ("completions", b'{"prompt": "a\\ud800b", "max_tokens": 4}', "prompt holds a lone"),
        ("completions", b'{"prompt": "a", "bad_words": ["\\udfff"]}', "bad_words holds"),
        (
            "chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
            "messages holds a lone",
        ),
    ]
    with httpx.Client(timeout=120) as http:
        for path, body, needle in cases:
            if isinstance(body, bytes):
                r = http.post(
                    f"{url}/{path}", content=body, headers={"Content-Type": "application/json"}
                )
            else:
                r = http.post(f"{url}/{path}", json=body)
            assert r.status_code == 400, (path, needle, r.text)
            err = r.json()["error"]
            assert needle in err["message"], (needle, err)
            ok = http.post(f"{url}/completions", json=good)
            assert ok.status_code == 200, ok.text
            assert ok.json()["choices"][0]["text"]
        # A surrogate pair, escaped, is one character (an emoji): served.
        pair = b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2, "temperature": 0}'
        r = http.post(
            f"{url}/completions", content=pair, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 200, r.text
    assert_pools_whole(deployment)


def test_bad_grpc_input_gets_invalid_argument(deployment: Deployment) -> None:
    bad = [
        frontend_pb2.GenerateRequest(
            text="hi", sampling_params=common_pb2.SamplingParams(temperature=-1)
        ),
        frontend_pb2.GenerateRequest(text="", sampling_params=_greedy()),
        frontend_pb2.GenerateRequest(
            token_ids=frontend_pb2.TokenIds(ids=[1] * (MAX_MODEL_LEN + 1)),
            sampling_params=_greedy(),
        ),
        frontend_pb2.GenerateRequest(model="gpt-9", text="hi", sampling_params=_greedy()),
        frontend_pb2.GenerateRequest(sampling_params=_greedy()),
        frontend_pb2.GenerateRequest(
            text="hi", sampling_params=common_pb2.SamplingParams(max_tokens=4, n=100000)
        ),
        frontend_pb2.GenerateRequest(
            chat=frontend_pb2.Chat(messages=[frontend_pb2.ChatMessage(role="wizard", content="x")]),
            sampling_params=_greedy(),
        ),
    ]

    async def run() -> None:
        for request in bad:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _grpc_generate(deployment.grpc_address, request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
            assert info.value.details()
            text, _, _ = await _grpc_generate(
                deployment.grpc_address,
                frontend_pb2.GenerateRequest(text=PROMPTS[1], sampling_params=_greedy(4)),
            )
            assert text

    asyncio.run(run())
    assert_pools_whole(deployment)


# ----------------------------------------------------------------------------- failures


def test_worker_that_stops_reporting_fails_its_requests(deployment: Deployment) -> None:
    """SIGSTOP the worker that decodes: the stream ends with UNAVAILABLE, no hang; after
    SIGCONT the worker registers again and serves."""
    victim = "unified" if "unified" in deployment.services else "decode"
    pid = deployment.pid(victim)
    try:
        code, waited = interrupt_a_stream(
            deployment.grpc_address, PROMPTS[2], lambda: os.kill(pid, signal.SIGSTOP)
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert waited < 20
    worker_id = f"{victim}-0"
    wait_until(
        lambda: any(w.worker_id == worker_id for w in list_workers(deployment).workers),
        30,
        f"{worker_id} to register again",
    )
    out = _client(deployment).completions.create(
        model="default", prompt=PROMPTS[1], max_tokens=4, temperature=0
    )
    assert out.choices[0].text
    assert_pools_whole(deployment, timeout_s=30)


def test_sigterm_drains_then_each_service_exits_cleanly(deployment: Deployment) -> None:
    """SIGTERM the frontend and the decoding worker mid-request: the request still completes
    (both drain), both exit 0; then every other service exits 0 on SIGTERM, each within its
    grace period."""
    decoder = "unified" if "unified" in deployment.services else "decode"
    first_wave = ["frontend", decoder]

    async def run() -> list[int]:
        async with grpc.aio.insecure_channel(deployment.grpc_address) as channel:
            stub = frontend_pb2_grpc.FrontendStub(channel)
            request = frontend_pb2.GenerateRequest(text=PROMPTS[0], sampling_params=_greedy(24))
            ids: list[int] = []
            async for resp in stub.Generate(request):
                if not ids:
                    for name in first_wave:
                        os.kill(deployment.pid(name), signal.SIGTERM)
                ids += [t for c in resp.choices for t in c.token_ids]
            return ids

    t0 = time.monotonic()
    assert len(asyncio.run(run())) == 24  # finished despite the SIGTERMs
    for name in first_wave:
        process = deployment.services[name].process
        code = process.wait(timeout=GRACE_S + 5)
        assert code == 0, (name, deployment.services[name].log_tail())
    assert time.monotonic() - t0 < GRACE_S + 5
    rest = [n for n in (*worker_names(deployment), "scheduler") if n not in first_wave]
    for name in rest:
        process = deployment.services[name].process
        t0 = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=GRACE_S + 5)
        assert code == 0, (name, deployment.services[name].log_tail())
        assert time.monotonic() - t0 < GRACE_S + 5

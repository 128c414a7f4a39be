"""Structured outputs and tools at the HTTP edge: OpenAI's `response_format`, vLLM's
`structured_outputs` extra-body object, and `tools` / `tool_choice`, parsed into the engine's
`StructuredOutputsParams` and a `ToolCalling` plan.

Everything that can be checked without compiling a grammar is checked here, before anything
is queued: shapes and types, JSON schemas against their meta-schema (`jsonschema`), tool
names and parameter schemas, conflicting constraints. Each refusal is a 400 whose `param`
names the field and whose message names the problem. What only a compile can tell (a regex
or grammar that does not parse, a schema feature the grammar compiler lacks, a compile that
runs out of time) is reported by the engine and surfaces as a 400 too (tracker.py).

Tool choice -> what the engine is asked for::

    "none" (or no tools)  nothing: tools are only shown to the chat template
    "auto"                nothing; the output is parsed for calls (tool_parsers.py) with the
                          frontend's --tool-call-parser (needs --enable-auto-tool-choice)
    {"function": f}       json = f's parameter schema; the output is f's arguments
    "required"            json = an array (1+ items; 1 with parallel_tool_calls false) of
                          {"name": <a tool's name>, "arguments": <its parameter schema>}
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import jsonschema

from tandem.sampling_params import SamplingParamsError, StructuredOutputsParams
from tandem_services.frontend.types import invalid

# OpenAI's rule for function names.
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# A function without `parameters` takes none.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's structured_outputs options tandem does not implement (refused by name).
_STRUCTURED_UNIMPLEMENTED = (
    "structural_tag",
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
)


# Schemas that passed the meta-schema check, by their canonical JSON text (most recent last).
# A client sends the same schema with each request; the check walks the draft's meta-schema
# (about 0.6 ms for a two-property schema on this repository's CPU, benchmarks/request_parse.py)
# where printing the schema takes microseconds. Refusals are not remembered.
_CHECKED_SCHEMAS: OrderedDict[str, None] = OrderedDict()
_CHECKED_SCHEMAS_MAX = 1024


def check_json_schema(schema: Any, where: str, param: str) -> dict[str, Any]:
    """`schema` (a dict, or its JSON text) checked against its JSON Schema meta-schema
    (the draft its `$schema` names, 2020-12 by default); returns it as a dict. A schema that
    passed before is not checked again (`_CHECKED_SCHEMAS`)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise invalid(f"{where} is not valid JSON: {exc}", param) from None
        except RecursionError:
            raise invalid(f"{where} is not valid JSON: it nests too deeply", param) from None
    if not isinstance(schema, dict):
        raise invalid(f"{where} must be a JSON schema object, got {type(schema).__name__}", param)
    try:
        key = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    except RecursionError:
        raise invalid(f"{where} nests too deeply", param) from None
    if key in _CHECKED_SCHEMAS:
        _CHECKED_SCHEMAS.move_to_end(key)
        return schema
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        at = "/".join(str(p) for p in exc.absolute_path)
        raise invalid(
            f"{where} is not a valid JSON schema: {exc.message}" + (f" (at /{at})" if at else ""),
            param,
        ) from None
    except Exception as exc:  # an unknown $schema draft and the like
        raise invalid(f"{where} is not a valid JSON schema: {exc}", param) from None
    _CHECKED_SCHEMAS[key] = None
    if len(_CHECKED_SCHEMAS) > _CHECKED_SCHEMAS_MAX:
        _CHECKED_SCHEMAS.popitem(last=False)
    return schema


def parse_response_format(value: Any) -> StructuredOutputsParams | None:
    """OpenAI's `response_format`: text (no constraint), json_object (the schema of any
    object), or json_schema."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("response_format must be an object", "response_format")
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise invalid(f"response_format: unknown field {extra[0]!r}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        # OpenAI's json_object is an object; the builtin JSON grammar (structured_outputs'
        # json_object) lets any JSON value through, arrays included.
        return StructuredOutputsParams(json=dict(_ANY_OBJECT))
    if kind != "json_schema":
        raise invalid(
            f"response_format.type must be text, json_object or json_schema, got {kind!r}",
            "response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid(
            'response_format.json_schema (with "name" and "schema") is required for type '
            "json_schema",
            "response_format",
        )
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise invalid(f"response_format.json_schema: unknown field {extra[0]!r}", "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        raise invalid(
            f"response_format.json_schema.name must be 1-64 letters, digits, _ or -, got {name!r}",
            "response_format",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("response_format.json_schema.strict must be true or false", "response_format")
    if "schema" not in spec:
        raise invalid("response_format.json_schema.schema is required", "response_format")
    schema = check_json_schema(
        spec["schema"], "response_format.json_schema.schema", "response_format"
    )
    return StructuredOutputsParams(json=schema)


def parse_structured_outputs(value: Any) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs` object: exactly one of json, regex, choice, grammar,
    json_object."""
    if value is None:
        return None
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise invalid("structured_outputs must be an object", param)
    for key in value:
        if key in _STRUCTURED_KEYS:
            continue
        if key in _STRUCTURED_UNIMPLEMENTED:
            if value[key] in (None, False):
                continue
            raise invalid(f"structured_outputs.{key} is not implemented by tandem", param)
        raise invalid(f"structured_outputs: unknown field {key!r}", param)
    kwargs: dict[str, Any] = {k: value[k] for k in _STRUCTURED_KEYS if value.get(k) is not None}
    if "json" in kwargs:
        kwargs["json"] = check_json_schema(kwargs["json"], "structured_outputs.json", param)
    for key in ("regex", "grammar"):
        if key in kwargs and (not isinstance(kwargs[key], str) or not kwargs[key]):
            raise invalid(f"structured_outputs.{key} must be a non-empty string", param)
    if "choice" in kwargs and not isinstance(kwargs["choice"], list):
        raise invalid("structured_outputs.choice must be a list of strings", param)
    if "json_object" in kwargs:
        if not isinstance(kwargs["json_object"], bool):
            raise invalid("structured_outputs.json_object must be true or false", param)
        if not kwargs["json_object"]:
            del kwargs["json_object"]
    try:
        return StructuredOutputsParams(**kwargs)
    except SamplingParamsError as exc:
        raise invalid(str(exc), param) from None


def check_structured(spec: StructuredOutputsParams | None, param: str) -> None:
    """The edge checks of a spec built elsewhere (gRPC): its JSON schema, if any."""
    if spec is not None and spec.json is not None:
        check_json_schema(spec.json, f"{param}.json", param)


# ----------------------------------------------------------------------------- tools


@dataclass(frozen=True)
class ToolCalling:
    """How a chat request's tools are used (see the module docstring).

    `mode` is "auto", "required" or "named" (then `function` is the named tool);
    `parameters` maps each tool's name to its parameter schema."""

    mode: str
    parameters: dict[str, dict[str, Any]]
    function: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "required", "named"):
            raise ValueError(f"mode must be auto, required or named, got {self.mode!r}")
        if (self.mode == "named") != (self.function is not None):
            raise ValueError("function is set exactly when mode is named")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.parameters)

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint the output is generated under (None for auto)."""
        if self.mode == "named":
            assert self.function is not None
            return StructuredOutputsParams(json=self.parameters[self.function])
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.parameters, self.parallel))
        return None


def required_schema(parameters: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of `tool_choice: "required"` output: a list of calls, each
    {"name": one tool's name, "arguments": that tool's parameters}, name first."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "arguments": schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, schema in parameters.items()
    ]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    out: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        out["maxItems"] = 1
    return out


def parse_tools(tools: Any) -> dict[str, dict[str, Any]]:
    """Function tools (shape and size already checked by limits.check_tools): name ->
    parameter schema, in order; 400 naming the tool and the problem."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or ()):
        at = f"tools[{i}]"
        if tool.get("type") != "function":
            raise invalid(f'{at}.type must be "function", got {tool.get("type")!r}', "tools")
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise invalid(f"{at}: unknown field {extra[0]!r}", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"{at}.function must be an object", "tools")
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise invalid(f"{at}.function: unknown field {extra[0]!r}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise invalid(
                f"{at}.function.name must be 1-64 letters, digits, _ or -, got {name!r}", "tools"
            )
        if name in out:
            raise invalid(f"{at}.function.name {name!r} is used by two tools", "tools")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid(f"{at}.function.description must be a string", "tools")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid(f"{at}.function.strict must be true or false", "tools")
        params = fn.get("parameters")
        if params is None:
            out[name] = dict(_NO_PARAMETERS)
            continue
        schema = check_json_schema(params, f"{at}.function.parameters", "tools")
        if schema.get("type", "object") != "object":
            raise invalid(
                f"{at}.function.parameters must be an object schema (type object), got type "
                f"{schema.get('type')!r}",
                "tools",
            )
        out[name] = schema
    return out


def parse_tool_choice(
    tools: dict[str, dict[str, Any]],
    tool_choice: Any,
    parallel_tool_calls: Any,
    auto_tool_parser: str | None,
) -> ToolCalling | None:
    """The request's `ToolCalling`, or None when tools are not used ("none", no tools).

    OpenAI's default is "auto" when tools are given; "auto" needs the frontend started with
    --enable-auto-tool-choice and a --tool-call-parser (`auto_tool_parser`), as in vLLM."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise invalid("parallel_tool_calls must be true or false", "parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required"):
            raise invalid(
                'tool_choice must be "none", "auto", "required" or {"type": "function", '
                f'"function": {{"name": ...}}}}, got {tool_choice!r}',
                "tool_choice",
            )
        if not tools:
            raise invalid(f'tool_choice "{tool_choice}" needs tools', "tool_choice")
        if tool_choice == "auto":
            if auto_tool_parser is None:
                raise invalid(
                    'tool_choice "auto" (the default when tools are given) needs the frontend '
                    'started with --enable-auto-tool-choice and --tool-call-parser; use "none", '
                    '"required" or a named function otherwise',
                    "tool_choice",
                )
            return ToolCalling("auto", tools, parallel=parallel)
        return ToolCalling("required", tools, parallel=parallel)
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise invalid(
            'tool_choice must be a string or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise invalid("tool_choice.function.name must be a string", "tool_choice")
    if name not in tools:
        known = ", ".join(tools) or "none"
        raise invalid(
            f"tool_choice names function {name!r}, which is not in tools (tools: {known})",
            "tool_choice",
        )
    return ToolCalling("named", tools, function=name, parallel=parallel)


def template_tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` for the chat template: each
    {"id", "type": "function", "function": {"name", "arguments"}} with the arguments' JSON
    text parsed into an object (what chat templates expect)."""
    if not isinstance(raw, list):
        raise invalid(f"{where} must be a list", "messages")
    calls = []
    for j, call in enumerate(raw):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise invalid(f"{at} must be an object", "messages")
        fn = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise invalid(f'{at} must be {{"type": "function", "function": {{...}}}}', "messages")
        name, args = fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise invalid(f"{at}.function.name must be a non-empty string", "messages")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise invalid(f"{at}.function.arguments is not valid JSON", "messages") from None
        if not isinstance(args, dict):
            raise invalid(f"{at}.function.arguments must be a JSON object", "messages")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise invalid(f"{at}.id must be a string", "messages")
        calls.append(
            {
                "id": call_id or f"call_{j}",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
        )
    return calls

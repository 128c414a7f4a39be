"""`EngineArgs`: the engine's arguments flat, as the command line and `LLM(...)` take them,
generated from the config classes (tandem.config: every settable field, its name, default and
flag declared there once; there is no second list).

    flags, LLM(**kwargs) --> EngineArgs --create_engine_config()--> EngineConfig (resolved
                                                                    by tandem.loader.resolve)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from dataclasses import field
from typing import Any

from tandem.config import (
    ENGINE_SECTIONS,
    ConfigError,
    EngineConfig,
    engine_kwargs_from,
    settable_fields,
)


def check_value_type(name: str, annotation: str, value: Any) -> None:
    """ConfigError naming `name` when `value` is not of its field's scalar type (`annotation`,
    the field's declared type as text): an integer (not a bool), a finite number, a bool, or
    a sequence of integers. Other types (text, choices, JSON) are checked by their section.
    The command line's parser gives these types already; `LLM(...)` passes what it is given."""
    if annotation == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
        kind = "an integer"
    elif annotation == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        kind = "a finite number"
    elif annotation == "bool":
        ok = isinstance(value, bool)
        kind = "true or false"
    elif annotation == "tuple[int, ...]":
        ok = isinstance(value, list | tuple) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        )
        kind = "a list of integers"
    else:
        return
    if not ok:
        raise ConfigError(f"{name} must be {kind}, got {value!r}")


class _EngineArgsMethods:
    """Behaviour of `EngineArgs` (its fields are generated from the config classes)."""

    def create_engine_config(self, resolve: bool = True) -> EngineConfig:
        """The config tree, validated; resolved (model path, HF config, max_model_len:
        `tandem.loader.resolve`) unless `resolve` is False (a launcher checking its flags
        without loading anything)."""
        for cls in ENGINE_SECTIONS.values():
            for f in settable_fields(cls):
                check_value_type(f.name, str(f.type), getattr(self, f.name))
        sections = {
            name: cls(**{f.name: getattr(self, f.name) for f in settable_fields(cls)})
            for name, cls in ENGINE_SECTIONS.items()
        }
        config = EngineConfig(**sections)
        if not resolve:
            return config
        from tandem.loader.resolve import resolve_engine_config

        return resolve_engine_config(config)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        """The engine arguments of a namespace parsed by a parser with `add_engine_args`."""
        return EngineArgs(model=ns.model, **engine_kwargs_from(ns))


def _engine_args_class() -> type:
    specs: list[tuple[str, Any, Any]] = []
    seen: set[str] = set()
    for cls in ENGINE_SECTIONS.values():
        for f in settable_fields(cls):
            if f.name in seen:
                raise TypeError(f"config field {f.name!r} is declared twice")
            seen.add(f.name)
            default = (
                field(default_factory=f.default_factory)
                if f.default_factory is not dataclasses.MISSING
                else field(default=f.default, metadata=f.metadata)
            )
            specs.append((f.name, f.type, default))
    made = dataclasses.make_dataclass("EngineArgs", specs, bases=(_EngineArgsMethods,))
    made.__module__ = __name__
    made.__doc__ = (
        "Flat engine arguments, as the CLI and `LLM(...)` take them: every settable field of "
        "ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, DeviceConfig, "
        "StructuredOutputsConfig, SamplerConfig, QuantizationConfig and SpeculativeConfig "
        "(one JSON flag), same names and "
        "defaults. `create_engine_config()` builds and resolves the config tree."
    )
    return made


if typing.TYPE_CHECKING:

    class EngineArgs(_EngineArgsMethods):
        def __init__(self, **kwargs: Any) -> None: ...
        def __getattr__(self, name: str) -> Any: ...

else:
    EngineArgs = _engine_args_class()

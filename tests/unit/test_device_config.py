"""--device cuda:<index>: DeviceConfig and the CLI accept exactly auto, cpu, cuda, cuda:<int>."""

from __future__ import annotations

import argparse

import pytest

from tandem.config import (
    ConfigError,
    DeviceConfig,
    add_engine_args,
    engine_kwargs_from,
    parse_device,
)
from tandem.engine_args import EngineArgs


@pytest.mark.parametrize(
    ("device", "index"),
    [("auto", None), ("cpu", None), ("cuda", None), ("cuda:0", 0), ("cuda:1", 1), ("cuda:12", 12)],
)
def test_device_names_accepted(device: str, index: int | None) -> None:
    config = DeviceConfig(device=device)
    assert config.device_index == index
    assert parse_device(device) == (device.partition(":")[0], index)
    if device != "auto":
        assert config.resolved_device() == device


@pytest.mark.parametrize(
    "device",
    [
        "",
        "gpu",
        "CUDA",
        "cuda:",
        "cuda:-1",
        "cuda:+1",
        "cuda: 1",
        "cuda:1:2",
        "cpu:0",
        "cuda:x",
        "cuda:\u0663",
        "mps",
    ],
)
def test_bad_device_names_raise_config_error(device: str) -> None:
    with pytest.raises(ConfigError, match="device must be auto, cpu, cuda or cuda:<index>"):
        DeviceConfig(device=device)


def test_engine_args_carry_the_index() -> None:
    config = EngineArgs(device="cuda:3").create_engine_config()
    assert config.device.device == "cuda:3" and config.device.device_index == 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_cli_device_flag() -> None:
    ns = _parser().parse_args(["--device", "cuda:1"])
    assert engine_kwargs_from(ns)["device"] == "cuda:1"
    assert _parser().parse_args([]).device == "auto"


@pytest.mark.parametrize("bad", ["gpu", "cuda:a", "cuda:-2"])
def test_cli_device_flag_errors_clearly(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--device", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device" in err and "cuda:<index>" in err and repr(bad) in err

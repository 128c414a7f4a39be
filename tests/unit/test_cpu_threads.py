"""CPU set-up: the --cpu-cores flag, what "auto" resolves to, the launcher's core sets, and
--dtype auto on CPUs."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tandem.config import ConfigError, DeviceConfig, parse_core_list
from tandem.worker.cpu_threads import (
    CpuThreadGovernor,
    cpu_supports_bf16,
    engine_process_cpu_cores,
    make_cpu_thread_governor,
    resolve_cpu_cores,
)
from tandem.worker.model_runner import resolve_dtype
from tandem_services.launcher import ServeConfig, worker_commands
from tandem_services.launcher.deployment import default_cpu_core_sets, default_cpu_threads


def test_core_lists_parse_and_bad_ones_are_refused() -> None:
    assert parse_core_list("0-3,8") == (0, 1, 2, 3, 8)
    assert parse_core_list("5") == (5,)
    for bad in ("", "a", "3-1", "1,1", "-2", "0-"):
        with pytest.raises(ConfigError):
            parse_core_list(bad)
    with pytest.raises(ConfigError):
        DeviceConfig(cpu_cores="0-x")
    assert DeviceConfig(cpu_cores="none").cpu_cores == "none"


def test_resolve_cpu_cores() -> None:
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    assert resolve_cpu_cores(DeviceConfig(cpu_cores="auto")) is None  # caller's thread
    assert resolve_cpu_cores(DeviceConfig(cpu_cores="none")) is None
    assert resolve_cpu_cores(DeviceConfig(cpu_cores="all")) == allowed
    assert resolve_cpu_cores(DeviceConfig(cpu_cores="all", num_threads=1)) == allowed[:1]
    assert resolve_cpu_cores(DeviceConfig(cpu_cores=str(allowed[-1]))) == (allowed[-1],)
    with pytest.raises(ValueError, match="may not use"):
        resolve_cpu_cores(DeviceConfig(cpu_cores=str(max(allowed) + 1000)))


def test_second_engine_in_a_process_binds_every_core_too() -> None:
    # A benchmark's fp32 and bf16 engines in one process: binding the first pins the calling
    # thread to one core, which the second must not read as the process's cores. In a child
    # process: binding would pin this one's thread (and every process it starts after).
    code = (
        "import json, os, torch\n"
        "from tandem.config import DeviceConfig\n"
        "from tandem.worker.cpu_threads import setup_cpu_threads, process_cpu_cores\n"
        "cores = sorted(os.sched_getaffinity(0))\n"
        "first = setup_cpu_threads(DeviceConfig(cpu_cores='all'))\n"
        "pinned = sorted(os.sched_getaffinity(0))\n"
        "second = setup_cpu_threads(DeviceConfig(cpu_cores='all'))\n"
        "print(json.dumps([cores, first, pinned, second, process_cpu_cores(),\n"
        "                  torch.get_num_threads()]))\n"
    )
    out = (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    cores, first, pinned, second, process, threads = json.loads(out)
    assert first == second == process == cores
    assert threads == len(cores)
    if len(cores) > 1:
        assert pinned == cores[:1]  # what misled the second engine: thread 0 on one core


def test_engine_process_binds_only_when_it_owns_its_cores() -> None:
    n = len(os.sched_getaffinity(0))
    assert engine_process_cpu_cores(DeviceConfig()) == "all"
    assert engine_process_cpu_cores(DeviceConfig(num_threads=n)) == "all"
    expected = "none" if n > 1 else "all"  # fewer threads than cores: as under a CPU quota
    assert engine_process_cpu_cores(DeviceConfig(num_threads=max(n - 1, 1))) == expected
    assert engine_process_cpu_cores(DeviceConfig(cpu_cores="0")) == "0"


def test_launcher_gives_each_cpu_worker_its_own_cores() -> None:
    cores = sorted(os.sched_getaffinity(0))
    sets = default_cpu_core_sets(2, 1)
    pool = cores[1:] if len(cores) > 1 else cores
    assert sets == [str(pool[0]), str(pool[1 % len(pool)])]
    # One worker with a thread a core (the default for one: default_cpu_threads) takes them
    # all, its governor yielding to the other services; fewer threads keep off the first.
    assert default_cpu_threads(1) == len(cores)
    assert default_cpu_core_sets(1, len(cores)) == [",".join(map(str, cores))]
    if len(cores) > 2:
        assert default_cpu_core_sets(1, 2) == [",".join(map(str, pool[:2]))]
    assert default_cpu_threads(2) == max(1, (len(cores) - 1) // 2)
    if len(cores) > 1:
        # A narrower affinity mask (a container's cpuset, taskset) is what counts, not the
        # machine's core count.
        os.sched_setaffinity(0, {cores[-1]})
        try:
            assert default_cpu_threads(1) == 1
            assert default_cpu_core_sets(1, 1) == [str(cores[-1])]
        finally:
            os.sched_setaffinity(0, set(cores))
    cmds = worker_commands(ServeConfig(unified=True, num_unified_workers=2), "127.0.0.1:1")
    got = [c.args[c.args.index("--cpu-cores") + 1] for c in cmds]
    assert got == default_cpu_core_sets(
        2, int(cmds[0].args[cmds[0].args.index("--num-threads") + 1])
    )
    given = worker_commands(ServeConfig(worker_args=("--cpu-cores", "0")), "127.0.0.1:1")
    assert all(c.args.count("--cpu-cores") == 1 for c in given)


def test_dtype_auto_is_bf16_where_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.worker import model_runner

    native = cpu_supports_bf16()
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    for has_bf16, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(model_runner, "cpu_supports_bf16", lambda v=has_bf16: v)
        assert resolve_dtype("auto", "cpu") == want
        assert resolve_dtype("float32", "cpu") == torch.float32
        assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
        assert resolve_dtype("auto", "cuda") == torch.bfloat16


def test_the_dtype_flag_takes_its_default_from_tandem_dtype() -> None:
    from tandem.config import add_engine_args

    for environ, want in (({}, "auto"), ({"TANDEM_DTYPE": "float32"}, "float32")):
        parser = argparse.ArgumentParser()
        add_engine_args(parser, environ=environ)
        assert parser.parse_args([]).dtype == want
        assert parser.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"


def test_importing_tandem_sets_the_openmp_spin_bound_before_torch() -> None:
    code = (
        "import os, sys; import tandem; "
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), "
        "'torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["None", "30000", "False"], out.stderr
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # a user's choice is kept, nothing added to it
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["ACTIVE", "None", "False"], out.stderr


class _Feed:
    """A clock and the machine's busy core-seconds and this process's CPU seconds, as the
    governor reads them, advanced by the test."""

    def __init__(self) -> None:
        self.t, self.busy, self.own = 0.0, 0.0, 0.0

    def window(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.t += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds


def test_governor_sizes_the_team_to_the_cores_others_leave() -> None:
    feed, calls = _Feed(), []
    gov = CpuThreadGovernor(
        (0, 1),
        2,
        calls.append,
        interval_s=0.1,
        busy_seconds=lambda: feed.busy,
        own_seconds=lambda: feed.own,
        clock=lambda: feed.t,
    )
    assert gov.before_step() == 2 and calls == []
    feed.window(0.05, own_cores=2.0, other_cores=0.0)
    assert gov.before_step() == 2  # within the interval: not looked at
    feed.window(0.1, own_cores=1.0, other_cores=1.0)  # another process takes a core
    assert gov.before_step() == 1 and calls == [1]
    assert gov.others_load == pytest.approx(0.1 / 0.15)  # over the whole window since t=0
    feed.window(0.2, own_cores=1.0, other_cores=0.3)  # a core is free, but not a whole one
    assert gov.before_step() == 1 and calls == [1]
    feed.window(0.2, own_cores=1.0, other_cores=0.1)
    assert gov.before_step() == 2 and calls == [1, 2]
    feed.window(0.2, own_cores=2.0, other_cores=0.3)  # within the down margin: kept
    assert gov.before_step() == 2 and calls == [1, 2]
    feed.window(0.2, own_cores=1.0, other_cores=2.0)  # more than the cores: still one thread
    assert gov.before_step() == 1 and calls == [1, 2, 1]
    feed.window(0.2, own_cores=1.0, other_cores=0.0)
    assert gov.before_step() == 2 and calls == [1, 2, 1, 2]
    # The engine idle for 30 s while another process ran (a peer benchmarked in turn): that
    # window starts a new one and decides nothing; the next, short one decides.
    feed.window(30.0, own_cores=0.0, other_cores=1.8)
    assert gov.before_step() == 2 and calls == [1, 2, 1, 2]
    feed.window(0.2, own_cores=2.0, other_cores=0.0)
    assert gov.before_step() == 2 and calls == [1, 2, 1, 2]
    feed.window(30.0, own_cores=0.0, other_cores=0.0)
    feed.window(0.0, own_cores=0.0, other_cores=0.0)
    assert gov.before_step() == 2
    feed.window(0.2, own_cores=1.0, other_cores=1.0)  # busy now: the short window sees it
    assert gov.before_step() == 1 and calls == [1, 2, 1, 2, 1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_governor_sees_a_busy_process_on_its_cores() -> None:
    # Real /proc/stat and CPU times: a spinning child process on this machine's cores is
    # the others' load; the governor goes to fewer threads within a few windows.
    cores = tuple(sorted(os.sched_getaffinity(0)))
    calls: list[int] = []
    gov = CpuThreadGovernor(cores, len(cores), calls.append, interval_s=0.1)
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(len(cores) - 1)
    ]
    try:
        deadline = time.monotonic() + 10
        while gov.threads == len(cores) and time.monotonic() < deadline:
            time.sleep(0.05)
            gov.before_step()
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert gov.threads < len(cores) and calls == [gov.threads]
    assert gov.others_load > 0.5


def test_governor_is_made_for_multithreaded_cpu_engines_unless_turned_off() -> None:
    threads = torch.get_num_threads()
    gov = make_cpu_thread_governor(DeviceConfig(), None)
    if threads > 1:
        assert gov is not None and gov.max_threads == threads == gov.threads
    else:
        assert gov is None
    assert make_cpu_thread_governor(DeviceConfig(cpu_adaptive_threads=False), None) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_governor_rebinds_a_bound_engine_on_its_cores() -> None:
    # In a child (it re-binds its own threads): an engine bound to every core drops to one
    # thread free on all of them, then comes back to one bound thread a core.
    code = (
        "import os, torch; from tandem.config import DeviceConfig; "
        "from tandem.worker.cpu_threads import make_cpu_thread_governor, setup_cpu_threads; "
        "cfg = DeviceConfig(cpu_cores='all'); bound = setup_cpu_threads(cfg); "
        "print(sorted(bound), sorted(os.sched_getaffinity(0))); "
        "gov = make_cpu_thread_governor(cfg, bound); gov._rebind(1); "
        "print(torch.get_num_threads(), sorted(os.sched_getaffinity(0))); "
        "gov._rebind(len(bound)); "
        "print(torch.get_num_threads(), sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    cores = sorted(os.sched_getaffinity(0))
    lines = out.stdout.split("\n")
    expected = [
        f"{cores} {cores[:1]}",  # bound: this thread on the first core
        f"1 {cores}",  # one thread, free on the engine's cores
        f"{len(cores)} {cores[:1]}",  # bound again
    ]
    assert lines[:3] == expected, out.stderr

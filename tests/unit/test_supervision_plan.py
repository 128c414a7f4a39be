"""`tandem serve` supervision and migration flags, decode worker counts, and the restart
back-off, without starting any process (the processes: tests/service/test_supervision.py)."""

from __future__ import annotations

import signal

import pytest

from tandem_services.launcher import (
    RestartPolicy,
    ServeConfig,
    build_parser,
    describe_exit,
    worker_commands,
)
from tandem_services.launcher.cli import restart_policy_from


def test_two_decode_workers_get_their_own_names_and_ids() -> None:
    cmds = worker_commands(ServeConfig(num_prefill_workers=2, num_decode_workers=2), "h:1")
    assert [(c.name, c.worker_id) for c in cmds] == [
        ("prefill", "prefill-0"),
        ("prefill-1", "prefill-1"),
        ("decode", "decode-0"),
        ("decode-1", "decode-1"),
    ]
    with pytest.raises(ValueError, match="num_decode_workers"):
        ServeConfig(unified=True, num_decode_workers=2)
    with pytest.raises(ValueError, match="num_decode_workers"):
        ServeConfig(num_decode_workers=0)


def test_restart_back_off_doubles_to_its_cap() -> None:
    policy = RestartPolicy(restart_backoff_s=1.0, restart_backoff_max_s=5.0)
    assert [policy.backoff_s(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="max_worker_restarts"):
        RestartPolicy(max_worker_restarts=-1)
    with pytest.raises(ValueError, match="restart_window_s"):
        RestartPolicy(restart_window_s=0)


def test_serve_flags() -> None:
    ns = build_parser().parse_args(
        [
            "--max-worker-restarts",
            "2",
            "--restart-window-s",
            "30",
            "--restart-backoff-s",
            "0.5",
            "--migration-limit",
            "1",
            "--num-decode-workers",
            "2",
        ]
    )
    assert restart_policy_from(ns) == RestartPolicy(2, 30.0, 0.5, 30.0)
    assert (ns.migration_limit, ns.num_decode_workers) == (1, 2)
    defaults = build_parser().parse_args([])
    assert restart_policy_from(defaults) == RestartPolicy()
    assert defaults.migration_limit == 3


def test_describe_exit() -> None:
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_exit(3) == "exited with code 3"

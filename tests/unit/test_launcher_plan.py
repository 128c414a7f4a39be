"""`tandem serve` worker plan: which workers start, with which ids and devices (--gpus,
--num-unified-workers), without starting any process."""

from __future__ import annotations

import pytest

from tandem_services.launcher import ServeConfig, build_parser, worker_commands

SCHED = "127.0.0.1:7000"


def _flag(args: tuple[str, ...], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_disaggregated_on_two_gpus_prefill_first_then_decode() -> None:
    config = ServeConfig(gpus=(0, 1), worker_args=("--dtype", "bfloat16"))
    cmds = worker_commands(config, SCHED)
    assert [(c.name, c.role, c.worker_id, c.device) for c in cmds] == [
        ("prefill", "prefill", "prefill-0", "cuda:0"),
        ("decode", "decode", "decode-0", "cuda:1"),
    ]
    assert [c.module for c in cmds] == [
        "tandem_services.prefill_worker",
        "tandem_services.decode_worker",
    ]
    for c in cmds:
        assert c.args.count("--device") == 1
        assert _flag(c.args, "--scheduler") == SCHED
        assert _flag(c.args, "--dtype") == "bfloat16"
        assert "--unified" not in c.args
        assert "--num-threads" not in c.args  # GPU workers: no CPU thread default


def test_round_robin_wraps_over_the_gpus_in_role_order() -> None:
    config = ServeConfig(num_prefill_workers=3, gpus=(2, 5))
    cmds = worker_commands(config, SCHED)
    assert [(c.worker_id, c.device) for c in cmds] == [
        ("prefill-0", "cuda:2"),
        ("prefill-1", "cuda:5"),
        ("prefill-2", "cuda:2"),
        ("decode-0", "cuda:5"),
    ]


def test_unified_workers_one_per_gpu() -> None:
    config = ServeConfig(unified=True, num_unified_workers=2, gpus=(0, 1))
    cmds = worker_commands(config, SCHED)
    assert [(c.name, c.worker_id, c.device) for c in cmds] == [
        ("unified", "unified-0", "cuda:0"),
        ("unified-1", "unified-1", "cuda:1"),
    ]
    assert all("--unified" in c.args and c.module == "tandem_services.decode_worker" for c in cmds)
    assert len({_flag(c.args, "--worker-id") for c in cmds}) == 2


def test_without_gpus_the_device_is_what_the_user_gave() -> None:
    cpu = worker_commands(ServeConfig(unified=True, num_unified_workers=2), SCHED)
    assert [c.device for c in cpu] == ["auto", "auto"]
    assert all(_flag(c.args, "--num-threads") is not None for c in cpu)
    given = worker_commands(ServeConfig(worker_args=("--device", "cuda:1")), SCHED)
    assert [c.device for c in given] == ["cuda:1", "cuda:1"]
    assert all(c.args.count("--device") == 1 and "--num-threads" not in c.args for c in given)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpus": (0, 1), "worker_args": ("--device", "cuda")}, "give --gpus or --device"),
        ({"gpus": (0, -1)}, "GPU indices must be >= 0"),
        ({"num_unified_workers": 2}, "needs unified workers"),
        ({"unified": True, "num_unified_workers": 0}, "num_unified_workers must be >= 1"),
    ],
)
def test_bad_plans_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeConfig(**kwargs)  # type: ignore[arg-type]


def test_serve_flags() -> None:
    ns = build_parser().parse_args(["--unified", "--num-unified-workers", "2", "--gpus", "0,1"])
    assert ns.gpus == (0, 1) and ns.num_unified_workers == 2 and ns.unified


@pytest.mark.parametrize("bad", ["", "0,", "a", "0,-1", "0;1"])
def test_bad_gpus_flag_errors_clearly(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--gpus", bad])
    assert "--gpus takes GPU indices like 0,1" in capsys.readouterr().err


def test_bench_serve_takes_the_same_flags() -> None:
    from tandem_services.bench.serve import build_parser as bench_parser

    ns = bench_parser().parse_args(
        ["--launch", "--unified", "--num-unified-workers", "2", "--gpus", "0,1"]
    )
    assert ns.gpus == (0, 1) and ns.num_unified_workers == 2


def test_a_worker_of_several_ranks_takes_consecutive_gpus() -> None:
    config = ServeConfig(
        unified=True, num_unified_workers=2, gpus=(0, 1, 2, 3), worker_args=("-tp", "2")
    )
    cmds = worker_commands(config, SCHED)
    assert [c.device for c in cmds] == ["cuda:0", "cuda:2"]
    tp_pp = ServeConfig(
        gpus=(4, 5, 6, 7),
        worker_args=("--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"),
    )
    # Prefill then decode, each worker four GPUs (the list wraps).
    assert [c.device for c in worker_commands(tp_pp, SCHED)] == ["cuda:4", "cuda:4"]


def test_a_worker_whose_gpus_are_not_consecutive_is_refused() -> None:
    config = ServeConfig(unified=True, gpus=(0, 2), worker_args=("-tp", "2"))
    with pytest.raises(ValueError, match=r"would take GPUs \[0, 2\].*consecutive"):
        worker_commands(config, SCHED)

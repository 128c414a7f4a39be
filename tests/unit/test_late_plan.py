"""Late planning (`--async-scheduling late`): the step clock's predictions and deadline, and
the engine-core loop's wait, which takes commands until the deadline or until the step in
flight lands."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from tandem.engine.core_proc import WaitEnd, take_commands_until
from tandem.engine.late_plan import SAFETY_S, StepClock, step_kind

DECODE = step_kind(8, 0)
MIXED = step_kind(600, 592)


def test_step_kinds_group_by_prefill_and_size() -> None:
    assert step_kind(8, 0) == (False, 4)
    assert step_kind(15, 0) == (False, 4) != step_kind(16, 0)
    assert step_kind(600, 592) == (True, 10)
    assert step_kind(0, 0) == (False, 1)


def test_no_deadline_before_a_step_of_the_kind_has_landed() -> None:
    clock = StepClock()
    assert clock.deadline() is None  # nothing in flight
    clock.launched(DECODE, 0.0)
    assert clock.deadline() is None  # nothing seen of its kind
    clock.landed(0.010)
    clock.launched(MIXED, 0.011)
    assert clock.deadline() is None  # decode seen, not mixed


def test_durations_count_from_the_later_of_launch_and_the_previous_landing() -> None:
    clock = StepClock()
    clock.launched(DECODE, 0.0)
    clock.launched(DECODE, 0.001)  # queued behind the first
    clock.landed(0.010)
    clock.landed(0.018)  # started when the first landed: 8 ms
    assert clock.predicted(DECODE) == pytest.approx(0.008)
    clock.launched(DECODE, 0.030)  # the device was idle: starts at its launch
    clock.landed(0.037)
    assert clock.predicted(DECODE) == pytest.approx(0.007)


def test_deadline_is_the_predicted_end_less_the_longest_planning_time() -> None:
    clock = StepClock()
    for i, (launch, land) in enumerate(((0.0, 0.010), (0.010, 0.019), (0.019, 0.030))):
        clock.planned(0.001 * (i + 1))
        clock.launched(DECODE, launch)
        clock.landed(land)
    # Shortest of the group (9 ms), longest planning (3 ms), from the last landing.
    clock.launched(DECODE, 0.029)
    assert clock.deadline() == pytest.approx(0.030 + 0.009 - 0.003 - SAFETY_S)
    # Two in flight: the caller would plan behind a step not yet started; no deadline.
    clock.launched(DECODE, 0.031)
    assert clock.deadline() is None


def test_a_late_landing_does_not_push_the_prediction_out() -> None:
    clock = StepClock(window=4)
    land = 0.0
    for _ in range(4):
        clock.launched(DECODE, land)
        land += 0.005
        clock.landed(land)
    clock.launched(DECODE, land)
    clock.landed(land + 0.050)  # the host took this one late
    assert clock.predicted(DECODE) == pytest.approx(0.005)
    for i in range(4):  # the window forgets it as new steps land
        clock.launched(DECODE, 1.0 + i)
        clock.landed(1.006 + i)
    assert clock.predicted(DECODE) == pytest.approx(0.006)
    clock.forget()
    clock.launched(DECODE, 5.0)
    assert clock.deadline() == pytest.approx(5.0 + 0.006 - SAFETY_S)


def _feed(
    inbox: queue.SimpleQueue[object], items: list[object], after_s: float
) -> threading.Thread:
    def put() -> None:
        time.sleep(after_s)
        for item in items:
            inbox.put(item)

    t = threading.Thread(target=put)
    t.start()
    return t


def test_commands_that_arrive_before_the_deadline_run_before_planning() -> None:
    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    ran: list[object] = []
    deadline = time.perf_counter() + 0.3
    feeder = _feed(inbox, ["a", "b", "c"], 0.02)
    end = take_commands_until(inbox, deadline, lambda: False, lambda x: ran.append(x) is None)
    assert end is WaitEnd.DEADLINE
    feeder.join()
    assert time.perf_counter() >= deadline  # the step was still in flight: waited for it
    assert ran == ["a", "b", "c"]


def test_the_wait_ends_when_the_step_lands() -> None:
    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    for item in ("a", "b", "c"):
        inbox.put(item)
    ran: list[object] = []

    def run(item: object) -> bool:
        ran.append(item)
        return True

    # The step lands once "b" has run: planning starts then, "c" waits for the next wait.
    landed = lambda: len(ran) >= 2  # noqa: E731
    assert take_commands_until(inbox, time.perf_counter() + 60, landed, run) is WaitEnd.LANDED
    assert ran == ["a", "b"] and inbox.get_nowait() == "c"


def test_a_past_deadline_plans_at_once_and_a_stop_ends_the_loop() -> None:
    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    inbox.put("a")
    end = take_commands_until(inbox, time.perf_counter() - 1, lambda: False, lambda x: True)
    assert end is WaitEnd.DEADLINE
    assert inbox.get_nowait() == "a"  # left for the loop's own command pass
    inbox.put("stop")
    end = take_commands_until(inbox, time.perf_counter() + 60, lambda: False, lambda x: x != "stop")
    assert end is WaitEnd.STOP
    # A step that has landed ends the wait before any command runs: plan now.
    inbox.put("b")
    assert take_commands_until(inbox, time.perf_counter() + 60, lambda: True, lambda x: False) is (
        WaitEnd.LANDED
    )
    assert inbox.get_nowait() == "b"

"""The timing semantics of testbed.timing: wait = latest arrival - own arrival, clamped to sync."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import step_record

from testbed.step_record import StepRecord
from testbed.timing import PHASES, StepClock, compute_time, fill_wait, percentile, real_compute_time

pytestmark = pytest.mark.unit


def rec(step: int, enter: float, t_sync: float, t_wait: float | None = None) -> StepRecord:
    return step_record(step=step, t_sync_enter=enter, t_sync=t_sync, t_wait=t_wait)


def test_wait_is_latest_arrival_minus_own() -> None:
    ranks = [[rec(0, 10.0, 0.5), rec(1, 20.0, 0.2)], [rec(0, 10.3, 0.2), rec(1, 20.1, 0.1)]]
    fill_wait(ranks, waits_for_peers=True)
    assert [r.t_wait for r in ranks[0]] == pytest.approx([0.3, 0.1])
    assert [r.t_wait for r in ranks[1]] == [0.0, 0.0]


def test_wait_never_exceeds_sync_time() -> None:
    # Clock error across machines can make the estimate exceed the time actually spent in sync.
    ranks = [[rec(0, 0.0, 0.05)], [rec(0, 1.0, 0.01)]]
    fill_wait(ranks, waits_for_peers=True)
    assert ranks[0][0].t_wait == 0.05


def test_no_wait_without_peers_and_unknown_for_missing_steps() -> None:
    ranks = [[rec(0, 0.0, 0.0), rec(1, 1.0, 0.0)], [rec(0, 5.0, 0.0)]]
    fill_wait(ranks, waits_for_peers=False)
    assert ranks[0][0].t_wait == 0.0 and ranks[1][0].t_wait == 0.0
    assert ranks[0][1].t_wait is None  # rank 1 never reached step 1


def test_step_clock_measures_each_phase() -> None:
    clock = StepClock(torch.device("cpu"))
    clock.start()
    for i, name in enumerate(PHASES):
        time.sleep(0.01 * (i + 1))
        clock.mark(name)
    times = clock.finish()
    assert list(times.phases) == list(PHASES)
    for i, name in enumerate(PHASES):
        assert times.phases[name] >= 0.01 * (i + 1)
    assert times.sync_exit - times.sync_enter == pytest.approx(times.phases["sync"], abs=1e-6)
    assert times.step == pytest.approx(sum(times.phases.values()))


def test_step_clock_rejects_missing_marks() -> None:
    clock = StepClock(torch.device("cpu"))
    clock.start()
    clock.mark("data")
    with pytest.raises(RuntimeError, match="every phase"):
        clock.finish()


def test_step_clock_adds_up_micro_steps_and_keeps_the_last_sync() -> None:
    clock = StepClock(torch.device("cpu"), micro_steps=2)
    clock.start()
    for micro in range(2):
        for name in ("data", "injected", "forward", "backward") if micro == 0 else ("data", "forward", "backward"):
            clock.mark(name)
        time.sleep(0.02 if micro else 0.0)
        clock.mark("sync")
    clock.mark("optimizer")
    times = clock.finish()
    assert times.phases["sync"] >= 0.02
    assert times.sync_exit - times.sync_enter >= 0.02  # the boundary's sync, not the no-op one
    with pytest.raises(RuntimeError, match="more than 10"):
        for _ in range(10):
            clock.mark("data")


def test_compute_excludes_sync_and_counts_injected_time_apart() -> None:
    r = step_record(t_data=1.0, t_injected=5.0, t_forward=2.0, t_backward=3.0, t_sync=100.0, t_optimizer=4.0)
    assert real_compute_time(r) == 10.0
    assert compute_time(r) == 15.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([], 50) is None


def test_a_synchronizers_own_wait_is_kept() -> None:
    ranks = [[rec(0, 0.0, 0.5, t_wait=0.125)], [rec(0, 1.0, 0.5, t_wait=0.0)]]
    fill_wait(ranks, waits_for_peers=False)
    assert ranks[0][0].t_wait == 0.125 and ranks[1][0].t_wait == 0.0

"""The scheduler watchdog fires when a forward makes no progress, including the last forward of a
burst, which the overlap loop waits on with no batch of its own scheduled (`cur_batch` is None)."""

from __future__ import annotations

import threading

import pytest

from engine.scheduler.process import SchedulerWatchdog

from sched_utils import FakeWorker, Harness
from utils_process import wait_until

TIMEOUT_S = 5.0


class HangingWorker(FakeWorker):
    """Blocks inside forward number `hang_at` (1-based) until released."""

    def __init__(self, hang_at: int) -> None:
        super().__init__()
        self.hang_at = hang_at
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward_batch_generation(self, batch):
        self.calls += 1
        if self.calls == self.hang_at:
            self.entered.set()
            self.release.wait()
        return super().forward_batch_generation(batch)


def _forwards_of_workload(overlap: bool) -> int:
    h = Harness(overlap=overlap)
    h.submit([1, 2, 3], max_new_tokens=3)
    h.run_until_idle()
    return len(h.worker.records)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_watchdog_fires_on_a_hang_in_the_last_forward_of_a_burst(overlap):
    worker = HangingWorker(hang_at=_forwards_of_workload(overlap))
    h = Harness(worker=worker, overlap=overlap)
    h.submit([1, 2, 3], max_new_tokens=3)
    watchdog = SchedulerWatchdog(h.scheduler, TIMEOUT_S)
    loop = threading.Thread(target=h.run_until_idle, daemon=True)
    loop.start()
    try:
        assert worker.entered.wait(30)
        sched = h.scheduler
        # The scheduling thread now waits on the hung forward's result.
        assert wait_until(lambda: not sched.result_queue if overlap else sched.cur_batch is not None, 30)
        if overlap:
            assert sched.cur_batch is None  # nothing else scheduled: the case the old check missed
        assert watchdog.check(now=0.0) is False
        assert watchdog.check(now=TIMEOUT_S / 2) is False
        assert watchdog.check(now=TIMEOUT_S + 1.0) is True
    finally:
        worker.release.set()
        loop.join(30)
    assert not loop.is_alive()
    assert len(h.outputs["r0"].output_ids) == 3


def test_watchdog_stays_quiet_while_idle_and_while_forwards_progress():
    h = Harness(overlap=True)
    watchdog = SchedulerWatchdog(h.scheduler, TIMEOUT_S)
    assert watchdog.check(now=0.0) is False
    assert watchdog.check(now=1000.0) is False  # idle for long: nothing in flight
    h.submit([1, 2, 3], max_new_tokens=50)
    now = 1000.0
    for _ in range(10):  # each step launches and completes forwards: progress, however slow
        h.step()
        now += TIMEOUT_S * 0.9
        assert watchdog.check(now=now) is False
    h.run_until_idle()
    assert watchdog.check(now=now + 1000.0) is False

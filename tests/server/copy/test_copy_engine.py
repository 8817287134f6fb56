"""The copy engine on its own: outcomes in job order, failures kept apart, deadlines, and
no job waiting behind a stalled copy thread while another thread is free; a copy that
raised is logged."""

import asyncio
import logging
import threading
import time

import pytest

from lmcache_mp.server.copy.engine import CopyEngine, DeadlinePassed
from lmcache_mp.server.ops.transfers import log_copy_failures


@pytest.fixture
def engine():
    copy_engine = CopyEngine(2)
    yield copy_engine
    copy_engine.shutdown()


def test_outcomes_come_in_job_order_and_one_failure_stays_its_own(engine):
    ran = []

    def job(i):
        def run():
            if i == 3:
                raise ValueError("chunk 3 is bad")
            ran.append(i)
        return run
    outcomes = asyncio.run(engine.run([job(i) for i in range(8)]))
    assert [type(o).__name__ if o else None for o in outcomes] == \
        [None, None, None, "ValueError", None, None, None, None]
    assert sorted(ran) == [0, 1, 2, 4, 5, 6, 7]


def test_no_job_starts_after_the_deadline(engine):
    started = []
    outcomes = asyncio.run(engine.run([lambda: started.append(1)] * 4, time.monotonic() - 1))
    assert started == []
    assert all(isinstance(o, DeadlinePassed) for o in outcomes)


def test_a_stalled_thread_does_not_hold_back_the_jobs_after_its_own(engine):
    """The first job blocks its thread until every other job has run: only a free thread
    taking the next job (not a fixed share per thread) lets it finish."""
    others_done = threading.Event()
    remaining = [7]
    lock = threading.Lock()

    def stalled():
        if not others_done.wait(60):  # ends a hang only
            raise TimeoutError("the other jobs waited behind the stalled thread")

    def quick():
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                others_done.set()
    outcomes = asyncio.run(engine.run([stalled] + [quick] * 7))
    assert outcomes == [None] * 8


def test_one_thread_runs_the_jobs_in_order(engine):
    threads, ran = set(), []

    def job(i):
        def run():
            threads.add(threading.get_ident())
            ran.append(i)
        return run
    asyncio.run(engine.run([job(i) for i in range(5)], threads=1))
    assert len(threads) == 1
    assert ran == [0, 1, 2, 3, 4]


def test_copies_that_raised_are_logged_once_a_request_and_missed_deadlines_not(caplog):
    with caplog.at_level(logging.ERROR, logger="lmcache_mp.server.ops.transfers"):
        log_copy_failures("STORE", [None, None])
        log_copy_failures("STORE", [DeadlinePassed("late"), None])
        assert not caplog.records
        log_copy_failures("RETRIEVE", [None, ValueError("first"), DeadlinePassed("late"),
                                        RuntimeError("second")])
    [record] = caplog.records
    assert record.getMessage() == "RETRIEVE: 2 of 4 chunk copies failed"
    assert str(record.exc_info[1]) == "first"

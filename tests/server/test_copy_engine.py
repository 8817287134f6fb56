"""The copy engine on its own: outcomes in job order, failures kept apart, deadlines, and
no job waiting behind a stalled copy thread while another thread is free."""

import asyncio
import threading
import time

import pytest

from lmcache_mp.server.copy_engine import CopyEngine, DeadlinePassed


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
        if not others_done.wait(10):
            raise TimeoutError("the other jobs waited behind the stalled thread")

    def quick():
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                others_done.set()
    outcomes = asyncio.run(engine.run([stalled] + [quick] * 7))
    assert outcomes == [None] * 8


def test_settled_prefixes_are_reported_in_order_even_when_jobs_finish_out_of_order(engine):
    """Job 0 finishes last: nothing is reported until it does, then every job at once;
    a failed job settles like a finished one."""
    job_0_may_finish = threading.Event()
    reports = []

    def slow_first():
        assert job_0_may_finish.wait(10)

    def later(i):
        def run():
            if i == 4:
                raise ValueError("chunk 4 is bad")
            if i == 5:
                job_0_may_finish.set()
        return run
    jobs = [slow_first] + [later(i) for i in range(1, 6)]
    outcomes = asyncio.run(engine.run(jobs, on_settled=reports.append))
    assert reports == [6]
    assert isinstance(outcomes[4], ValueError)


def test_one_thread_runs_the_jobs_in_order_and_reports_each(engine):
    threads, reports = set(), []

    def job():
        threads.add(threading.get_ident())
    asyncio.run(engine.run([job] * 5, on_settled=reports.append, threads=1))
    assert len(threads) == 1
    assert reports == [1, 2, 3, 4, 5]

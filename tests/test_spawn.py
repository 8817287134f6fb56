"""ServerProcess: a server forked from the tests' forkserver starts like an exec'd one."""

from __future__ import annotations

import signal
import subprocess

import pytest

from lmcache_mp import phases
from lmcache_mp.client import LookupItem
from lmcache_mp.spawn import ForkedServer, ServerProcess

from .utils import run_server, server_process, started_process
from .workers import MODEL, prompt


def test_a_forked_server_takes_the_callers_environment_directory_and_log(tmp_path, monkeypatch):
    """The forkserver started long before: what the server reads must still be the caller's
    at the time of start(), as an exec'd server's would be."""
    with run_server():  # the forkserver runs from before the changes below
        pass
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LMCACHE_MP_CPU_SIZE", "48MiB")
    monkeypatch.setenv("LMCACHE_MP_LOG_LEVEL", "info")
    monkeypatch.setenv("LMCACHE_MP_PROFILE", str(tmp_path))
    server = server_process(runtime_dir="relative-runtime-dir")
    server.start()
    try:
        assert (tmp_path / "relative-runtime-dir" / "token").exists()
        with server.client() as client:
            assert client.stats().capacity_bytes == 48 << 20
            assert client.lookup(MODEL, 1, [LookupItem.build("r", prompt(1, 2))]) == [0]
        assert started_process(server).poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            started_process(server).wait(0.1)
    finally:
        assert server.close() == 0
    assert "configuration:" in server.output()  # info, from the environment, into its log
    profile = phases.read(tmp_path)  # timed, and its totals written as it exited
    assert profile["LOOKUP\tserver index"][1:] == [1, 2]  # one span, two keys


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "exec'd"])
def test_exit_codes_and_errors_are_those_of_the_command(forked, tmp_path):
    """A refusal exits 2 with its reason in the log; SIGKILL reads as -9, as from Popen."""
    refusing = ["--cpu-size", "16MiB", "--pool-segment", f"lmcache-mp-absent-{tmp_path.name}",
                "--adopt", "require"]
    make = server_process if forked else ServerProcess
    server = make(None, refusing)
    with pytest.raises(RuntimeError, match="exited with 2"):
        server.start()
    server.close()
    assert "cannot use the pool segment" in server.output()

    server = make(None, ["--cpu-size", "16MiB"])
    server.start()
    started_process(server).send_signal(signal.SIGKILL)
    assert started_process(server).wait(20) == -signal.SIGKILL
    assert server.close() == -signal.SIGKILL


def test_a_server_that_is_not_ready_in_time_is_stopped_and_closed_by_start():
    """start() that raises leaves nothing behind for a caller that never reaches close():
    no running server, no runtime directory, no open log."""
    server = server_process(None, ["--cpu-size", "16MiB"])
    with pytest.raises(RuntimeError, match="wrote no token in 0"):
        server.start(ready_timeout=0.0)
    assert started_process(server).returncode is not None
    assert not server.runtime_dir.exists()
    assert server.close() == started_process(server).returncode  # closing again is harmless


def test_a_server_reaped_before_its_exit_code_arrived_is_stopped_and_closed(monkeypatch):
    """A forked server is the forkserver's child: the forkserver reaps it, then sends its
    exit code. Between the two, poll() still says running while the pid is gone; stopping
    it then must not fail, and a close() whose stop fails still releases the log."""
    server = server_process(None, ["--cpu-size", "16MiB"])
    server.start()
    forked = started_process(server)
    assert isinstance(forked, ForkedServer)
    forked.send_signal(signal.SIGKILL)
    forked._process.join()  # reaped: its exit code is in the sentinel, unread by poll()
    real_poll, unread = type(forked).poll, [None, None]
    monkeypatch.setattr(type(forked), "poll",
                        lambda self: unread.pop() if unread else real_poll(self))
    assert server.close() == -signal.SIGKILL  # SIGTERM to a pid no longer there: no error

    failing = server_process(None, ["--cpu-size", "16MiB"])
    failing.start()
    monkeypatch.setattr(failing, "stop", lambda timeout=20.0: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.close()
    assert failing._log.closed and not failing.runtime_dir.exists()
    monkeypatch.undo()
    started_process(failing).kill()
    started_process(failing).wait()

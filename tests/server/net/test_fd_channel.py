"""The fd channel over real unix sockets: what it tickets, what it refuses, and that it never
leaks a descriptor or stalls its event loop."""

import asyncio
import concurrent.futures
import errno
import fcntl
import mmap
import multiprocessing
import os
import socket
import stat
import threading
import time

import msgpack
import pytest
import uvloop

from lmcache_mp.client import CacheClient
from lmcache_mp.client.memfd import SharedSegment
from lmcache_mp.errors import BadRequest, RequestTimeout, ServerUnavailable
from lmcache_mp.fdpass import BOUND_FD_CHANNEL_MAGIC, FD_CHANNEL_MAGIC, open_watch, send_fds
from lmcache_mp.protocol import (
    BINDING_BYTES,
    FD_REQUEST_TIMEOUT_MS,
    MAX_FDS_PER_MESSAGE,
    MAX_PENDING_TICKETS_PER_UID,
    MAX_WAITING_FD_CONNECTIONS_PER_UID,
    MAX_WATCHES_PER_UID,
    TICKET_BYTES,
    TICKET_TTL_S,
)
from lmcache_mp.server.net.access import Sessions
from lmcache_mp.server.net.fd_channel import FdChannel

from ...utils import FakeClock, run_server, started_process
from ...workers import (
    BLOCKS_PER_CHUNK,
    Job,
    WorkerProcess,
    abandoned_store_worker,
    chunk_blocks,
    prompt,
)


class Served:
    """An FdChannel on an event loop in its own thread, as in the server; this test process
    plays the server, so its open descriptors are the server's."""

    def __init__(self, path: str, new_loop, clock: FakeClock, **options):
        self.clock = clock
        self.loop_errors: list[dict] = []
        self.loop = new_loop()
        self.loop.set_exception_handler(lambda loop, context: self.loop_errors.append(context))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.channel = FdChannel(path, clock=clock, **options)
        self.call(self.channel.start, self.loop)

    def call(self, fn, *args):
        """fn(*args) on the loop's thread, once the callback running there now has finished."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn(*args))
            except BaseException as exc:
                done.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return done.result(timeout=5)

    def open_fds(self) -> int:
        return self.call(lambda: len(os.listdir("/proc/self/fd")))

    def close(self) -> None:
        self.call(self.channel.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
        assert self.loop_errors == []


# The server runs uvloop; asyncio's own loop behaves differently enough to check both.
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(params=list(LOOPS))
def served(request, tmp_path):
    served = Served(str(tmp_path / "fd.sock"), LOOPS[request.param], FakeClock())
    yield served
    served.close()


def _fill_and_send(path: str, payload: bytes) -> tuple[list[bytes], int]:
    """In a worker process: put the payload in a SharedSegment and trade its fd for a ticket."""
    with SharedSegment(len(payload)) as segment:
        segment.mapping[:] = payload
        tickets = send_fds(path, [segment.fd], timeout=5.0)
    return tickets, os.getpid()  # the server's duplicate outlives this process's segment


@pytest.mark.parametrize("served", ["uvloop"], indirect=True)  # a process start is slow: once
def test_a_worker_process_trades_its_segment_for_a_ticket_and_the_server_maps_its_bytes(served):
    payload = os.urandom(3 * mmap.PAGESIZE + 123)
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        tickets, worker_pid = pool.submit(_fill_and_send, served.channel.path, payload).result(60)
    (ticket,) = tickets
    assert len(ticket) == TICKET_BYTES
    passed = served.call(served.channel.peek, ticket)
    assert (passed.size, passed.pid, passed.uid) == (len(payload), worker_pid, os.getuid())
    assert passed.engine is None  # a version 1 request: bound to the uid only
    assert passed.expires == served.clock.now + TICKET_TTL_S
    assert fcntl.fcntl(passed.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # not for the server's children
    with mmap.mmap(passed.fd, passed.size) as mapped:
        assert mapped[:] == payload
    assert served.call(served.channel.peek, ticket) is passed  # a look spends nothing
    before = served.open_fds()
    served.call(served.channel.spend, ticket)
    assert served.open_fds() == before - 1
    assert served.call(served.channel.peek, ticket) is None  # a ticket is good for one use


def _regular_file(tmp_path) -> int:
    fd = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.ftruncate(fd, 4096)
    return fd


def _memfd(seals: int, size: int = 4096) -> int:
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _read_only(tmp_path) -> int:
    with SharedSegment(4096) as segment:
        return os.open(f"/proc/self/fd/{segment.fd}", os.O_RDONLY | os.O_CLOEXEC)


def _pipe(tmp_path) -> int:
    read_end, write_end = os.pipe()
    os.close(write_end)
    return read_end


def _hugetlb_memfd(tmp_path) -> int:
    """A sealed hugetlbfs memfd; no huge page need exist (none is touched)."""
    try:
        fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
    except OSError as exc:
        pytest.skip(f"this kernel makes no hugetlbfs memfds: {exc}")
    os.ftruncate(fd, 2 * 1024**2)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


BAD_FDS = {
    "regular file": (_regular_file, "fd 1 is not a memfd sealed with F_SEAL_SHRINK; allocate "
                                    "with lmcache_mp.client.SharedSegment"),
    "unsealed memfd": (lambda tmp_path: _memfd(0), "fd 1 is not a memfd sealed with F_SEAL_SHRINK"),
    "write-sealed memfd": (lambda tmp_path: _memfd(fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE),
                           r"fd 1 is sealed against writes \(F_SEAL_WRITE"),
    "read-only fd": (_read_only, "fd 1 is not open for reading and writing"),
    "pipe": (_pipe, "fd 1 is not a regular file but a pipe"),
    "empty memfd": (lambda tmp_path: _memfd(fcntl.F_SEAL_SHRINK, size=0), "fd 1 is empty"),
    "hugetlbfs memfd": (_hugetlb_memfd, r"fd 1 is a hugetlbfs memfd \(MFD_HUGETLB\)"),
}


@pytest.mark.parametrize("kind", list(BAD_FDS))
def test_one_unfit_descriptor_refuses_the_whole_message_and_none_is_kept(served, tmp_path, kind):
    make, reason = BAD_FDS[kind]
    bad = make(tmp_path)
    try:
        with SharedSegment(4096) as good:
            before = served.open_fds()
            with pytest.raises(BadRequest, match=reason):
                send_fds(served.channel.path, [good.fd, bad], timeout=5.0)
            assert served.open_fds() == before  # the good one's duplicate was closed too
            (ticket,) = send_fds(served.channel.path, [good.fd], timeout=5.0)  # still serving
            served.call(served.channel.spend, ticket)
    finally:
        os.close(bad)


def test_too_many_descriptors_are_refused_by_the_client_and_by_the_server(served):
    with SharedSegment(4096) as segment:
        with pytest.raises(ValueError, match=f"1 to {MAX_FDS_PER_MESSAGE} descriptors"):
            send_fds(served.channel.path, [segment.fd] * (MAX_FDS_PER_MESSAGE + 1), timeout=5.0)
        with pytest.raises(ValueError, match="got 0"):
            send_fds(served.channel.path, [], timeout=5.0)
        before = served.open_fds()
        # A client that ignores the limit: the kernel delivers what fits and drops the rest.
        for data, count, reason in (
                (FD_CHANNEL_MAGIC, MAX_FDS_PER_MESSAGE + 1, "did not all arrive"),
                (b"hello", 1, "not an fd channel request"),
                (FD_CHANNEL_MAGIC, 0, "carries no descriptors")):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as raw:
                raw.settimeout(5.0)
                raw.connect(served.channel.path)
                socket.send_fds(raw, [data], [segment.fd] * count)
                assert reason in msgpack.unpackb(raw.recv(4096))["error"]
            assert served.open_fds() == before


def _connect_silently(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    return sock


def test_a_silent_connection_is_closed_after_the_request_timeout(served):
    before = served.open_fds()
    started = time.monotonic()
    silent = _connect_silently(served.channel.path)
    try:
        with SharedSegment(4096) as segment:  # served meanwhile
            (ticket,) = send_fds(served.channel.path, [segment.fd], timeout=5.0)
            served.call(served.channel.spend, ticket)
        silent.settimeout(FD_REQUEST_TIMEOUT_MS / 1000 + 60.0)  # the 60 s only end a hang
        assert silent.recv(16) == b""
        assert time.monotonic() - started > FD_REQUEST_TIMEOUT_MS / 1000 - 0.1
    finally:
        silent.close()
    assert served.open_fds() == before


def test_a_uid_keeps_only_its_newest_silent_connections_and_its_worker_gets_in(tmp_path):
    """Past MAX_WAITING_FD_CONNECTIONS_PER_UID waiting connections, a uid's newest drops its
    oldest (a timeout that never comes here shows it is not that); a worker of it is still
    served."""
    served = Served(str(tmp_path / "fd.sock"), uvloop.new_event_loop, FakeClock(),
                    request_timeout=600.0)
    before = served.open_fds()
    evicted = [_connect_silently(served.channel.path) for _ in range(3)]
    silent = [_connect_silently(served.channel.path)
              for _ in range(MAX_WAITING_FD_CONNECTIONS_PER_UID)]
    try:
        for sock in evicted:
            sock.settimeout(5.0)
            assert sock.recv(16) == b""
        with SharedSegment(4096) as segment:
            (ticket,) = send_fds(served.channel.path, [segment.fd], timeout=5.0)
            served.call(served.channel.spend, ticket)
        # The worker's connection dropped at most the then oldest one: the rest still wait.
        for sock in silent[1:]:
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(16)
        for sock in evicted + silent:
            sock.close()
        _until(lambda: served.open_fds() == before)  # each hang-up closed the server's end
    finally:
        for sock in evicted + silent:
            sock.close()
        served.close()


def test_a_bound_request_ties_its_tickets_to_its_sessions_engine(tmp_path):
    sessions = Sessions("e" * 16, "a" * 16, token_required=False)
    mine = sessions.open(b"worker", "", "engine-a", os.getuid())
    remote = sessions.open(b"remote", "", "engine-b", None)  # a tcp:// session: uid unknown
    other = sessions.open(b"other", "", "engine-c", os.getuid() + 1)
    served = Served(str(tmp_path / "fd.sock"), uvloop.new_event_loop, FakeClock(),
                    bindings=sessions.bound)
    try:
        with SharedSegment(4096) as segment:
            (ticket,) = send_fds(served.channel.path, [segment.fd], 5.0, mine.binding)
            assert served.call(served.channel.peek, ticket).engine == mine.engine
            (ticket,) = send_fds(served.channel.path, [segment.fd], 5.0, remote.binding)
            assert served.call(served.channel.peek, ticket).engine == remote.engine
            before = served.open_fds()
            sessions.open(b"worker", "", "engine-a", os.getuid())  # a new HELLO, a new binding
            for binding, reason in (
                    (other.binding, r"belongs to a session of another uid than this sender's"),
                    (mine.binding, "unknown fd_binding"),
                    (os.urandom(BINDING_BYTES), "unknown fd_binding")):
                with pytest.raises(BadRequest, match=reason):
                    send_fds(served.channel.path, [segment.fd], 5.0, binding)
            for data in (BOUND_FD_CHANNEL_MAGIC, BOUND_FD_CHANNEL_MAGIC + other.binding[:-1],
                         BOUND_FD_CHANNEL_MAGIC + other.binding + b"!"):
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as raw:
                    raw.settimeout(5.0)
                    raw.connect(served.channel.path)
                    socket.send_fds(raw, [data], [segment.fd])
                    assert "not an fd channel request" in msgpack.unpackb(raw.recv(4096))["error"]
            assert served.open_fds() == before  # nothing of them kept
            with pytest.raises(ValueError, match=f"an fd_binding has {BINDING_BYTES} bytes"):
                send_fds(served.channel.path, [segment.fd], 5.0, b"short")
    finally:
        served.close()


def test_one_uid_holds_at_most_its_share_of_tickets_and_watches(served):
    with SharedSegment(4096) as segment:
        for _ in range(MAX_PENDING_TICKETS_PER_UID // MAX_FDS_PER_MESSAGE):  # all or none
            send_fds(served.channel.path, [segment.fd] * MAX_FDS_PER_MESSAGE, timeout=5.0)
        share = MAX_PENDING_TICKETS_PER_UID
        with pytest.raises(BadRequest, match=f"uid {os.getuid()} holds {share} unused tickets "
                                             f"already, and may hold {share} "
                                             rf"\(MAX_PENDING_TICKETS_PER_UID\)"):
            send_fds(served.channel.path, [segment.fd], timeout=5.0)
        watches = [open_watch(served.channel.path, 5.0) for _ in range(MAX_WATCHES_PER_UID)]
        with pytest.raises(BadRequest, match=r"\(MAX_WATCHES_PER_UID\)"):
            open_watch(served.channel.path, 5.0)
        served.clock.now += TICKET_TTL_S  # unused, all of them expire, and make room again
        send_fds(served.channel.path, [segment.fd], timeout=5.0)
        open_watch(served.channel.path, 5.0).close()
    for watch in watches:
        watch.close()


def test_tickets_expire_and_their_descriptors_are_closed(served):
    with SharedSegment(4096) as segment:
        first, second = send_fds(served.channel.path, [segment.fd, segment.fd], timeout=5.0)
    sealed = _memfd(fcntl.F_SEAL_SHRINK)
    send_fds(served.channel.path, [sealed], timeout=5.0)
    os.close(sealed)
    assert served.call(served.channel.expire) == 0
    before = served.open_fds()
    served.clock.now += TICKET_TTL_S
    assert served.call(served.channel.peek, first) is None  # expired: closed on the spot
    assert served.open_fds() == before - 1
    assert served.call(served.channel.expire) == 2
    assert served.open_fds() == before - 3
    assert served.call(served.channel.peek, second) is None
    assert served.call(served.channel.peek, b"\0" * TICKET_BYTES) is None


def test_close_releases_every_descriptor_and_the_socket_file(served):
    with SharedSegment(4096) as segment:
        send_fds(served.channel.path, [segment.fd] * 3, timeout=5.0)
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    idle.connect(served.channel.path)
    served.call(lambda: None)  # let the loop accept it
    before = served.open_fds()
    served.call(served.channel.close)
    assert served.open_fds() == before - 3 - 1 - 1  # tickets, the connection, the listener
    assert not os.path.exists(served.channel.path)
    idle.settimeout(1.0)
    assert idle.recv(16) == b""
    idle.close()
    with SharedSegment(4096) as segment, \
            pytest.raises(ServerUnavailable, match="must run on this machine"):
        send_fds(served.channel.path, [segment.fd], timeout=1.0)


def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


def test_a_watch_reports_its_hangup_once_and_stopping_closes_it(served):
    before = served.open_fds()
    first, second = open_watch(served.channel.path, 5.0), open_watch(served.channel.path, 5.0)
    assert len(first.token) == TICKET_BYTES and first.token != second.token
    assert served.open_fds() == before + 4  # both ends of both, held open
    hung_up: list[str] = []
    stops = [served.call(served.channel.watch, first.token, lambda: hung_up.append("a")),
             served.call(served.channel.watch, first.token, lambda: hung_up.append("b"))]
    stop_second = served.call(served.channel.watch, second.token, lambda: hung_up.append("c"))
    assert None not in stops and stop_second is not None
    assert served.call(served.channel.watch, b"\0" * TICKET_BYTES, hung_up.append) is None
    # Nobody watching any more: the server closes it (and calls nobody).
    served.call(stop_second)
    assert served.open_fds() == before + 3 and hung_up == []
    # The worker hangs up: everyone still watching hears it, once; the token is gone.
    served.call(stops[0])
    first.close()
    _until(lambda: hung_up == ["b"])
    assert served.open_fds() == before + 1  # second's own end
    served.call(stops[1])  # stopping after the hangup is harmless
    assert served.call(served.channel.watch, first.token, hung_up.append) is None
    second.close()
    assert hung_up == ["b"] and served.open_fds() == before


def test_a_watch_nobody_names_expires_and_one_that_writes_is_closed(served):
    before = served.open_fds()
    idle = open_watch(served.channel.path, 5.0)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as chatty:
        chatty.connect(served.channel.path)
        chatty.send(b"lmcache-mp-watch/1")  # the wire format, by hand
        token = msgpack.unpackb(chatty.recv(4096))["watch"]
        hung_up: list[str] = []
        assert served.call(served.channel.watch, token, lambda: hung_up.append("chatty"))
        served.clock.now += TICKET_TTL_S
        assert served.call(served.channel.expire) == 1  # the idle one; a named one stays
        assert served.call(served.channel.watch, idle.token, hung_up.append) is None
        chatty.send(b"hello")  # a watch says nothing; one that does is closed like a hangup
        _until(lambda: hung_up == ["chatty"])
        chatty.settimeout(1.0)
        assert chatty.recv(16) == b""
    idle.close()
    assert served.open_fds() == before


def test_a_killed_worker_is_unregistered_and_unmapped_at_once_not_at_its_timeout():
    with run_server("--worker-timeout", "60") as server, \
            CacheClient(server.url, admin=True) as admin:
        job = Job(server.url, 4 * BLOCKS_PER_CHUNK, 5, prompt(40, 4), chunk_blocks(range(4)))
        with WorkerProcess(abandoned_store_worker, job) as worker:
            segment = worker.receive()
            assert admin.stats().registrations == 1
            assert f"/memfd:{segment}" in _maps(started_process(server).pid)
            worker.process.kill()
            worker.process.join()
            killed = time.monotonic()
        # Its STORE may still be copying: the mapping goes once that has finished.
        _until(lambda: admin.stats().registrations == 0, timeout=10)
        _until(lambda: f"/memfd:{segment}" not in _maps(started_process(server).pid), timeout=10)
        assert time.monotonic() - killed < 30  # half the worker timeout: not by silence
        assert admin.stats().pending_stores == 0


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as maps:
        return maps.read()


def test_the_socket_file_is_private_and_only_a_stale_socket_is_replaced(served, tmp_path):
    assert stat.S_IMODE(os.stat(served.channel.path).st_mode) == 0o600
    shared = FdChannel(str(tmp_path / "shared.sock"), mode=0o660, gid=os.getgid())
    served.call(shared.start, served.loop)
    st = os.stat(shared.path)
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, os.getgid())
    served.call(shared.close)

    with pytest.raises(OSError) as live:  # another channel listens there
        served.call(FdChannel(served.channel.path).start, served.loop)
    assert live.value.errno == errno.EADDRINUSE

    not_socket = tmp_path / "not_a_socket"
    not_socket.write_bytes(b"precious")
    with pytest.raises(OSError, match="not a socket"):
        served.call(FdChannel(str(not_socket)).start, served.loop)
    assert not_socket.read_bytes() == b"precious"

    stale_path = str(tmp_path / "stale.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as dead:
        dead.bind(stale_path)  # a server that died without unlinking its socket
    revived = FdChannel(stale_path)
    served.call(revived.start, served.loop)
    try:
        with SharedSegment(4096) as segment:
            (ticket,) = send_fds(stale_path, [segment.fd], timeout=5.0)
        served.call(revived.spend, ticket)
    finally:
        served.call(revived.close)


def test_client_errors_say_what_went_wrong(tmp_path):
    with SharedSegment(4096) as segment:
        missing = str(tmp_path / "missing.sock")
        with pytest.raises(ServerUnavailable, match=f"{missing}.*must run on this machine"):
            send_fds(missing, [segment.fd], timeout=1.0)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as mute:
            mute.bind(str(tmp_path / "mute.sock"))
            mute.listen(1)  # never accepts, never answers
            with pytest.raises(RequestTimeout, match="did not answer within 0.2 s"):
                send_fds(str(tmp_path / "mute.sock"), [segment.fd], timeout=0.2)
        closed = os.dup(segment.fd)
        os.close(closed)
        with pytest.raises(ValueError, match=f"descriptor 1 \\({closed}\\) cannot be sent"):
            send_fds(missing, [segment.fd, closed], timeout=1.0)

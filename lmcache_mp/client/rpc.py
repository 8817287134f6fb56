"""The RPC transport: a thread-safe client whose calls are futures matched to replies by
request id."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, Literal, overload

import zmq
from zmq.utils.monitor import recv_monitor_message

from .. import phases, protocol, runtime
from ..errors import (
    RequestTimeout,
    ServerError,
    ServerUnavailable,
    Unauthenticated,
    error_from_reply,
)
from ..zmq_io import POLLIN, readable, recv_frames, send_frames
from .calls import Call, ReplySlot, SettledFuture

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
_IDLE_WAIT_S = 0.05
_RETRY_SEND_S = 0.005
_RECONNECT_IVL_MS = 100
# How recent a read of the socket monitor spares a send from reading it again. ZeroMQ
# publishes a lost connection's event before it starts the reconnect timer, which waits at
# least RECONNECT_IVL. An event still unread at a send was published after the last read,
# so no new connection exists until RECONNECT_IVL after that read: a send sooner goes out
# on the lost connection or not at all, and the event, read after it, rightly fails it.
# Well under RECONNECT_IVL, this spares back-to-back calls a zmq_poll of the monitor each
# (~3 µs of a ~150 µs LOOKUP).
_MONITOR_FRESH_S = 0.02


# Per request type: its op's name, its op frame, its reply's type.
_ROUTES: dict[type, tuple[str, bytes, type]] = {
    spec.request: (name, name.encode("ascii"), spec.reply) for name, spec in protocol.OPS.items()}


class RpcClient:
    """Sends requests to one server from any thread; every call has a deadline.

    One DEALER socket, guarded by a lock. At most one thread at a time, the leader, waits
    on the socket; whenever it wakes it pumps: receives every reply that has arrived and
    resolves its future, sends what could not be sent yet, and fails calls past their
    deadline. A thread blocked in call() leads for itself when nobody else does, so a
    sequential round trip costs no thread hand-off; other callers wait on a condition
    that the leader signals. A background thread leads for submit() futures that nobody
    waits on, and sends heartbeats.

    A request that cannot be sent (the server is down or restarting) waits for the
    connection until its deadline, then fails with RequestTimeout (or at once with
    ServerUnavailable if submitted with wait_for_connection=False); a reply that arrives
    after its call timed out is dropped, never handed to another call. ZeroMQ
    reconnects by itself when the server comes back.

    When the connection drops (a socket monitor reports it), every call sent on it and
    not answered fails at once with ServerUnavailable: the server process closed its
    end, so it is gone (it cannot write into the caller's memory any more), and a
    restarted server never answers its predecessor's requests.

    The session: HELLO is the first message sent, and whenever the server answers a call
    `unauthenticated` (it restarted, or forgot an idle session) HELLO goes again and the
    call is sent once more, so callers never see a lost session.
    """

    def __init__(self, url: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 heartbeat_interval: float | None = None,
                 on_push: Callable[[bytes], None] | None = None,
                 hello: protocol.HelloRequest | None = None, push_watcher: bool = True):
        """`url`: default runtime.default_url(), the server's ipc:// socket for this user;
        `on_push(payload)` receives what the server sends unasked (request id 0); it runs
        on whichever thread reads the socket, with the client's lock held: keep it short;
        `push_watcher`: with on_push, the background thread reads the socket whenever no
        call does, so that pushes are handled as they come; False: only while a call
        waits (or a submitted call is open), for pushes that matter only to waiters;
        `hello`: the HELLO that opens the session (default: this user's engine token)."""
        self.on_push = on_push
        self._push_watcher = on_push is not None and push_watcher
        self.url = url = url or runtime.default_url()
        self.hello_request = hello or protocol.HelloRequest(
            protocol.PROTOCOL_VERSION, token=runtime.find_token(url))
        self.server_info: protocol.HelloReply | None = None  # the last HELLO's reply
        self._hello_error: ServerError | None = None
        self.timeout = timeout
        self._heartbeat_interval = heartbeat_interval
        self._context = zmq.Context()
        self._dealer = self._context.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        # A fixed identity keeps this client's registrations usable across reconnects.
        self._dealer.setsockopt(zmq.ROUTING_ID, b"lmcache-mp-" + uuid.uuid4().bytes)
        self._dealer.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for a dead server
        self._dealer.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_IVL_MS)
        self._dealer.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        # Before connect(), so that no event is missed.
        self._monitor = self._dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.disconnects = 0  # connections lost so far: a change means the server went away
        # time.monotonic() before the latest read of the monitor that left no event unread.
        self._monitor_read_at = -math.inf
        self._dealer.connect(url)
        self._kick_r, self._kick_w = os.pipe()  # wakes the leader when another thread sent
        os.set_blocking(self._kick_r, False)
        # Sockets and a descriptor, as zmq_poll takes them (pyzmq's stubs take one or the other).
        self._watched: list[tuple[Any, int]] = [(self._dealer, POLLIN), (self._monitor, POLLIN),
                                                (self._kick_r, POLLIN)]
        # Guards the socket and every field below. Taken directly (`with self._lock`), not
        # through a Condition on it, whose `with` costs two Python calls, a dozen per call.
        self._lock = threading.Lock()
        self._state = threading.Condition(self._lock)  # callers waiting for the leader
        self._background_wake = threading.Condition(self._lock)
        self._leader: int | None = None  # thread ident of the thread waiting on the socket
        self._followers = 0  # threads in call() waiting for the leader
        self._kicked = False  # a byte waits in the kick pipe
        self._unattended_ids: set[int] = set()  # submitted calls that no call() waits on
        self._waiting: dict[int, Call] = {}  # sent; reply not in yet
        self._unsent: deque[Call] = deque()
        self._deadlines: list[tuple[float, int]] = []
        self._ids = itertools.count(1)
        self._last_sent = time.monotonic()
        self._closed = False
        self._thread = threading.Thread(target=self._background, name="lmcache-mp-rpc",
                                        daemon=True)
        with self._lock:
            self._queue_hello()
        self._thread.start()

    @property
    def heartbeat_interval(self) -> float | None:
        """Seconds of silence after which a PING is sent, or None for no heartbeats."""
        return self._heartbeat_interval

    @heartbeat_interval.setter
    def heartbeat_interval(self, seconds: float | None) -> None:
        with self._lock:
            self._heartbeat_interval = seconds
            self._background_wake.notify()

    # -- calls (any thread) ---------------------------------------------------------------

    def submit(self, request: Any, timeout: float | None = None,
               wait_for_connection: bool = True, wait: float = 0.0) -> Future:
        """Send `request` (a protocol request dataclass); the future yields its reply
        dataclass. `wait_for_connection=False`: if the request cannot be sent at once (no
        connection to the server), the future fails at once with ServerUnavailable rather
        than waiting for the connection (and sending it late). `wait`: seconds to wait
        for the reply on this thread before returning, reading the socket itself from the
        send on (as wait() would, without first waking the background thread to read it)."""
        future = self._submit(request, timeout, attended=False,
                              wait_for_connection=wait_for_connection, lead=wait > 0)
        if wait > 0:
            try:
                self._wait_leading(future.is_settled, time.monotonic() + wait)
            finally:
                with self._lock:
                    if self._leader == threading.get_ident():  # it never had to read
                        self._resign()
        return future

    def call(self, request: Any, timeout: float | None = None) -> Any:
        """Send `request` and wait for its reply; raises ServerError or TransportError
        subclasses."""
        reply = self._submit(request, timeout, attended=True)
        self._wait_leading(reply.is_settled, None)
        return reply.result()

    def wait(self, futures: Iterable[Future], timeout: float) -> None:
        """Block until every future (of submit(), or set when one of its replies is read) is
        done or `timeout` seconds have passed, reading the socket on this thread meanwhile,
        as call() does: each reply then reaches its waiter without a hand-off from the
        background thread (a thread wake-up, tens of µs on a busy machine)."""
        pending = [future for future in futures if not future.done()]
        settled = 0  # pending[:settled] are done: until() is tested after each reply read

        def all_done() -> bool:
            nonlocal settled
            while settled < len(pending) and pending[settled].done():
                settled += 1
            return settled == len(pending)
        if pending:
            self._wait_leading(all_done, time.monotonic() + timeout)

    def wait_until(self, until: Callable[[], bool], timeout: float) -> bool:
        """As wait(), for any condition: block until `until()` (checked after each read of
        the socket, on_push's included) or `timeout` seconds have passed; returns until()."""
        if not until():
            self._wait_leading(until, time.monotonic() + timeout)
        return until()

    def _wait_leading(self, until: Callable[[], bool], end: float | None) -> None:
        """Until `until()` (or time.monotonic() reaches `end`; None: no end): lead while
        nobody else does, else wait for the leader's signal and take over when it resigns."""
        if self._leader == threading.get_ident() or self._take_lead(until, end):
            self._lead(until, end)  # it resigns once the wait is over

    def _take_lead(self, until: Callable[[], bool], end: float | None) -> bool:
        """Follow the leader until it resigns, then lead (True); or until `until()`, the
        client's close or `end` (False)."""
        def over() -> bool:
            return until() or self._closed or (end is not None and time.monotonic() >= end)
        with self._lock:
            self._followers += 1
            if self._leader is not None and not self._kicked:
                self._kicked = True  # the background thread hands over when it wakes
                os.write(self._kick_w, b"x")
            while self._leader is not None and not over():
                self._state.wait(None if end is None else end - time.monotonic())
            self._followers -= 1
            if over():
                if self._leader is None:  # the socket may need a watcher again
                    self._background_wake.notify()
                return False
            self._leader = threading.get_ident()
            return True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._state.notify_all()
            self._background_wake.notify()
        os.write(self._kick_w, b"x")
        self._thread.join()
        with self._lock:
            error = ServerUnavailable("the client was closed before the reply arrived")
            for call in [*self._waiting.values(), *self._unsent]:
                if not call.future.done():
                    call.future.set_exception(error)
            self._dealer.disable_monitor()
            self._monitor.close()
            self._dealer.close()
        self._context.term()
        os.close(self._kick_r)
        os.close(self._kick_w)

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @overload
    def _submit(self, request: Any, timeout: float | None, attended: Literal[True],
                wait_for_connection: bool = ..., lead: bool = ...) -> ReplySlot: ...
    @overload
    def _submit(self, request: Any, timeout: float | None, attended: Literal[False],
                wait_for_connection: bool = ..., lead: bool = ...) -> SettledFuture: ...

    def _submit(self, request: Any, timeout: float | None, attended: bool,
                wait_for_connection: bool = True, lead: bool = False) -> SettledFuture | ReplySlot:
        """Queue and send the request; `attended`: call() waits for it, and gets a ReplySlot."""
        op, op_frame, reply_type = _ROUTES[type(request)]
        stamp = phases.now() if phases.enabled else 0  # a stamp is a call: only if profiling
        payload = protocol.pack(request)
        if phases.enabled:
            stamp = phases.add(op, "client encode", stamp)
        future = ReplySlot() if attended else SettledFuture()
        with self._lock:
            if self._closed:
                raise ServerUnavailable("the client is closed")
            call = self._new_call(op_frame, reply_type, payload, timeout, future, attended)
            call.wait_for_connection = wait_for_connection
            call.sent = stamp
            if attended or lead:
                if self._leader is None:  # lead straight away: no hand-off on the way back
                    self._leader = threading.get_ident()
            if not attended:
                self._unattended_ids.add(call.request_id)
                if not lead:
                    self._background_wake.notify()  # it may need to lead
            if self._unsent:  # others wait to be sent: in turn
                self._unsent.append(call)
                self._flush_unsent()
            else:
                self._watch_connection_before_send()
                if self._try_send(call):
                    self._after_send()
                else:
                    self._unsent.append(call)
                    self._fail_unsendable()
        return future

    def _new_call(self, op_frame: bytes, reply_type: type, payload: bytes,
                  timeout: float | None, future: Future | ReplySlot, attended: bool) -> Call:
        """A call with its id and deadline (lock held); the caller queues it."""
        request_id = next(self._ids)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        heapq.heappush(self._deadlines, (deadline, request_id))
        frames = [protocol.REQUEST_ID.pack(request_id), op_frame, payload]
        return Call(request_id, reply_type, frames, future, attended)

    def _queue_hello(self) -> None:
        """Put HELLO at the front of what goes out next (lock held); nobody waits on it."""
        future: Future = Future()
        future.add_done_callback(self._hello_done)
        stamp = phases.now()
        _, op_frame, reply_type = _ROUTES[protocol.HelloRequest]
        call = self._new_call(op_frame, reply_type, protocol.pack(self.hello_request), None,
                              future, attended=True)
        call.sent = stamp  # its round trip in --profile starts here, as a call's does
        self._unsent.appendleft(call)

    def _hello_done(self, future: Future) -> None:
        error = future.exception()
        if error is None:
            self.server_info = future.result()
            self._hello_error = None
        elif isinstance(error, ServerError):  # a wrong token, say: the calls behind it say why
            logger.warning("HELLO to %s refused: %s", self.url, error)
            self._hello_error = error

    def _unattended(self) -> bool:
        """Whether a submitted future that nobody waits on is still open."""
        calls = itertools.chain(self._waiting.values(), self._unsent)
        self._unattended_ids.intersection_update(
            c.request_id for c in calls if not c.attended and not c.future.done())
        return bool(self._unattended_ids)

    def _resign(self) -> None:
        """Give up leading (lock held): a follower or the background thread takes over."""
        self._leader = None
        if self._followers:
            self._state.notify_all()
        if self._push_watcher or (self._unattended_ids and self._unattended()):
            self._background_wake.notify()  # the socket needs a watcher again

    # -- leading (one thread at a time) ---------------------------------------------------

    def _lead(self, until: Callable[[], bool], end: float | None) -> None:
        """Wait on the socket and pump, until `until()` is true, the client closes, or
        time.monotonic() reaches `end` (None: no end); then, or when it raises, resign."""
        # zmq_poll, unlike select() on the sockets' edge-triggered FDs, sees a message that
        # came before the wait, and the kick pipe is level-triggered: nothing needs reading
        # before the first wait; calls queued or expired meanwhile are dealt with after it
        # (it ends by a call's deadline, or within _RETRY_SEND_S while calls are queued).
        watched = self._watched
        ready: list[tuple[Any, int]] | None = None  # what the last poll found readable
        polled_at = 0.0  # when that poll began: set before each poll, read once ready is
        try:
            while True:
                with self._lock:
                    if ready is not None:
                        self._pump(ready, polled_at, until)
                        if self._followers:
                            self._state.notify_all()
                    polled_at = time.monotonic()  # when the next poll begins, at the latest
                    if until() or self._closed or (end is not None and polled_at >= end):
                        self._resign()  # in the same hold of the lock: one acquire fewer
                        return
                    wait = _RETRY_SEND_S if self._unsent else _IDLE_WAIT_S
                    if self._deadlines:
                        wait = max(0.0, min(wait, self._deadlines[0][0] - polled_at))
                ready = zmq.zmq_poll(watched, math.ceil(wait * 1000))
        except BaseException:
            with self._lock:
                self._resign()
            raise

    def _pump(self, ready: list[tuple[Any, int]], polled_at: float,
              until: Callable[[], bool]) -> None:
        """After a poll that began at `polled_at` found `ready` readable: read the monitor's
        events and the replies that arrived (until `until()`), send what waits, fail what
        expired."""
        # In the order watched: the dealer first. Anything else is the monitor or the kick
        # pipe; a read of the monitor that finds nothing costs a zmq_poll.
        receive = bool(ready) and ready[0][0] is self._dealer
        watch = len(ready) > receive
        if self._kicked:
            self._kicked = False
            try:
                while os.read(self._kick_r, 4096):
                    pass
            except BlockingIOError:
                pass
        if watch:  # before any send: a loss read after it would fail a call sent after it
            self._watch_connection()
        else:  # the poll tested the monitor after it began (an older time only costs a read)
            self._monitor_read_at = polled_at
        if self._unsent:
            self._flush_unsent()
        if receive:
            self._receive(seen=True, until=until)
        self._expire()

    def _watch_connection(self) -> None:
        """Read the socket monitor's events; on a lost connection, fail the calls sent on it."""
        lost = False
        read_at = time.monotonic()
        while readable(self._monitor):
            event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            if event == zmq.EVENT_DISCONNECTED:  # not MONITOR_STOPPED, sent at close()
                self.disconnects += 1
                lost = True
        self._monitor_read_at = read_at
        if not lost:
            return
        self._receive()  # replies that came in before the connection dropped
        error = ServerUnavailable(f"lost the connection to {self.url}: the server is gone, "
                                  f"and no reply to a request sent before can come")
        for call in self._waiting.values():
            if not call.future.done():
                call.future.set_exception(error)
        self._waiting.clear()

    def _flush_unsent(self) -> None:
        if not self._unsent:
            return
        self._watch_connection_before_send()
        sent = False
        while self._unsent:
            call = self._unsent[0]
            if call.future.done():
                self._unsent.popleft()
                continue
            if not self._try_send(call):  # not connected yet; retried until its deadline
                self._fail_unsendable()
                break
            self._unsent.popleft()
            sent = True
        if sent:
            self._after_send()

    def _watch_connection_before_send(self) -> None:
        """Read the monitor's events unless they were read within _MONITOR_FRESH_S: a loss
        read after a send would fail a call sent on the new connection."""
        if time.monotonic() - self._monitor_read_at >= _MONITOR_FRESH_S:
            self._watch_connection()

    def _try_send(self, call: Call) -> bool:
        """Send a call (lock held); False: not connected, nothing sent."""
        try:
            send_frames(self._dealer, call.frames)
        except zmq.Again:
            return False
        self._waiting[call.request_id] = call
        return True

    def _fail_unsendable(self) -> None:
        """The server cannot be reached now: fail the calls that must not wait for it."""
        error = ServerUnavailable(f"could not reach {self.url} (not connected); is the "
                                  f"server up?")
        for call in [c for c in self._unsent if not c.wait_for_connection]:
            self._unsent.remove(call)
            if not call.future.done():
                call.future.set_exception(error)

    def _after_send(self) -> None:
        self._last_sent = time.monotonic()
        # A send can swallow the socket FD's edge for a reply that arrived meanwhile.
        if (self._leader is not None and self._leader != threading.get_ident()
                and not self._kicked):
            self._kicked = True
            os.write(self._kick_w, b"x")

    def _receive(self, seen: bool = False, until: Callable[[], bool] | None = None) -> None:
        """Read every reply that has arrived, or until `until()`; `seen`: a poll saw one, so
        read it without a test first. Each test is a zmq_poll: a leader whose reply is in
        leaves the rest to the next poll, which sees them (zmq_poll is level-triggered),
        and returns to its caller one test sooner."""
        while seen or not (until is not None and until()) and readable(self._dealer):
            seen = False
            try:
                frames = recv_frames(self._dealer)
            except zmq.Again:  # a sender that saw the connection drop read it first
                return
            if len(frames) != 3 or len(frames[0]) != protocol.REQUEST_ID_BYTES:
                logger.warning("dropping a malformed reply of %d frames", len(frames))
                continue
            request_id, = protocol.REQUEST_ID.unpack(frames[0])
            if request_id == protocol.PUSH_REQUEST_ID and frames[1] == protocol.STATUS_OK:
                if self.on_push is not None:
                    self.on_push(frames[2])
                continue
            call = self._waiting.pop(request_id, None)
            if call is None:
                if frames[1] == protocol.STATUS_ERR:
                    logger.warning("server error for no pending call: %r", frames[2][:200])
                continue  # a late reply to a call that timed out, or a heartbeat's reply
            self._resolve(call, frames[1], frames[2])

    def _resolve(self, call: Call, status: bytes, payload: bytes) -> None:
        if call.future.done():  # cancelled by its caller
            return
        try:
            if status == protocol.STATUS_OK:
                if phases.enabled:
                    stamp = phases.add(call.frames[1], "client round trip", call.sent)
                reply = protocol.unpack_reply(call.reply_type, payload)
                if phases.enabled:
                    phases.add(call.frames[1], "client decode", stamp)
                call.future.set_result(reply)
                return
            reply = protocol.unpack_reply(protocol.ErrorReply, payload)
        except ServerError as exc:  # the server's payload did not decode
            call.future.set_exception(exc)
            return
        error = error_from_reply(reply.code, reply.message)
        if isinstance(error, Unauthenticated) and call.frames[1] != b"HELLO":
            if not call.retried:
                # The server lost this connection's session: HELLO, then this call again.
                call.retried = True
                self._unsent.append(call)
                self._queue_hello()
                return
            error = self._hello_error or error
        call.future.set_exception(error)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            call = self._waiting.pop(request_id, None)
            if call is not None:
                message = f"no reply from {self.url} within the call's timeout"
            else:
                call = next((c for c in self._unsent if c.request_id == request_id), None)
                message = f"could not reach {self.url} within the call's timeout; is the server up?"
            if call is not None and not call.future.done():
                call.future.set_exception(RequestTimeout(f"{message} (request {request_id})"))

    # -- the background thread ------------------------------------------------------------

    def _background(self) -> None:
        """Leads while submitted futures have nobody waiting; sends heartbeats when idle;
        with `on_push`, watches the socket whenever no call does."""
        while True:
            with self._lock:
                if self._closed:
                    return
                idle_wait = _IDLE_WAIT_S * 20
                if self._heartbeat_interval is not None:
                    due = self._last_sent + self._heartbeat_interval - time.monotonic()
                    if due <= 0:
                        self._heartbeat()
                        due = self._heartbeat_interval
                    idle_wait = due
                # Never while a caller waits to lead: taking the socket back from it at once
                # would pass it to and fro, each pass a pump, until the caller wins a race.
                if self._leader is not None or self._followers or not self._needs_watcher():
                    self._background_wake.wait(idle_wait)
                    continue
                self._leader = threading.get_ident()
            # Hand the socket over as soon as a call() wants it: it leads for itself.
            self._lead(lambda: self._followers > 0 or not self._needs_watcher(),
                       time.monotonic() + idle_wait)

    def _needs_watcher(self) -> bool:
        return self._push_watcher or self._unattended()

    def _heartbeat(self) -> None:
        request_id = next(self._ids)  # never waited on: its reply is dropped like a late one
        frames = [protocol.encode_request_id(request_id), b"PING",
                  protocol.pack(protocol.PingRequest())]
        try:
            send_frames(self._dealer, frames)
        except zmq.Again:
            return  # not connected: nothing to keep alive
        self._after_send()

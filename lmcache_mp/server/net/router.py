"""The ZeroMQ ROUTER socket: requests read on the loop, dispatched, and answered exactly once."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq

from ... import phases, protocol, runtime
from ...errors import InternalError, ServerError, ShuttingDown
from ...zmq_io import readable, recv_message, send_frames
from ..config import Config
from ..observe.metrics import OK, ServerMetrics
from ..ops.answer import Answer
from ..ops.dispatcher import Dispatcher
from .access import Sessions

logger = logging.getLogger("lmcache_mp.server")

_MAX_MESSAGES_PER_WAKE = 64
_BACKLOG_RETRY_S = 0.002  # how soon replies a slow reader could not take are offered again
# At shutdown, before the socket closes: how long it must have been quiet (nothing new
# to refuse, no reply waiting for a slow reader), and the most time spent on that.
_STRAGGLERS_QUIET_S = 0.05
_STRAGGLERS_S = 2.0
_LINGER_MS = 1000  # then, how long replies already queued in ZeroMQ may take to leave


@dataclass(frozen=True)
class _InFlight:
    client: bytes
    request_id: int
    op: str
    started: float  # time.perf_counter() when it arrived


def _op_of(body: list[bytes]) -> str:
    """The op a request names, or `invalid` (a metrics label: never what a client wrote)."""
    try:
        return protocol.parse_request_frames(body).op
    except Exception:
        return "invalid"


class Router:
    """bind() the endpoint, start() reading on the loop; at shutdown refuse_new(), let the
    requests in flight finish or fail_in_flight(), refuse_stragglers(), then close().

    A plain socket driven by the loop's reader callback: zmq.asyncio's futures cost more
    than a whole LOOKUP."""

    def __init__(self, config: Config, dispatcher: Dispatcher, sessions: Sessions,
                 metrics: ServerMetrics):
        self.config = config
        self.dispatcher = dispatcher
        self.sessions = sessions
        self.metrics = metrics
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        # A full pipe to a client raises instead of dropping the reply: see _send.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # _dispatch, until refuse_new() makes it _refuse
        self._on_message: Callable[[list[bytes], zmq.Frame], None] = self._dispatch
        self._reading = False  # inside _read_socket()
        self._refused = 0  # requests answered shutting_down
        self.in_flight: dict[asyncio.Task, _InFlight] = {}
        self._answered: set[asyncio.Task] = set()
        # Replies ZeroMQ could not take yet (the client reads slowly), in order, per client.
        self._backlog: dict[bytes, deque[list[bytes]]] = {}
        self._backlog_bytes: dict[bytes, int] = {}
        self._backlog_retry: asyncio.TimerHandle | None = None

    def bind(self) -> None:
        """Bind the endpoint; an ipc:// socket file is born with no permission for others
        (0600, 0660 with --socket-group), not chmod-ed a moment later."""
        config = self.config
        umask = os.umask(0o117 if config.socket_gid is not None else 0o177)
        try:
            self._socket.bind(config.bind_url)
        finally:
            os.umask(umask)
        socket_path = runtime.ipc_socket_path(config.bind_url)
        if socket_path is not None and config.socket_gid is not None:
            os.chown(socket_path, -1, config.socket_gid)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self._socket.FD, self._read_socket)

    def push(self, client: bytes, message: object) -> None:
        """Send a message the client did not ask for (an MLA follower's LOAD_DONE)."""
        self._send(client, protocol.push_frames(message))

    # -- reading and dispatching -------------------------------------------------------

    def _read_socket(self) -> None:
        """Handle what has arrived. ZeroMQ's FD is edge-triggered: keep going until EVENTS is
        empty."""
        socket = self._socket
        self._reading = True  # its own loop reads what a reply's send left behind
        try:
            for read in range(_MAX_MESSAGES_PER_WAKE):
                # The FD nearly always wakes the loop for a message (>99% in a run of
                # LOOKUPs): the first is read without a test (a zmq_poll), at the price of
                # an exception when it woke for ZeroMQ's own commands.
                if read and not readable(socket):
                    return
                try:
                    first, frames = recv_message(socket)
                except zmq.Again:
                    return
                self._on_message(frames, first)
        finally:
            self._reading = False
        # More is waiting: yield to replies and copies, then come back.
        asyncio.get_running_loop().call_soon(self._read_socket)

    def _dispatch(self, frames: list[bytes], first: zmq.Frame) -> None:
        """Serve one request; `first`: its first frame, which says who sent it (HELLO)."""
        started = time.perf_counter()
        timing = phases.enabled  # its stamps are Python calls: ~3% of a LOOKUP's own work
        stamp = phases.now() if timing else 0
        client, body = frames[0], frames[1:]
        request_id = op = then = None
        try:
            request_id, op, payload = protocol.parse_request_frames(body)
            # Who may send it is known from the frames: no decoding for those who may not.
            session = self.dispatcher.admit(client, op)
            request = protocol.unpack(protocol.OPS[op].request, payload, bounded=True)
            if timing:
                stamp = phases.add(op, "server decode", stamp)
            result = self.dispatcher.serve(client, op, request, session, first)
            if isinstance(result, Answer):
                result, then = result.reply, result.then
            if timing:
                stamp = phases.add(op, "server handle", stamp)
            # inspect.isawaitable(), less its three Python calls: a coroutine or a Future.
            awaitable = hasattr(result, "__await__")
            if not awaitable:
                reply = protocol.reply_frames(request_id, result)
                if timing:
                    phases.add(op, "server reply", stamp)
        except Exception as exc:
            if op is None:  # the frames did not parse
                request_id, op = protocol.request_id_of(body), "invalid"
            assert request_id is not None  # parsed together with op
            self._send_error(client, request_id, exc, op, started)
        else:
            if awaitable:
                pending = _InFlight(client, request_id, op, started)
                task = asyncio.ensure_future(self._finish(pending, result))
                self.in_flight[task] = pending
                task.add_done_callback(self._forget)
            else:
                self._send(client, reply)
                self.metrics.answered(op, OK, time.perf_counter() - started)
        if then is not None:  # the reply (or its error) is on its way: nothing ran since
            self._then(then, op)
        # Any request that names a known op counts, and is a sign of life, even when its
        # payload was refused: noted once its reply is on its way, off the round trip.
        if op != "invalid":
            self.dispatcher.note_request(client, op)

    @staticmethod
    def _then(then: Callable[[], None], op: str) -> None:
        """An Answer's work after its reply; a failure is logged (the reply has gone)."""
        try:
            then()
        except Exception:
            logger.exception("the work after a %s reply failed", op)

    async def _finish(self, pending: _InFlight, result: Awaitable) -> None:
        try:
            value = await result
            stamp = phases.now()
            reply = protocol.reply_frames(pending.request_id, value)
            phases.add(pending.op, "server reply", stamp)
        except Exception as exc:
            if asyncio.current_task() not in self._answered:
                self._send_error(pending.client, pending.request_id, exc, pending.op,
                                 pending.started)
            return
        if asyncio.current_task() not in self._answered:
            self._send(pending.client, reply)
            self.metrics.answered(pending.op, OK, time.perf_counter() - pending.started)

    def _forget(self, task: asyncio.Task) -> None:
        self.in_flight.pop(task, None)
        self._answered.discard(task)

    # -- replies -------------------------------------------------------------------------

    def _send_error(self, client: bytes, request_id: int, exc: BaseException, op: str,
                    started: float) -> None:
        code = exc.code if isinstance(exc, ServerError) else InternalError.code
        fields = dict(request_id=request_id, op=op, client=client.hex(), outcome=code)
        if not isinstance(exc, ServerError):
            logger.error("request %d (%s) failed", request_id, op, exc_info=exc, extra=fields)
            # The first line only: the log has the rest (torch's errors carry C++ frames).
            summary = str(exc).strip().split("\n", 1)[0][:200]
            exc = InternalError(f"internal error: {type(exc).__name__}: {summary}")
        else:
            logger.debug("request %d (%s) refused: %s: %s", request_id, op, code, exc,
                         extra=fields)
        self._send(client, protocol.error_frames(request_id, code, str(exc)))
        self.metrics.answered(op, code, time.perf_counter() - started)

    def _send(self, client: bytes, frames: list[bytes]) -> None:
        """Send, or keep in the client's backlog while ZeroMQ's pipe to it is full: no reply
        is ever dropped for a client that reads, however late."""
        backlog = self._backlog.get(client)
        if backlog is not None:
            self._keep(client, backlog, frames)
        else:
            try:
                send_frames(self._socket, [client, *frames])
            except zmq.Again:
                backlog = self._backlog[client] = deque()
                self._backlog_bytes[client] = 0
                self._keep(client, backlog, frames)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the client is gone; its loss only
                logger.debug("dropping a reply to a client that left: %s", exc)
        self._read_if_pending()

    def _read_if_pending(self) -> None:
        # A send can consume the FD's edge for messages that arrived meanwhile.
        if not self._reading and readable(self._socket):
            asyncio.get_running_loop().call_soon(self._read_socket)

    def _keep(self, client: bytes, backlog: deque[list[bytes]], frames: list[bytes]) -> None:
        size = sum(len(frame) for frame in frames)
        if self._backlog_bytes[client] + size > protocol.REPLY_BACKLOG_BYTES:
            # It stopped reading: free what it left, and end its session so that its next
            # request learns why (unauthenticated, naming the backlog) before HELLO again.
            logger.warning("a client left over %d bytes of replies unread: dropping them and "
                           "its session", protocol.REPLY_BACKLOG_BYTES)
            del self._backlog[client], self._backlog_bytes[client]
            self.sessions.drop(client, reason=f"it left more than "
                               f"{protocol.REPLY_BACKLOG_BYTES} bytes of replies unread")
            return
        backlog.append(frames)
        self._backlog_bytes[client] += size
        if self._backlog_retry is None:
            self._backlog_retry = asyncio.get_running_loop().call_later(
                _BACKLOG_RETRY_S, self._flush_backlogs)

    def _flush_backlogs(self) -> None:
        self._backlog_retry = None
        for client in list(self._backlog):
            backlog = self._backlog[client]
            while backlog:
                try:
                    send_frames(self._socket, [client, *backlog[0]])
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != errno.EHOSTUNREACH:
                        raise
                    backlog.clear()
                    break
                self._backlog_bytes[client] -= sum(len(frame) for frame in backlog.popleft())
            if not backlog:
                del self._backlog[client], self._backlog_bytes[client]
        if self._backlog:
            self._backlog_retry = asyncio.get_running_loop().call_later(
                _BACKLOG_RETRY_S, self._flush_backlogs)
        self._read_if_pending()

    # -- shutdown ------------------------------------------------------------------------

    def refuse_new(self) -> None:
        """From now on every request is answered `shutting_down`; what waits is read now."""
        self._on_message = self._refuse
        self._read_socket()

    def _refuse(self, frames: list[bytes], _first: zmq.Frame) -> None:
        self._refused += 1
        self._send_error(frames[0], protocol.request_id_of(frames[1:]),
                         ShuttingDown("the server is shutting down"), _op_of(frames[1:]),
                         time.perf_counter())

    def fail_in_flight(self) -> None:
        """Answer every request still in flight `shutting_down` (its task may go on)."""
        for task, pending in list(self.in_flight.items()):
            self._answered.add(task)
            self._send_error(pending.client, pending.request_id,
                             ShuttingDown("the server shut down before this request finished"),
                             pending.op, pending.started)

    async def refuse_stragglers(self) -> None:
        """Answer `shutting_down` to what clients sent before they could know, and hand
        slow readers the replies kept for them, until the socket has been quiet for
        _STRAGGLERS_QUIET_S (at most _STRAGGLERS_S): a request sent just before the signal
        may still be on its way through ZeroMQ's I/O thread, and a socket closed under it
        or under a backlog would leave those requests without a reply."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + _STRAGGLERS_S
        seen, quiet_since = self._refused, loop.time()
        while loop.time() < give_up:
            if readable(self._socket):
                self._read_socket()
            if self._refused != seen or self._backlog:
                seen, quiet_since = self._refused, loop.time()
            elif loop.time() - quiet_since >= _STRAGGLERS_QUIET_S:
                break
            await asyncio.sleep(_STRAGGLERS_QUIET_S / 5)
        if self._refused:
            logger.info("shutdown: %d requests that arrived while draining were answered "
                        "shutting_down", self._refused)
        if self._backlog:
            logger.warning("shutdown: %d clients did not read their last replies within "
                           "%g s; dropping them", len(self._backlog), _STRAGGLERS_S)

    def close(self) -> None:
        """Stop reading and close the socket, giving the replies ZeroMQ still holds a moment
        to leave (a reader that stopped reading does not hold the exit up longer)."""
        asyncio.get_running_loop().remove_reader(self._socket.FD)
        self._context.destroy(linger=_LINGER_MS)

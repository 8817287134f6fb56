"""A request in flight: its call record, and what its caller waits on for the reply.

Both are built per request on the hot path, so they do as little as they can: what a
call mostly leaves as it was is a class default, and call() waits on a ReplySlot, not a
Future. RpcClient (rpc.py) makes them, and settles them under its lock.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class SettledFuture(Future):
    """A Future that also keeps a plain flag of having a result or an exception: the thread
    waiting for a call tests it after each read of the socket, where done() takes the
    future's lock (three Python calls a test)."""

    settled = False

    def set_result(self, result: Any) -> None:
        super().set_result(result)
        self.settled = True

    def set_exception(self, exception: BaseException | None) -> None:
        super().set_exception(exception)
        self.settled = True

    def is_settled(self) -> bool:
        return self.settled


class ReplySlot:
    """What call() waits for, in place of a Future: set once, under the client's lock, by the
    thread that reads the reply, and read by the caller only after that. Nobody else sees
    it, so it needs none of a Future's Condition, which takes a lock at each step: a Future
    created, set and read costs ~3 µs, this ~0.3. Its fields start as class defaults: no
    __init__ to run per call."""

    settled = False
    _value: Any = None
    _error: BaseException | None = None

    def done(self) -> bool:
        return self.settled

    def is_settled(self) -> bool:
        return self.settled

    def set_result(self, value: Any) -> None:
        self._value = value
        self.settled = True

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self.settled = True

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class Call:
    """A request from its queueing to its reply. What is mostly left as it was is a class
    default, not set in __init__: a call is built per request, and each assignment there
    is a line of Python on every round trip."""

    retried = False  # sent again after HELLO, once, when the server had no session
    wait_for_connection = True  # False: fail at once when it cannot be sent now
    sent = 0  # phases.now() when it was queued (lmcache-mp-bench --profile)

    def __init__(self, request_id: int, reply_type: type, frames: list[bytes],
                 future: Future | ReplySlot, attended: bool):
        self.request_id = request_id
        self.reply_type = reply_type
        self.frames = frames
        self.future = future
        self.attended = attended  # a thread in call() waits on it

"""Multipart sends and receives on pyzmq sockets, without pyzmq's per-frame enum conversions.

pyzmq's send_multipart ORs an enum flag per frame, its recv_multipart and getsockopt turn
every option into a SocketOption enum: about a µs of Python each, ~10 µs a round trip on
each side, a tenth of a small LOOKUP's. These do the same work with plain ints, and send
through the socket's compiled send() itself, below the Python one that handles the
routing_id and group options of draft socket types (a third of a µs a frame).
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
POLLIN = int(zmq.POLLIN)
_poll = zmq.zmq_poll
_send = zmq.backend.Socket.send


def readable(socket: zmq.Socket) -> bool:
    """Whether a message waits. Like getsockopt(EVENTS), it processes the socket's pending
    commands, which re-arms its edge-triggered FD: call it until False before waiting on
    that FD."""
    return bool(_poll([(socket, POLLIN)], 0))


def send_frames(socket: zmq.Socket, frames: Sequence[bytes], flags: int = NOBLOCK) -> None:
    """send_multipart(frames, flags); raises zmq.Again like it (a multipart message is
    queued whole or not at all)."""
    more = flags | _SNDMORE
    for frame in frames[:-1]:
        _send(socket, frame, more)
    _send(socket, frames[-1], flags)


def recv_frames(socket: zmq.Socket, flags: int = NOBLOCK) -> list[bytes]:
    """recv_multipart(flags): every frame of the next message, as bytes."""
    recv = socket.recv
    frame = recv(flags, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = recv(flags, copy=False)
        frames.append(frame.bytes)
    return frames

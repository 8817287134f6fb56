"""Multipart sends and receives on pyzmq sockets, without pyzmq's per-frame enum conversions.

The receive hands over the message's first frame too, whose metadata says who sent it
(peer_uid): the server reads that at HELLO only, at no cost to other requests.

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
    return recv_message(socket, flags)[1]


def recv_message(socket: zmq.Socket, flags: int = NOBLOCK) -> tuple[zmq.Frame, list[bytes]]:
    """recv_frames(), and the first frame as the zmq.Frame it came in: its metadata says
    who sent the message (peer_uid)."""
    recv = socket.recv
    first = frame = recv(flags, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = recv(flags, copy=False)
        frames.append(frame.bytes)
    return first, frames


def peer_uid(frame: zmq.Frame) -> int | None:
    """The uid of the process that connected the unix socket a frame came over: libzmq
    appends ":uid:gid:pid" (SO_PEERCRED) to a unix peer's Peer-Address. None when the
    address carries no credentials. Only for frames from ipc:// sockets: an IPv6 address
    can end in three groups of digits too."""
    try:
        # pyzmq's stubs type every named property int | str; Peer-Address is a str.
        _host, uid, gid, pid = frame.get("Peer-Address").rsplit(":", 3)  # type: ignore[union-attr]
    except (ValueError, zmq.ZMQError):  # no credentials, or no such property
        return None
    return int(uid) if uid.isdigit() and gid.isdigit() and pid.isdigit() else None

"""Frames: a request's split and checked, a reply's and a push message's built.

A DEALER sends [request_id, op, payload]; the server answers [request_id, status, payload],
and sends push messages with PUSH_REQUEST_ID (docs/protocol.md, "Frames").
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import BadFrame, UnknownOp
from .codec import pack
from .messages import OPS, ErrorReply

REQUEST_ID_BYTES = 8
PUSH_REQUEST_ID = 0
STATUS_OK = b"ok"
STATUS_ERR = b"err"

REQUEST_ID = struct.Struct("<Q")  # a request id frame: REQUEST_ID_BYTES, little-endian


def encode_request_id(request_id: int) -> bytes:
    return REQUEST_ID.pack(request_id)


def decode_request_id(frame: bytes) -> int:
    if len(frame) != REQUEST_ID_BYTES:
        raise BadFrame(f"request_id frame must be {REQUEST_ID_BYTES} bytes, got {len(frame)}")
    return REQUEST_ID.unpack(frame)[0]


def request_id_of(frames: list[bytes]) -> int:
    """The request id of a DEALER's frames, or PUSH_REQUEST_ID when it cannot be read."""
    if frames and len(frames[0]) == REQUEST_ID_BYTES:
        return REQUEST_ID.unpack(frames[0])[0]
    return PUSH_REQUEST_ID


class RequestFrames(NamedTuple):
    """A request's frames, split: a tuple, built in one step on every request."""
    request_id: int
    op: str
    payload: bytes


_OP_BY_FRAME = {name.encode("ascii"): name for name in OPS}


def parse_request_frames(frames: list[bytes]) -> RequestFrames:
    """Split [request_id, op, payload] as sent by a DEALER; raises BadFrame or UnknownOp."""
    if len(frames) != 3:
        raise BadFrame(f"a request has 3 frames [request_id, op, payload], got {len(frames)}")
    request_id = decode_request_id(frames[0])
    if request_id == PUSH_REQUEST_ID:
        raise BadFrame(f"request_id {PUSH_REQUEST_ID} is reserved for server push messages")
    op = _OP_BY_FRAME.get(frames[1])
    if op is None:
        try:
            named = frames[1].decode("ascii")
        except UnicodeDecodeError:
            raise BadFrame("op frame is not ASCII") from None
        raise UnknownOp(f"unknown op {named[:64]!r}; known ops: {', '.join(OPS)}")
    return RequestFrames(request_id, op, frames[2])


def push_frames(message: Any) -> list[bytes]:
    return [encode_request_id(PUSH_REQUEST_ID), STATUS_OK, pack(message)]


@dataclass(frozen=True)
class Packed:
    """A reply packed already (off the server's loop, for a large one): sent as it is."""
    payload: bytes


def reply_frames(request_id: int, message: Any) -> list[bytes]:
    payload = message.payload if type(message) is Packed else pack(message)
    return [REQUEST_ID.pack(request_id), STATUS_OK, payload]


def error_frames(request_id: int, code: str, message: str) -> list[bytes]:
    return [encode_request_id(request_id), STATUS_ERR, pack(ErrorReply(code, message))]

"""Payloads: messages packed as msgpack maps, and the two decoders that read them back.

- msgspec's decoder, in C, straight into the message classes: the hot paths. A client
  reads every reply with it (unpack_reply); the server reads a request with it when the
  payload is byte for byte what pack() makes of the message it decodes to, as our clients
  send it (unpack). It checks the field bounds the message classes declare (messages.py).
- the general decoder, in Python, for everything else: it converts what the protocol
  allows (an integral float for an int), fills in defaults, tells a tagged union's members
  apart, checks the same bounds, and names the field at fault ("`items[3].model`: ...").

Both decode the same payload to the same message; where msgspec refuses or cannot be sure,
the general decoder decides, so every error is the general decoder's.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple, Union

import msgpack
import msgspec

from ..errors import BadRequest
from .limits import (
    LIMITS,
    MAX_ITEMS_PER_MESSAGE,
    MAX_MAP_FIELDS,
    MAX_REQUEST_VALUES,
    MAX_STRING_BYTES,
)
from .messages import PUSH_MESSAGES, LoadDone, LoadProgress

# ---------------------------------------------------------------------------
# Encoding: plain msgpack maps, never pickle.


def _refuse(value: Any) -> Any:
    """msgspec's hook for what it cannot encode itself: nothing else goes on the wire."""
    raise TypeError(f"cannot send a {type(value).__name__} on the wire")


# msgspec writes a dataclass as the map of its fields, in order (class-level constants
# such as MemfdHandle.KIND are none of them), the same bytes as msgpack-python with
# use_bin_type, in C: 4-9x as fast as msgpack.packb with a Python hook per message. An
# Encoder keeps no state between calls: one serves every thread.
pack: Callable[[Any], bytes] = msgspec.msgpack.Encoder(enc_hook=_refuse).encode


# ---------------------------------------------------------------------------
# The entry points.

def unpack(cls: type, payload: bytes, bounded: bool = False) -> Any:
    """Decode and validate a payload as `cls`; errors name the field that is wrong.

    `bounded` (the server, for requests): msgpack refuses arrays, maps and strings over
    the LIMITS as it reads their headers, before building anything, and the whole payload
    over MAX_REQUEST_VALUES values as it builds them."""
    try:
        decode = _EXACT[cls]
    except KeyError:
        decode = _exact_decoder(cls)
    if decode is not None:
        try:
            message = decode(payload)
            if pack(message) == payload:
                return message
        except _REFUSED:
            pass
    return from_wire(cls, _decoded(payload, bounded))


def unpack_reply(cls: type, payload: bytes) -> Any:
    """Decode a reply as `cls`, for a client: msgspec builds the message from what the
    server packed (unknown fields ignored, defaults filled in, as the general decoder
    does); what it refuses goes to unpack(), which converts or names the field that is
    wrong. A LOOKUP's reply decodes in one C call instead of a dozen lines of Python,
    which right after a round trip (caches cold from the context switches) take ~5 µs."""
    try:
        decode = _MSGSPEC[cls]
    except KeyError:
        decode = _msgspec_decoder(cls)
    try:
        return decode(payload)
    except _REFUSED:
        return unpack(cls, payload)


def unpack_push(payload: bytes) -> LoadDone | LoadProgress:
    """A push message, of the type its `event` names; BadRequest if it is none of them."""
    raw = _decoded(payload, bounded=False)
    event = raw.get("event") if isinstance(raw, dict) else None
    # Only a str is looked up: an unhashable `event` (a list, a map) raised TypeError here.
    kind = PUSH_MESSAGES.get(event, LoadDone) if isinstance(event, str) else LoadDone
    return from_wire(kind, raw)


def from_wire(tp: Any, value: Any) -> Any:
    """Validate a decoded msgpack value against a type annotation and build it."""
    try:
        return _decoder(tp)(value)
    except _Invalid as invalid:
        raise BadRequest(invalid.message()) from None


# ---------------------------------------------------------------------------
# msgspec's decoder.

_MSGSPEC: dict[type, Callable[[bytes], Any]] = {}
_EXACT: dict[type, Callable[[bytes], Any] | None] = {}
# What msgspec raises for a payload it does not take: DecodeError (ValidationError among
# them), or RecursionError for an unknown field's value nested deeper than the interpreter's
# recursion limit, which it skips recursively (msgpack's own depth limit refuses it).
_REFUSED = (msgspec.DecodeError, RecursionError)


def _msgspec_decoder(cls: type) -> Callable[[bytes], Any]:
    """msgspec's decoder straight into `cls` (built once; a dataclass's fields are set
    without its __init__, which none of the messages needs), or, for a type msgspec cannot
    build (a union of dataclasses), the general decoder: not a Decoder tried and refused on
    every payload."""
    decode: Callable[[bytes], Any]
    try:
        decode = msgspec.msgpack.Decoder(cls).decode
    except TypeError:
        decode = functools.partial(unpack, cls)
    _MSGSPEC[cls] = decode
    return decode


def _exact_decoder(cls: type) -> Callable[[bytes], Any] | None:
    """msgspec's decoder of `cls` for unpack() (kept once), or None where it could take a
    payload that a bounded decode refuses.

    unpack() keeps what msgspec decodes only when the payload is byte for byte pack() of
    it: every value of its field's very type, no unknown field, no duplicate key, no
    default left out. What remains to make sure of are the LIMITS a bounded decode holds
    a request to, which a payload within the fields' declared bounds must keep."""
    most = _most_values(cls)
    decode = _msgspec_decoder(cls) if most is not None and most <= MAX_REQUEST_VALUES else None
    _EXACT[cls] = decode
    return decode


def _most_values(tp: Any, nested: bool = False) -> int | None:
    """The most values (map entries and array elements) pack() of a `tp` within its
    fields' declared bounds holds, or None if it could break another of the LIMITS: a map
    of more than MAX_MAP_FIELDS keys, a str over MAX_STRING_BYTES (UTF-8 takes at most 4
    bytes a character), an array over MAX_ITEMS_PER_MESSAGE elements. Arrays are of
    messages only, and not in those: values nested deeper would multiply."""
    if not dataclasses.is_dataclass(tp) or len(dataclasses.fields(tp)) > MAX_MAP_FIELDS:
        return None
    hints = _field_types(tp)
    most = len(dataclasses.fields(tp))
    for f in dataclasses.fields(tp):
        base, bounds = _bounds_of(hints[f.name])
        if base in (bytes, int, bool):
            continue
        longest = _ends(bounds)[1] if bounds is not None else None
        if base is str and longest is not None and 4 * longest <= MAX_STRING_BYTES:
            continue
        if (nested or typing.get_origin(base) is not list or longest is None
                or longest > MAX_ITEMS_PER_MESSAGE):
            return None
        per_item = _most_values(typing.get_args(base)[0], nested=True)
        if per_item is None:
            return None
        most += longest * (1 + per_item)
    return most


def _bounds_of(tp: Any) -> tuple[Any, msgspec.Meta | None]:
    """A field type without its declared bounds, and those (messages.length_in, value_in)."""
    if typing.get_origin(tp) is Annotated:
        base, bounds = typing.get_args(tp)
        return base, bounds
    return tp, None


def _ends(bounds: msgspec.Meta) -> tuple[int, int]:
    """The lowest and highest value, or length, that bounds declared by messages.value_in
    or length_in allow (each declares both)."""
    lo = bounds.ge if bounds.ge is not None else bounds.min_length
    hi = bounds.le if bounds.le is not None else bounds.max_length
    assert lo is not None and hi is not None
    return int(lo), int(hi)


# ---------------------------------------------------------------------------
# Reading msgpack, with the LIMITS of a request.

_REQUEST_LIMITS = dict(max_array_len=MAX_ITEMS_PER_MESSAGE, max_map_len=MAX_MAP_FIELDS,
                       max_str_len=MAX_STRING_BYTES, max_ext_len=0)

# msgpack errors that carry no text of their own.
_UNPACK_REASONS = {"StackError": "arrays and maps nested more than 1024 deep",
                   "FormatError": "a byte that starts no msgpack value"}

# msgpack's words when a header is over one of _REQUEST_LIMITS: "1025 exceeds max_array_len(1024)"
_OVER_LIMIT = re.compile(r"(\d+) exceeds (max_array_len|max_map_len|max_str_len)\(")
_LIMIT_OF_OPTION = {"max_array_len": "MAX_ITEMS_PER_MESSAGE", "max_map_len": "MAX_MAP_FIELDS",
                    "max_str_len": "MAX_STRING_BYTES"}
_WHAT_OF_OPTION = {"max_array_len": "an array of {} elements", "max_map_len": "a map of {} keys",
                   "max_str_len": "a string of {} bytes"}


class _ValueBudget:
    """msgpack's list_hook and object_hook: counts each container as it is built, and stops
    the decoding once the request holds more than MAX_REQUEST_VALUES values."""

    def __init__(self) -> None:
        self.left = MAX_REQUEST_VALUES

    def __call__(self, container: Any) -> Any:
        self.left -= len(container)
        if self.left < 0:
            raise BadRequest(f"payload holds more than {MAX_REQUEST_VALUES} values in its "
                             f"arrays and maps (MAX_REQUEST_VALUES)")
        return container


def _decoded(payload: bytes, bounded: bool) -> Any:
    """The payload's msgpack value (see unpack); BadRequest if it is not msgpack."""
    try:
        # Every value takes a byte at least: a payload of up to MAX_REQUEST_VALUES bytes
        # cannot hold more values, and skips the count (a Python call per array and map).
        if bounded and len(payload) > MAX_REQUEST_VALUES:
            budget = _ValueBudget()
            raw = msgpack.unpackb(payload, raw=False, strict_map_key=True, list_hook=budget,
                                  object_hook=budget, **_REQUEST_LIMITS)
        elif bounded:
            raw = msgpack.unpackb(payload, raw=False, strict_map_key=True, **_REQUEST_LIMITS)
        else:
            raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except BadRequest:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        over = _OVER_LIMIT.search(str(exc)) if isinstance(exc, ValueError) else None
        if over is not None:  # one of _REQUEST_LIMITS, read from a header before any work
            limit = _LIMIT_OF_OPTION[over.group(2)]
            raise BadRequest(f"payload holds {_WHAT_OF_OPTION[over.group(2)].format(over.group(1))}"
                             f", more than {limit} allows ({LIMITS[limit].value}: "
                             f"{LIMITS[limit].what})") from None
        reason = str(exc) or _UNPACK_REASONS.get(type(exc).__name__,
                                                 "the data ends early or holds extra bytes")
        raise BadRequest(f"payload is not valid msgpack ({type(exc).__name__}: {reason})"
                         ) from None
    return raw


# ---------------------------------------------------------------------------
# The general decoder: a function per type annotation, built once, that validates a
# msgpack value and converts it.

Decoder = Callable[[Any], Any]
_DECODERS: dict[Any, Decoder] = {}
_TYPE_NAMES = {int: "int", float: "float", str: "str", bool: "bool", bytes: "bytes"}
_EXACT_FLOAT_INT = 2**53


class _Invalid(Exception):
    """A value that does not fit its type. Raised where it is found, without its path:
    each array and map it leaves adds its own step, so that only a wrong value costs a
    path (a valid request with thousands of fields formats none)."""

    def __init__(self, describe: Callable[[str], str]):
        """`describe(where)`: the message, given the value's place ("`items[3].model`")."""
        self.describe = describe
        self.steps: list[str] = []

    def at(self, step: str) -> _Invalid:
        """Add the step ("[3]", ".model") from the container it is leaving."""
        self.steps.append(step)
        return self

    def message(self) -> str:
        path = "".join(reversed(self.steps)).removeprefix(".")
        return self.describe(f"`{path}`" if path else "payload")


def _describe(value: Any) -> str:
    return type(value).__name__ if value is not None else "nil"


def _mismatch(expected: str, value: Any) -> _Invalid:
    return _Invalid(lambda where: f"{where}: expected {expected}, got {_describe(value)}")


def _decoder(tp: Any) -> Decoder:
    """The decoder of `tp` (built once)."""
    decoder = _DECODERS.get(tp)
    if decoder is None:
        decoder = _DECODERS[tp] = _build_decoder(tp)
    return decoder


def _build_decoder(tp: Any) -> Decoder:
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _bounded_decoder(*typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return _union_decoder(typing.get_args(tp))
    if origin is list:
        return _list_decoder(*typing.get_args(tp))
    if origin is dict:
        return _dict_decoder(*typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return _dataclass_decoder(tp)
    return _SCALAR_DECODERS[tp]


def _decode_int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    # JavaScript's msgpack encoders send integers above 2^32 as float64.
    if isinstance(value, float) and value.is_integer() and abs(value) <= _EXACT_FLOAT_INT:
        return int(value)
    raise _mismatch("int", value)


def _decode_float(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise _mismatch("float", value)


def _exactly(tp: type) -> Decoder:
    def decode(value: Any) -> Any:
        if isinstance(value, tp):
            return value
        raise _mismatch(_TYPE_NAMES[tp], value)
    return decode


_SCALAR_DECODERS: dict[type, Decoder] = {int: _decode_int, float: _decode_float,
                                         str: _exactly(str), bool: _exactly(bool),
                                         bytes: _exactly(bytes)}


def _bounded_decoder(tp: Any, bounds: msgspec.Meta) -> Decoder:
    """A field type's decoder that also checks its declared bounds (messages.length_in or
    value_in), as msgspec does."""
    decode = _decoder(tp)
    lo, hi = _ends(bounds)
    if bounds.ge is not None:
        def decode_in_range(value: Any) -> Any:
            value = decode(value)
            if lo <= value <= hi:
                return value
            raise _Invalid(lambda where: f"{where}: must be in [{lo}, {hi}], got {value}")
        return decode_in_range
    extra = bounds.extra or {}  # messages.length_in fills it
    unit, refusal = extra["unit"], extra["refusal"]
    expected = f"expected {lo}..{hi} {unit}" if lo else f"at most {hi} {unit}"

    def decode_in_length(value: Any) -> Any:
        value = decode(value)
        if lo <= len(value) <= hi:
            return value
        if refusal is not None:
            raise _Invalid(lambda where: f"{where}: {refusal(value)}")
        raise _Invalid(lambda where: f"{where}: {expected}, got {len(value)}")
    return decode_in_length


def _union_decoder(options: tuple[Any, ...]) -> Decoder:
    """`X | None`, `X | UnsetType` (a field left out when unset), or a tagged union of
    dataclasses: told apart by their `kind` field, and without one, the first."""
    if type(None) in options:
        (inner,) = [o for o in options if o is not type(None)]
        inner_decoder = _decoder(inner)
        return lambda value: None if value is None else inner_decoder(value)
    if msgspec.UnsetType in options:  # a field left out when unset: present, it is the other
        (inner,) = [o for o in options if o is not msgspec.UnsetType]
        return _decoder(inner)
    by_kind = {cls.KIND: cls for cls in options}

    def decode_tagged(value: Any) -> Any:
        if not isinstance(value, dict):
            raise _mismatch("map", value)
        kind = value.get("kind", options[0].KIND)
        cls = by_kind.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise _unsupported_kind(kind, ", ".join(repr(k) for k in by_kind))
        return _decoder(cls)(value)
    return decode_tagged


def _unsupported_kind(kind: Any, supported: str) -> _Invalid:
    return _Invalid(lambda where: f"{where}: unsupported handle kind {kind!r}; this server "
                                  f"supports {supported}").at(".kind")


def _list_decoder(item_tp: Any) -> Decoder:
    item_decoder = _decoder(item_tp)

    def decode_list(value: Any) -> list:
        if not isinstance(value, list):
            raise _mismatch("array", value)
        try:
            return [item_decoder(v) for v in value]
        except _Invalid as invalid:  # which item: found again, only now
            for i, v in enumerate(value):
                try:
                    item_decoder(v)
                except _Invalid:
                    raise invalid.at(f"[{i}]") from None
            raise
    return decode_list


def _dict_decoder(key_tp: Any, value_tp: Any) -> Decoder:
    key_decoder, value_decoder = _decoder(key_tp), _decoder(value_tp)

    def decode_dict(value: Any) -> dict:
        if not isinstance(value, dict):
            raise _mismatch("map", value)
        decoded = {}
        for k, v in value.items():
            try:
                key = key_decoder(k)
            except _Invalid as invalid:
                raise invalid.at(".<key>") from None
            try:
                decoded[key] = value_decoder(v)
            except _Invalid as invalid:
                raise invalid.at(f".{k}") from None
        return decoded
    return decode_dict


def _field_types(cls: Any) -> dict[str, Any]:
    """A message class's field types, with their declared bounds."""
    return typing.get_type_hints(cls, include_extras=True)


def _dataclass_decoder(cls: Any) -> Decoder:
    hints = _field_types(cls)
    kind = getattr(cls, "KIND", None)
    fields = [_field_of(f, hints[f.name]) for f in dataclasses.fields(cls)]

    def decode(value: Any) -> Any:
        if not isinstance(value, dict):
            raise _mismatch("map", value)
        if kind is not None and value.get("kind", kind) != kind:
            raise _unsupported_kind(value.get("kind"), repr(kind))
        kwargs = {}
        for name, exact, measure, lo, hi, field_decoder, required in fields:
            if name in value:
                field_value = value[name]
                # A scalar of its very type, within its bounds: as it is.
                if type(field_value) is exact and (measure is None
                                                   or lo <= measure(field_value) <= hi):
                    kwargs[name] = field_value
                    continue
                try:
                    kwargs[name] = field_decoder(field_value)
                except _Invalid as invalid:
                    raise invalid.at(f".{name}") from None
            elif required:
                raise _Invalid(lambda where: f"{where}: missing").at(f".{name}")
        # Unknown fields are ignored so that newer clients can talk to this server.
        return cls(**kwargs)
    return decode


class _Field(NamedTuple):
    """How _dataclass_decoder reads a field: a scalar of type `exact` whose `measure` (its
    length, or an int itself; None: unbounded) is within lo..hi is taken as it is, in the
    loop (the common case costs no Python call a field); any other value goes to `decode`,
    which converts it or names what is wrong."""

    name: str
    exact: type | None
    measure: Callable[[Any], int] | None
    lo: int
    hi: int
    decode: Decoder
    required: bool


def _field_of(f: dataclasses.Field, tp: Any) -> _Field:
    base, bounds = _bounds_of(tp)
    measure = None if bounds is None else operator.index if bounds.ge is not None else len
    lo, hi = (0, 0) if bounds is None else _ends(bounds)
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    return _Field(f.name, base if base in _TYPE_NAMES else None, measure, lo, hi,
                  _decoder(tp), required)

"""docs/protocol.md's refusals of strings, against a real server: a salt refused for its
length reads as one refused for its characters (the message the Cache salt section quotes,
ending with its first 40 characters), and the other strings' refusals name their length,
never their text (a token, an engine secret)."""

from __future__ import annotations

import pytest

from lmcache_mp.spawn import ServerProcess

from .document import quoted_message
from .wire import refused, session

TEMPLATE = quoted_message("### Cache salt", r"`` (`<field>`: cache_salt must [^`]*) `` ")


def salt_refusal(field: str, salt: str) -> str:
    return TEMPLATE.replace("<field>", field).replace("'<salt>'", repr(salt[:40]))


LONG = "long-salt-" * 25 + "1234567"  # 257 characters
# (op, payload with the salt, the field the message names, admin op)
CARRIERS = [
    ("LOOKUP", lambda salt: {"model": "m", "kv_world_size": 1, "items": [
        {"request_id": "r", "chunk_hashes": b"", "cache_salt": salt}]},
     "items[0].cache_salt", False),
    ("RELEASE", lambda salt: {"items": [{"request_id": "r", "cache_salt": salt}]},
     "items[0].cache_salt", False),
    ("END_SESSION", lambda salt: {"request_id": "r", "cache_salt": salt}, "cache_salt", False),
    ("CLEAR", lambda salt: {"cache_salt": salt}, "cache_salt", True),
    ("QUOTA_SET", lambda salt: {"cache_salt": salt, "cap": None}, "cache_salt", True),
    ("QUOTA_GET", lambda salt: {"cache_salt": salt}, "cache_salt", True),
]


def test_the_documented_salt_message_is_quoted_whole() -> None:
    assert TEMPLATE == ("`<field>`: cache_salt must be at most 256 printable ASCII characters "
                        "without spaces, got '<salt>'")
    assert len(LONG) == 257


@pytest.mark.parametrize("salt", [LONG, "a b", "x" * 300 + " "], ids=["257", "space", "both"])
@pytest.mark.parametrize("op, payload, field, admin", CARRIERS, ids=[c[0] for c in CARRIERS])
def test_a_refused_salt_gets_the_documented_message_whatever_is_wrong_with_it(
        server: ServerProcess, salt: str, op: str, payload, field: str, admin: bool) -> None:
    with session(server, admin=admin) as sock:
        reply = refused(sock, 1, op, payload(salt))
    assert reply == {"code": "bad_request", "message": salt_refusal(field, salt)}


@pytest.mark.parametrize("field", ["token", "engine", "client_name"])
def test_other_strings_over_256_characters_are_refused_by_length_never_quoted(
        server: ServerProcess, field: str) -> None:
    secret = "s3cret-" * 37 + "xx"  # 261 characters
    with session(server) as sock:
        reply = refused(sock, 1, "HELLO", {"protocol_version": 2, field: secret})
    assert reply == {"code": "bad_request", "message": f"`{field}`: at most 256 characters, "
                                                       f"got {len(secret)}"}
    assert "s3cret" not in reply["message"]

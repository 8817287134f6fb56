"""A reply with work that must follow it at once: the router sends the reply, then runs it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Answer:
    """`reply`, and `then()`: work the reply's promise needs (a LOOKUP's holds), done off
    the round trip but before the loop serves anything else, so that no request can tell
    it came after the reply (the router calls it straight after the send, with no await)."""

    reply: Any
    then: Callable[[], None]

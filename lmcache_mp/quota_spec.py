"""Quotas as people write them, CAP[:RESERVE] and SALT=CAP[:RESERVE]: for server and admin."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import LMCacheMPError
from .sizes import exact_size, parse_size

UNLIMITED = "unlimited"


class QuotaError(LMCacheMPError, ValueError):
    """A quota that cannot be applied: unparsable, reservation above cap, or over the pool.
    A ValueError too: it is a value a person wrote that is wrong."""


@dataclass(frozen=True)
class Quota:
    cap: int | None = None  # bytes the salt may hold; None: no cap
    reserve: int = 0  # bytes that pressure from other tenants never takes away

    def __post_init__(self) -> None:
        if self.cap is not None and self.cap < 0:
            raise QuotaError(f"cap must not be negative, got {self.cap}")
        if self.reserve < 0:
            raise QuotaError(f"reservation must not be negative, got {self.reserve}")
        if self.cap is not None and self.reserve > self.cap:
            raise QuotaError(f"reservation {exact_size(self.reserve)} exceeds cap "
                             f"{exact_size(self.cap)}")


def parse_cap(text: str) -> int | None:
    if text.strip().lower() == UNLIMITED:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise QuotaError(str(exc)) from None


def parse_quota(text: str) -> Quota:
    """`CAP[:RESERVE]`, e.g. `2GiB`, `2GiB:512MiB` or `unlimited:1GiB`."""
    cap_text, _, reserve_text = str(text).partition(":")
    reserve = 0
    if reserve_text:
        try:
            reserve = parse_size(reserve_text)
        except ValueError as exc:
            raise QuotaError(f"reservation: {exc}") from None
    return Quota(parse_cap(cap_text), reserve)


def parse_quota_flag(text: str) -> tuple[str, Quota]:
    """`SALT=CAP[:RESERVE]` as given to --quota; the salt may be empty (`=1GiB`)."""
    salt, sep, spec = text.rpartition("=")
    if not sep:
        raise QuotaError(f"expected SALT=CAP[:RESERVE], got {text!r}")
    return salt, parse_quota(spec)


def format_quota_flag(pair: tuple[str, Quota]) -> str:
    """What parse_quota_flag reads back as `pair`."""
    salt, quota = pair
    cap = UNLIMITED if quota.cap is None else exact_size(quota.cap)
    return f"{salt}={cap}:{exact_size(quota.reserve)}" if quota.reserve else f"{salt}={cap}"

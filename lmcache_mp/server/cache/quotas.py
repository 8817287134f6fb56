"""Per-tenant quotas: a cap and a reservation per cache_salt, from flags, a file and edits."""

from __future__ import annotations

import sys
from pathlib import Path

from ...errors import BadRequest
from ...protocol import validate_salt
from ...quota_spec import UNLIMITED, Quota, QuotaError, parse_cap, parse_quota
from ...sizes import exact_size, parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def load_quota_file(path: str | Path) -> dict[str, Quota]:
    """A TOML file with a [quotas] table: `"salt" = "CAP[:RESERVE]"` or `{cap=..., reserve=...}`."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise QuotaError(f"quota file {path}: {exc}") from None
    table = data.get("quotas", {})
    if not isinstance(table, dict):
        raise QuotaError(f"quota file {path}: [quotas] must be a table")
    quotas = {}
    for salt, value in table.items():
        try:
            validate_salt(salt, "salt")
            if isinstance(value, str):
                quotas[salt] = parse_quota(value)
            elif isinstance(value, dict):
                quotas[salt] = Quota(parse_cap(str(value.get("cap", UNLIMITED))),
                                     parse_size(str(value.get("reserve", 0))))
            else:
                raise QuotaError("expected \"CAP[:RESERVE]\" or {cap = ..., reserve = ...}")
        except (ValueError, BadRequest) as exc:
            raise QuotaError(f"quota file {path}: salt {salt!r}: {exc}") from None
    return quotas


class QuotaBook:
    """Which quota applies to each salt.

    Three layers, the later winning: --quota flags, the quota file (replaced as a whole
    on reload), and run-time QUOTA_SET. QUOTA_DELETE removes the run-time layer for a
    salt, so a quota from the file or the flags applies again; salts in no layer get
    the default.
    """

    def __init__(self, capacity: int, default: Quota, flags: dict[str, Quota],
                 file_quotas: dict[str, Quota] | None = None):
        self.capacity = capacity
        self.default = default
        self._flags = dict(flags)
        self._file = dict(file_quotas or {})
        self._runtime: dict[str, Quota] = {}
        self._check(self._effective_table())

    def get(self, salt: str) -> Quota:
        for layer in (self._runtime, self._file, self._flags):
            if salt in layer:
                return layer[salt]
        return self.default

    def configured(self) -> dict[str, Quota]:
        """Every salt with a quota of its own, and the quota that applies to it."""
        return self._effective_table()

    def set(self, salt: str, quota: Quota) -> None:
        table = self._effective_table()
        table[salt] = quota
        self._check(table)
        self._runtime[salt] = quota

    def has_own(self, salt: str) -> bool:
        return salt in self._runtime or salt in self._file or salt in self._flags

    def delete(self, salt: str) -> bool:
        """Drop the salt's run-time quota; refused if what applies again breaks the rules."""
        if salt not in self._runtime:
            return False
        self._check({**self._flags, **self._file,
                     **{k: v for k, v in self._runtime.items() if k != salt}})
        del self._runtime[salt]
        return True

    def replace_file(self, file_quotas: dict[str, Quota]) -> None:
        table = {**self._flags, **file_quotas, **self._runtime}
        self._check(table)
        self._file = dict(file_quotas)

    def _effective_table(self) -> dict[str, Quota]:
        return {**self._flags, **self._file, **self._runtime}

    def _check(self, table: dict[str, Quota]) -> None:
        reserved = sum(q.reserve for q in table.values())
        if reserved > self.capacity:
            raise QuotaError(f"reservations add up to {exact_size(reserved)}, more than the "
                             f"{exact_size(self.capacity)} pool")

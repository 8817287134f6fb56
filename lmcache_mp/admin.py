"""`lmcache-mp-server quota set|get|delete|list`: edit a running server's quotas over the wire."""

from __future__ import annotations

import argparse
import logging
import sys

from .client import CacheClient
from .errors import LMCacheMPError
from .protocol import QuotaInfo
from .quota_spec import Quota, QuotaError, parse_quota
from .sizes import format_size


def _size(value: int | None) -> str:
    return "unlimited" if value is None else format_size(value)


def _line(info: QuotaInfo) -> str:
    source = "own quota" if info.own else "default"
    return (f"{info.cache_salt!r}: cap {_size(info.cap)}, reserve {_size(info.reserve)}, "
            f"using {_size(info.bytes_used)} ({source})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-mp-server quota",
        description="Read or change per-tenant (cache_salt) quotas of a running server. "
                    "Changes last until the server restarts; put lasting ones in --quota-file.")
    parser.add_argument("--url", default=None,
                        help="the server's endpoint (default: $LMCACHE_MP_URL, else this "
                             "user's ipc:// socket in the runtime directory); the admin token "
                             "comes from $LMCACHE_MP_ADMIN_TOKEN or the runtime directory's "
                             "admin.token")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for the server (default: 5)")
    actions = parser.add_subparsers(dest="action", required=True)
    set_ = actions.add_parser("set", help="give SALT a cap and an optional reservation; "
                                          "lowering a cap evicts down to it at once")
    set_.add_argument("salt", help="the cache_salt ('' for requests without one)")
    set_.add_argument("quota", help="CAP[:RESERVE], e.g. 2GiB, 2GiB:512MiB, unlimited:1GiB")
    set_.add_argument("reserve", nargs="?", help="RESERVE, as a second word instead of after "
                                                 "a colon: `set team-a 2GiB 512MiB`")
    for name, text in (("get", "show the quota that applies to SALT and its usage"),
                       ("delete", "drop SALT's run-time quota: the file's, the flags' or "
                                  "the default applies again")):
        action = actions.add_parser(name, help=text)
        action.add_argument("salt", help="the cache_salt")
    actions.add_parser("list", help="show the default cap and every salt with its own quota")
    return parser


def _quota_of(args: argparse.Namespace) -> Quota:
    """`set`'s quota: CAP[:RESERVE] in one word, or CAP and RESERVE in two."""
    if args.reserve is None:
        return parse_quota(args.quota)
    if ":" in args.quota:
        raise QuotaError(f"give the reservation once: {args.quota} {args.reserve} names it "
                         f"twice; write CAP:RESERVE or CAP RESERVE")
    return parse_quota(f"{args.quota}:{args.reserve}")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    # This command prints each error once, itself: the client's log lines (a refused HELLO
    # is logged as it happens, and again when the call is retried) would repeat it.
    logging.getLogger("lmcache_mp.client").setLevel(logging.CRITICAL)
    try:
        quota = _quota_of(args) if args.action == "set" else None
        with CacheClient(args.url, timeout=args.timeout, client_name="lmcache-mp-admin",
                         admin=True) as client:
            if quota is not None:
                print(_line(client.quota_set(args.salt, quota.cap, quota.reserve)))
            elif args.action == "get":
                print(_line(client.quota_get(args.salt)))
            elif args.action == "delete":
                print(_line(client.quota_delete(args.salt)))
            else:
                listing = client.quota_list()
                print(f"default cap: {_size(listing.default_cap)}")
                for info in listing.quotas:
                    print(_line(info))
    except (QuotaError, LMCacheMPError) as exc:
        print(f"lmcache-mp-server quota: error: {exc}", file=sys.stderr)
        return 1
    return 0

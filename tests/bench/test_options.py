"""`lmcache-mp-bench`'s options: declared once (BenchOptions' fields), each flag explained in
--help, the workloads' defaults filled in, and --l2 checked by the server's own rule."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from lmcache_mp.bench.cli import build_parser
from lmcache_mp.bench.options import BenchOptions, FlagError, resolve
from lmcache_mp.client import ParallelStrategy
from lmcache_mp.server.l2.urls import check_url


def test_every_field_is_a_flag_with_its_help_and_nothing_else_is():
    parser = build_parser()
    actions = [action for action in parser._actions
               if not isinstance(action, argparse._HelpAction)]
    fields = {field.name for field in dataclasses.fields(BenchOptions)}
    assert {action.dest for action in actions} == fields
    for action in actions:
        assert action.help and len(action.help) > 20, action.option_strings
    help_text = parser.format_help()
    for action in actions:
        for name in action.option_strings:
            assert name in help_text
    # A command line parses into the dataclass as it is, defaults included.
    options = parser.parse_args(["--workload", "chat", "--no-verify", "--no-mla"])
    assert options.verify is False and options.mla is False and options.tp == 1


@pytest.mark.parametrize("workload, requests, chunks, batch, shape, mla", [
    ("W1", 16, 4, 4, "W1", False),
    ("W2", 128, 8, 8, "W2", False),
    ("W3", 16, 4, 4, "W3", True),
    ("chat", 240, 1, 8, "W2", False),
    ("multi-tenant", None, 4, 4, "W2", False),
    ("engine", 5, 1, 1, "W2", False),
    ("warm-restart", None, 1, 1, "8KiB", False),
    ("disk", 64, 32, 4, "W2", False),
])
def test_each_workload_gets_its_defaults(workload, requests, chunks, batch, shape, mla):
    options = resolve(BenchOptions(workload=workload))
    assert (options.requests, options.chunks, options.batch, options.shape, options.mla) == \
        (requests, chunks, batch, shape, mla)
    chunks_given = 0 if workload == "chat" else 3  # chat refuses --chunks
    given = resolve(BenchOptions(workload=workload, chunks=chunks_given, batch=2))
    assert (given.chunks, given.batch) == (chunks_given or 1, 2)


def test_duration_replaces_requests_for_the_simulated_engines():
    assert resolve(BenchOptions(workload="chat", duration=5.0)).requests is None
    assert resolve(BenchOptions(workload="disk", duration=5.0)).requests == 64


@pytest.mark.parametrize("shape, tp, pp", [("W2", 2, 2), ("W3", 2, 2), ("W3", 4, 1)])
def test_the_shards_of_a_cache_follow_the_clients_rule(shape, tp, pp):
    options = resolve(BenchOptions(workload="chat" if shape == "W2" else shape, shape=shape,
                                   tp=tp, pp=pp))
    mla = shape == "W3"
    assert options.kv_world_size == ParallelStrategy(mla, tp * pp, 0, tp, pp).kv_world_size
    assert options.kv_world_size == (pp if mla else tp * pp)
    # --no-mla: every rank sends, but an MLA cache is still one shard per PP stage
    if mla:
        assert resolve(dataclasses.replace(options, mla=False)).kv_world_size == pp


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379", "rediss://user:secret@cache.example:6380/2",
    "redis+cluster://10.0.0.1:7000,10.0.0.2:7001", "rediss+cluster://u:p@[::1]:7000",
])
def test_l2_takes_every_url_the_servers_l2_takes(url):
    check_url(url)  # the server's own rule takes it
    assert resolve(BenchOptions(workload="chat", nodes=2, l2=url)).l2 == url


@pytest.mark.parametrize("url", ["http://x", "redis://:6379", "redis+cluster://", "redis://h:1/x"])
def test_l2_refuses_what_the_servers_l2_refuses_with_its_message(url):
    with pytest.raises(ValueError) as server:
        check_url(url)
    with pytest.raises(FlagError) as bench:
        resolve(BenchOptions(workload="chat", nodes=2, l2=url))
    assert str(bench.value) == str(server.value)

"""What the security tests share: real servers, and agents (worker or attacker processes,
forked from the tests' worker server (tests.workers.context), as root or as `nobody`) that
the test drives step by step, and a raw ZeroMQ client for frames no well-behaved client sends.

An agent runs a loop in its own process: the test sends it a module-level function and
arguments, the agent runs it with its own state (clients, caches, registrations kept by
name) and sends back the result, or the very exception it raised. So the server sees real
processes with their own connections, memfds, uids and deaths.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import struct
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import zmq

from lmcache_mp import protocol
from lmcache_mp.client import CacheClient, SharedKVCache

from .. import workers
from ..utils import rid, run_server

NOBODY = 65534  # uid of `nobody` and gid of `nogroup`: the other user of these tests
CALL_TIMEOUT_S = 60.0  # an agent step that takes longer is a hang
W1 = dict(layout="mha", num_layers=32, block_size=16, heads=8, head_dim=128,
          dtype=torch.float16)  # 32 MiB chunks


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes, as bytes: what crosses between processes and gets compared."""
    flat = tensor.contiguous().view(torch.uint8).flatten()
    return ctypes.string_at(flat.data_ptr(), flat.numel())


def fill(cache: SharedKVCache, seed: int) -> SharedKVCache:
    """Random bytes from `seed`, fast enough for W1-sized caches (64-bit draws)."""
    generator = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        words = layer.view(torch.uint8).flatten().view(torch.int64)
        words.copy_(torch.randint(-2**63, 2**63 - 1, words.shape, dtype=torch.int64,
                                  generator=generator))
    return cache


def new_cache(num_blocks: int, seed: int | None, shape: dict) -> SharedKVCache:
    """A SharedKVCache of `shape` (tests.workers.W2, W1, MLA) filled from `seed` (zeros if None)."""
    cache = SharedKVCache(shape["layout"], shape["num_layers"], num_blocks, shape["block_size"],
                          shape["heads"], shape["head_dim"], shape["dtype"])
    return fill(cache, seed) if seed is not None else cache


# ---------------------------------------------------------------------------
# Agents: worker and attacker processes driven by the test.

@dataclass(frozen=True)
class Ref:
    """Names an object in an agent's state, as an argument of a call run there."""

    name: str


def _agent_main(conn, uid: int | None) -> None:
    if uid is not None:  # drop every privilege before touching anything of the server's
        # Python and its packages may lie where only root can read (/root/.pyenv): what the
        # steps' modules import is loaded while the process can still read it, and so is the
        # codec that socket.getaddrinfo() needs for any host name (a network client's).
        importlib.import_module("pytest")
        importlib.import_module("encodings.idna")
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    state: dict = {"conn": conn, "report": lambda value: conn.send(("progress", value))}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            break
        fn, args, kwargs = message
        try:
            args = [state[a.name] if isinstance(a, Ref) else a for a in args]
            kwargs = {k: state[v.name] if isinstance(v, Ref) else v for k, v in kwargs.items()}
            answer: tuple = ("ok", fn(state, *args, **kwargs))
        except BaseException as exc:  # sent back to the test, which decides
            answer = ("err", exc, traceback.format_exc())
        try:
            conn.send(answer)
        except Exception as exc:  # an unpicklable result or exception
            conn.send(("err", RuntimeError(f"cannot send back {answer[1]!r}: {exc}"),
                       answer[2] if len(answer) > 2 else ""))
    for value in state.values():
        if hasattr(value, "close") and value is not conn:
            with contextlib.suppress(Exception):
                value.close()
    os._exit(0)  # everything is closed: skip the interpreter's slow teardown (torch)


class Agent:
    """A worker or attacker in its own process; `uid`: run as that user (and its group)."""

    def __init__(self, name: str, uid: int | None = None):
        context = workers.context()
        self.name = name
        self.conn, child = context.Pipe()
        self.progress: list = []  # what calls reported with state["report"](value)
        self._stopping = False
        self.process = context.Process(target=_agent_main, args=(child, uid), daemon=True,
                                       name=name)
        self.process.start()
        child.close()

    def send(self, fn, *args, **kwargs) -> None:
        """Start fn(state, *args, **kwargs) in the agent; result() collects it."""
        self.conn.send((fn, args, kwargs))

    def _next(self, deadline: float):
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"agent {self.name} (pid {self.process.pid}) hung: no answer "
                               f"in time")
        return self.conn.recv()

    def result(self, wait: float = CALL_TIMEOUT_S):
        """The running call's result (its progress reports go to self.progress)."""
        deadline = time.monotonic() + wait
        while True:
            status, value, *trace = self._next(deadline)
            if status == "progress":
                self.progress.append(value)
                continue
            if status == "err":
                value.add_note(f"in agent {self.name}:\n{trace[0]}")
                raise value
            return value

    def wait_progress(self, predicate, wait: float = CALL_TIMEOUT_S):
        """Collect the running call's progress reports until one satisfies predicate."""
        deadline = time.monotonic() + wait
        while True:
            status, value, *trace = self._next(deadline)
            if status != "progress":
                raise AssertionError(f"agent {self.name} finished ({status}: {value!r}) "
                                     f"before the expected report")
            self.progress.append(value)
            if predicate(value):
                return value

    def run(self, fn, *args, wait: float = CALL_TIMEOUT_S, **kwargs):
        """fn(state, *args, **kwargs) in the agent, waiting at most `wait` seconds for it;
        Ref(name) arguments are the agent's objects."""
        self.send(fn, *args, **kwargs)
        return self.result(wait)

    def do(self, obj: str, method: str, *args, wait: float = CALL_TIMEOUT_S, **kwargs):
        """state[obj].method(*args, **kwargs), in the agent."""
        return self.run(_do, obj, method, *args, wait=wait, **kwargs)

    def wait_exit(self, timeout: float = 30.0) -> int:
        self.process.join(timeout)
        assert self.process.exitcode is not None, f"agent {self.name} did not exit"
        return self.process.exitcode

    def stop(self) -> None:
        """Ask the agent to close what it holds and exit (close() waits for that)."""
        if not self._stopping and self.process.is_alive():
            self._stopping = True
            with contextlib.suppress(OSError):
                self.conn.send(None)

    def close(self) -> None:
        self.stop()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def _do(state, obj, method, *args, **kwargs):
    return getattr(state[obj], method)(*args, **kwargs)


# Steps that agents run (module level, so that they reach the agent by name).

def connect(state, name: str, url: str, **kwargs) -> str:
    """A CacheClient in state[name]; returns the role the server gave its session."""
    state[name] = CacheClient(url, **kwargs)
    return state[name].hello().role


def make(state, name: str, num_blocks: int, seed: int | None, shape: dict) -> None:
    state[name] = new_cache(num_blocks, seed, shape)


def register(state, name: str, client: str, cache: str, model: str = "test-model",
             **kwargs) -> int:
    cache_obj = state[cache]
    state[name] = state[client].register_kv_cache(
        cache_obj.handles(), model=model, layout=cache_obj.layout,
        block_size=cache_obj.block_size, **kwargs)
    return state[name].instance_id


# ---------------------------------------------------------------------------
# Servers and raw clients.

@contextlib.contextmanager
def group_server(*args: str) -> Iterator:
    """A server that members of `nogroup` (the nobody agents) may connect to."""
    with run_server("--socket-group", str(NOBODY), *args) as server:
        yield server


class RawClient:
    """A bare DEALER: sends any frames, pipelines, reads when told."""

    def __init__(self, url: str, hwm: int | None = None, timeout_ms: int = 10_000):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
        if hwm is not None:
            self.socket.setsockopt(zmq.RCVHWM, hwm)
            self.socket.setsockopt(zmq.SNDHWM, hwm)
        self.socket.connect(url)
        self._ids = iter(range(1, 2**62))

    def send(self, op: str, payload, request_id: int | None = None) -> int:
        request_id = next(self._ids) if request_id is None else request_id
        if not isinstance(payload, bytes):
            payload = msgpack.packb(payload, use_bin_type=True)
        self.socket.send_multipart([rid(request_id), op.encode(), payload])
        return request_id

    def recv(self) -> tuple[int, bytes, Any]:
        frames = self.socket.recv_multipart()
        assert len(frames) == 3, frames
        return struct.unpack("<Q", frames[0])[0], frames[1], msgpack.unpackb(frames[2])

    def call(self, op: str, payload) -> tuple[bytes, Any]:
        sent = self.send(op, payload)
        request_id, status, body = self.recv()
        assert request_id == sent
        return status, body

    def hello(self, token: str = "", engine: str = "") -> dict:
        status, body = self.call("HELLO", {"protocol_version": protocol.PROTOCOL_VERSION,
                                           "token": token, "engine": engine})
        assert status == b"ok", body
        return body

    def close(self) -> None:
        self.socket.close()
        self.context.term()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

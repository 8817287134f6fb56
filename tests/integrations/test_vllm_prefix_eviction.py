"""vLLM's chunked prefill stores a prompt a chunk per step; a quota cut keeps its first chunk.

Issue 11, item 12: the chunks of such a prompt reached the server in separate STOREs, so
its first chunk was its least recently used, went first, and a cut to one chunk left a
hit of 0. With vLLM's real scheduler (see test_vllm.py's `Engine`).
"""

from ..utils import run_server
from .test_vllm import Engine, prompt

CHUNK_TOKENS = 256


def test_a_quota_cut_after_chunked_prefill_keeps_the_prompts_first_chunk(model_dir):
    tokens = prompt(12, 4 * CHUNK_TOKENS + 10)
    with run_server("--lease-timeout", "30") as server:
        writer = Engine(model_dir, server.url)
        reader = Engine(model_dir, server.url)
        try:
            writer.scheduler.max_num_scheduled_tokens = CHUNK_TOKENS  # one chunk per step
            writer.add("a", tokens, cache_salt="t")
            writer.run_until_idle()
            with server.client(admin=True) as admin:
                stats = admin.stats()
                assert stats.requests["STORE"] == 4  # a STORE of one chunk per step
                usage = stats.tenants["t"]
                assert usage.chunks == 4
                chunk_bytes = usage.bytes_used // 4
                assert admin.quota_set("t", chunk_bytes).bytes_used == chunk_bytes

            reader.add("b", tokens, cache_salt="t")
            reader.run_until_idle()
            assert reader.first_computed["b"] == CHUNK_TOKENS  # chunk 0 was loaded
            reader.assert_kv("b", tokens)
        finally:
            writer.close()
            reader.close()

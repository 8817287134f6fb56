"""kv_role under vLLM's real scheduler, counted at a real server: a kv_producer stores and
never looks up or retrieves, a kv_consumer looks up and loads and never stores, and a
prefill engine hands a prompt to a decode engine through the server."""


from ..utils import fresh_salt
from .test_vllm import prompt, stats


def counts(server, engine) -> tuple[int, int]:
    """(STOREs, RETRIEVEs) the engine's rank 0 sent, by the server's count."""
    registration = engine.workers[0][0]._worker.adapter.adapters[0].registration
    (instance,) = [i for i in stats(server).instances if i.instance_id == registration.instance_id]
    return instance.stores, instance.retrieves


def tenant_chunks(server, salt: str) -> int:
    tenant = stats(server).tenants.get(salt)
    return tenant.chunks if tenant else 0


def lookups(server) -> int:
    return stats(server).requests.get("LOOKUP", 0)


def test_a_producer_stores_and_never_looks_up_or_loads(engines, server):
    salt = fresh_salt("roles")
    tokens = prompt(81, 3 * 256 + 40)
    first = engines(kv_role="kv_producer")
    before = lookups(server)
    first.add("p1", tokens, salt)
    first.run_until_idle()
    assert tenant_chunks(server, salt) == 3
    # A second producer (a fresh KV cache) with the same prompt computes it all again.
    second = engines(kv_role="kv_producer")
    second.add("p2", tokens, salt)
    second.run_until_idle()
    assert second.first_computed["p2"] == 0
    assert lookups(server) == before
    # two STOREs each: the prefill takes two steps of at most 512 tokens
    assert counts(server, first) == counts(server, second) == (2, 0)


def test_a_consumer_loads_and_never_stores(engines, server):
    salt = fresh_salt("roles")
    tokens = prompt(82, 3 * 256 + 40)
    writer = engines()
    writer.add("w", tokens, salt)
    writer.run_until_idle()
    consumer = engines(kv_role="kv_consumer")
    before = lookups(server)
    consumer.add("hit", tokens, salt)
    miss_salt = fresh_salt("roles")
    consumer.add("miss", prompt(83, 2 * 256 + 9), miss_salt)
    consumer.run_until_idle()
    assert lookups(server) - before == 2
    assert consumer.first_computed["hit"] == 768
    consumer.assert_kv("hit", tokens)
    assert consumer.first_computed["miss"] == 0
    assert tenant_chunks(server, miss_salt) == 0  # computed, never stored
    assert counts(server, consumer) == (0, 1)


def test_a_prefill_engine_hands_the_prompt_to_a_decode_engine(engines, server):
    """P/D on one node: the producer computes the prompt (one token), the consumer loads
    every full chunk of it, computes the rest and decodes."""
    salt = fresh_salt("roles")
    tokens = prompt(84, 4 * 256 + 17)
    prefill, decode = engines(kv_role="kv_producer"), engines(kv_role="kv_consumer")
    prefill.add("r", tokens, salt, max_tokens=1)
    prefill.run_until_idle()
    decode.add("r", tokens, salt, max_tokens=20)
    decode.run_until_idle()
    assert decode.first_computed["r"] == 4 * 256
    decode.assert_kv("r", tokens)
    assert counts(server, prefill) == (2, 0)  # chunks 0-1, then 2-3: a step of 512 each
    assert counts(server, decode) == (0, 1)
    assert tenant_chunks(server, salt) == 4
    assert stats(server).leases_held == 0


def store_copies(server) -> tuple[int, int, int]:
    """(chunks held, bytes STORE placed, STOREs whose copies ran), by the server's counts."""
    now = stats(server)
    histogram = now.copy_time.get("store")
    return now.chunks, now.bytes_stored, sum(histogram.counts) if histogram else 0


def test_a_producer_storing_chunks_the_server_holds_copies_nothing(engines, server):
    """A prefill engine never looks up, so it stores a prompt the server holds again: each
    chunk is ALREADY_STORED, and the server copies nothing (no STORE's copies run)."""
    salt = fresh_salt("roles")
    tokens = prompt(85, 3 * 256 + 40)
    first = engines(kv_role="kv_producer")
    first.add("p1", tokens, salt)
    first.run_until_idle()
    chunks, stored, copies = store_copies(server)
    assert tenant_chunks(server, salt) == 3 and copies >= 2
    second = engines(kv_role="kv_producer")
    second.add("p2", tokens, salt)
    second.run_until_idle()
    assert counts(server, second) == (2, 0)  # it sent both STOREs
    assert store_copies(server) == (chunks, stored, copies)

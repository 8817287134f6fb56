"""KV events through vLLM's own publisher (its ZMQ PUB with a replay socket, as
--kv-events-config makes it), decoded with vLLM's own KVEventBatch: the chunks an engine
stored or found in the server's memory are BlockStored with medium CPU (those found on its
disk tier: STORAGE) and vLLM's block hashes, and those a LOOKUP shows gone or in another
tier are BlockRemoved under the medium they were announced with."""

import time
import uuid
from functools import partial

import msgspec
import zmq

from .test_vllm import Engine, prompt, stats  # isort: skip (first: it imports vLLM for the CPU)
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from ..utils import fresh_salt, run_server, wait_for

CHUNK, BLOCK = 256, 16
PER_CHUNK = CHUNK // BLOCK


class Subscriber:
    """Reads what an engine's publisher sent, from the start, through its replay socket
    (a SUB socket would miss what was published before it joined)."""

    def __init__(self):
        name = uuid.uuid4().hex[:12]
        self.config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                     endpoint=f"inproc://events-{name}",
                                     replay_endpoint=f"inproc://replay-{name}")
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    def batches(self) -> list[KVEventBatch]:
        """Every batch published so far: one per engine step that had events."""
        socket: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)  # the publisher's
        try:
            socket.connect(self.config.replay_endpoint)
            socket.send_multipart((b"", (0).to_bytes(8, "big")))
            batches: list[KVEventBatch] = []
            while True:
                assert socket.poll(10_000), "no replay"
                _, _, seq, payload = socket.recv_multipart()
                if seq == ZmqEventPublisher.END_SEQ:
                    return batches
                batches.append(self.decoder.decode(payload))
        finally:
            socket.close(linger=0)

    def events(self) -> list:
        return [event for batch in self.batches() for event in batch.events]

    def wait_for(self, count, kind=BlockStored, medium="CPU") -> list:
        """Our events of a kind, once there are `count` (vLLM's thread publishes them), or
        what came in 60 s (which only a hang takes)."""
        deadline = time.monotonic() + 60
        while True:
            ours = [e for e in self.events() if isinstance(e, kind) and e.medium == medium]
            if len(ours) >= count or time.monotonic() > deadline:
                return ours
            time.sleep(0.01)


def chunk_hashes(request, index: int) -> list:
    """The chunk's blocks as vLLM's events name them (64-bit ints by default)."""
    return [maybe_convert_block_hash(h)
            for h in request.block_hashes[index * PER_CHUNK:(index + 1) * PER_CHUNK]]


def test_stored_and_looked_up_chunks_are_announced_and_gone_ones_withdrawn(engines, server):
    salt = fresh_salt("events")
    tokens = prompt(101, 3 * CHUNK + 40)
    feed = Subscriber()
    writer = engines(kv_events=feed.config)
    try:
        request = writer.add("w", tokens, salt)
        writer.run_until_idle()
        stored = feed.wait_for(3)
        # One BlockStored per chunk: vLLM's hashes for its 16 blocks, its tokens, its parent.
        assert [e.block_hashes for e in stored] == [chunk_hashes(request, i) for i in range(3)]
        assert [e.token_ids for e in stored] == [tokens[i * CHUNK:(i + 1) * CHUNK]
                                                 for i in range(3)]
        assert [e.parent_block_hash for e in stored] == [None, *(chunk_hashes(request, i)[-1]
                                                                 for i in range(2))]
        assert {(e.block_size, e.locality, e.group_idx) for e in stored} == {(BLOCK, "LOCAL", 0)}
        assert stored[0].extra_keys[0] == (salt,)  # as vLLM keys block 0 of a salted prompt
        # vLLM's own GPU events name the same blocks with the same hashes.
        gpu = {h for e in feed.events() if isinstance(e, BlockStored) and e.medium == "GPU"
               for h in e.block_hashes}
        assert {h for e in stored for h in e.block_hashes} <= gpu

        # The server loses the chunks (here: an admin clears the tenant); the writer's next
        # LOOKUP of the prompt (its own prefix cache reset) misses them: withdrawn, then
        # announced again once computed and stored again.
        with server.client(admin=True) as admin:
            assert admin.clear(salt) == 3
        assert writer.scheduler.reset_prefix_cache()
        writer.add("again", tokens, salt)
        writer.run_until_idle()
        (removed,) = feed.wait_for(1, BlockRemoved)
        assert removed.block_hashes == [h for i in range(3) for h in chunk_hashes(request, i)]
        assert len(feed.wait_for(6)) == 6

        # Another engine's LOOKUP that finds them announces them for that engine.
        other_feed = Subscriber()
        reader = engines(kv_events=other_feed.config)
        try:
            reader.add("r", tokens, salt)
            reader.run_until_idle()
            assert reader.first_computed["r"] == 3 * CHUNK
            assert [e.block_hashes for e in other_feed.wait_for(3)] == \
                [chunk_hashes(request, i) for i in range(3)]
        finally:
            reader.scheduler.kv_event_publisher.shutdown()
    finally:
        writer.scheduler.kv_event_publisher.shutdown()


def test_past_kv_events_max_chunks_the_oldest_announcement_is_withdrawn(engines, server):
    feed = Subscriber()
    engine = engines(kv_events=feed.config, kv_events_max_chunks=2)
    try:
        request = engine.add("w", prompt(102, 3 * CHUNK + 40), f"cap-{uuid.uuid4().hex[:8]}")
        engine.run_until_idle()
        assert len(feed.wait_for(3)) == 3
        (removed,) = feed.wait_for(1, BlockRemoved)
        assert removed.block_hashes == chunk_hashes(request, 0)
    finally:
        engine.scheduler.kv_event_publisher.shutdown()


def written_at_least(server, chunks: int) -> bool:
    """Whether the server has written `chunks` chunks to its disk tier (wait_for's test)."""
    return stats(server).disk_chunks_written >= chunks


def ours(batch: KVEventBatch) -> list[tuple[str, str, list]]:
    """The connector's events in a batch (not vLLM's GPU ones): kind, medium, hashes."""
    return [(type(e).__name__, e.medium, e.block_hashes) for e in batch.events
            if isinstance(e, (BlockStored, BlockRemoved)) and e.medium in ("CPU", "STORAGE")]


def test_a_chunk_found_on_disk_is_storage_until_a_lookup_finds_it_in_memory(model_dir,
                                                                            tmp_path):
    # A pool of 4 MiB holds 8 chunks of this model (512 KiB each); 12 are stored, so the
    # first prompt's 3 are on the disk tier only.
    with run_server("--cpu-size", "4MiB", "--disk-dir", str(tmp_path / "disk"),
                    "--disk-size", "64MiB", "--disk-prefetch-wait", "30") as server:
        prompts = [prompt(110 + i, 3 * CHUNK + 40) for i in range(4)]
        writer = Engine(model_dir, server.url)
        try:
            for count, tokens in enumerate(prompts, start=1):
                writer.add(f"p{count}", tokens)
                writer.run_until_idle()
                wait_for(partial(written_at_least, server, 3 * count),
                         "the prompt's chunks on disk")
        finally:
            writer.close()
        assert stats(server).chunks <= 8

        assert_storage_then_cpu(model_dir, server, prompts[0])
        assert stats(server).disk_hits >= 3


def test_a_chunk_pulled_from_l2_is_storage_until_a_lookup_finds_it_in_memory(model_dir):
    from ..redis_servers import redis_server  # skips the test where no redis-server is

    with redis_server() as redis, \
            run_server("--l2", redis.url, "--l2-prefetch-wait", "20") as node_a, \
            run_server("--l2", redis.url, "--l2-prefetch-wait", "20") as node_b:
        tokens = prompt(120, 3 * CHUNK + 40)
        writer = Engine(model_dir, node_a.url)
        try:
            writer.add("w", tokens)
            writer.run_until_idle()
        finally:
            writer.close()
        wait_for(lambda: stats(node_a).l2_chunks_written >= 3, "the chunks in L2")
        assert_storage_then_cpu(model_dir, node_b, tokens)


def assert_storage_then_cpu(model_dir: str, server, tokens: list[int]) -> None:
    """A fresh engine's LOOKUP finds the prompt's 3 chunks in a lower tier only: announced
    STORAGE; its next LOOKUP (the first brought them into memory) finds them in memory:
    in one batch, each chunk withdrawn under STORAGE, then announced CPU."""
    feed = Subscriber()
    reader = Engine(model_dir, server.url, kv_events=feed.config)
    try:
        request = reader.add("lower", tokens)
        reader.run_until_idle()
        assert reader.first_computed["lower"] == 3 * CHUNK
        assert [e.block_hashes for e in feed.wait_for(3, medium="STORAGE")] == \
            [chunk_hashes(request, i) for i in range(3)]
        assert feed.wait_for(0, medium="CPU") == []

        assert reader.scheduler.reset_prefix_cache()
        reader.add("memory", tokens)
        reader.run_until_idle()
        assert reader.first_computed["memory"] == 3 * CHUNK
        assert len(feed.wait_for(3, medium="CPU")) == 3
        batches = [ours(batch) for batch in feed.batches() if ours(batch)]
        assert batches == [
            [("BlockStored", "STORAGE", chunk_hashes(request, i)) for i in range(3)],
            [event for i in range(3)
             for event in (("BlockRemoved", "STORAGE", chunk_hashes(request, i)),
                           ("BlockStored", "CPU", chunk_hashes(request, i)))]]
    finally:
        reader.scheduler.kv_event_publisher.shutdown()
        reader.close()

"""KV events through vLLM's own publisher (its ZMQ PUB with a replay socket, as
--kv-events-config makes it), decoded with vLLM's own KVEventBatch: the chunks an engine
stored or found on the server are BlockStored with medium CPU and vLLM's block hashes,
and those a LOOKUP shows gone are BlockRemoved."""

import time
import uuid

import msgspec
import zmq

from .test_vllm import prompt  # isort: skip (first: it imports vLLM for the CPU)
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from ..utils import fresh_salt

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

    def events(self) -> list:
        socket: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)  # the publisher's
        try:
            socket.connect(self.config.replay_endpoint)
            socket.send_multipart((b"", (0).to_bytes(8, "big")))
            events: list = []
            while True:
                assert socket.poll(10_000), "no replay"
                _, _, seq, payload = socket.recv_multipart()
                if seq == ZmqEventPublisher.END_SEQ:
                    return events
                events.extend(self.decoder.decode(payload).events)
        finally:
            socket.close(linger=0)

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

"""The workloads' request streams: what each engine is asked to prefill, step by step."""

import itertools
from collections import Counter

from lmcache_mp.bench.shapes import SHAPES
from lmcache_mp.bench.workloads.chat import ChatWorkload
from lmcache_mp.bench.workloads.uniform import UniformWorkload
from lmcache_mp.client import chunk_hashes

W2 = SHAPES["W2"]


def test_shapes_weigh_what_the_design_says():
    assert {name: shape.chunk_bytes for name, shape in SHAPES.items()} == {
        "W1": 32 * 2**20, "W2": 512 * 2**10, "W3": 9 * 2**20, "8KiB": 8 * 2**10}


def test_uniform_sends_each_prompt_twice_in_consecutive_steps():
    workload = UniformWorkload(W2, chunks=3, batch=4, requests=10, engines=2, salt="s", seed=1)
    per_engine = [list(workload.stream("run", engine)) for engine in range(2)]
    prompts = []
    for steps in per_engine:
        assert len(steps) % 2 == 0
        for first, again in zip(steps[::2], steps[1::2]):
            assert [r.token_ids for r in first] == [r.token_ids for r in again]
            assert all(r.request_id.endswith("-store") for r in first)
            assert all(r.request_id.endswith("-hit") for r in again)
            prompts += [r.token_ids for r in first]
    assert len(prompts) == 10  # split 5 + 5 over the engines, in batches of at most 4
    assert all(len(p) == 3 * 256 + 16 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 10
    ids = [r.request_id for steps in per_engine for step in steps for r in step]
    assert len(ids) == len(set(ids)) == 20


def test_chat_turns_extend_their_conversation_and_documents_follow_zipf():
    workload = ChatWorkload(W2, batch=4, requests=400, engines=1, salt="s", seed=3)
    requests = [r for step in workload.stream("run", 0) for r in step]
    assert len(requests) == 400
    assert len({r.request_id for r in requests}) == 400
    by_conversation: dict[str, list[list[int]]] = {}
    for request in requests:
        conversation = request.request_id.rsplit("-t", 1)[0]
        by_conversation.setdefault(conversation, []).append(request.token_ids)
    for turns in by_conversation.values():
        for earlier, later in itertools.pairwise(turns):
            assert later[:len(earlier)] == earlier  # the next prompt holds the whole history
            assert len(later) > len(earlier)
        assert len(turns[-1]) <= workload.max_prompt_tokens
    openings = Counter(tuple(turns[0][:256]) for turns in by_conversation.values())
    most, least = openings.most_common()[0][1], openings.most_common()[-1][1]
    assert most >= 3 * least  # the popular document opens many more conversations
    # Shared documents make shared chunk prefixes across conversations.
    first_chunks = Counter(chunk_hashes(turns[0], 256)[0] for turns in by_conversation.values())
    assert first_chunks.most_common()[0][1] > 1

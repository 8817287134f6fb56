"""Multi-turn under vLLM's real scheduler: full chunks of generated tokens are stored once
computed (or at the latest when the request finishes), so that the next turn's prompt
(prompt, answer, new message) loads the answer on another engine; store_generated false
stores prompts only."""


from ..utils import fresh_salt
from .test_vllm import (  # vLLM's names too: test_vllm imports them for the CPU
    CachedRequestData,
    Request,
    RequestStatus,
    SamplingParams,
    blocks_of,
    lookup,
    one_rank_connectors,
    prompt,
    sampled_token,
    scheduler_output,
    stats,
    step_until_reported,
    worker_step,
)


def tenant_chunks(server, salt: str) -> int:
    tenant = stats(server).tenants.get(salt)
    return tenant.chunks if tenant else 0


def test_the_next_turn_on_another_engine_loads_the_prompt_and_the_answer(engines, server):
    """Turn 1: 868 prompt tokens and a 200-token answer, whose tokens 768-1023 (100 of the
    prompt, 156 generated) make the 4th chunk. Turn 2 on a fresh engine loads all 4 and
    computes only what follows: the bytes are those the first engine's passes wrote."""
    salt = fresh_salt("turns")
    first_prompt = prompt(91, 3 * 256 + 100)
    first = engines()
    turn1 = first.add("turn-1", first_prompt, salt, max_tokens=200)
    first.run_until_idle()
    answer = turn1.output_token_ids
    assert len(answer) == 200 and len(set(answer)) > 100  # what the fake model sampled
    assert tenant_chunks(server, salt) == 4

    second_prompt = [*first_prompt, *answer, *prompt(92, 50)]
    second = engines()
    second.add("turn-2", second_prompt, salt)
    second.run_until_idle()
    assert second.first_computed["turn-2"] == 4 * 256
    second.assert_kv("turn-2", second_prompt)
    assert stats(server).leases_held == 0


def test_store_generated_false_stores_the_prompt_only(engines, server):
    salt = fresh_salt("turns")
    first_prompt = prompt(93, 3 * 256 + 100)
    first = engines(store_generated=False)
    turn1 = first.add("turn-1", first_prompt, salt, max_tokens=200)
    first.run_until_idle()
    assert tenant_chunks(server, salt) == 3

    second_prompt = [*first_prompt, *turn1.output_token_ids, *prompt(94, 50)]
    second = engines()
    second.add("turn-2", second_prompt, salt)
    second.run_until_idle()
    assert second.first_computed["turn-2"] == 3 * 256  # the answer is computed again
    second.assert_kv("turn-2", second_prompt)


def decode_step(request: Request, computed: int, count: int):
    """A SchedulerOutput that schedules `count` tokens of a running request from `computed`."""
    output = scheduler_output(num_scheduled={request.request_id: count})
    output.scheduled_cached_reqs = CachedRequestData(
        req_ids=[request.request_id], resumed_req_ids=set(), new_token_ids=[[]],
        all_token_ids={}, new_block_ids=[None], num_computed_tokens=[computed],
        num_output_tokens=[request.num_output_tokens])
    return output


def test_a_chunk_whose_last_tokens_came_after_its_step_is_stored_when_the_request_ends(server):
    """Under async scheduling vLLM plans a step before it knows the tokens the step before
    sampled: the step that computes a chunk's last token plans no store for it (its id
    is not known yet). request_finished stores it, and vLLM keeps the blocks until then."""
    scheduler, worker = one_rank_connectors(server.url)
    try:
        salt = fresh_salt("turns")
        tokens = prompt(95, 250)
        request = Request("async", tokens, SamplingParams(max_tokens=7), None, cache_salt=salt)
        blocks = list(range(17))
        assert lookup(scheduler, request) == (0, False)
        scheduler.update_state_after_alloc(request, blocks_of(blocks), 0)
        meta = scheduler.build_connector_meta(scheduler_output(
            new=[(request, blocks)], num_scheduled={"async": 250}))
        assert not meta.stores
        worker_step([worker], meta)
        # Six decode steps (positions 250-255), each planned before its input was sampled.
        for position in range(250, 256):
            meta = scheduler.build_connector_meta(decode_step(request, position, 1))
            assert not meta.stores
            worker_step([worker], meta)
            request.append_output_token_ids(sampled_token(position))
        request.append_output_token_ids(sampled_token(256))  # the 7th: the request ends
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        assert scheduler.request_finished(request, blocks) == (True, None)
        meta = scheduler.build_connector_meta(scheduler_output(finished={"async"}))
        assert [store.request_id for store in meta.stores] == ["async"]
        assert meta.await_stores == ["async"]
        step_until_reported([worker], scheduler, meta, 0, "async", finished={"async"})
        assert tenant_chunks(server, salt) == 1

        # That chunk, of 250 prompt and 6 generated tokens, is the next turn's hit.
        turn2 = Request("turn-2", [*request.all_token_ids, *prompt(96, 30)],
                        SamplingParams(max_tokens=1), None, cache_salt=salt)
        assert lookup(scheduler, turn2) == (256, True)  # an async load (hand_config)
        turn2.status = RequestStatus.FINISHED_ABORTED
        scheduler.request_finished(turn2, [])
    finally:
        worker.shutdown()
        scheduler.shutdown()

"""A two-turn conversation across two real vLLM engines: turn 2 on the reader loads the
prompt and the answer the writer generated in turn 1, and gives the cold run's output."""

from __future__ import annotations

import random

import pytest

from lmcache_mp.bench.vllm_engine import Prompt

from ..utils import fresh_salt
from .conftest import CHUNK_SIZE
from .test_vllm_engine import cold, retrieves, run, tenant_hits, tokens, wait_stored

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def test_turn_two_on_another_engine_loads_the_answer_and_gives_the_cold_output(engines, admin):
    rng = random.Random(21)
    question = tokens(2 * CHUNK_SIZE + 20, rng)
    salt = fresh_salt("e2e")
    # 148 prompt tokens and a 120-token answer: chunks 2 and 3 hold generated tokens
    (answer,) = engines.writer.generate([Prompt(question, salt)], max_tokens=120).completions
    assert len(answer.tokens) == 120
    wait_stored(admin, salt, (len(question) + 120 - 1) // CHUNK_SIZE)  # the last is not fed
    follow_up = [*question, *answer.tokens, *tokens(30, rng)]  # 4 full chunks, then 42 tokens
    expected = cold(engines.reader, follow_up)
    hits, before = tenant_hits(admin, salt), retrieves(admin)
    loaded = run(engines.reader, Prompt(follow_up, salt))[0]
    assert retrieves(admin) > before, "the reader loaded nothing"
    assert tenant_hits(admin, salt) - hits == 4  # the question's 2 chunks and the answer's 2
    assert loaded == expected

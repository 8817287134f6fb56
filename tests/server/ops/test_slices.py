"""Long requests share the loop a slice at a time, in turn, with everything else."""

import asyncio

import pytest

from lmcache_mp.server.ops.slices import SliceRunner


def test_slices_take_turns_and_the_loop_runs_between_them():
    order: list[str] = []

    def job(name: str, slices: int):
        left = [slices]

        def step() -> bool:
            order.append(name)
            left[0] -= 1
            return left[0] == 0
        return step

    async def scenario():
        runner = SliceRunner()
        ticks = 0

        async def bystander():
            nonlocal ticks
            while len(order) < 7:
                ticks += 1
                await asyncio.sleep(0)
        watcher = asyncio.ensure_future(bystander())
        await asyncio.gather(runner.run(job("a", 4)), runner.run(job("b", 3)))
        await watcher
        return ticks

    ticks = asyncio.run(scenario())
    assert order == ["a", "b", "a", "b", "a", "b", "a"]
    assert ticks >= 6  # the loop turned between slices


def test_a_failing_slice_fails_its_request_only():
    async def scenario():
        runner = SliceRunner()

        def broken() -> bool:
            raise ValueError("bad slice")
        steps = iter([False, True])
        with pytest.raises(ValueError, match="bad slice"):
            await runner.run(broken)
        await runner.run(lambda: next(steps))

    asyncio.run(scenario())

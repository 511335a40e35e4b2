"""The worker begins a step sent ahead only after the step it follows, whatever order they arrive in."""
from __future__ import annotations

import asyncio

import pytest

from prefixcache.worker.step_order import StepOrder, StepOutOfOrder


def test_a_step_that_arrives_before_the_one_it_follows_begins_after_it():
    async def main() -> list[int]:
        order, begun = StepOrder(), []

        async def arrive(step_id: int, follows: int | None) -> None:
            await order.begin(step_id, follows)
            begun.append(step_id)

        later = asyncio.ensure_future(arrive(8, follows=7))
        await asyncio.sleep(0.01)
        assert begun == []  # still waiting for step 7
        await arrive(7, follows=None)
        await later
        await arrive(9, follows=8)  # its predecessor has begun: no wait
        return begun

    assert asyncio.run(main()) == [7, 8, 9]


def test_a_step_whose_predecessor_never_begins_is_refused_after_the_wait():
    async def main() -> None:
        order = StepOrder(wait_s=0.05)
        await order.begin(3, None)
        with pytest.raises(StepOutOfOrder, match="step 5 follows step 4, which did not begin within 0.05s"):
            await order.begin(5, follows_step_id=4)
        await order.begin(4, follows_step_id=3)  # the order still works afterwards

    asyncio.run(main())


def test_a_new_kv_cache_refuses_steps_sent_for_the_old_one():
    async def main() -> None:
        order = StepOrder()
        generation = await order.begin(1, None)
        waiting = asyncio.ensure_future(order.begin(3, follows_step_id=2))
        await asyncio.sleep(0.01)
        await order.restart()
        with pytest.raises(StepOutOfOrder, match="re-initialized"):
            await waiting
        assert not order.is_current(generation)
        assert order.is_current(await order.begin(0, None))

    asyncio.run(main())

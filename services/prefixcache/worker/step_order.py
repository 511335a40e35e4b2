"""Begins steps in the order the scheduler made them.

A scheduler that schedules ahead sends a step while the one before it still runs, naming that one in
`follows_step_id`: the new step's decodes feed back tokens only the earlier step samples. Two calls
on one connection normally arrive in the order they were sent, but nothing in gRPC promises that
their handlers start in that order, so a step that follows another waits here until that one has
begun (steps then run one at a time, first come first served).
"""
from __future__ import annotations

import asyncio

FOLLOWED_STEP_WAIT_S = 30.0  # a followed step that has not begun by then is not coming


class StepOutOfOrder(Exception):
    """The step this one follows did not begin in time, or the KV cache was re-initialized since."""


class StepOrder:
    def __init__(self, wait_s: float = FOLLOWED_STEP_WAIT_S) -> None:
        self.wait_s = wait_s
        self._last_begun: int | None = None
        self._generation = 0  # of the KV cache: a step never follows one from before InitializeCache
        self._changed = asyncio.Condition()

    async def begin(self, step_id: int, follows_step_id: int | None) -> int:
        """Record that `step_id` begins, once the step it follows (if any) has begun. Returns the KV
        cache generation it arrived in, for `is_current`. Raises StepOutOfOrder instead of waiting
        longer than `wait_s`."""
        generation = self._generation
        async with self._changed:
            if follows_step_id is not None:
                try:
                    await asyncio.wait_for(self._changed.wait_for(
                        lambda: self._generation != generation or self._last_begun == follows_step_id), self.wait_s)
                except TimeoutError:
                    raise StepOutOfOrder(f"step {step_id} follows step {follows_step_id}, which did not begin "
                                         f"within {self.wait_s:g}s") from None
                if self._generation != generation:
                    raise StepOutOfOrder(f"step {step_id} follows step {follows_step_id} of a KV cache that was "
                                         "re-initialized since")
            self._last_begun = step_id
            self._changed.notify_all()
        return generation

    def is_current(self, generation: int) -> bool:
        """Whether no InitializeCache came since a step arrived in `generation`: one that did leaves
        the step naming requests and blocks of a cache that is gone."""
        return generation == self._generation

    async def restart(self) -> None:
        """A new KV cache: steps that follow one from before it are refused."""
        async with self._changed:
            self._generation += 1
            self._last_begun = None
            self._changed.notify_all()

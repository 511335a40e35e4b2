"""How much of the engine one tenant may hold, so that a tenant flooding the API cannot starve the
others: open Generate calls, and requests waiting for admission."""
from __future__ import annotations

from dataclasses import dataclass

from prefixcache.scheduler.config import SchedulerConfig


@dataclass(frozen=True)
class TenantLimits:
    """None: the default, a share of the scheduler's own limits."""

    max_in_flight: int | None = None  # open Generate calls
    max_waiting: int | None = None  # requests waiting for admission

    def over(self, other: TenantLimits) -> TenantLimits:
        """These limits, with `other`'s where these leave one unset."""
        return TenantLimits(self.max_in_flight if self.max_in_flight is not None else other.max_in_flight,
                            self.max_waiting if self.max_waiting is not None else other.max_waiting)

    def resolved(self, config: SchedulerConfig) -> tuple[int, int]:
        """(in flight, waiting) at most. By default half the running slots, so that a flooding tenant
        always leaves room to admit another's request at the next step, and half the waiting queue."""
        return (self.max_in_flight if self.max_in_flight is not None else max(1, config.max_num_seqs // 2),
                self.max_waiting if self.max_waiting is not None else max(1, config.max_waiting // 2))

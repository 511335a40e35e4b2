"""Status conditions in the Kubernetes convention (metav1.Condition): one entry per type, and
`lastTransitionTime` moves only when the status does.

Types:
    Reconciled  the children match the current spec (False, reason InvalidSpec/NotOwned/Rejected, when they can't)
    Ready       the Engine API can serve: every engine replica and a tokenizer are available
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

RECONCILED = "Reconciled"
READY = "Ready"


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str = ""


def merge_condition(existing: Sequence[Mapping[str, Any]] | None, new: Condition, generation: int | None,
                    now: datetime | None = None) -> list[dict[str, Any]]:
    """The condition list with `new` replacing its type's entry."""
    status = "True" if new.status else "False"
    previous = next((c for c in existing or () if c.get("type") == new.type), None)
    if previous is not None and previous.get("status") == status and previous.get("lastTransitionTime"):
        transition = previous["lastTransitionTime"]
    else:
        transition = (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    entry: dict[str, Any] = {"type": new.type, "status": status, "reason": new.reason, "message": new.message,
                             "lastTransitionTime": transition}
    if generation is not None:
        entry["observedGeneration"] = generation
    others = [dict(c) for c in existing or () if c.get("type") != new.type]
    return sorted([*others, entry], key=lambda c: c["type"])


def condition_status(existing: Sequence[Mapping[str, Any]] | None, type_: str) -> str | None:
    return next((c.get("status") for c in existing or () if c.get("type") == type_), None)


def find_condition(existing: Sequence[Mapping[str, Any]] | None, type_: str) -> Condition | None:
    """The stored condition of a type, without its bookkeeping fields."""
    for entry in existing or ():
        if entry.get("type") == type_:
            return Condition(type_, entry.get("status") == "True", entry.get("reason", ""),
                             entry.get("message", ""))
    return None


def readiness(desired_replicas: int, engine_available: int | None, tokenizer_available: int | None) -> Condition:
    """Ready from what the child Deployments report."""
    if engine_available is None or tokenizer_available is None:
        return Condition(READY, False, "Progressing", "waiting for the Deployments to be created")
    if desired_replicas == 0:
        return Condition(READY, False, "ScaledToZero", "spec.replicas is 0")
    if tokenizer_available == 0:
        return Condition(READY, False, "TokenizerUnavailable", "no tokenizer replica is available")
    if engine_available < desired_replicas:
        return Condition(READY, False, "Progressing",
                         f"{engine_available} of {desired_replicas} engine replicas available")
    return Condition(READY, True, "Available", f"{engine_available} engine replicas available")

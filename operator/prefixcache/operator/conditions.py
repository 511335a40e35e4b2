"""Status conditions in the Kubernetes convention (metav1.Condition): one entry per type, and
`lastTransitionTime` moves only when the status does.

Types:
    Reconciled  the children match the current spec (False, reason InvalidSpec/NotOwned/Rejected, when they can't)
    Ready       the Engine API serves the current spec: every engine replica is updated and available, and a
                tokenizer is (False, reason Progressing/TokenizerUnavailable/RolloutFailed/ScaledToZero, or the
                Reconciled reason, until then; the message names the field or the object)
    Progressing a rollout of the current spec is under way (True, reason RollingOut; False: Complete,
                ScaledToZero, or the reason it stopped)
    Degraded    something needs a person: an invalid or refused spec, a stopped rollout, no tokenizer
                (True with that reason; False, AsExpected)
    CacheThrashing  cache_health.py (Unknown while nothing could be measured)
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

RECONCILED = "Reconciled"
READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
_DEGRADING = frozenset({"InvalidSpec", "NotOwned", "Rejected", "RolloutFailed", "TokenizerUnavailable"})
_STATUS = {True: "True", False: "False", None: "Unknown"}


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: bool | None  # None: Unknown
    reason: str
    message: str = ""


def merge_condition(existing: Sequence[Mapping[str, Any]] | None, new: Condition, generation: int | None,
                    now: datetime | None = None) -> list[dict[str, Any]]:
    """The condition list with `new` replacing its type's entry."""
    status = _STATUS[new.status]
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
            status = {"True": True, "False": False}.get(entry.get("status", ""))
            return Condition(type_, status, entry.get("reason", ""),
                             entry.get("message", ""))
    return None


@dataclass(frozen=True, slots=True)
class Rollout:
    """Where a Deployment's rollout stands, from its status (absent counts are 0, as the API omits them)."""

    replicas: int  # spec.replicas
    updated: int  # replicas running the latest pod template
    available: int  # replicas available, updated or not
    observed: bool  # the Deployment controller has seen the latest spec
    existing: int = 0  # pods of any template (status.replicas): more than `updated` while old ones remain
    failure: str | None = None  # why the rollout stopped (Progressing=False, ProgressDeadlineExceeded)

    @classmethod
    def from_deployment(cls, deployment: Mapping[str, Any]) -> Rollout:
        status = deployment.get("status") or {}
        generation = (deployment.get("metadata") or {}).get("generation")
        stalled = next((c for c in status.get("conditions") or () if c.get("type") == "Progressing"
                        and c.get("status") == "False" and c.get("reason") == "ProgressDeadlineExceeded"), None)
        return cls(replicas=int((deployment.get("spec") or {}).get("replicas", 1)),
                   updated=int(status.get("updatedReplicas") or 0),
                   available=int(status.get("availableReplicas") or 0),
                   existing=int(status.get("replicas") or 0),
                   observed=generation is None or int(status.get("observedGeneration") or 0) >= generation,
                   failure=None if stalled is None else str(stalled.get("message") or stalled["reason"]))


def readiness(desired_replicas: int, engine: Rollout | None, tokenizer: Rollout | None) -> Condition:
    """Ready from what the child Deployments report: True once every engine replica runs the current
    spec and is available, and a tokenizer is."""
    if engine is None or tokenizer is None:
        return Condition(READY, False, "Progressing", "waiting for the Deployments to be created")
    if desired_replicas == 0:
        return Condition(READY, False, "ScaledToZero", "spec.replicas is 0")
    for role, state in (("engine", engine), ("tokenizer", tokenizer)):
        if state.failure is not None:
            return Condition(READY, False, "RolloutFailed", f"the {role} Deployment's rollout stopped: {state.failure}")
    if tokenizer.available == 0:
        return Condition(READY, False, "TokenizerUnavailable", "no tokenizer replica is available")
    for role, state, wanted in (("engine", engine, desired_replicas), ("tokenizer", tokenizer, tokenizer.replicas)):
        if not state.observed or state.updated < wanted or state.existing > state.updated:
            return Condition(READY, False, "Progressing",
                             f"rolling out: {state.updated if state.observed else 0} of {wanted} {role} replicas "
                             f"run the current spec; {state.available} available")
    if engine.available < desired_replicas:
        return Condition(READY, False, "Progressing",
                         f"{engine.available} of {desired_replicas} engine replicas available")
    return Condition(READY, True, "Available", f"{engine.available} engine replicas available")


def progress_conditions(ready: Condition) -> tuple[Condition, Condition]:
    """Progressing and Degraded, from what Ready says and why."""
    if ready.status:
        return Condition(PROGRESSING, False, "Complete", ready.message), Condition(DEGRADED, False, "AsExpected")
    if ready.reason == "Progressing":
        return Condition(PROGRESSING, True, "RollingOut", ready.message), Condition(DEGRADED, False, "AsExpected")
    degraded = ready.reason in _DEGRADING
    return (Condition(PROGRESSING, False, ready.reason, ready.message),
            Condition(DEGRADED, degraded, ready.reason if degraded else "AsExpected", ready.message if degraded else ""))

"""The cache-health timer: every stack's ready engine pods read over the Engine API (`GetCacheStats`),
one interval's figures (`cache_health.py`) written to `.status.cache`, and `CacheThrashing`.

Each pod is read at its own address (the pod IP and the scheduler's `grpc` container port), not
through the Service, which would hand the reads to whichever pod it picks. With tenants configured,
the reads carry the operator's admin key (`admin_key.py`); a stack that serves the Engine API over
TLS is not read (the operator holds no CA for it), and says so per pod. A read that fails is reported
with its gRPC status, and its pod's figures are left out of the aggregate.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from kubernetes import client

from prefixcache.client import EngineClient
from prefixcache.operator import kube
from prefixcache.operator.cache_health import (
    CACHE_THRASHING,
    PodHealth,
    Reading,
    Thresholds,
    is_thrashing,
    pod_health,
    summary,
    thrashing_condition,
)
from prefixcache.operator.conditions import (
    RECONCILED,
    Condition,
    condition_status,
    find_condition,
    merge_condition,
)
from prefixcache.operator.owner import Owner, selector_labels
from prefixcache.operator.ports import ENGINE_PORT
from prefixcache.operator.schema import SpecError
from prefixcache.operator.spec import CacheHealthSpec, parse_spec

log = logging.getLogger(__name__)
READ_TIMEOUT_S = 5.0
TICK_S = 1.0  # how often the timer looks for a stack that is due


@dataclass
class _StackState:
    due_at: float = 0.0
    readings: dict[str, Reading] = field(default_factory=dict)  # pod name -> its last reading
    streak: int = 0  # consecutive thrashing intervals


@dataclass
class CachePoller:
    api: client.ApiClient
    admin_key: str
    states: dict[tuple[str, str], _StackState] = field(default_factory=dict)

    async def run(self, stacks: Mapping[tuple[str, str], str]) -> None:
        """Forever: poll each stack in `stacks` ((namespace, name) -> uid) when its interval is due."""
        while True:
            now = time.monotonic()
            for key in set(self.states) - set(stacks):
                del self.states[key]
            for (namespace, name), uid in list(stacks.items()):
                state = self.states.setdefault((namespace, name), _StackState())
                if now < state.due_at:
                    continue
                try:
                    interval = await self.poll(namespace, name, uid, state)
                except Exception:  # the API server unreachable, say: the next round tries again
                    log.exception("cache health of %s/%s", namespace, name)
                    interval = 30.0
                state.due_at = now + interval
            await asyncio.sleep(TICK_S)

    async def poll(self, namespace: str, name: str, uid: str, state: _StackState) -> float:
        """Read one stack's pods and write its status; returns the stack's interval."""
        parent = await asyncio.to_thread(kube.read_custom, self.api, name, namespace)
        if parent is None or parent["metadata"].get("uid") != uid:
            return 30.0
        status = parent.get("status") or {}
        try:
            spec = parse_spec(parent.get("spec"))
        except SpecError:
            return 30.0  # the reconcile handler reports an invalid spec
        settings = spec.cache_health
        if condition_status(status.get("conditions"), RECONCILED) != "True":
            return settings.interval_seconds
        owner = Owner.from_body(parent)
        pods = await asyncio.to_thread(kube.list_pods, self.api, namespace, selector_labels(owner, "engine"))
        healths = await asyncio.gather(*(self._read(pod, state, spec.tls is not None, spec.tenants is not None)
                                         for pod in pods if _ready(pod)))
        state.readings = {h.name: h.current for h in healths if h.current is not None}
        if not healths and "cache" not in status:
            # No engine pod has been ready yet: nothing to report, and no status write (each write
            # is a watch event that kopf must process before the stack's next spec change).
            return settings.interval_seconds
        cache = summary(healths, settings.interval_seconds)
        verdict = is_thrashing(cache, _thresholds(settings))
        state.streak = state.streak + 1 if verdict else 0
        condition = thrashing_condition(cache, _thresholds(settings), state.streak)
        await asyncio.to_thread(_write_status, self.api, name, namespace, uid, cache, condition)
        return settings.interval_seconds

    async def _read(self, pod: Mapping[str, Any], state: _StackState, tls: bool, tenants: bool) -> PodHealth:
        name = pod["metadata"]["name"]
        if tls:
            return PodHealth(name, error="not read: the Engine API serves TLS, and the operator holds no CA for it")
        target = f"{pod['status']['podIP']}:{_engine_port(pod)}"
        try:
            async with EngineClient(target, api_key=self.admin_key if tenants else None) as engine:
                stats = await asyncio.wait_for(engine.cache_stats(), READ_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:  # the code only: a server's message may quote a credential
            return PodHealth(name, error=f"GetCacheStats failed: {error.code().name}")
        except TimeoutError:
            return PodHealth(name, error=f"GetCacheStats took longer than {READ_TIMEOUT_S:g} s")
        return pod_health(name, Reading.from_stats(time.monotonic(), stats), state.readings.get(name))


def _write_status(api: client.ApiClient, name: str, namespace: str, uid: str, cache: dict[str, Any],
                  condition: Condition) -> None:
    """status.cache and CacheThrashing, merged into the conditions as they are now: read just before
    the write, so that a Ready the handlers wrote while the pods were being read is kept."""
    parent = kube.read_custom(api, name, namespace)
    if parent is None or parent["metadata"].get("uid") != uid:
        return
    status = parent.get("status") or {}
    conditions = status.get("conditions") or []
    if find_condition(conditions, CACHE_THRASHING) == condition:
        if status.get("cache") == cache:
            return  # unchanged (no pod to read, say): no write, no new resourceVersion, no watch event
    else:
        conditions = merge_condition(conditions, condition, parent["metadata"].get("generation"))
    # A merge patch keeps what it does not name: a figure this interval could not measure is removed.
    cleared = dict.fromkeys(status.get("cache") or {})
    kube.patch_custom_status(api, name, namespace, {"cache": {**cleared, **cache}, "conditions": conditions})


def _thresholds(settings: CacheHealthSpec) -> Thresholds:
    return Thresholds(settings.thrashing_evicted_miss_share, settings.thrashing_kv_usage,
                      settings.thrashing_intervals)


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return bool(status.get("podIP")) and not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def _engine_port(pod: Mapping[str, Any]) -> int:
    """The scheduler's Engine API port, as the pod declares it."""
    for container in pod.get("spec", {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == "grpc":
                return int(port["containerPort"])
    return ENGINE_PORT

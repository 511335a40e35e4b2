"""kopf handlers for PrefixCacheDeployment. Run with:

    kopf run --standalone -m prefixcache.operator.handlers --all-namespaces   # or --namespace NS

Handlers stay thin: validate (`spec.py`), render (`render.py`), write (`kube.py`), report conditions.
Deletion needs no handler and no finalizer: every child carries an ownerReference, so the cluster's garbage
collector removes the stack, and deleting never waits for the operator to be up.

The operator reads no Secret. The tenants file and the tenant salt key reach the scheduler as mounted
Secrets the kubelet resolves (and refreshes: the scheduler reloads both), so they cannot appear in the
operator's logs, events or the resource's status. For stacks with tenants, the operator holds its own
admin key (`admin_key.py`) to read their cache statistics (`cache_poller.py`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes import client, config

from prefixcache.operator import kube
from prefixcache.operator.admin_key import key_hash, new_admin_key
from prefixcache.operator.cache_poller import CachePoller
from prefixcache.operator.conditions import (
    READY,
    RECONCILED,
    Condition,
    condition_status,
    find_condition,
    merge_condition,
    progress_conditions,
    readiness,
)
from prefixcache.operator.owner import MANAGED_BY, Owner, selector_labels
from prefixcache.operator.render import render
from prefixcache.operator.schema import GROUP, KIND, PLURAL, VERSION, SpecError
from prefixcache.operator.spec import check_name, parse_spec

_MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
RESYNC_INTERVAL_ENV = "PREFIXCACHE_OPERATOR_RESYNC_SECONDS"

log = logging.getLogger(__name__)


@dataclass
class Stacks:
    """The PrefixCacheDeployments this operator has reconciled, and one lock each: a resync or a
    child event must not re-apply an older spec while `reconcile` applies a newer one."""

    owners: dict[tuple[str, str], str] = field(default_factory=dict)  # (namespace, name) -> uid
    _locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def forget(self, namespace: str, name: str, uid: str | None) -> None:
        """The stack is gone (or its name now belongs to a new object)."""
        with self._guard:
            if self.owners.get((namespace, name)) == uid:
                del self.owners[(namespace, name)]
                self._locks.pop((namespace, name), None)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Keep kopf's bookkeeping in our own annotations: the CRD's status schema is strict and would prune it.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    # Watch only our children: kopf's `labels=` filters on the client, after the whole cluster's
    # Services and ConfigMaps have been sent.
    managed = ",".join(f"{key}={value}" for key, value in _MANAGED.items())
    for resource in (("apps", "v1", "deployments"), ("", "v1", "services"), ("", "v1", "configmaps"),
                     ("networking.k8s.io", "v1", "networkpolicies")):
        settings.watching.label_selectors[resource] = managed
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # read now, not at import
    memo.api = client.ApiClient()
    memo.stacks = Stacks()
    memo.admin_key = new_admin_key()  # in memory only: the cluster gets its hash
    memo.poller = asyncio.create_task(CachePoller(memo.api, memo.admin_key).run(memo.stacks.owners))
    # Not kopf.timer: kopf puts a finalizer on every object a timer watches, and deleting a
    # PrefixCacheDeployment would then wait for the operator to be running.
    memo.resync = asyncio.create_task(_resync_forever(memo, float(os.environ.get(RESYNC_INTERVAL_ENV, "60"))))


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    memo.resync.cancel()
    memo.poller.cancel()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(body: kopf.Body, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, patch: kopf.Patch,
              memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Bring the children in line with the spec; a spec that can never work is a permanent error."""
    generation = meta.get("generation")
    patch.status["observedGeneration"] = generation  # observed, whether or not it can be applied
    conditions = list(status.get("conditions") or [])

    def report(condition: Condition) -> None:
        nonlocal conditions
        for each in (condition, *progress_conditions(condition)) if condition.type == READY else (condition,):
            conditions = merge_condition(conditions, each, generation)
        patch.status["conditions"] = conditions

    try:
        check_name(meta["name"])
        parsed = parse_spec(spec)
    except SpecError as error:
        report(Condition(RECONCILED, False, "InvalidSpec", str(error)))
        report(Condition(READY, False, "InvalidSpec", f"invalid spec: {error}"))
        raise kopf.PermanentError(f"invalid spec: {error}") from error

    owner = Owner.from_body(body)
    try:
        with memo.stacks.lock(owner.namespace, owner.name):
            kube.apply(memo.api, render(owner, parsed, key_hash(memo.admin_key)), owner.uid)
            memo.stacks.owners[owner.namespace, owner.name] = owner.uid
    except kube.NotOwnedError as error:
        report(Condition(RECONCILED, False, "NotOwned", str(error)))
        raise kopf.TemporaryError(str(error), delay=60) from error
    except kube.RejectedError as error:  # a spec the schema allows but the API server does not
        report(Condition(RECONCILED, False, "Rejected", str(error)))
        report(Condition(READY, False, "Rejected", f"the API server refused a child object: {error}"))
        raise kopf.PermanentError(f"rejected by the API server: {error}") from error

    report(Condition(RECONCILED, True, "Applied", f"children match generation {generation}"))
    # Ready is also written here, fresh, because this patch replaces the whole condition list.
    engine_available, ready = _readiness(memo.api, owner, parsed.replicas)
    report(ready)
    patch.status["availableReplicas"] = engine_available
    patch.status["replicas"] = parsed.replicas
    patch.status["engineEndpoint"] = owner.engine_endpoint
    patch.status["selector"] = ",".join(f"{k}={v}" for k, v in selector_labels(owner, "engine").items())
    logger.info("reconciled: %d engine replicas, block size %d, %s", parsed.replicas, parsed.block_size,
                parsed.hash_algorithm)


@kopf.on.event("apps", "v1", "deployments", labels=_MANAGED)
@kopf.on.event("", "v1", "services", labels=_MANAGED)
@kopf.on.event("", "v1", "configmaps", labels=_MANAGED)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=_MANAGED)
def child_changed(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """A child was changed, deleted or moved on: put back what drifted from the spec (a deleted
    Service, a hand-scaled Deployment), and let Ready follow the Deployments."""
    owner_ref = next((ref for ref in body.metadata.get("ownerReferences") or [] if ref.get("kind") == KIND), None)
    if owner_ref is not None:
        _restore_and_report(memo.api, memo.stacks, owner_ref["name"], body.metadata["namespace"],
                            owner_ref.get("uid"), key_hash(memo.admin_key), logger)


async def _resync_forever(memo: kopf.Memo, interval_s: float) -> None:
    """The same for every stack, now and then, for what no child event tells: a Deployment whose
    status changed while its spec was being reconciled, or an event the watch missed."""
    while True:
        await asyncio.sleep(interval_s)
        for (namespace, name), uid in list(memo.stacks.owners.items()):
            try:
                await asyncio.to_thread(_restore_and_report, memo.api, memo.stacks, name, namespace, uid,
                                        key_hash(memo.admin_key), log)
            except Exception:  # the API server unreachable, say: the next round tries again
                log.exception("resync of %s/%s failed", namespace, name)


def _restore_and_report(api: client.ApiClient, stacks: Stacks, name: str, namespace: str, uid: str | None,
                        admin_hash: str, logger: logging.Logger) -> None:
    with stacks.lock(namespace, name):
        parent = kube.read_custom(api, name, namespace)
        if parent is None or parent["metadata"].get("uid") != uid or parent["metadata"].get("deletionTimestamp"):
            stacks.forget(namespace, name, uid)
            return  # the owner is gone, going, or a new object with the same name: garbage collection follows
        status = parent.get("status") or {}
        conditions = status.get("conditions") or []
        if condition_status(conditions, RECONCILED) != "True" \
                or status.get("observedGeneration") != parent["metadata"].get("generation"):
            return  # the spec cannot be applied, or a newer one is being reconciled: that handler reports
        owner = Owner.from_body(parent)
        try:
            restored = kube.apply(api, render(owner, parse_spec(parent["spec"]), admin_hash), owner.uid)
        except (SpecError, kube.NotOwnedError, kube.RejectedError) as error:
            logger.warning("cannot restore the children of %s/%s: %s", namespace, name, error)
            return
    if restored:
        logger.info("restored what drifted from the spec: %s", ", ".join(restored))
    engine_available, condition = _readiness(api, owner, int(status.get("replicas") or 0))
    if find_condition(conditions, READY) == condition and status.get("availableReplicas") == engine_available:
        return  # unchanged: no write, no new resourceVersion
    generation = parent["metadata"].get("generation")
    for each in (condition, *progress_conditions(condition)):
        conditions = merge_condition(conditions, each, generation)
    kube.patch_custom_status(api, name, namespace, {"availableReplicas": engine_available, "conditions": conditions})


def _readiness(api: client.ApiClient, owner: Owner, desired_replicas: int) -> tuple[int, Condition]:
    engine = kube.rollout(api, owner.engine_deployment, owner.namespace)
    tokenizer = kube.rollout(api, owner.tokenizer_deployment, owner.namespace)
    return engine.available if engine else 0, readiness(desired_replicas, engine, tokenizer)

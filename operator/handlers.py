"""kopf handlers for PrefixCacheDeployment. Run with:

    kopf run --standalone -m prefixcache.operator.handlers --all-namespaces   # or --namespace NS

Handlers stay thin: validate (`spec.py`), render (`render.py`), write (`kube.py`), report conditions.
Deletion needs no handler and no finalizer: every child carries an ownerReference, so the cluster's garbage
collector removes the stack, and deleting never waits for the operator to be up.

The operator reads no Secret. The tenant salt key reaches the scheduler through a secretKeyRef the kubelet
resolves, so it cannot appear in the operator's logs, events or the resource's status.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import kopf
from kubernetes import client, config

from prefixcache.operator import kube
from prefixcache.operator.conditions import (RECONCILED, READY, Condition, condition_status, find_condition,
                                             merge_condition, readiness)
from prefixcache.operator.render import MANAGED_BY, Owner, render
from prefixcache.operator.schema import GROUP, KIND, PLURAL, VERSION, SpecError
from prefixcache.operator.spec import check_name, parse_spec


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Keep kopf's bookkeeping in our own annotations: the CRD's status schema is strict and would prune it.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # read now, not at import
    memo.api = client.ApiClient()


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
        conditions = merge_condition(conditions, condition, generation)
        patch.status["conditions"] = conditions

    try:
        check_name(meta["name"])
        parsed = parse_spec(spec)
    except SpecError as error:
        report(Condition(RECONCILED, False, "InvalidSpec", str(error)))
        report(Condition(READY, False, "InvalidSpec", "the spec is invalid; see the Reconciled condition"))
        raise kopf.PermanentError(f"invalid spec: {error}") from error

    owner = Owner.from_body(body)
    try:
        kube.apply(memo.api, render(owner, parsed), owner.uid)
    except kube.NotOwnedError as error:
        report(Condition(RECONCILED, False, "NotOwned", str(error)))
        raise kopf.TemporaryError(str(error), delay=60) from error
    except kube.RejectedError as error:  # a spec the schema allows but the API server does not
        report(Condition(RECONCILED, False, "Rejected", str(error)))
        report(Condition(READY, False, "Rejected", "the API server refused a child object; see the Reconciled condition"))
        raise kopf.PermanentError(f"rejected by the API server: {error}") from error

    report(Condition(RECONCILED, True, "Applied", f"children match generation {generation}"))
    # Ready is also written here, fresh, because this patch replaces the whole condition list.
    engine_available, ready = _readiness(memo.api, owner, parsed.replicas)
    report(ready)
    patch.status["availableReplicas"] = engine_available
    patch.status["replicas"] = parsed.replicas
    patch.status["engineEndpoint"] = owner.engine_endpoint
    logger.info("reconciled: %d engine replicas, block size %d, %s", parsed.replicas, parsed.block_size,
                parsed.hash_algorithm)


_MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
RESYNC_INTERVAL_S = 60.0


@kopf.on.event("apps", "v1", "deployments", labels=_MANAGED)
@kopf.on.event("", "v1", "services", labels=_MANAGED)
@kopf.on.event("", "v1", "configmaps", labels=_MANAGED)
def child_changed(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """A child was changed, deleted or moved on: put back what drifted from the spec (a deleted
    Service, a hand-scaled Deployment), and let Ready follow the Deployments."""
    owner_ref = next((ref for ref in body.metadata.get("ownerReferences") or [] if ref.get("kind") == KIND), None)
    if owner_ref is not None:
        _restore_and_report(memo.api, owner_ref["name"], body.metadata["namespace"], owner_ref.get("uid"), logger)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_INTERVAL_S, initial_delay=RESYNC_INTERVAL_S)
def resync(meta: kopf.Meta, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """The same, now and then, for what no child event tells: a Deployment whose status changed
    while the spec was being reconciled, or an event the watch missed."""
    _restore_and_report(memo.api, meta["name"], meta["namespace"], meta.get("uid"), logger)


def _restore_and_report(api: client.ApiClient, name: str, namespace: str, uid: str | None,
                        logger: logging.Logger) -> None:
    parent = kube.read_custom(api, name, namespace)
    if parent is None or parent["metadata"].get("uid") != uid or parent["metadata"].get("deletionTimestamp"):
        return  # the owner is gone, going, or a new object with the same name: garbage collection follows
    status = parent.get("status") or {}
    conditions = status.get("conditions") or []
    if condition_status(conditions, RECONCILED) != "True" \
            or status.get("observedGeneration") != parent["metadata"].get("generation"):
        return  # the spec cannot be applied, or a newer one is being reconciled: that handler reports
    owner = Owner.from_body(parent)
    try:
        restored = kube.apply(api, render(owner, parse_spec(parent["spec"])), owner.uid)
    except (SpecError, kube.NotOwnedError, kube.RejectedError) as error:
        logger.warning("cannot restore the children of %s/%s: %s", namespace, name, error)
        return
    if restored:
        logger.info("restored what drifted from the spec: %s", ", ".join(restored))
    engine_available, condition = _readiness(api, owner, int(status.get("replicas") or 0))
    if find_condition(conditions, READY) == condition and status.get("availableReplicas") == engine_available:
        return  # unchanged: no write, no new resourceVersion
    kube.patch_custom_status(api, name, namespace, {
        "availableReplicas": engine_available,
        "conditions": merge_condition(conditions, condition, parent["metadata"].get("generation")),
    })


def _readiness(api: client.ApiClient, owner: Owner, desired_replicas: int) -> tuple[int, Condition]:
    engine = kube.rollout(api, owner.engine_deployment, owner.namespace)
    tokenizer = kube.rollout(api, owner.tokenizer_deployment, owner.namespace)
    return engine.available if engine else 0, readiness(desired_replicas, engine, tokenizer)

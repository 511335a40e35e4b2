"""kopf handlers for PrefixCacheDeployment. Run with:

    kopf run -m prefixcache.operator.handlers --all-namespaces   # or --namespace NS

Handlers stay thin: validate (`spec.py`), render (`render.py`), write (`kube.py`), report conditions.
Deletion needs no handler and no finalizer: every child carries an ownerReference, so the cluster's garbage
collector removes the stack, and deleting never waits for the operator to be up.

The operator reads no Secret. Tenant salts reach the scheduler as a Secret volume the kubelet mounts, so
they cannot appear in the operator's logs, events or the resource's status.
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
from prefixcache.operator.render import Owner, render
from prefixcache.operator.schema import GROUP, PLURAL, VERSION, SpecError
from prefixcache.operator.spec import parse_spec

# How often Ready is recomputed from the child Deployments.
STATUS_INTERVAL_SECONDS = float(os.environ.get("PREFIXCACHE_OPERATOR_STATUS_INTERVAL", "10"))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Keep kopf's bookkeeping in our own annotations: the CRD's status schema is strict and would prune it.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    memo.api = client.ApiClient()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(body: kopf.Body, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, patch: kopf.Patch,
              memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Bring the children in line with the spec; a spec that can never work is a permanent error."""
    generation = meta.get("generation")
    conditions = list(status.get("conditions") or [])

    def report(condition: Condition) -> None:
        nonlocal conditions
        conditions = merge_condition(conditions, condition, generation)
        patch.status["conditions"] = conditions

    try:
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

    report(Condition(RECONCILED, True, "Applied", f"children match generation {generation}"))
    patch.status["observedGeneration"] = generation
    patch.status["replicas"] = parsed.replicas
    patch.status["engineEndpoint"] = owner.engine_endpoint
    logger.info("reconciled: %d engine replicas, block size %d, %s", parsed.replicas, parsed.block_size,
                parsed.hash_algorithm)


@kopf.timer(GROUP, VERSION, PLURAL, interval=STATUS_INTERVAL_SECONDS)
def refresh_readiness(body: kopf.Body, status: kopf.Status, meta: kopf.Meta, patch: kopf.Patch,
                      memo: kopf.Memo, **_: Any) -> None:
    """Ready follows the child Deployments; nothing to report while the spec itself is invalid."""
    conditions = status.get("conditions") or []
    if condition_status(conditions, RECONCILED) != "True":
        return
    owner = Owner.from_body(body)
    engine = kube.available_replicas(memo.api, owner.engine_deployment, owner.namespace)
    tokenizer = kube.available_replicas(memo.api, owner.tokenizer_deployment, owner.namespace)
    desired = int(status.get("replicas") or 0)
    condition = readiness(desired, engine, tokenizer)
    if find_condition(conditions, READY) == condition and status.get("availableReplicas") == (engine or 0):
        return  # unchanged: no write, no new resourceVersion
    patch.status["availableReplicas"] = engine or 0
    patch.status["conditions"] = merge_condition(conditions, condition, meta.get("generation"))

"""Writing rendered objects to the cluster with the official client (kopf itself is not a Kubernetes client).

Each object is created, or JSON-merge-patched when it exists: lists (containers, env, ports) are replaced
whole, so what the renderer dropped disappears. An existing object this PrefixCacheDeployment does not own
is never touched.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.utils.quantity import parse_quantity

from prefixcache.operator.conditions import Rollout
from prefixcache.operator.schema import GROUP, PLURAL, VERSION

MERGE_PATCH = "application/merge-patch+json"


class NotOwnedError(RuntimeError):
    """An object with a rendered object's name exists but belongs to someone else."""


class RejectedError(RuntimeError):
    """The API server refused a rendered object as invalid (422): retrying the same spec cannot help."""


@dataclass(frozen=True, slots=True)
class _KindApi:
    api: type
    suffix: str  # as in create_namespaced_<suffix>


_KINDS = {
    "ConfigMap": _KindApi(client.CoreV1Api, "config_map"),
    "Service": _KindApi(client.CoreV1Api, "service"),
    "Deployment": _KindApi(client.AppsV1Api, "deployment"),
    "NetworkPolicy": _KindApi(client.NetworkingV1Api, "network_policy"),
    "PodDisruptionBudget": _KindApi(client.PolicyV1Api, "pod_disruption_budget"),
}


def _call(api_client: client.ApiClient, kind: str, verb: str, *args: Any, **kwargs: Any) -> Any:
    entry = _KINDS[kind]
    return getattr(entry.api(api_client), f"{verb}_namespaced_{entry.suffix}")(*args, **kwargs)


def _read(api_client: client.ApiClient, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    try:
        found = _call(api_client, kind, "read", name, namespace, _preload_content=False)
    except ApiException as error:
        if error.status == 404:
            return None
        raise
    return json.loads(found.data)  # a plain dict, as the server sent it


def apply(api_client: client.ApiClient, objects: Iterable[Mapping[str, Any]], owner_uid: str) -> list[str]:
    """Create every object that is missing and patch every one that drifted from its rendering, in
    order; return them as "Kind name". Raises NotOwnedError, or RejectedError with the API server's
    message (the objects before the refused one stay applied)."""
    changed = []
    for obj in objects:
        kind, metadata = obj["kind"], obj["metadata"]
        name, namespace = metadata["name"], metadata["namespace"]
        current = _read(api_client, kind, name, namespace)
        if current is not None:
            owners = current.get("metadata", {}).get("ownerReferences") or []
            if not any(ref.get("uid") == owner_uid for ref in owners):
                raise NotOwnedError(f"{kind} {namespace}/{name} already exists and is not managed by this "
                                    f"PrefixCacheDeployment; rename one of them")
        cleared = _cleared_fields(current, obj) if current is not None else []
        stale = _stale_keys(current, obj) if current is not None else {}
        if current is not None and not cleared and not stale and not _drifted(current, obj):
            continue
        try:
            if current is None:
                _call(api_client, kind, "create", namespace, dict(obj))
            else:
                _call(api_client, kind, "patch", name, namespace, _merge_patch(obj, cleared, stale),
                      _content_type=MERGE_PATCH)
        except ApiException as error:
            if error.status == 422:
                raise RejectedError(_status_message(error)) from error
            raise
        changed.append(f"{kind} {name}")
    return changed


def _drifted(current: Any, desired: Any, path: tuple[str, ...] = ()) -> bool:
    """Whether a merge patch of `desired` would change `current`: fields the API server added
    (defaults, status, bookkeeping) do not count, nor a quantity it wrote in canonical form ("0.5"
    CPU stored as "500m"); a rendered field that differs, or a list whose length or any element
    differs, does."""
    if isinstance(desired, Mapping):
        if not isinstance(current, Mapping):
            return True
        return any(_drifted(current.get(key), value, (*path, key)) for key, value in desired.items())
    if isinstance(desired, list):
        if not isinstance(current, list) or len(current) != len(desired):
            return True
        return any(_drifted(have, want, path) for have, want in zip(current, desired))
    if current != desired and len(path) >= 2 and path[-2] in ("requests", "limits"):
        return not _same_quantity(current, desired)
    return current != desired


def _same_quantity(a: Any, b: Any) -> bool:
    try:
        return parse_quantity(a) == parse_quantity(b)
    except (ValueError, TypeError):
        return False


# Pod-spec fields the renderer leaves out when the spec has nothing for them. A merge patch keeps
# what it does not mention, so once rendered they must be removed explicitly (null) when dropped.
_OPTIONAL_POD_FIELDS = ("nodeSelector", "tolerations", "imagePullSecrets", "runtimeClassName", "priorityClassName",
                        "affinity")


# Maps that must hold exactly the rendered keys: a merge patch merges maps, so a key that is no
# longer rendered (or was added by hand) stays unless the patch removes it (null). A key left in a
# node selector pins pods to nodes the spec no longer asks for; one added to a Service's selector
# selects no pods at all.
_EXACT_MAPS = {
    "ConfigMap": ("data",),
    "Service": ("spec", "selector"),
    "Deployment": ("spec", "template", "spec", "nodeSelector"),
}


def _stale_keys(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[tuple[str, ...], list[str]]:
    """The keys of `current`'s exact map (`_EXACT_MAPS`) that `desired` does not render, by the
    map's path; nothing when `desired` renders no such map (see `_cleared_fields`)."""
    path = _EXACT_MAPS.get(desired["kind"])
    if path is None:
        return {}
    want, have = _at(desired, path), _at(current, path)
    if not isinstance(want, Mapping) or not isinstance(have, Mapping):
        return {}
    stale = sorted(set(have) - set(want))
    return {path: stale} if stale else {}


def _at(obj: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _cleared_fields(current: Mapping[str, Any], desired: Mapping[str, Any]) -> list[str]:
    """The optional pod-spec fields `current` has and `desired` no longer renders."""
    if desired["kind"] != "Deployment":
        return []
    have = ((current.get("spec") or {}).get("template") or {}).get("spec") or {}
    want = desired["spec"]["template"]["spec"]
    return [key for key in _OPTIONAL_POD_FIELDS if key in have and key not in want]


def _status_message(error: ApiException) -> str:
    """The message of the Status object an API error carries (its raw body if there is none)."""
    try:
        return str(json.loads(error.body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(error.body or error.reason)


def _merge_patch(desired: Mapping[str, Any], cleared: list[str],
                 stale: Mapping[tuple[str, ...], list[str]]) -> dict[str, Any]:
    """`desired` as a merge patch, with explicit nulls for the `stale` keys of its exact maps and
    for the `cleared` pod-spec fields."""
    patch = copy.deepcopy(dict(desired))
    for path, keys in stale.items():
        _at(patch, path).update(dict.fromkeys(keys))
    if cleared:
        patch["spec"]["template"]["spec"].update(dict.fromkeys(cleared))
    return patch


def rollout(api_client: client.ApiClient, name: str, namespace: str) -> Rollout | None:
    """A Deployment's rollout; None when it does not exist."""
    deployment = _read(api_client, "Deployment", name, namespace)
    return None if deployment is None else Rollout.from_deployment(deployment)


def read_custom(api_client: client.ApiClient, name: str, namespace: str) -> dict[str, Any] | None:
    """A PrefixCacheDeployment as a dict; None when it does not exist."""
    try:
        return client.CustomObjectsApi(api_client).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def patch_custom_status(api_client: client.ApiClient, name: str, namespace: str,
                        status: Mapping[str, Any]) -> None:
    client.CustomObjectsApi(api_client).patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, {"status": dict(status)}, _content_type=MERGE_PATCH)


def list_pods(api_client: client.ApiClient, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
    """The pods that carry every one of `labels` (filtered here too: a selector is only a request)."""
    selector = ",".join(f"{key}={value}" for key, value in labels.items())
    found = client.CoreV1Api(api_client).list_namespaced_pod(namespace, label_selector=selector,
                                                             _preload_content=False)
    pods = json.loads(found.data).get("items") or []
    return [pod for pod in pods
            if all((pod.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in labels.items())]

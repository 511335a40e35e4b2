"""The PrefixCacheDeployment that owns a stack: the names of its objects, and the labels and metadata
every object carries. Each object's ownerReference names the PrefixCacheDeployment, so deleting it
garbage-collects the stack."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefixcache.operator.ports import ENGINE_PORT
from prefixcache.operator.schema import GROUP, KIND, VERSION

MANAGED_BY = "prefixcache-operator"


@dataclass(frozen=True, slots=True)
class Owner:
    """The PrefixCacheDeployment the objects belong to."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Owner:
        metadata = body["metadata"]
        return cls(name=metadata["name"], namespace=metadata["namespace"], uid=metadata["uid"])

    @property
    def reference(self) -> dict[str, Any]:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}

    @property
    def engine_service(self) -> str:
        return self.name

    @property
    def tokenizer_service(self) -> str:
        return f"{self.name}-tokenizer"

    @property
    def engine_deployment(self) -> str:
        return f"{self.name}-engine"

    @property
    def tokenizer_deployment(self) -> str:
        return f"{self.name}-tokenizer"

    @property
    def config_map(self) -> str:
        return f"{self.name}-env"

    @property
    def operator_admin(self) -> str:
        return f"{self.name}-operator-admin"

    @property
    def dashboard(self) -> str:
        return f"{self.name}-dashboard"

    @property
    def engine_endpoint(self) -> str:
        return f"{self.engine_service}.{self.namespace}.svc:{ENGINE_PORT}"


def selector_labels(owner: Owner, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "prefixcache", "app.kubernetes.io/instance": owner.name,
            "app.kubernetes.io/component": component}


def object_labels(owner: Owner, component: str) -> dict[str, str]:
    return {**selector_labels(owner, component), "app.kubernetes.io/part-of": "prefixcache",
            "app.kubernetes.io/managed-by": MANAGED_BY}


def object_metadata(owner: Owner, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": object_labels(owner, component),
            "ownerReferences": [owner.reference]}

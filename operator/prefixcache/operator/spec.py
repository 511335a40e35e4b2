"""A typed, fully validated view of a PrefixCacheDeployment `.spec`.

`parse_spec` is the only way in: it applies the CRD's defaults and schema (`schema.py`), then the rules the
CRD states as CEL (`x-kubernetes-validations`, with the same messages) and those no schema can state
(a quantity that is a whole number of bytes). Everything downstream trusts a `PrefixCacheSpec`.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import InvalidOperation
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from prefixcache.operator.schema import SpecError, defaulted_spec

EMBEDDED = "Embedded"
PERSISTENT_VOLUME_CLAIM = "PersistentVolumeClaim"
_PARENT_SEGMENT = re.compile(r"(^|/)[.][.](/|$)")
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# A qualified name, as resource names are: an optional DNS-subdomain prefix and "/", then up to 63
# alphanumerics with inner "-", "_" or ".".
_RESOURCE_NAME = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                            r"(?=.{1,63}$)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_CONTAINER_RESOURCES = frozenset({"cpu", "memory", "ephemeral-storage"})
MAX_NAME_LENGTH = 53  # a Service name is at most 63 characters, and "-tokenizer" takes 10


@dataclass(frozen=True, slots=True)
class ModelSpec:
    source: str  # Embedded | PersistentVolumeClaim
    id: str
    claim_name: str | None = None
    path: str = ""  # model directory inside the claim, relative


@dataclass(frozen=True, slots=True)
class Resources:
    requests: dict[str, str] = field(default_factory=dict)  # resource name -> quantity
    limits: dict[str, str] = field(default_factory=dict)  # resource name -> quantity


@dataclass(frozen=True, slots=True)
class TenantSaltsRef:
    """Where the key for tenant salts lives; the operator never reads the Secret's data."""

    secret_name: str
    key: str


@dataclass(frozen=True, slots=True)
class SecretRef:
    """A Secret (and the entry in it) mounted into the scheduler; the operator never reads its data."""

    secret_name: str
    key: str = ""


@dataclass(frozen=True, slots=True)
class Placement:
    """Which nodes a component's pods may run on."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()  # core/v1 Toleration objects, as given


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    image: str  # the worker image; the other containers run the control-plane image (`PrefixCacheSpec.image`)
    gpus: int
    gpu_resource: str
    dtype: str  # "auto" leaves the choice to the worker
    attention_backend: str  # "auto" leaves the choice to the worker
    resources: Resources
    placement: Placement = field(default_factory=Placement)  # of the engine pods: scheduler and worker
    startup_probe_seconds: int = 600
    runtime_class_name: str | None = None
    priority_class_name: str | None = None
    affinity: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    replicas: int
    resources: Resources
    placement: Placement = field(default_factory=Placement)


@dataclass(frozen=True, slots=True)
class CacheHealthSpec:
    """How the operator watches the cache (`cache_poller.py`) and when it calls it thrashing."""

    interval_seconds: int = 30
    thrashing_evicted_miss_share: float = 0.5
    thrashing_kv_usage: float = 0.8
    thrashing_intervals: int = 2


@dataclass(frozen=True, slots=True)
class PrefixCacheSpec:
    image: str  # the control-plane image: tokenizer and scheduler
    image_pull_policy: str
    replicas: int
    model: ModelSpec
    block_size: int
    hash_algorithm: str
    enable_prefix_caching: bool
    max_num_seqs: int
    kv_cache_memory_bytes: int
    worker: WorkerSpec
    scheduler_resources: Resources
    tokenizer: TokenizerSpec
    termination_grace_period_seconds: int
    tenant_salts: TenantSaltsRef | None = None
    tenants: SecretRef | None = None  # the tenants file
    tls: SecretRef | None = None  # the Engine API's kubernetes.io/tls certificate
    otel_endpoint: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    cache_health: CacheHealthSpec = field(default_factory=CacheHealthSpec)
    max_surge: int = 0


def parse_spec(raw_spec: Mapping[str, Any] | None) -> PrefixCacheSpec:
    """Default and validate a raw `.spec` (as stored in the cluster); raises SpecError naming each field."""
    spec, problems = defaulted_spec(raw_spec)
    if not spec:
        raise SpecError(problems)

    def well_formed(field: str) -> bool:  # the finer rules below need their field to be structurally sound
        return not any(p.startswith((f"{field}:", f"{field}.")) for p in problems)

    rules = []
    if well_formed("spec.model"):
        rules += _model_problems(spec["model"])
    kv_bytes = 0
    if well_formed("spec.kvCacheMemory"):
        kv_bytes, kv_problem = _whole_bytes(spec["kvCacheMemory"])
        rules += [f"spec.kvCacheMemory: {kv_problem}"] if kv_problem else []
    for section in ("worker", "scheduler", "tokenizer"):
        if well_formed(f"spec.{section}"):
            rules += _resource_problems(spec[section]["resources"], f"spec.{section}.resources")
    for section in ("worker", "tokenizer"):
        if well_formed(f"spec.{section}"):
            rules += _placement_problems(spec[section], f"spec.{section}")
    if well_formed("spec.worker"):
        worker = spec["worker"]
        rules += [f"spec.worker.resources.{kind}.{worker['gpuResource']}: set GPUs with spec.worker.gpus, "
                  "which also tells the worker to use them" for kind in ("requests", "limits")
                  if worker["gpuResource"] in worker["resources"].get(kind, {})]
        if not _is_extended_resource(worker["gpuResource"]):
            rules.append(f"spec.worker.gpuResource: {worker['gpuResource']!r} is not a device resource name "
                         "(a domain and a name, e.g. nvidia.com/gpu)")
        if worker["attentionBackend"] == "triton" and worker["gpus"] == 0:
            rules.append("spec.worker: worker.attentionBackend triton needs GPUs (worker.gpus > 0); "
                         "the CPU runs the torch backend")
    if problems or rules:
        raise SpecError(sorted(problems + rules))

    model = spec["model"]
    worker = spec["worker"]
    return PrefixCacheSpec(
        image=spec["image"],
        image_pull_policy=spec["imagePullPolicy"],
        replicas=spec["replicas"],
        model=ModelSpec(source=model["source"], id=model["id"], claim_name=model.get("claimName"),
                        path=model["path"].rstrip("/")),
        block_size=spec["blockSize"],
        hash_algorithm=spec["hashAlgorithm"],
        enable_prefix_caching=spec["enablePrefixCaching"],
        max_num_seqs=spec["maxNumSeqs"],
        kv_cache_memory_bytes=kv_bytes,
        worker=WorkerSpec(image=worker["image"], gpus=worker["gpus"], gpu_resource=worker["gpuResource"], dtype=worker["dtype"],
                          attention_backend=worker["attentionBackend"],
                          resources=_resources(worker["resources"]), placement=_placement(worker),
                          startup_probe_seconds=worker["startupProbeSeconds"],
                          runtime_class_name=worker.get("runtimeClassName"),
                          priority_class_name=worker.get("priorityClassName"), affinity=worker.get("affinity")),
        scheduler_resources=_resources(spec["scheduler"]["resources"]),
        tokenizer=TokenizerSpec(replicas=spec["tokenizer"]["replicas"],
                                resources=_resources(spec["tokenizer"]["resources"]),
                                placement=_placement(spec["tokenizer"])),
        termination_grace_period_seconds=spec["terminationGracePeriodSeconds"],
        tenant_salts=TenantSaltsRef(spec["tenantSalts"]["secretName"], spec["tenantSalts"]["key"])
        if "tenantSalts" in spec else None,
        tenants=SecretRef(spec["tenants"]["secretName"], spec["tenants"]["key"]) if "tenants" in spec else None,
        tls=SecretRef(spec["tls"]["secretName"]) if "tls" in spec else None,
        otel_endpoint=(spec.get("otel") or {}).get("endpoint"),
        image_pull_secrets=tuple(spec.get("imagePullSecrets") or ()),
        cache_health=CacheHealthSpec(
            interval_seconds=spec["cacheHealth"]["intervalSeconds"],
            thrashing_evicted_miss_share=float(spec["cacheHealth"]["thrashing"]["evictedMissShare"]),
            thrashing_kv_usage=float(spec["cacheHealth"]["thrashing"]["kvUsage"]),
            thrashing_intervals=spec["cacheHealth"]["thrashing"]["intervals"]),
        max_surge=spec["rollout"]["maxSurge"],
    )


def _placement(section: Mapping[str, Any]) -> Placement:
    # Empty strings are left out, as the API server stores them: a rendering it never echoes back
    # would look like drift forever.
    return Placement(node_selector=dict(section.get("nodeSelector") or {}),
                     tolerations=tuple({key: value for key, value in t.items() if value != ""}
                                       for t in section.get("tolerations") or ()))


def _placement_problems(section: Mapping[str, Any], prefix: str) -> list[str]:
    """The CRD's CEL rules on tolerations, word for word, and the label-key rule on nodeSelector the
    CRD cannot state (a CEL regex over map keys of unbounded length exceeds the API server's cost
    budget): the API server would refuse the pods."""
    problems = []
    if not all(map(_RESOURCE_NAME.fullmatch, section.get("nodeSelector") or {})):
        problems.append(f"{prefix}.nodeSelector: nodeSelector keys must be label keys (an optional DNS prefix "
                        "and '/', then a name)")
    for index, toleration in enumerate(section.get("tolerations") or ()):
        where = f"{prefix}.tolerations.{index}"
        if toleration.get("operator") == "Exists" and toleration.get("value"):
            problems.append(f"{where}: a toleration with operator Exists has no value")
        if not toleration.get("key") and toleration.get("operator") != "Exists":
            problems.append(f"{where}: a toleration without a key needs operator Exists")
        if "tolerationSeconds" in toleration and toleration.get("effect") != "NoExecute":
            problems.append(f"{where}: tolerationSeconds applies to effect NoExecute only")
    return problems


def check_name(name: str) -> None:
    """The CRD's schema for metadata.name: every child's name and label value must stay valid."""
    if len(name) > MAX_NAME_LENGTH or not _DNS_1035_LABEL.fullmatch(name):
        raise SpecError([f"metadata.name: metadata.name must be a DNS-1035 label of at most {MAX_NAME_LENGTH} "
                         "characters (it names Services such as <name>-tokenizer)"])


def _model_problems(model: Mapping[str, Any]) -> list[str]:
    """The CRD's CEL rules on `spec.model`, word for word."""
    problems = []
    from_claim = model["source"] == PERSISTENT_VOLUME_CLAIM
    if from_claim and "claimName" not in model:
        problems.append("spec.model: model.claimName is required when model.source is PersistentVolumeClaim")
    if not from_claim and "claimName" in model:
        problems.append(
            "spec.model: model.claimName is only allowed when model.source is PersistentVolumeClaim")
    path = model["path"]
    if path.startswith("/") or _PARENT_SEGMENT.search(path):
        problems.append("spec.model.path: model.path must be relative to the claim and must not contain '..'")
    return problems


def _whole_bytes(quantity: int | str) -> tuple[int, str | None]:
    try:
        value = parse_quantity(quantity)
    except (ValueError, InvalidOperation):
        return 0, f"{quantity!r} is not a quantity"
    if value <= 0 or value != value.to_integral_value():
        return 0, f"{quantity!r} must be a positive whole number of bytes"
    return int(value), None


def _is_extended_resource(name: str) -> bool:
    """A device or other extended resource (`example.com/gpu`): a domain, and not kubernetes.io's."""
    return "/" in name and "kubernetes.io/" not in name and not name.startswith("requests.")


def _resource_problems(resources: Mapping[str, Any], prefix: str) -> list[str]:
    """The API server's rules for a container's resources (ValidateResourceRequirements), so that a
    Deployment it would refuse is never rendered."""
    problems = []
    for kind in ("requests", "limits"):
        for name, quantity in resources.get(kind, {}).items():
            if not _RESOURCE_NAME.fullmatch(name) or not (
                    name in _CONTAINER_RESOURCES or name.startswith("hugepages-") or _is_extended_resource(name)):
                problems.append(f"{prefix}.{kind}.{name}: not a container resource "
                                "(cpu, memory, ephemeral-storage, hugepages-<size>, or a device such as example.com/device)")
                continue
            try:
                value = parse_quantity(quantity)
            except (ValueError, InvalidOperation):
                problems.append(f"{prefix}.{kind}.{name}: {quantity!r} is not a quantity")
                continue
            if value < 0:
                problems.append(f"{prefix}.{kind}.{name}: must not be negative")
            elif _is_extended_resource(name) and value != int(value):
                problems.append(f"{prefix}.{kind}.{name}: a device count must be a whole number, got {quantity}")
    if problems:
        return problems
    requests, limits = resources.get("requests", {}), resources.get("limits", {})
    for name, request in requests.items():
        if _is_extended_resource(name):  # devices cannot be overcommitted
            if name not in limits:
                problems.append(f"{prefix}.requests.{name}: a device request needs a limit, equal to it")
            elif parse_quantity(request) != parse_quantity(limits[name]):
                problems.append(f"{prefix}.requests.{name}: {request} must equal its limit {limits[name]}")
        elif name in limits and parse_quantity(request) > parse_quantity(limits[name]):
            problems.append(f"{prefix}.requests.{name}: {request} is more than its limit {limits[name]}")
    return problems


def _resources(raw: Mapping[str, Any]) -> Resources:
    return Resources(requests={k: str(v) for k, v in raw.get("requests", {}).items()},
                     limits={k: str(v) for k, v in raw.get("limits", {}).items()})

"""The operator against a real cluster: CRD admission (defaults, enums, CEL rules) by a real API server,
children with ownerReferences, garbage collection on delete, and with an image, pods that become Ready.

Runs only where KUBECONFIG points at a cluster the test may change (it installs the CRD and uses a fresh
namespace). Set PREFIXCACHE_E2E_IMAGE and PREFIXCACHE_E2E_WORKER_IMAGE to builds of
Dockerfile.control-plane and Dockerfile the cluster can pull to also wait for Ready pods (CPU is enough:
the spec asks for no GPU, and the worker image runs on CPU); on kind, `kind load docker-image <tag>` first.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

KUBECONFIG = os.environ.get("KUBECONFIG", "")
pytestmark = pytest.mark.skipif(not KUBECONFIG or not all(Path(p).is_file() for p in KUBECONFIG.split(os.pathsep)),
                                reason="needs a Kubernetes cluster: set KUBECONFIG to its kubeconfig file")

import kubernetes  # noqa: F401  (the operator extra: fail, not skip, where it is missing)
from kubernetes import client, config  # noqa: E402

from prefixcache.operator.schema import GROUP, KIND, PLURAL, VERSION, load_crd  # noqa: E402

IMAGE = os.environ.get("PREFIXCACHE_E2E_IMAGE")
WORKER_IMAGE = os.environ.get("PREFIXCACHE_E2E_WORKER_IMAGE")


def wait_for(predicate: Callable[[], Any], what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def api() -> client.ApiClient:
    return config.new_client_from_config(config_file=KUBECONFIG)


@pytest.fixture(scope="module")
def crd_installed(api: client.ApiClient) -> None:
    extensions = client.ApiextensionsV1Api(api)
    crd = load_crd()
    try:
        extensions.create_custom_resource_definition(crd)
    except client.ApiException as error:
        if error.status != 409:
            raise
        extensions.patch_custom_resource_definition(crd["metadata"]["name"], crd)
    wait_for(lambda: any(c["type"] == "Established" and c["status"] == "True" for c in
                         (extensions.read_custom_resource_definition(crd["metadata"]["name"]).to_dict()["status"]
                          .get("conditions") or [])), "the CRD to be established", 60)


@pytest.fixture(scope="module")
def namespace(api: client.ApiClient, crd_installed: None) -> Iterator[str]:
    name = f"prefixcache-e2e-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    yield name
    client.CoreV1Api(api).delete_namespace(name)


@pytest.fixture(scope="module")
def operator(namespace: str) -> Iterator[Any]:
    import kopf
    from kopf.testing import KopfRunner

    with KopfRunner(["run", "--standalone", f"--namespace={namespace}", "-m", "prefixcache.operator.handlers"],
                    settings=kopf.OperatorSettings(), timeout=120) as runner:
        yield runner
    assert runner.exception is None, runner.output[-4000:]


def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def create(api: client.ApiClient, namespace: str, name: str, spec: dict[str, Any], **options: Any) -> dict[str, Any]:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": name}, "spec": spec}
    return custom(api).create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body, **options)


# Admission only: the server defaults and validates a dry run as it would the real thing, and stores
# nothing for the operator started later to reconcile.
DRY_RUN = {"dry_run": "All"}


@pytest.mark.parametrize(("spec", "status", "message"), [
    ({"blockSize": 24}, 422, "spec.blockSize"),
    ({"model": {"source": "PersistentVolumeClaim"}}, 422, "model.claimName is required"),
    ({"model": {"source": "PersistentVolumeClaim", "claimName": "m", "path": "../x"}}, 422, "model.path must be relative"),
    ({"worker": {"gpus": 0, "attentionBackend": "triton"}}, 422, "attentionBackend triton needs GPUs"),
    # Unknown fields: refused under strict field validation (kubectl's default), a 400.
    ({"tenantSalts": {"secretName": "s", "salts": {"acme": "x"}}}, 400, "spec.tenantSalts.salts"),
])
def test_api_server_refuses_invalid_specs(api: client.ApiClient, namespace: str, spec: dict[str, Any],
                                          status: int, message: str) -> None:
    with pytest.raises(client.ApiException) as error:
        create(api, namespace, f"bad-{uuid.uuid4().hex[:6]}", spec, field_validation="Strict", **DRY_RUN)
    assert error.value.status == status and message in error.value.body


def test_api_server_applies_the_defaults_and_prunes_unknown_fields(api: client.ApiClient, namespace: str) -> None:
    created = create(api, namespace, "defaults", {"replicas": 0, "blocksize": 32}, **DRY_RUN)
    assert created["spec"]["blockSize"] == 16 and created["spec"]["model"]["source"] == "Embedded"
    assert created["spec"]["worker"]["gpus"] == 1
    assert "blocksize" not in created["spec"]  # pruned (the default field validation only warns)


def test_operator_creates_the_stack_and_deletion_collects_it(api: client.ApiClient, namespace: str,
                                                             operator: Any) -> None:
    create(api, namespace, "stack", {"replicas": 0, "worker": {"gpus": 0}})
    apps = client.AppsV1Api(api)
    engine = wait_for(lambda: next((d for d in apps.list_namespaced_deployment(namespace).items
                                    if d.metadata.name == "stack-engine"), None), "the engine Deployment", 60)
    assert engine.metadata.owner_references[0].kind == KIND
    status = wait_for(lambda: custom(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "stack")
                      .get("status", {}).get("conditions"), "status conditions", 60)
    assert {c["type"]: c["status"] for c in status}["Reconciled"] == "True"
    custom(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "stack")
    wait_for(lambda: not [d for d in apps.list_namespaced_deployment(namespace).items
                          if d.metadata.name.startswith("stack-")], "garbage collection of the children", 120)


@pytest.mark.skipif(not (IMAGE and WORKER_IMAGE), reason="set PREFIXCACHE_E2E_IMAGE and "
                    "PREFIXCACHE_E2E_WORKER_IMAGE to images the cluster can pull")
@pytest.mark.timeout(1500)  # an image pull, then the worker's 600 s startup and the scheduler's 300 s
def test_pods_become_ready_on_grpc_health(api: client.ApiClient, namespace: str, operator: Any) -> None:
    create(api, namespace, "serving", {"image": IMAGE, "worker": {"image": WORKER_IMAGE, "gpus": 0},
                                       "kvCacheMemory": "256Mi"})

    def ready() -> bool:
        status = custom(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "serving").get("status")
        return any(c["type"] == "Ready" and c["status"] == "True" for c in (status or {}).get("conditions", []))

    wait_for(ready, "Ready=True (all probes pass over gRPC health)", 1200)


# The chart's operator, in the cluster (it reads each engine pod's cache statistics at the pod's IP,
# which a test host outside the cluster network cannot reach), serving the test's namespace only.
REQUEST_TWICE = """
import asyncio, json
from prefixcache.client import EngineClient, build_request
async def main():
    async with EngineClient("localhost:50051") as engine:
        request = build_request(text="The same prompt twice, so that its blocks are cached. " * 8,
                                max_tokens=4, temperature=0.0)
        print(json.dumps([(await engine.complete(request)).usage.cached_tokens for _ in range(2)]))
asyncio.run(main())
"""


@pytest.fixture(scope="module")
def chart_operator(api: client.ApiClient, namespace: str, crd_installed: None) -> Iterator[None]:
    import helm_python as helm
    from kubernetes import utils

    chart = helm.Chart.load(str(Path(__file__).resolve().parents[2] / "charts" / "prefixcache"))
    values = {"stack": {"enabled": False}, "operator": {"enabled": True, "image": IMAGE, "watchNamespace": namespace}}
    objects = [doc for path, text in chart.render(values, name="e2e", namespace=namespace).items()
               if not path.endswith("NOTES.txt") for doc in yaml.safe_load_all(text) if doc]
    for obj in objects:
        utils.create_from_dict(api, obj, namespace=namespace)
    yield
    rbac = client.RbacAuthorizationV1Api(api)
    for obj in objects:  # the cluster-scoped ones; the namespace takes the rest
        if obj["kind"] == "ClusterRole":
            rbac.delete_cluster_role(obj["metadata"]["name"])
        elif obj["kind"] == "ClusterRoleBinding":
            rbac.delete_cluster_role_binding(obj["metadata"]["name"])


@pytest.mark.skipif(not (IMAGE and WORKER_IMAGE), reason="set PREFIXCACHE_E2E_IMAGE and "
                    "PREFIXCACHE_E2E_WORKER_IMAGE to images the cluster can pull")
@pytest.mark.timeout(1800)
def test_the_chart_serves_a_warm_cache_and_reports_it(api: client.ApiClient, namespace: str,
                                                      chart_operator: None) -> None:
    """Install the chart's operator, apply a PrefixCacheDeployment, wait for Ready, send the same request
    twice (the second is served from the cache), see the hit rate in status, delete and see it all go."""
    from kubernetes.stream import stream

    create(api, namespace, "warm", {"image": IMAGE, "worker": {"image": WORKER_IMAGE, "gpus": 0},
                                    "kvCacheMemory": "256Mi", "cacheHealth": {"intervalSeconds": 5}})

    def get_status() -> dict[str, Any]:
        return custom(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "warm").get("status") or {}

    wait_for(lambda: any(c["type"] == "Ready" and c["status"] == "True" for c in get_status().get("conditions", [])),
             "Ready=True", 1500)
    core = client.CoreV1Api(api)
    (pod,) = [p for p in core.list_namespaced_pod(namespace, label_selector=get_status()["selector"]).items]
    output = stream(core.connect_get_namespaced_pod_exec, pod.metadata.name, namespace, container="scheduler",
                    command=["python", "-c", REQUEST_TWICE], stderr=True, stdin=False, stdout=True, tty=False)
    first, second = json.loads(output.strip().splitlines()[-1])
    assert first == 0 and second > 0
    cache = wait_for(lambda: (c := get_status().get("cache") or {}).get("hitRate") and c, "a hit rate in status", 120)
    assert cache["podsRead"] == 1 and cache["cachedBlocks"] > 0

    custom(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "warm")
    apps = client.AppsV1Api(api)
    wait_for(lambda: not [d for d in apps.list_namespaced_deployment(namespace).items
                          if d.metadata.name.startswith("warm-")], "the Deployments to be collected", 300)
    wait_for(lambda: not [s for s in core.list_namespaced_service(namespace).items
                          if s.metadata.name.startswith("warm")], "the Services to be collected", 120)
    wait_for(lambda: not core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/instance=warm").items,
             "the pods to go", 300)

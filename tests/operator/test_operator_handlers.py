"""The real operator (kopf, the handlers module, the official client) against an emulated Kubernetes API
over HTTP: create, update, readiness, invalid specs, foreign objects, and salts that never leak."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import kmock
import pytest
from kube_emulator import EmulatedCluster
from kubernetes import client

from prefixcache.operator.schema import GROUP, KIND, PLURAL, VERSION

NAMESPACE = "default"
SALT_VALUES = ("salt-for-acme-7f3a9c", "salt-for-globex-41d2e8")


RESYNC_BOUND_S = 90.0  # the operator re-applies every stack every 60 s (handlers.RESYNC_INTERVAL_ENV)


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def create(api: client.ApiClient, name: str, spec: dict[str, Any], uid: str) -> None:
    # The emulator stamps no uid, generation or resourceVersion: set them as an API server would.
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "spec": spec,
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid, "generation": 1, "resourceVersion": "1"}}
    client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)


def get(api: client.ApiClient, name: str) -> dict[str, Any]:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)


def condition(api: client.ApiClient, name: str, type_: str) -> dict[str, Any] | None:
    conditions = (get(api, name).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), None)


def deployment(api: client.ApiClient, name: str) -> dict[str, Any] | None:
    try:
        response = client.AppsV1Api(api).read_namespaced_deployment(name, NAMESPACE, _preload_content=False)
    except client.ApiException as error:
        if error.status == 404:
            return None
        raise
    return json.loads(response.data)


def set_rollout(api: client.ApiClient, name: str, *, updated: int, available: int, existing: int | None = None,
                conditions: list[dict[str, str]] | None = None) -> None:
    """Play the Deployment controller: report how far a Deployment's rollout is."""
    status: dict[str, Any] = {"updatedReplicas": updated, "availableReplicas": available,
                              "replicas": updated if existing is None else existing}
    if conditions is not None:
        status["conditions"] = conditions
    client.AppsV1Api(api).patch_namespaced_deployment_status(name, NAMESPACE, {"status": status})


def args_of(deployment_body: dict[str, Any], container: str) -> list[str]:
    (found,) = [c for c in deployment_body["spec"]["template"]["spec"]["containers"] if c["name"] == container]
    return found["args"]


def test_create_renders_the_stack_and_reports_readiness(operator: Any, api: client.ApiClient) -> None:
    create(api, "alpha", {"replicas": 2, "blockSize": 32}, uid="uid-alpha")
    engine = wait_for(lambda: deployment(api, "alpha-engine"), "the engine Deployment")
    assert engine["metadata"]["ownerReferences"][0]["uid"] == "uid-alpha"
    assert "--block-size" in args_of(engine, "scheduler") and "32" in args_of(engine, "scheduler")
    assert wait_for(lambda: deployment(api, "alpha-tokenizer"), "the tokenizer Deployment")
    services = {s.metadata.name for s in client.CoreV1Api(api).list_namespaced_service(NAMESPACE).items}
    assert {"alpha", "alpha-tokenizer"} <= services

    reconciled = wait_for(lambda: condition(api, "alpha", "Reconciled"), "Reconciled")
    assert (reconciled["status"], reconciled["reason"], reconciled["observedGeneration"]) == ("True", "Applied", 1)
    assert not get(api, "alpha")["metadata"].get("finalizers")  # deleting never waits for the operator
    status = get(api, "alpha")["status"]
    assert status["engineEndpoint"] == "alpha.default.svc:50051" and status["replicas"] == 2
    assert condition(api, "alpha", "Ready")["status"] == "False"

    # Play the Deployment controller: the children become available, and Ready follows.
    set_rollout(api, "alpha-tokenizer", updated=1, available=1)
    set_rollout(api, "alpha-engine", updated=2, available=1)
    waiting = wait_for(lambda: (c := condition(api, "alpha", "Ready"))
                       and c["message"] == "1 of 2 engine replicas available" and c, "1 of 2 replicas available")
    assert (waiting["status"], waiting["reason"]) == ("False", "Progressing")
    set_rollout(api, "alpha-engine", updated=2, available=2)
    ready = wait_for(lambda: (c := condition(api, "alpha", "Ready")) and c["status"] == "True" and c, "Ready=True")
    assert ready["reason"] == "Available"
    assert get(api, "alpha")["status"]["availableReplicas"] == 2


def test_ready_waits_for_a_rollout_and_names_one_that_stopped(operator: Any, api: client.ApiClient) -> None:
    create(api, "zeta", {"replicas": 2}, uid="uid-zeta")
    wait_for(lambda: (c := condition(api, "zeta", "Reconciled")) and c["status"] == "True", "Reconciled")
    set_rollout(api, "zeta-tokenizer", updated=1, available=1)
    set_rollout(api, "zeta-engine", updated=2, available=2)
    wait_for(lambda: (c := condition(api, "zeta", "Ready")) and c["status"] == "True", "Ready=True")

    # A new pod template: the old replicas still serve, but the spec is not rolled out yet.
    set_rollout(api, "zeta-engine", updated=1, available=2)
    rolling = wait_for(lambda: (c := condition(api, "zeta", "Ready")) and c["status"] == "False" and c, "Ready=False")
    assert rolling["reason"] == "Progressing"
    assert rolling["message"] == "rolling out: 1 of 2 engine replicas run the current spec; 2 available"
    progressing = wait_for(lambda: (c := condition(api, "zeta", "Progressing")) and c["status"] == "True" and c,
                           "Progressing=True")
    assert progressing["reason"] == "RollingOut" and condition(api, "zeta", "Degraded")["status"] == "False"

    # The tokenizer rolls with a surge: a new pod exists beside the old one, which alone is available.
    set_rollout(api, "zeta-engine", updated=2, available=2)
    set_rollout(api, "zeta-tokenizer", updated=1, available=1, existing=2)
    surging = wait_for(lambda: (c := condition(api, "zeta", "Ready")) and "tokenizer" in c["message"] and c,
                       "Ready to wait for the tokenizer's rollout")
    assert (surging["status"], surging["reason"]) == ("False", "Progressing")
    set_rollout(api, "zeta-tokenizer", updated=1, available=1, existing=1)
    wait_for(lambda: (c := condition(api, "zeta", "Ready")) and c["status"] == "True", "Ready=True again")

    stalled = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
               "message": 'ReplicaSet "zeta-engine-7d9" has timed out progressing.'}
    set_rollout(api, "zeta-engine", updated=1, available=1, conditions=[stalled])
    failed = wait_for(lambda: (c := condition(api, "zeta", "Ready")) and c["reason"] == "RolloutFailed" and c,
                      "Ready reason RolloutFailed")
    assert failed["status"] == "False" and stalled["message"] in failed["message"]
    degraded = wait_for(lambda: (c := condition(api, "zeta", "Degraded")) and c["status"] == "True" and c, "Degraded")
    assert degraded["reason"] == "RolloutFailed" and condition(api, "zeta", "Progressing")["status"] == "False"


def test_children_that_drift_from_the_spec_are_put_back(operator: Any, api: client.ApiClient) -> None:
    create(api, "eta", {"replicas": 2, "tokenizer": {"replicas": 1}}, uid="uid-eta")
    wait_for(lambda: deployment(api, "eta-engine"), "the engine Deployment")
    wait_for(lambda: (c := condition(api, "eta", "Reconciled")) and c["status"] == "True", "Reconciled")
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)

    core.delete_namespaced_service("eta", NAMESPACE)
    wait_for(lambda: "eta" in {s.metadata.name for s in core.list_namespaced_service(NAMESPACE).items},
             "the deleted engine Service to be recreated")
    apps.patch_namespaced_deployment("eta-tokenizer", NAMESPACE, {"spec": {"replicas": 5}})  # scaled by hand
    wait_for(lambda: deployment(api, "eta-tokenizer")["spec"]["replicas"] == 1, "the spec's tokenizer replicas")
    apps.delete_namespaced_deployment("eta-engine", NAMESPACE)
    engine = wait_for(lambda: deployment(api, "eta-engine"), "the deleted engine Deployment to be recreated")
    assert engine["spec"]["replicas"] == 2 and engine["metadata"]["ownerReferences"][0]["uid"] == "uid-eta"


def test_update_rolls_the_new_spec_out(operator: Any, api: client.ApiClient) -> None:
    create(api, "beta", {}, uid="uid-beta")
    wait_for(lambda: deployment(api, "beta-engine"), "the engine Deployment")
    patch = {"metadata": {"generation": 2}, "spec": {"hashAlgorithm": "xxhash", "enablePrefixCaching": False,
                                                      "otel": {"endpoint": "http://otel:4317"}}}
    client.CustomObjectsApi(api).patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "beta", patch)
    engine = wait_for(lambda: (d := deployment(api, "beta-engine")) and "--no-prefix-caching" in args_of(d, "scheduler")
                      and d, "the updated engine Deployment")
    assert args_of(engine, "scheduler")[args_of(engine, "scheduler").index("--hash-algo") + 1] == "xxhash"
    config_map = client.CoreV1Api(api).read_namespaced_config_map("beta-env", NAMESPACE)
    assert config_map.data["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel:4317"
    wait_for(lambda: condition(api, "beta", "Reconciled")["observedGeneration"] == 2, "observedGeneration 2")


def test_scaling_the_resource_scales_the_engine_and_rolls_nothing(operator: Any, api: client.ApiClient) -> None:
    """What `kubectl scale pcd` and an HPA do through the scale subresource: set spec.replicas. The
    selector they read is in the status; the pods they add start cold, and none of the others restarts."""
    create(api, "mu", {"replicas": 1}, uid="uid-mu")
    engine = wait_for(lambda: deployment(api, "mu-engine"), "the engine Deployment")
    status = wait_for(lambda: (s := get(api, "mu").get("status") or {}).get("selector") and s, "status.selector")
    assert status["selector"] == ",".join(f"{k}={v}" for k, v in engine["spec"]["selector"]["matchLabels"].items())
    patch = {"metadata": {"generation": 2}, "spec": {"replicas": 4}}
    client.CustomObjectsApi(api).patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "mu", patch)
    scaled = wait_for(lambda: (d := deployment(api, "mu-engine")) and d["spec"]["replicas"] == 4 and d, "4 replicas")
    assert scaled["spec"]["template"] == engine["spec"]["template"]


def test_invalid_spec_is_reported_and_renders_nothing(operator: Any, api: client.ApiClient) -> None:
    # The API server would refuse this spec; an older CRD or a bypassed webhook must not get it rendered.
    create(api, "broken", {"blockSize": 24, "model": {"source": "PersistentVolumeClaim"}}, uid="uid-broken")
    reconciled = wait_for(lambda: condition(api, "broken", "Reconciled"), "Reconciled")
    assert (reconciled["status"], reconciled["reason"]) == ("False", "InvalidSpec")
    assert "spec.blockSize: must be one of" in reconciled["message"]
    assert "model.claimName is required" in reconciled["message"]
    ready = condition(api, "broken", "Ready")
    assert ready["reason"] == "InvalidSpec" and "spec.blockSize" in ready["message"]  # names the field
    assert (condition(api, "broken", "Degraded")["status"], condition(api, "broken", "Degraded")["reason"]) == \
        ("True", "InvalidSpec")
    assert deployment(api, "broken-engine") is None and deployment(api, "broken-tokenizer") is None


def test_a_child_the_api_server_refuses_is_reported_not_retried(operator: Any, api: client.ApiClient,
                                                                 emulated_cluster: EmulatedCluster,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    # What the schema cannot see, the API server refuses (here: a request above its limit).
    message = 'Deployment.apps "epsilon-engine" is invalid: spec.template.spec.containers[0].resources.requests: ' \
              'Invalid value: "8Gi": must be less than or equal to memory limit of 4Gi'
    refusal = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid", "code": 422,
               "message": message}
    emulated_cluster.emulator["post", kmock.resource("apps", "v1", "deployments"),
                              {"metadata": {"name": "epsilon-engine"}}] << 422 << refusal
    create(api, "epsilon", {}, uid="uid-epsilon")
    reconciled = wait_for(lambda: condition(api, "epsilon", "Reconciled"), "Reconciled")
    assert (reconciled["status"], reconciled["reason"], reconciled["message"]) == ("False", "Rejected", message)
    assert condition(api, "epsilon", "Ready")["reason"] == "Rejected"

    def verdicts() -> list[str]:  # kopf's log lines about the handler's failure
        return [r.getMessage() for r in caplog.records if "'reconcile' failed" in r.getMessage()]

    # A permanent failure, not one kopf will try again.
    assert any("permanently" in v for v in wait_for(verdicts, "kopf's verdict on the handler", 15)), verdicts()
    assert not any("try again" in v for v in verdicts()), verdicts()


def test_foreign_object_with_the_same_name_is_left_alone(operator: Any, api: client.ApiClient) -> None:
    foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gamma-env", "namespace": NAMESPACE},
               "data": {"owner": "someone else"}}
    client.CoreV1Api(api).create_namespaced_config_map(NAMESPACE, foreign)
    create(api, "gamma", {}, uid="uid-gamma")
    reconciled = wait_for(lambda: condition(api, "gamma", "Reconciled"), "Reconciled")
    assert (reconciled["status"], reconciled["reason"]) == ("False", "NotOwned")
    assert "ConfigMap default/gamma-env already exists" in reconciled["message"]
    assert client.CoreV1Api(api).read_namespaced_config_map("gamma-env", NAMESPACE).data == {"owner": "someone else"}


def test_tenant_salts_never_leave_their_secret(operator: Any, api: client.ApiClient,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # every log line of the operator and kopf, from all threads
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "tenant-salts", "namespace": NAMESPACE},
              "stringData": dict(zip(("acme", "globex"), SALT_VALUES))}
    client.CoreV1Api(api).create_namespaced_secret(NAMESPACE, secret)
    create(api, "delta", {"tenantSalts": {"secretName": "tenant-salts", "key": "acme"}}, uid="uid-delta")
    engine = wait_for(lambda: deployment(api, "delta-engine"), "the engine Deployment")
    # A mounted Secret (which the kubelet refreshes, and the scheduler reloads), never a value.
    assert {"name": "salt-key", "secret": {"secretName": "tenant-salts", "items": [{"key": "acme", "path": "key"}]}} \
        in engine["spec"]["template"]["spec"]["volumes"]
    assert "--tenant-salt-key-file" in args_of(engine, "scheduler")
    wait_for(lambda: condition(api, "delta", "Reconciled"), "Reconciled")

    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    everything = json.dumps([
        get(api, "delta"),
        [json.loads(apps.list_namespaced_deployment(NAMESPACE, _preload_content=False).data)],
        [json.loads(core.list_namespaced_service(NAMESPACE, _preload_content=False).data)],
        [json.loads(core.list_namespaced_config_map(NAMESPACE, _preload_content=False).data)],
    ])
    for salt in SALT_VALUES:
        assert salt not in everything
        assert salt not in caplog.text
    assert "delta" in caplog.text  # the capture did see the operator at work


def test_name_too_long_for_its_children_is_refused(operator: Any, api: client.ApiClient) -> None:
    name = "n" * 54  # "<name>-tokenizer" would exceed the 63 characters of a Service name
    create(api, name, {}, uid="uid-long")
    reconciled = wait_for(lambda: condition(api, name, "Reconciled"), "Reconciled")
    assert (reconciled["status"], reconciled["reason"]) == ("False", "InvalidSpec")
    assert reconciled["message"].startswith("metadata.name: ")
    assert deployment(api, f"{name}-engine") is None


def test_placement_removed_from_the_spec_leaves_the_pods(operator: Any, api: client.ApiClient) -> None:
    # CPU workers: GPU workers keep a default toleration of the GPU taint whatever the spec says.
    placed = {"gpus": 0, "nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "spot", "operator": "Exists"}]}
    create(api, "theta", {"worker": placed, "imagePullSecrets": ["regcred"]}, uid="uid-theta")
    engine = wait_for(lambda: deployment(api, "theta-engine"), "the engine Deployment")
    assert engine["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu"}
    patch = {"metadata": {"generation": 2}, "spec": {"worker": {"nodeSelector": None, "tolerations": None},
                                                      "imagePullSecrets": None}}
    client.CustomObjectsApi(api).patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "theta", patch)
    pod = wait_for(lambda: (d := deployment(api, "theta-engine"))
                   and "nodeSelector" not in d["spec"]["template"]["spec"] and d["spec"]["template"]["spec"],
                   "the node selector to leave the engine pods")
    assert "tolerations" not in pod and "imagePullSecrets" not in pod


def test_maps_that_must_match_the_spec_lose_keys_it_no_longer_has(operator: Any, api: client.ApiClient) -> None:
    """A merge patch merges maps: a node-selector key dropped from the spec, or a key added by hand to
    the Service's selector, must be removed explicitly or it stays."""
    two_labels = {"pool": "gpu", "cloud.google.com/gke-accelerator": "nvidia-a100"}
    create(api, "iota", {"worker": {"nodeSelector": two_labels}}, uid="uid-iota")
    engine = wait_for(lambda: deployment(api, "iota-engine"), "the engine Deployment")
    assert engine["spec"]["template"]["spec"]["nodeSelector"] == two_labels
    patch = {"metadata": {"generation": 2},
             "spec": {"worker": {"nodeSelector": {"cloud.google.com/gke-accelerator": None}}}}
    client.CustomObjectsApi(api).patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "iota", patch)
    # Within the operator's periodic resync (60 s) at the latest, should the update event come late.
    wait_for(lambda: deployment(api, "iota-engine")["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu"},
             "the dropped label to leave the engine pods' node selector", timeout=RESYNC_BOUND_S)
    # An edit made while a spec is being reconciled waits for the periodic resync: edit after it.
    wait_for(lambda: condition(api, "iota", "Reconciled")["observedGeneration"] == 2, "observedGeneration 2")

    core = client.CoreV1Api(api)
    selector = core.read_namespaced_service("iota", NAMESPACE).spec.selector
    core.patch_namespaced_service("iota", NAMESPACE, {"spec": {"selector": {"edited-by": "hand"}}})
    wait_for(lambda: core.read_namespaced_service("iota", NAMESPACE).spec.selector == selector,
             "the engine Service's selector to be put back")

"""The CRD as the API server would apply it: structural schema, defaults, validation and the CEL rules
(mirrored in Python), each bad field named in the error."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from prefixcache.operator.schema import VERSION, apply_defaults, load_crd, spec_schema
from prefixcache.operator.spec import SpecError, check_name, parse_spec

KUBE_VERSIONS = ("1.33", "1.37")


def walk(schema: dict[str, Any], path: str = "spec"):
    yield path, schema
    for name, child in schema.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}.*")


def test_cel_rules_hold_on_the_object_defaults_they_are_checked_against() -> None:
    """The API server evaluates a node's CEL rules on its `default` as written (`{}`: the defaults
    inside are not applied first), and a rule reading a missing field fails the whole CRD. So every
    field a rule reads must be in that default or guarded by has()."""
    for path, node in walk(spec_schema()):
        if not isinstance(node.get("default"), dict):
            continue
        for rule in node.get("x-kubernetes-validations", []):
            for name in set(re.findall(r"self\.(\w+)", rule["rule"])) - set(node["default"]):
                assert f"has(self.{name})" in rule["rule"], f"{path}: {rule['rule']!r} reads self.{name} unguarded"


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_crd_is_a_valid_custom_resource_definition(version: str) -> None:
    kubernetes_validate.validate(load_crd(), version, strict=True)


def test_crd_schema_is_structural() -> None:
    """What the API server checks beyond the CRD's own OpenAPI type: every node has a type (or is
    int-or-string, typed only by the anyOf it allows), and no object both lists its properties and
    sets additionalProperties ("additionalProperties and properties are mutual exclusive")."""
    for path, node in walk(spec_schema()):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node and node.get("anyOf") == [{"type": "integer"}, {"type": "string"}], path
        assert not ("properties" in node and "additionalProperties" in node), path


def test_crd_has_status_subresource_and_printer_columns() -> None:
    (version,) = load_crd()["spec"]["versions"]
    # `kubectl scale pcd` and an HPA on the resource: replicas in the spec, the engine pods' selector in the status.
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.availableReplicas",
        "labelSelectorPath": ".status.selector"}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"] if not c.get("priority")}
    assert list(columns) == ["Ready", "Replicas", "Available", "Model", "Block", "Hash", "Hit rate", "Age"]
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Block"] == ".spec.blockSize" and columns["Hash"] == ".spec.hashAlgorithm"
    assert columns["Hit rate"] == ".status.cache.hitRate"
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"selector", "cache"} <= set(status)


def test_empty_spec_gets_every_default() -> None:
    defaulted = apply_defaults(spec_schema(), {})
    assert defaulted == {
        "image": "prefixcache/control-plane:0.1.0", "imagePullPolicy": "IfNotPresent", "replicas": 1,
        "model": {"source": "Embedded", "path": "", "id": "SmolLM2-135M-Instruct"},
        "blockSize": 16, "hashAlgorithm": "sha256", "enablePrefixCaching": True, "maxNumSeqs": 256,
        "kvCacheMemory": "2Gi",
        "worker": {"image": "prefixcache/worker:0.1.0", "gpus": 1, "gpuResource": "nvidia.com/gpu", "dtype": "auto",
                   "attentionBackend": "auto", "resources": {}, "startupProbeSeconds": 600},
        "rollout": {"maxSurge": 0},
        "scheduler": {"resources": {}}, "tokenizer": {"replicas": 1, "resources": {}},
        "terminationGracePeriodSeconds": 60,
        "cacheHealth": {"intervalSeconds": 30, "thrashing": {"evictedMissShare": 0.5, "kvUsage": 0.8, "intervals": 2}},
    }


def test_a_manifest_without_a_spec_gets_every_default() -> None:
    (version,) = (v for v in load_crd()["spec"]["versions"] if v["name"] == VERSION)
    root = version["schema"]["openAPIV3Schema"]
    assert "spec" not in root.get("required", [])
    manifest = {"apiVersion": f"prefixcache.dev/{VERSION}", "kind": "PrefixCacheDeployment",
                "metadata": {"name": "chat"}}
    assert apply_defaults(root, manifest)["spec"] == apply_defaults(spec_schema(), {})


def test_defaults_fill_gaps_but_keep_given_values() -> None:
    spec = parse_spec({"blockSize": 32, "worker": {"gpus": 0}, "kvCacheMemory": "8Gi",
                       "tenantSalts": {"secretName": "tenant-salts"}, "otel": {"endpoint": "http://otel:4317"}})
    assert spec.block_size == 32 and spec.worker.gpus == 0 and spec.worker.gpu_resource == "nvidia.com/gpu"
    assert spec.kv_cache_memory_bytes == 8 * 2**30
    assert (spec.tenant_salts.secret_name, spec.tenant_salts.key) == ("tenant-salts", "key")
    assert spec.otel_endpoint == "http://otel:4317"
    assert spec.tenants is None and spec.tls is None
    secured = parse_spec({"tenants": {"secretName": "chat-tenants"}, "tls": {"secretName": "chat-tls"}})
    assert (secured.tenants.secret_name, secured.tenants.key, secured.tls.secret_name) == (
        "chat-tenants", "tenants.json", "chat-tls")


@pytest.mark.parametrize(("raw", "field"), [
    pytest.param({"blockSize": 24}, "spec.blockSize: must be one of", id="block-size-not-power-of-two"),
    pytest.param({"blockSize": 512}, "spec.blockSize: must be one of", id="block-size-too-large"),
    pytest.param({"hashAlgorithm": "md5"}, "spec.hashAlgorithm: must be one of", id="hash-algorithm"),
    pytest.param({"replicas": -1}, "spec.replicas: -1 is less than the minimum", id="replicas"),
    pytest.param({"maxNumSeqs": 0}, "spec.maxNumSeqs: 0 is less than the minimum", id="max-num-seqs"),
    pytest.param({"enablePrefixCaching": "yes"}, "spec.enablePrefixCaching: 'yes' is not of type 'boolean'",
                 id="prefix-caching-flag"),
    pytest.param({"kvCacheMemory": "lots"}, "spec.kvCacheMemory: 'lots' does not match", id="kv-quantity"),
    pytest.param({"kvCacheMemory": "1.5"}, "spec.kvCacheMemory: '1.5' must be a positive whole number",
                 id="kv-fraction-of-a-byte"),
    pytest.param({"terminationGracePeriodSeconds": 10}, "spec.terminationGracePeriodSeconds: 10 is less than",
                 id="grace-too-short-for-drain-and-stop"),
    pytest.param({"worker": {"gpus": 17}}, "spec.worker.gpus: 17 is greater than the maximum", id="gpus"),
    pytest.param({"worker": {"dtype": "int4"}}, "spec.worker.dtype: must be one of", id="dtype"),
    pytest.param({"model": {"source": "Hub"}}, "spec.model.source: must be one of", id="model-source"),
    pytest.param({"model": {"source": "PersistentVolumeClaim"}},
                 "spec.model: model.claimName is required when model.source is PersistentVolumeClaim",
                 id="pvc-without-claim"),
    pytest.param({"model": {"claimName": "models"}},
                 "spec.model: model.claimName is only allowed when model.source is PersistentVolumeClaim",
                 id="claim-for-embedded"),
    pytest.param({"model": {"source": "PersistentVolumeClaim", "claimName": "m", "path": "a/../../etc"}},
                 "spec.model.path: model.path must be relative", id="path-escapes-claim"),
    pytest.param({"tenantSalts": {"secretName": "s", "salts": {"acme": "x"}}}, "spec.tenantSalts.salts: unknown field",
                 id="inline-salts-refused"),
    pytest.param({"tenantSalts": {}}, "spec.tenantSalts: 'secretName' is a required property", id="salts-no-secret"),
    pytest.param({"tenants": {"secretName": "s", "apiKeys": ["k"]}}, "spec.tenants.apiKeys: unknown field",
                 id="inline-keys-refused"),
    pytest.param({"tls": {}}, "spec.tls: 'secretName' is a required property", id="tls-no-secret"),
    pytest.param({"otel": {"endpoint": "otel:4317"}}, "spec.otel.endpoint: 'otel:4317' does not match",
                 id="otel-endpoint-scheme"),
    pytest.param({"blocksize": 16}, "spec.blocksize: unknown field", id="typo"),
    pytest.param({"worker": {"resources": {"limits": {"memory": "lots"}}}},
                 "spec.worker.resources.limits.memory: 'lots' does not match", id="resource-quantity"),
    pytest.param({"kvCacheMemory": 0}, "spec.kvCacheMemory: 0 is less than the minimum of 1", id="kv-zero"),
    pytest.param({"kvCacheMemory": "0Gi"}, "spec.kvCacheMemory: '0Gi' does not match", id="kv-zero-quantity"),
    pytest.param({"scheduler": {"resources": {"limits": {"BAD NAME": "1"}}}},
                 "spec.scheduler.resources.limits.BAD NAME: not a container resource", id="resource-name"),
    pytest.param({"worker": {"gpus": 1, "resources": {"limits": {"nvidia.com/gpu": 4}}}},
                 "spec.worker.resources.limits.nvidia.com/gpu: set GPUs with spec.worker.gpus", id="gpus-twice"),
    pytest.param({"worker": {"gpus": 2}}, "spec.worker.gpus: 2 is greater than the maximum of 1", id="gpus-beyond-one"),
    pytest.param({"tokenizer": {"nodeSelector": {"not a label": "x"}}},
                 "spec.tokenizer.nodeSelector: nodeSelector keys must be label keys", id="node-selector-key"),
    pytest.param({"worker": {"tolerations": [{"key": "no spaces/in keys", "operator": "Exists"}]}},
                 "spec.worker.tolerations.0.key: 'no spaces/in keys' does not match", id="toleration-key"),
    pytest.param({"worker": {"resources": {"requests": {"nvidia.com/gpu": 1}}}},
                 "spec.worker.resources.requests.nvidia.com/gpu: set GPUs with spec.worker.gpus",
                 id="gpu-without-gpus"),
    pytest.param({"worker": {"gpus": 0, "attentionBackend": "triton"}},
                 "spec.worker: worker.attentionBackend triton needs GPUs", id="triton-on-cpu"),
    pytest.param({"scheduler": {"resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "4Gi"}}}},
                 "spec.scheduler.resources.requests.memory: 8Gi is more than its limit 4Gi", id="request-over-limit"),
    pytest.param({"tokenizer": {"resources": {"requests": {"gpu": "1"}}}},
                 "spec.tokenizer.resources.requests.gpu: not a container resource", id="resource-without-domain"),
    pytest.param({"scheduler": {"resources": {"requests": {"example.com/dev": "1"}}}},
                 "spec.scheduler.resources.requests.example.com/dev: a device request needs a limit",
                 id="device-request-without-limit"),
    pytest.param({"scheduler": {"resources": {"requests": {"example.com/dev": "1"}, "limits": {"example.com/dev": "2"}}}},
                 "spec.scheduler.resources.requests.example.com/dev: 1 must equal its limit 2", id="device-overcommit"),
    pytest.param({"scheduler": {"resources": {"limits": {"example.com/dev": "500m"}}}},
                 "spec.scheduler.resources.limits.example.com/dev: a device count must be a whole number",
                 id="device-fraction"),
    pytest.param({"worker": {"gpuResource": "gpu"}}, "spec.worker.gpuResource: 'gpu' is not a device resource name",
                 id="gpu-resource-without-domain"),
])
def test_invalid_spec_names_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as error:
        parse_spec(raw)
    assert any(problem.startswith(field) for problem in error.value.problems), error.value.problems
    assert isinstance(error.value, ValueError)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(SpecError) as error:
        parse_spec({"blockSize": 3, "hashAlgorithm": "md5", "replicas": 1000})
    assert [p.split(":")[0] for p in error.value.problems] == ["spec.blockSize", "spec.hashAlgorithm", "spec.replicas"]


def test_python_rules_mirror_every_cel_rule_of_the_crd() -> None:
    """The API server enforces x-kubernetes-validations; the operator enforces the same messages itself."""
    (version,) = load_crd()["spec"]["versions"]
    root = version["schema"]["openAPIV3Schema"]
    cel_messages = {rule["message"] for _, node in [("", root), *walk(spec_schema())]
                    for rule in node.get("x-kubernetes-validations", [])}
    violations = [
        {"model": {"source": "PersistentVolumeClaim"}},
        {"model": {"claimName": "models"}},
        {"model": {"source": "PersistentVolumeClaim", "claimName": "m", "path": "/abs"}},
        {"worker": {"gpus": 0, "attentionBackend": "triton"}},
        {"tokenizer": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
        {"worker": {"tolerations": [{"operator": "Equal", "value": "v"}]}},
        {"worker": {"tolerations": [{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 30}]}},
    ]
    reported = set()
    for raw in violations:
        with pytest.raises(SpecError) as error:
            parse_spec(raw)
        reported |= {re.sub(r"^[\w.\[\]]+: ", "", p) for p in error.value.problems}
    assert cel_messages == reported


def name_schema() -> dict[str, Any]:
    (version,) = load_crd()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["metadata"]["properties"]["name"]


@pytest.mark.parametrize("name", ["chat", "a", "llm-2", "x" * 53])
def test_names_that_fit_every_child_are_accepted(name: str) -> None:
    check_name(name)
    jsonschema.validate(name, name_schema())  # as the API server checks it


@pytest.mark.parametrize("name", ["Chat", "2chat", "chat.v1", "chat-", "x" * 54, ""])
def test_names_that_break_a_child_name_are_refused(name: str) -> None:
    with pytest.raises(SpecError, match="metadata.name: .*DNS-1035 label of at most 53"):
        check_name(name)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(name, name_schema())


@pytest.mark.parametrize("path", ["", "smollm2", "hf/SmolLM2-135M", "a..b/c", "models/v1.2"])
def test_model_paths_inside_the_claim_are_accepted(path: str) -> None:
    spec = parse_spec({"model": {"source": "PersistentVolumeClaim", "claimName": "models", "path": path}})
    assert spec.model.path == path and spec.model.claim_name == "models"


def test_the_readme_example_is_a_valid_manifest() -> None:
    readme = (Path(__file__).parents[2] / "operator" / "README.md").read_text()
    (example,) = re.findall(r"```yaml\n(.*?)```", readme, re.S)
    manifest = yaml.safe_load(example)
    assert manifest["kind"] == "PrefixCacheDeployment" and manifest["apiVersion"] == f"prefixcache.dev/{VERSION}"
    check_name(manifest["metadata"]["name"])
    parsed = parse_spec(manifest["spec"])
    assert parsed.replicas == 2 and (parsed.tenants.secret_name, parsed.tls.secret_name) == ("chat-tenants", "chat-engine-tls")

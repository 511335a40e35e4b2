"""The CRD's OpenAPI schema, applied the way the API server applies it: defaults first, then validation.

The operator cannot assume the API server did this (an older CRD version may be installed, and tests run
without one), so `.spec` is always defaulted and checked here before anything is rendered. CEL rules
(`x-kubernetes-validations`) are not evaluated here; `spec.py` enforces the same rules in Python.

Unknown fields: the API server refuses a CRD whose object nodes set both `properties` and
`additionalProperties`, so the CRD cannot say "no other fields". The server prunes unknown fields, and
`kubectl apply` (strict field validation, its default) refuses them; the operator refuses them too, by
validating against the schema with every object that lists its properties closed.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRD_PATH = Path(__file__).with_name("crd.yaml")
GROUP = "prefixcache.dev"
VERSION = "v1alpha1"
KIND = "PrefixCacheDeployment"
PLURAL = "prefixcachedeployments"


class SpecError(ValueError):
    """A PrefixCacheDeployment spec the operator refuses; `problems` name each offending field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


@cache
def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def spec_schema() -> dict[str, Any]:
    """The OpenAPI schema of `.spec` for the served version."""
    (version,) = (v for v in load_crd()["spec"]["versions"] if v["name"] == VERSION)
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Return a copy of `value` with the schema's defaults filled in, as Kubernetes structural defaulting
    does: a missing property with a `default` gets it, and defaults nested under it apply too (which is
    why `default: {}` on an object makes its children's defaults appear)."""
    value = copy.deepcopy(value)
    _default_in_place(schema, value)
    return value


def _default_in_place(schema: Mapping[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name, child in properties.items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                _default_in_place(child, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for name, item in value.items():
                if name not in properties:
                    _default_in_place(extra, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for item in value:
            _default_in_place(schema["items"], item)


def closed(schema: Mapping[str, Any]) -> dict[str, Any]:
    """`schema` with `additionalProperties: false` on every object node that lists its properties."""
    result = {key: value for key, value in schema.items()}
    if "properties" in result:
        result["properties"] = {name: closed(child) for name, child in result["properties"].items()}
        result.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties"):
        if isinstance(result.get(key), Mapping):
            result[key] = closed(result[key])
    return result


def schema_problems(schema: Mapping[str, Any], value: Any, prefix: str = "spec") -> list[str]:
    """Every violation of `schema` by `value`, unknown fields included, each as '<field path>: <what is wrong>'."""
    problems = []
    for error in jsonschema.Draft7Validator(closed(schema)).iter_errors(value):
        path = ".".join([prefix, *(str(part) for part in error.absolute_path)])
        if error.validator == "additionalProperties":
            known = error.schema.get("properties", {})
            problems += [f"{path}.{name}: unknown field" for name in error.instance if name not in known]
        elif error.validator == "enum":
            problems.append(f"{path}: must be one of {error.validator_value}, got {error.instance!r}")
        elif error.validator == "anyOf":
            problems.append(f"{path}: must be an integer or a string, got {error.instance!r}")
        else:
            problems.append(f"{path}: {error.message}")
    return sorted(problems)


def defaulted_spec(raw_spec: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """A raw `.spec` with defaults applied, and its structural problems (empty when valid)."""
    if raw_spec is None:
        raw_spec = {}
    if not isinstance(raw_spec, Mapping):
        return {}, [f"spec: must be an object, got {type(raw_spec).__name__}"]
    schema = spec_schema()
    spec = apply_defaults(schema, dict(raw_spec))
    return spec, schema_problems(schema, spec)

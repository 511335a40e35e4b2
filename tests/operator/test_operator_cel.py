"""The CRD's CEL rules (x-kubernetes-validations), evaluated by a real CEL implementation on defaulted
specs, and the operator's own checks (`spec.py`), which mirror them for clusters that never ran them,
refuse exactly the same specs with the same messages."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import cel
import pytest

from prefixcache.operator.schema import SpecError, apply_defaults, spec_schema
from prefixcache.operator.spec import parse_spec


def cel_failures(schema: Mapping[str, Any], value: Any) -> set[str]:
    """The messages of every rule that `value` breaks, at every node of the schema, as the API server checks."""
    failed = {rule["message"] for rule in schema.get("x-kubernetes-validations", ())
              if not cel.evaluate(rule["rule"], {"self": value})}
    if isinstance(value, Mapping):
        for name, child in value.items():
            child_schema = schema.get("properties", {}).get(name) or schema.get("additionalProperties")
            if isinstance(child_schema, Mapping):
                failed |= cel_failures(child_schema, child)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for item in value:
            failed |= cel_failures(schema["items"], item)
    return failed


def all_rule_messages(schema: Mapping[str, Any]) -> set[str]:
    found = {rule["message"] for rule in schema.get("x-kubernetes-validations", ())}
    for child in [*schema.get("properties", {}).values(), schema.get("items"), schema.get("additionalProperties")]:
        if isinstance(child, Mapping):
            found |= all_rule_messages(child)
    return found


def operator_failures(spec: dict[str, Any]) -> set[str]:
    try:
        parse_spec(spec)
    except SpecError as error:
        messages = {problem.split(": ", 1)[1] for problem in error.problems}
        return messages & all_rule_messages(spec_schema())
    return set()


CASES = [
    {},
    {"model": {"source": "PersistentVolumeClaim"}},
    {"model": {"claimName": "models"}},
    {"model": {"source": "PersistentVolumeClaim", "claimName": "models", "path": "/absolute"}},
    {"model": {"source": "PersistentVolumeClaim", "claimName": "models", "path": "hf/../../etc"}},
    {"model": {"source": "PersistentVolumeClaim", "claimName": "models", "path": "hf/..x/model"}},
    {"worker": {"gpus": 0, "attentionBackend": "triton"}},
    {"worker": {"gpus": 1, "attentionBackend": "triton"}},
    {"worker": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
    {"worker": {"tolerations": [{"key": "k", "operator": "Exists", "value": ""}]}},
    {"tokenizer": {"tolerations": [{"operator": "Equal", "value": "v"}]}},
    {"tokenizer": {"tolerations": [{"operator": "Exists"}]}},
    {"worker": {"tolerations": [{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 30}]}},
    {"worker": {"tolerations": [{"key": "k", "effect": "NoExecute", "tolerationSeconds": 30}]}},
]


@pytest.mark.parametrize("spec", CASES, ids=[str(case) for case in CASES])
def test_cel_and_the_operator_refuse_the_same_specs(spec: dict[str, Any]) -> None:
    by_cel = cel_failures(spec_schema(), apply_defaults(spec_schema(), spec))
    assert by_cel == operator_failures(spec)


def test_the_cases_exercise_every_rule() -> None:
    """A rule no case breaks would be checked by nothing here."""
    broken = set().union(*(cel_failures(spec_schema(), apply_defaults(spec_schema(), case)) for case in CASES))
    assert broken == all_rule_messages(spec_schema())

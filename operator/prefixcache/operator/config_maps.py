"""The stack's ConfigMaps: the environment every container shares, the operator's admins file and the
Grafana dashboard."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefixcache.operator.admin_key import ADMIN_NAME
from prefixcache.operator.owner import Owner, object_metadata
from prefixcache.operator.spec import PrefixCacheSpec

DASHBOARD_PATH = Path(__file__).with_name("dashboard.json")  # the chart ships the same file (dashboards/)
DASHBOARD_KEY = "prefixcache.json"
ADMINS_FILE = "admins.json"


def env_config_map(owner: Owner, spec: PrefixCacheSpec) -> dict[str, Any]:
    """Environment every container shares. Never a secret: the tenant salt key is a secretKeyRef."""
    if spec.otel_endpoint:
        data = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": spec.otel_endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    else:
        data = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": object_metadata(owner, owner.config_map, "config"),
            "data": data}


def operator_admins(owner: Owner, key_hash: str) -> dict[str, Any]:
    """The admins file that makes the operator an admin of this stack's Engine API: a key's hash only."""
    admins = {"admins": [{"name": ADMIN_NAME, "api_keys": [key_hash]}]}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": object_metadata(owner, owner.operator_admin, "config"),
            "data": {ADMINS_FILE: json.dumps(admins)}}


def dashboard(owner: Owner) -> dict[str, Any]:
    """The Grafana dashboard (hit rate, missed tokens by reason, evictions, KV usage, TTFT with and
    without a hit), labelled for Grafana's sidecar to load."""
    metadata = object_metadata(owner, owner.dashboard, "dashboard")
    metadata["labels"]["grafana_dashboard"] = "1"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
            "data": {DASHBOARD_KEY: DASHBOARD_PATH.read_text()}}

"""The real operator (kopf, against the emulated API) reads a real Engine server's cache statistics
(the scheduler's Engine API over the simulated worker, on loopback) into status.cache: the hit rate
of the last interval after the same request twice, and a pod it cannot read reported as such. With
tenants, it reads as an admin through the admins file it renders (its key's hash only)."""
from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path
from typing import Any

from kubernetes import client
from test_operator_handlers import NAMESPACE, condition, create, get, wait_for

sys.path[:0] = [str(Path(__file__).parents[1] / "scheduler"), str(Path(__file__).parents[1] / "scheduler" / "api")]
from engine_harness import engine_api  # noqa: E402
from tenants_file import new_key, tenants_document, write_tenants  # noqa: E402

from prefixcache.client import EngineClient, build_request  # noqa: E402
from prefixcache.scheduler.tenancy import TenantRegistry  # noqa: E402


class EngineInThread:
    """The Engine API (scheduler + simulated worker + tokenizer) served from its own event loop."""

    def __init__(self, registry: TenantRegistry | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.target = ""
        self._registry = registry
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        from prefixcache.model_store.store import ensure_default_model
        from prefixcache.tokenizer.text import TextTokenizer

        self._stop = asyncio.Event()
        async with engine_api(TextTokenizer(ensure_default_model()), registry=self._registry) as (target, _):
            self.target = target
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> EngineInThread:
        self._thread.start()
        assert self._ready.wait(60), "the Engine server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)  # type: ignore[union-attr]
        self._thread.join(timeout=30)

    @property
    def port(self) -> int:
        return int(self.target.rsplit(":", 1)[1])

    def generate_twice(self, api_key: str | None = None) -> list[int]:
        async def twice() -> list[int]:
            async with EngineClient(self.target, api_key=api_key) as engine:
                request = build_request(text="The same long prompt, twice, so that its blocks are cached " * 4,
                                        max_tokens=2, temperature=0.0)
                return [(await engine.complete(request)).usage.cached_tokens for _ in range(2)]

        return asyncio.run_coroutine_threadsafe(twice(), self.loop).result(60)


def engine_pod(api: client.ApiClient, stack: str, name: str, port: int) -> None:
    """Play the kubelet: a ready engine pod of `stack` whose scheduler listens on 127.0.0.1:`port`."""
    labels = {"app.kubernetes.io/name": "prefixcache", "app.kubernetes.io/instance": stack,
              "app.kubernetes.io/component": "engine"}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
           "spec": {"containers": [{"name": "scheduler", "image": "cp",
                                    "ports": [{"name": "grpc", "containerPort": port}]}]},
           "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}
    client.CoreV1Api(api).create_namespaced_pod(NAMESPACE, pod)


def cache_of(api: client.ApiClient, name: str) -> dict[str, Any]:
    return (get(api, name).get("status") or {}).get("cache") or {}


def test_status_shows_the_hit_rate_of_the_last_interval(operator: Any, api: client.ApiClient) -> None:
    with EngineInThread() as engine:
        create(api, "kappa", {"cacheHealth": {"intervalSeconds": 1}}, uid="uid-kappa")
        wait_for(lambda: (c := condition(api, "kappa", "Reconciled")) and c["status"] == "True", "Reconciled")
        engine_pod(api, "kappa", "kappa-engine-a", engine.port)
        engine_pod(api, "kappa", "kappa-engine-b", 1)  # nothing listens there
        wait_for(lambda: cache_of(api, "kappa").get("podsRead") == 1, "a first reading of the live pod")
        cached = engine.generate_twice()
        assert cached[0] == 0 and cached[1] > 0
        cache = wait_for(lambda: (c := cache_of(api, "kappa")).get("hitRate") and c, "a hit rate in status", 60)
        assert 0 < cache["hitRate"] < 1 and cache["cachedBlocks"] > 0
        assert (cache["podsRead"], cache["podsUnread"]) == (1, 1)
        pods = {p["name"]: p for p in cache["pods"]}
        assert pods["kappa-engine-b"]["error"].startswith("GetCacheStats failed: ")
        assert pods["kappa-engine-a"]["cachedBlocks"] == cache["cachedBlocks"]
        # An interval without requests: no hits, no lookups, so no hit rate is guessed.
        wait_for(lambda: "hitRate" not in cache_of(api, "kappa"), "the next interval, without requests", 60)
        thrashing = condition(api, "kappa", "CacheThrashing")
        assert thrashing is not None and thrashing["status"] in ("False", "Unknown")


def test_with_tenants_the_operator_reads_as_its_own_admin(operator: Any, api: client.ApiClient,
                                                          tmp_path: Path) -> None:
    create(api, "lambda", {"tenants": {"secretName": "lambda-tenants"}, "cacheHealth": {"intervalSeconds": 1}},
           uid="uid-lambda")
    admins = wait_for(lambda: _config_map(api, "lambda-operator-admin"), "the operator's admins file")
    document = json.loads(admins["admins.json"])
    assert document["admins"][0]["api_keys"][0].startswith("sha256:")
    tenant_key = new_key()
    tenants = write_tenants(tmp_path / "tenants.json", tenants_document({"acme": tenant_key}))
    admins_file = tmp_path / "admins.json"
    admins_file.write_text(admins["admins.json"])  # what the kubelet mounts into the scheduler
    registry = TenantRegistry(tenants, check_interval_s=0, admins_path=admins_file)
    with EngineInThread(registry) as engine:
        engine_pod(api, "lambda", "lambda-engine-a", engine.port)
        engine.generate_twice(api_key=tenant_key)
        wait_for(lambda: cache_of(api, "lambda").get("podsRead") == 1, "a reading as the operator's admin")
        # Without the admins file, the same reads are refused, and said to be.
        admins_file.write_text(json.dumps({"admins": []}))
        refused = wait_for(lambda: (c := cache_of(api, "lambda")).get("podsUnread") == 1 and c, "a refused read")
        assert refused["pods"][0]["error"] == "GetCacheStats failed: UNAUTHENTICATED"


def _config_map(api: client.ApiClient, name: str) -> dict[str, str] | None:
    try:
        return client.CoreV1Api(api).read_namespaced_config_map(name, NAMESPACE).data
    except client.ApiException as error:
        if error.status == 404:
            return None
        raise

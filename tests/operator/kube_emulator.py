"""An in-memory Kubernetes API (kmock's emulator) served over real HTTP from a background thread, and the
real kopf operator running against it. (A uniquely named module, not conftest.py, so tests can import it.)"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import yaml

from prefixcache.operator.schema import GROUP, KIND, PLURAL, VERSION


class EmulatedCluster:
    """kmock's KubernetesEmulator on 127.0.0.1:<free port>, owned by its own event-loop thread."""

    def __init__(self) -> None:
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        import kmock

        self._stop = asyncio.Event()
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            self.emulator = emulator
            emulator.resources.load_bundled()
            crd = emulator.resources[f"{GROUP}/{VERSION}/{PLURAL}"]
            crd.kind, crd.namespaced, crd.subresources = KIND, True, {"status"}
            crd.verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
            self.url = str(server.url).rstrip("/")
            self._started.set()
            await self._stop.wait()

    def __enter__(self) -> EmulatedCluster:
        self._thread.start()
        if not self._started.wait(timeout=30):
            raise RuntimeError("the Kubernetes emulator did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def write_kubeconfig(self, path: Path) -> Path:
        kubeconfig = {
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "test"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        }
        path.write_text(yaml.safe_dump(kubeconfig))
        return path


@contextlib.contextmanager
def running_operator() -> Iterator[object]:
    """The real operator module under kopf, in a thread, against whatever KUBECONFIG points at."""
    import kopf
    from kopf.testing import KopfRunner

    settings = kopf.OperatorSettings()
    settings.posting.enabled = False  # kmock cannot take kopf's Event objects (generateName twice)
    settings.watching.server_timeout = 5
    settings.execution.default_backoff = 0.5  # a handler that fails is retried within a test's patience
    with KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "prefixcache.operator.handlers"],
                    settings=settings, timeout=60) as runner:
        yield runner

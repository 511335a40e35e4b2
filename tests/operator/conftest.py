"""Fixtures for the operator tests."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kube_emulator import EmulatedCluster, running_operator
from kubernetes import client, config


@pytest.fixture(scope="module")
def emulated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedCluster]:
    pytest.importorskip("kmock", reason="kmock (the pip-installable Kubernetes API emulator) is not installed")
    with EmulatedCluster() as cluster:
        kubeconfig = cluster.write_kubeconfig(tmp_path_factory.mktemp("kube") / "config")
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("KUBECONFIG", str(kubeconfig))
            # kopf logs in through the official client, which read $KUBECONFIG when it was imported.
            patch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
            yield cluster


@pytest.fixture(scope="module")
def operator(emulated_cluster: EmulatedCluster) -> Iterator[Any]:
    """The real operator under kopf for a module's tests, failing them if it raised."""
    with running_operator() as runner:
        yield runner
    assert runner.exception is None, runner.output[-4000:]


@pytest.fixture(scope="module")
def api(emulated_cluster: EmulatedCluster) -> client.ApiClient:
    return config.new_client_from_config()

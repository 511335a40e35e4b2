"""Fixtures for the operator tests."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from kube_emulator import EmulatedCluster


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

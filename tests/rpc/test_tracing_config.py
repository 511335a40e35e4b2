"""Which exporter the OTEL_* environment selects (the SDK reads the rest itself)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

from prefixcache.rpc.tracing import _configured_exporters, service_resource

OTEL_VARS = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
             "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME",
             "OTEL_RESOURCE_ATTRIBUTES")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


def test_nothing_configured_means_no_exporter() -> None:
    assert _configured_exporters() == []


def test_an_otlp_endpoint_alone_turns_otlp_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4317")
    assert [type(e) for e in _configured_exporters()] == [OTLPSpanExporter]


def test_an_empty_exporter_setting_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", " ")
    assert _configured_exporters() == []
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert [type(e) for e in _configured_exporters()] == [OTLPSpanExporter]


def test_exporters_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console, otlp")
    assert [type(e) for e in _configured_exporters()] == [ConsoleSpanExporter, OTLPSpanExporter]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert _configured_exporters() == []  # an explicit "none" wins over an endpoint


def test_an_unknown_exporter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        _configured_exporters()


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"])
def test_otlp_over_http_is_refused_not_sent_to_a_grpc_exporter(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv(variable, "http/protobuf")
    with pytest.raises(ValueError, match=f"{variable}: 'http/protobuf' is not supported"):
        _configured_exporters()
    monkeypatch.setenv(variable, "grpc")
    assert [type(e) for e in _configured_exporters()] == [OTLPSpanExporter]


@pytest.mark.parametrize(("environment", "name"), [
    ({}, "prefixcache-scheduler"),
    ({"OTEL_SERVICE_NAME": "chat-engine"}, "chat-engine"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=chat-engine,deployment.environment=prod"}, "chat-engine"),
])
def test_the_service_name_comes_from_the_environment_first(monkeypatch, environment: dict[str, str], name: str) -> None:
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    assert service_resource("prefixcache-scheduler").attributes["service.name"] == name


def test_otel_sdk_disabled_turns_every_exporter_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert _configured_exporters() == []


def test_stopping_with_an_unreachable_collector_is_bounded() -> None:
    """The exporter retries with backoff against a dead endpoint; the service still stops promptly."""
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead_endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    script = textwrap.dedent("""
        import time
        from prefixcache.rpc.tracing import configure_tracing, shutdown_tracing, tracer
        assert configure_tracing("test")
        with tracer("test").start_as_current_span("lost"):
            pass
        started = time.monotonic()
        shutdown_tracing(timeout_s=1.0)
        print(time.monotonic() - started)
    """)
    environment = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    environment["OTEL_EXPORTER_OTLP_ENDPOINT"] = dead_endpoint
    result = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) < 2.0
    assert "dropped" in result.stderr or float(result.stdout) < 1.0


@pytest.mark.parametrize(("variable", "value"), [("OTEL_TRACES_EXPORTER", "bogus"),
                                                 ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
                                                 ("OTEL_EXPORTER_OTLP_TIMEOUT", "ten"),
                                                 ("OTEL_BSP_MAX_QUEUE_SIZE", "-1")])
def test_a_service_refuses_an_otel_setting_in_one_line_naming_it(variable: str, value: str) -> None:
    environment = {key: v for key, v in os.environ.items() if not key.startswith("OTEL_")}
    environment[variable] = value
    if variable != "OTEL_TRACES_EXPORTER":
        environment["OTEL_TRACES_EXPORTER"] = "otlp"
    # The scheduler needs neither a model nor its peers to get as far as tracing.
    command = [sys.executable, "-m", "prefixcache.cli.main", "scheduler", "--host", "127.0.0.1",
               "--port", "0", "--tokenizer", "127.0.0.1:1", "--worker", "127.0.0.1:1"]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr
    assert f"{variable}: {value!r}" in result.stderr or f"{variable}: unsupported exporter {value!r}" in result.stderr

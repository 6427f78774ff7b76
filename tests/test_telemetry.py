"""Log filters for third-party noise on calls that ended on the client's side."""

from __future__ import annotations

import logging
import re
import tomllib
from pathlib import Path

import pytest
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from compactd import telemetry
from compactd.errors import ConfigError


def test_grpc_s_error_for_a_send_the_client_abandoned_becomes_one_debug_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    telemetry.quiet_cancelled_stream_detach()
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    with caplog.at_level(logging.DEBUG, logger="grpc._cython.cygrpc"):
        try:
            raise RuntimeError("execute_batch failed")
        except RuntimeError:
            grpc_log.exception(
                "ExecuteBatchError raised in core by servicer method [%s]",
                "/compactd.v1.SessionService/ListEvents",
            )
            grpc_log.exception("Unexpected [%s] raised by servicer method", "KeyError")
    abandoned, other = caplog.records
    assert (abandoned.levelno, abandoned.exc_info) == (logging.DEBUG, None)
    assert "/compactd.v1.SessionService/ListEvents" in abandoned.getMessage()
    assert other.levelno == logging.ERROR  # other errors stay errors
    assert other.exc_info is not None


ROOT = Path(__file__).resolve().parents[1]


def test_no_module_uses_opentelemetry_s_private_helpers() -> None:
    """The SDK's private modules change without notice (the semantic conventions' published
    ``_incubating`` names are not such a module)."""
    private = re.compile(r"^\s*(?:from|import) opentelemetry\.sdk\S*\._", re.MULTILINE)
    users = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "server" / "compactd").rglob("*.py")
        if private.search(path.read_text(encoding="utf-8"))
    ]
    assert users == []


def test_the_opentelemetry_sdk_has_an_upper_bound() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (sdk,) = [d for d in project["dependencies"] if d.startswith("opentelemetry-sdk")]
    assert "<" in sdk


@pytest.mark.parametrize(
    ("variables", "traces", "metrics"),
    [
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
         ["otlp_proto_http"], []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ["otlp_proto_grpc"],
         ["otlp_proto_grpc"]),
        ({"OTEL_TRACES_EXPORTER": "console, otlp", "OTEL_METRICS_EXPORTER": "none"},
         ["console", "otlp_proto_grpc"], []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "TRUE"}, [], []),
    ],
)  # fmt: skip
def test_the_exporters_follow_the_otel_variables(
    monkeypatch: pytest.MonkeyPatch,
    variables: dict[str, str],
    traces: list[str],
    metrics: list[str],
) -> None:
    for name in list(telemetry.os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert (telemetry.exporter_names("traces"), telemetry.exporter_names("metrics")) == (
        traces,
        metrics,
    )


def test_an_unknown_otlp_protocol_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        telemetry.exporter_names("traces")


def test_without_a_reader_or_an_exporter_metrics_are_not_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in list(telemetry.os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    assert isinstance(telemetry.meter_provider_from_env(), NoOpMeterProvider)
    reader = InMemoryMetricReader()
    assert isinstance(telemetry.meter_provider_from_env([reader]), SdkMeterProvider)

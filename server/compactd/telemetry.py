"""Traces and metrics set up the standard way, once, at the composition root.

Business code depends on ``opentelemetry-api`` only and receives providers; this module builds the
SDK ones from the standard ``OTEL_*`` variables, as the SDK's own configuration reads them (the
exporters are the packages' ``opentelemetry_{traces,metrics}_exporter`` entry points; the SDK's
configuration module is private, so it is not used):

* the exporters are the ones ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` name (``otlp``,
  ``console``, ``prometheus``, ``none``), with ``otlp`` meaning gRPC or HTTP/protobuf as
  ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or the per-signal ``..._TRACES_PROTOCOL``) says; when the
  exporter variable is unset and an OTLP endpoint variable is set, ``otlp`` is implied;
* each exporter reads its own endpoint, headers, TLS, timeout and compression variables
  (``OTEL_EXPORTER_OTLP_ENDPOINT`` and the per-signal ones);
* the resource reads ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (default service name
  ``compactd``); the sampler ``OTEL_TRACES_SAMPLER``; ``OTEL_SDK_DISABLED=true`` turns every
  OpenTelemetry export off (the start-up log says so), but not compactd's own ``/metrics``.

Nothing is exported when no variable asks for it. The Prometheus endpoint is compactd's own
setting (``metrics_listen``), so its address is logged at start and can be port 0 in tests.
Tests pass their own providers (the global ones can be set only once per process).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import entry_points
from typing import Any, Literal

import httpx
from opentelemetry import trace
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
from opentelemetry.metrics import MeterProvider, NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from compactd import __version__
from compactd.errors import ConfigError

INSTRUMENTATION = "compactd"
Signal = Literal["traces", "metrics"]
_ENDPOINTS = {
    "traces": "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "metrics": "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
}
_EXPORTER_VARIABLES = {"traces": "OTEL_TRACES_EXPORTER", "metrics": "OTEL_METRICS_EXPORTER"}
_PROTOCOLS = {
    "traces": "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "metrics": "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
}
_OTLP_BY_PROTOCOL = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}


def resource() -> Resource:
    """The service's resource: ``OTEL_*`` attributes, ``service.name`` defaulting to compactd."""
    detected = Resource.create({"service.version": __version__})
    if "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        return detected
    return detected.merge(Resource({SERVICE_NAME: INSTRUMENTATION}))


def sdk_disabled() -> bool:
    """Whether ``OTEL_SDK_DISABLED`` is ``true``: no OpenTelemetry exporter runs, and the SDK's
    providers hand out no-op tracers and meters."""
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def exporter_names(signal: Signal) -> list[str]:
    """The SDK exporter entry points the environment selects for ``signal`` (maybe none).

    Raises:
        ConfigError: ``otlp`` with a protocol variable naming neither ``grpc`` nor
            ``http/protobuf``.
    """
    if sdk_disabled():
        return []
    names = os.environ.get(_EXPORTER_VARIABLES[signal], "")
    if not names.strip():
        endpoint = os.environ.get(_ENDPOINTS[signal]) or os.environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        names = "otlp" if endpoint else ""
    selected = [name.strip() for name in names.split(",") if name.strip()]
    return [_entry_point(name, signal) for name in selected if name.lower() != "none"]


def _entry_point(name: str, signal: Signal) -> str:
    """``otlp`` as the entry point its protocol variable selects (gRPC unless it says HTTP)."""
    if name != "otlp":
        return name
    for variable in (_PROTOCOLS[signal], "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = os.environ.get(variable, "").strip()
        if protocol:
            if protocol not in _OTLP_BY_PROTOCOL:
                raise ConfigError(
                    f"{variable}={protocol!r}: expected one of {', '.join(_OTLP_BY_PROTOCOL)}"
                )
            return _OTLP_BY_PROTOCOL[protocol]
    return _OTLP_BY_PROTOCOL["grpc"]


def _exporters(signal: Signal) -> list[type]:
    """The exporter classes of ``exporter_names(signal)``, from their packages' entry points."""
    group = f"opentelemetry_{signal}_exporter"
    found = []
    for name in exporter_names(signal):
        points = entry_points(group=group, name=name)
        if not points:
            raise ConfigError(
                f"{_EXPORTER_VARIABLES[signal]}: no installed exporter is named {name!r}"
            )
        found.append(next(iter(points)).load())
    return found


def tracer_provider_from_env() -> trace.TracerProvider:
    """An SDK tracer provider exporting to what the ``OTEL_*`` variables select; a no-op one
    when they select no exporter: a span nothing exports is per-call work for nothing (opening a
    call's server span cost about half of an append's own handler), and a caller's W3C trace
    context still reaches the log lines and the summary calls' ``traceparent``."""
    exporters = _exporters("traces")
    if not exporters:
        return trace.NoOpTracerProvider()
    provider = TracerProvider(resource=resource())
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter()))
    return provider


def meter_provider_from_env(readers: Sequence[MetricReader] = ()) -> MeterProvider:
    """An SDK meter provider with ``readers`` and what the ``OTEL_*`` variables select; a no-op
    one when there is neither: a measurement no reader collects is per-call work for nothing
    (recording each RPC's duration cost a tenth of an empty call).

    ``readers`` are compactd's own (the ``metrics_listen`` endpoint): with ``OTEL_SDK_DISABLED``
    the provider still records for them, and exports nowhere else.
    """
    selected: list[MetricReader] = list(readers)
    for exporter in _exporters("metrics"):
        if issubclass(exporter, MetricExporter):
            selected.append(PeriodicExportingMetricReader(exporter()))
        elif issubclass(exporter, MetricReader):  # a pull reader (prometheus on its own port)
            selected.append(exporter())
        else:
            name = exporter.__name__
            raise ConfigError(f"OTEL_METRICS_EXPORTER: {name} is not a metric exporter")
    if not selected:
        return NoOpMeterProvider()
    if readers and sdk_disabled():
        with _sdk_enabled():
            return SdkMeterProvider(resource=resource(), metric_readers=selected)
    return SdkMeterProvider(resource=resource(), metric_readers=selected)


@contextmanager
def _sdk_enabled() -> Iterator[None]:
    """``OTEL_SDK_DISABLED`` unset while an SDK provider is built (it reads the variable once,
    in its constructor, and offers no argument for it); set again right after."""
    value = os.environ.pop("OTEL_SDK_DISABLED")
    try:
        yield
    finally:
        os.environ["OTEL_SDK_DISABLED"] = value


def export_target(signal: Signal) -> str:
    """Where ``signal`` goes, for the start-up log: ``otlp_proto_http http://...`` or ``off``
    (``off (OTEL_SDK_DISABLED)`` when the variable turned exporting off)."""
    names = exporter_names(signal)
    if not names:
        return "off (OTEL_SDK_DISABLED)" if sdk_disabled() else "off"
    endpoint = os.environ.get(_ENDPOINTS[signal]) or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return ", ".join(
        f"{name} {endpoint}" if endpoint and "otlp" in name else name for name in names
    )


def instrument_http_client(provider: trace.TracerProvider) -> Callable[[httpx.AsyncClient], None]:
    """A hook tracing each summarizer HTTP client with ``provider`` (``traceparent`` included)."""

    def instrument(client: httpx.AsyncClient) -> None:
        HTTPXClientInstrumentor.instrument_client(client, tracer_provider=provider)

    return instrument


class PrometheusEndpoint:
    """A Prometheus ``/metrics`` endpoint on ``listen`` (``HOST:PORT``; port 0 picks one).

    ``reader`` goes into the meter provider; ``start`` binds and serves from a daemon thread;
    ``stop`` closes the socket and unregisters the reader. prometheus-client serves its default
    registry, where the reader registers itself.
    """

    def __init__(self, listen: str) -> None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        host, _, port = listen.rpartition(":")
        self._address = (host.strip("[]"), int(port))
        self.reader = PrometheusMetricReader()
        self._server: Any = None
        self.port = 0

    @property
    def url(self) -> str:
        """The scrape URL."""
        return f"http://{self._address[0]}:{self.port}/metrics"

    def start(self) -> None:
        """Bind and serve."""
        from prometheus_client import start_http_server

        self._server, _ = start_http_server(self._address[1], addr=self._address[0])
        self.port = self._server.server_port

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _CancelledStreamDetach(logging.Filter):
    """Drops the gRPC instrumentation's "Failed to detach context" error on cancelled streams.

    When a client cancels a server-streaming call (a WatchPressure reader going away), the aio
    server interceptor ends its span in another context and OpenTelemetry logs a harmless
    ValueError at ERROR (opentelemetry-python-contrib issue 2357). Only that message is dropped.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Failed to detach context"


class _AbandonedSend(logging.Filter):
    """Turns grpc's "ExecuteBatchError raised in core by servicer method" ERROR, with its
    traceback, into one DEBUG line.

    grpc.aio logs it when a handler's pending send fails in gRPC core, which is what a client
    that cancels a stream (or goes away) while a large response is being written causes: the
    call is over, the client knows why, and the server has nothing to mend.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("ExecuteBatchError raised in core by servicer"):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info, record.exc_text = None, None
            record.msg, record.args = "%s (the call ended meanwhile)", (record.getMessage(),)
        return True


_DETACH_FILTER = _CancelledStreamDetach()
_SEND_FILTER = _AbandonedSend()


def quiet_cancelled_stream_detach() -> None:
    """Install the filters above on the ``opentelemetry.context`` and grpc's own loggers
    (idempotent)."""
    for name, quiet in (
        ("opentelemetry.context", _DETACH_FILTER),
        ("grpc._cython.cygrpc", _SEND_FILTER),
    ):
        logger = logging.getLogger(name)
        if quiet not in logger.filters:
            logger.addFilter(quiet)


def shutdown(provider: Any) -> None:
    """Flush and stop exporting (no-op for providers without ``shutdown``)."""
    stop = getattr(provider, "shutdown", None)
    if callable(stop):
        stop()

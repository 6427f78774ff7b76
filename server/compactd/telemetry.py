"""Tracing setup, done once at the composition root.

Business code depends on ``opentelemetry-api`` only and receives a ``TracerProvider``; this module
builds the SDK provider: OTLP/gRPC export when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the traces
variant) is set, nothing exported otherwise. Tests pass their own provider with an in-memory
exporter.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from compactd import __version__

INSTRUMENTATION = "compactd"


def tracer_provider_from_env(environ: Mapping[str, str] | None = None) -> trace.TracerProvider:
    """An SDK provider exporting over OTLP/gRPC when the standard endpoint variables are set."""
    env = os.environ if environ is None else environ
    resource = Resource.create(
        {"service.name": env.get("OTEL_SERVICE_NAME", "compactd"), "service.version": __version__}
    )
    provider = TracerProvider(resource=resource)
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # Read from ``env``, not only ``os.environ`` as the exporter would on its own, so a
        # caller's mapping configures where spans go.
        insecure = env.get("OTEL_EXPORTER_OTLP_TRACES_INSECURE") or env.get(
            "OTEL_EXPORTER_OTLP_INSECURE"
        )
        exporter = OTLPSpanExporter(
            endpoint=endpoint,
            insecure=None if insecure is None else insecure.strip().lower() == "true",
        )
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class _CancelledStreamDetach(logging.Filter):
    """Drops the gRPC instrumentation's "Failed to detach context" error on cancelled streams.

    When a client cancels a server-streaming call (a WatchPressure reader going away), the aio
    server interceptor ends its span in another context and OpenTelemetry logs a harmless
    ValueError at ERROR (opentelemetry-python-contrib issue 2357). Only that message is dropped.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Failed to detach context"


_DETACH_FILTER = _CancelledStreamDetach()


def quiet_cancelled_stream_detach() -> None:
    """Install the filter above on the ``opentelemetry.context`` logger (idempotent)."""
    context_log = logging.getLogger("opentelemetry.context")
    if _DETACH_FILTER not in context_log.filters:
        context_log.addFilter(_DETACH_FILTER)


def shutdown(provider: trace.TracerProvider) -> None:
    """Flush and stop exporting (no-op for providers without ``shutdown``)."""
    stop = getattr(provider, "shutdown", None)
    if callable(stop):
        stop()

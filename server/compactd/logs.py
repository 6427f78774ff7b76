"""Structured logging: one JSON object per line (or plain text), correlated with traces.

Every record carries, when known, the current span's ``trace_id`` and ``span_id`` (W3C hex, the
ids a trace backend shows) and the ``session_id`` and ``compaction_id`` of the work it belongs
to. The ids come from the OpenTelemetry context and from ``bind``, which the RPC interceptor calls
with each request's session id and the bracket with its compaction id; both live in context
variables, so each RPC's task sees only its own. ``extra`` fields passed to a log call are kept
(and win).

Kept by hand rather than through ``opentelemetry-instrumentation-logging``: that package replaces
the process-wide LogRecord factory and, in current releases, also installs an OTLP log handler on
the root logger; it stamps trace ids only, and the session and compaction ids need this module's
context variables anyway.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Final

from opentelemetry import trace

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_CONTEXT: Final[contextvars.ContextVar[dict[str, str] | None]] = contextvars.ContextVar(
    "compactd_log_context", default=None
)
#: The correlation fields, in the order they are written.
CORRELATION: Final = ("trace_id", "span_id", "session_id", "compaction_id")


def bind(**fields: str) -> None:
    """Add ``fields`` (``session_id``, ``compaction_id``) to this task's later log records."""
    _CONTEXT.set({**(_CONTEXT.get() or {}), **fields})


class CorrelationFilter(logging.Filter):
    """Stamps the trace, span, session and compaction ids on every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        fields: dict[str, str] = dict(_CONTEXT.get() or {})
        if context.is_valid:
            fields["trace_id"] = trace.format_trace_id(context.trace_id)
            fields["span_id"] = trace.format_span_id(context.span_id)
        for key, value in fields.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: time, level, logger, message and every extra field."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...`` with the correlation ids and extras."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extras = [
            f"{key}={value}"
            for key, value in record.__dict__.items()
            if key not in _STANDARD and not key.startswith("_")
        ]
        return " ".join([text, *extras])


def configure(level: str = "INFO", fmt: str = "json") -> None:
    """Route the root logger to stderr in the chosen format, with correlation ids."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(CorrelationFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

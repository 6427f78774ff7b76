"""The summary request as OpenTelemetry GenAI telemetry: a client span and the client metrics.

A model-backed summary is one ``chat {model}`` span of kind CLIENT with the current GenAI
semantic conventions' attributes (``gen_ai.operation.name``, ``gen_ai.provider.name``,
``gen_ai.request.*``, ``gen_ai.response.*``, ``gen_ai.usage.*``, ``server.address``/``port``,
``error.type`` on failure); the HTTP client span of the request (httpx instrumentation) is its
child, so the ``traceparent`` a gateway receives continues the agent's trace. The extractive
summarizer calls no model: it gets no GenAI span and no GenAI metrics.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as genai
from opentelemetry.semconv.attributes import error_attributes, server_attributes
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode, Tracer

from compactd.metrics import Metrics
from compactd.providers.base import Summarizer, SummaryError, SummaryRequest, SummaryResult
from compactd.providers.extractive import ExtractiveSummarizer
from compactd.routes import Route
from compactd.v1 import events_pb2


def calls_a_model(summarizer: Summarizer) -> bool:
    """Whether ``summarizer`` sends the request to a model (everything but extractive)."""
    return not isinstance(summarizer, ExtractiveSummarizer)


def input_tokens(usage: events_pb2.Usage) -> int:
    """GenAI ``input_tokens``: every input token, cached ones included."""
    return usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens


@dataclass
class SummaryCall:
    """One summary in progress; ``answered`` or ``failed`` records how it ended."""

    summarizer: Summarizer
    metrics: Metrics
    span: Span = INVALID_SPAN
    attributes: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    ended: bool = False

    def answered(self, result: SummaryResult) -> None:
        """The summary came back."""
        usage = result.usage
        inputs = input_tokens(usage) if usage is not None else 0
        outputs = usage.output_tokens if usage is not None else 0
        self.span.set_attribute(genai.GEN_AI_RESPONSE_MODEL, result.model)
        self.span.set_attribute(genai.GEN_AI_RESPONSE_FINISH_REASONS, [result.finish_reason])
        if result.response_id:
            self.span.set_attribute(genai.GEN_AI_RESPONSE_ID, result.response_id)
        if usage is not None:
            self.span.set_attribute(genai.GEN_AI_USAGE_INPUT_TOKENS, inputs)
            self.span.set_attribute(genai.GEN_AI_USAGE_OUTPUT_TOKENS, outputs)
            self.span.set_attribute(
                genai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, usage.cache_read_tokens
            )
        self._end("ok", inputs, outputs)

    def failed(self, error: SummaryError) -> None:
        """The summary request failed with ``error``."""
        self.span.set_attribute(error_attributes.ERROR_TYPE, error.reason)
        self.span.set_status(Status(StatusCode.ERROR, error.message))
        self.attributes[error_attributes.ERROR_TYPE] = error.reason
        self._end(error.reason, 0, 0)

    def _end(self, outcome: str, inputs: int, outputs: int) -> None:
        self.ended = True
        seconds = time.perf_counter() - self.started
        self.metrics.summary(self.summarizer.name, outcome, seconds)
        if calls_a_model(self.summarizer):
            self.metrics.model_call(self.attributes, seconds, inputs, outputs)


@contextmanager
def summary_call(
    tracer: Tracer,
    metrics: Metrics,
    target: Route,
    request: SummaryRequest,
    summarizer: Summarizer,
) -> Iterator[SummaryCall]:
    """The GenAI span (model-backed summarizers only) around one ``summarize`` call."""
    if not calls_a_model(summarizer):
        yield SummaryCall(summarizer, metrics)
        return
    attributes = _request_attributes(target, request)
    with tracer.start_as_current_span(
        f"chat {target.model}",
        kind=SpanKind.CLIENT,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        call = SummaryCall(summarizer, metrics, span, _metric_attributes(attributes))
        yield call


def _request_attributes(target: Route, request: SummaryRequest) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        genai.GEN_AI_OPERATION_NAME: genai.GenAiOperationNameValues.CHAT.value,
        genai.GEN_AI_PROVIDER_NAME: target.provider,
        genai.GEN_AI_REQUEST_MODEL: target.model,
        genai.GEN_AI_REQUEST_MAX_TOKENS: request.max_tokens,
    }
    config = request.config
    if config.HasField("temperature"):
        attributes[genai.GEN_AI_REQUEST_TEMPERATURE] = config.temperature
    if config.HasField("top_p"):
        attributes[genai.GEN_AI_REQUEST_TOP_P] = config.top_p
    if target.base_url:
        parts = urlsplit(target.base_url)
        if parts.hostname:
            attributes[server_attributes.SERVER_ADDRESS] = parts.hostname
            attributes[server_attributes.SERVER_PORT] = parts.port or (
                443 if parts.scheme == "https" else 80
            )
    return attributes


def _metric_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """The low-cardinality subset the GenAI client metrics carry."""
    keep = (genai.GEN_AI_OPERATION_NAME, genai.GEN_AI_PROVIDER_NAME, genai.GEN_AI_REQUEST_MODEL,
            server_attributes.SERVER_ADDRESS, server_attributes.SERVER_PORT)  # fmt: skip
    return {key: attributes[key] for key in keep if key in attributes}

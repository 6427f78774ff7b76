"""The summarizer seam: one request type, one result type, one method.

The compaction bracket builds a ``SummaryRequest`` (the system head and the shadowed span,
already projected, the latest header's tools, the target route and our instruction) and hands it
to a ``Summarizer``. Any deployment can plug in its own summarizer by implementing ``summarize``;
the bracket keeps pricing, selection, validation and the log to itself.

Failures are ``SummaryError``s: a stable ``reason`` (``SUMMARY_FAILED``, ``UNSUPPORTED_CONTENT``,
``CONTEXT_WINDOW_EXCEEDED``, ``IMAGE_OFFLOAD_REQUIRED``, ``RATE_LIMITED``, ``TIMEOUT`` ...), whether
trying again may help, and, for image offload, how many input images the provider wants removed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from compactd.core.probes import SpanFacts
from compactd.errors import CompactdError
from compactd.reasons import Reason
from compactd.v1 import events_pb2, session_service_pb2


@dataclass(frozen=True)
class SummaryRequest:
    """Everything a summarizer needs for one summary.

    Attributes:
        messages: The system head (when it projects to a message) and the pinned-state message
            (when a pin is in force), followed by the shadowed span, already projected (image
            offloads applied), in surface order.
        tools: The latest ``request/header``'s tool declarations, in order.
        config: The summary target (provider, model) and sampling settings.
        instruction: The final user message text (``prompts.compaction_instruction(focus)``).
        max_tokens: Output cap for the summary, including provider-counted reasoning tokens.
        pins: The pins in force (key -> text; ``core.pins``). The pinned-state message that
            renders them follows the system head in ``messages`` (``Message.pinned_state``);
            they are kept outside every checkpoint, so a summary need not repeat them.
        span_tokens: The span's route price, what the quality gate measures a checkpoint's
            reduction against; 0 when unknown (a summarizer that takes a share of the span
            prices it itself).
        room_tokens: The most the summary may take for the request to fit the window (a
            request over it cuts its summary to the room left beside the floor; ``max_tokens``
            is no larger); 0 when nothing but ``max_tokens`` bounds it. A summarizer that writes
            no model output (the extractive one) is bounded by its share of the span and by
            this room, not by ``max_tokens``, which caps a model's generation.
        checkpoint_tokens: The route price of the checkpoint a summary text becomes (framed,
            with its recall handle: what the quality gate measures against ``span_tokens``);
            None when unknown. A summarizer that fits a share of the span counts with it instead
            of estimating.
    """

    messages: Sequence[session_service_pb2.Message]
    tools: Sequence[events_pb2.ToolDeclaration]
    config: events_pb2.RequestConfig
    instruction: str
    max_tokens: int
    pins: Mapping[str, str] = field(default_factory=dict)
    span_tokens: int = 0
    room_tokens: int = 0
    checkpoint_tokens: Callable[[str], int] | None = None


@dataclass(frozen=True)
class SummaryResult:
    """A summary and its accounting.

    Attributes:
        text: The summary text only: reasoning and tool calls never enter it.
        usage: Provider-reported usage summed over every call that produced ``text``; None when
            the summarizer calls no model or the provider reported none.
        provider: Provider that wrote the summary.
        model: Model that wrote the summary (as reported by the provider when it says).
        finish_reason: The provider's stop reason for the final call, e.g. ``stop``.
        response_id: The provider's id of the final call's response (``chatcmpl-...``); empty
            when it sent none or no model was called.
        span_facts: The facts of the span (``probes.span_facts`` of ``request.messages`` without
            the system head) when the summarizer extracted them anyway: the quality gate then
            reuses them instead of extracting them again. None otherwise.
    """

    text: str
    usage: events_pb2.Usage | None
    provider: str
    model: str
    finish_reason: str
    span_facts: SpanFacts | None = None
    response_id: str = ""


@runtime_checkable
class Summarizer(Protocol):
    """Writes one summary of a span. The only method a custom summarizer implements."""

    name: str

    async def summarize(self, request: SummaryRequest) -> SummaryResult:
        """Summarize ``request.messages`` following ``request.instruction``.

        Raises:
            SummaryError: The summary could not be produced; ``reason`` says why.
        """
        ...


class SummaryError(CompactdError):
    """A summary request failed.

    Attributes:
        reason: Canonical failure reason (module constants above).
        retryable: Whether sending the same request again may succeed (rate limits, overload,
            connection loss, timeouts).
        offload_images: For ``IMAGE_OFFLOAD_REQUIRED``, how many input images the provider needs
            removed; 0 when the provider did not say.
        status: The provider's HTTP status, when the failure came from one.
        retry_after: Seconds the provider asked us to wait, when it said.
    """

    reason = Reason.SUMMARY_FAILED

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        retryable: bool = False,
        offload_images: int = 0,
        status: int | None = None,
        retry_after: float | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        details = dict(metadata or {})
        details["retryable"] = "true" if retryable else "false"
        if offload_images:
            details["offload_images"] = str(offload_images)
        if status is not None:
            details["http_status"] = str(status)
        super().__init__(message, reason=reason, metadata=details)
        self.retryable = retryable
        self.offload_images = offload_images
        self.status = status
        self.retry_after = retry_after

"""The one table of provider failures compactd recognizes, and the classifier that reads it.

Every path that meets a provider error classifies it here: the ``openai`` summarizer's failed
summary requests, and a runtime's own failed requests sent to ``ClassifyProviderError`` or to
``RecoverFromError`` as a raw error (HTTP status, body, headers), so every language gets the same
answer. ``TABLE`` holds one ``Rule`` per recognized failure, most specific first; the first rule
that matches wins. Each rule names the provider family whose real error body it was written
against (the test suite replays those bodies through a real HTTP server):

- context-window overflow (``CONTEXT_WINDOW_EXCEEDED``): OpenAI and llama-cpp-python (code
  ``context_length_exceeded``), llama.cpp's ``llama-server`` (type ``exceed_context_size_error``,
  an integer ``code``, ``n_prompt_tokens`` / ``n_ctx``), Anthropic (``prompt is too long``),
  Gemini (``input token count ... exceeds the maximum``), DeepSeek and vLLM (``maximum context
  length is N tokens``), then generic wording for other OpenAI-compatible servers; the window and
  the prompt's size are read when the provider states them;
- image budget (``IMAGE_OFFLOAD_REQUIRED``, with ``offload_images`` when known): an explicit
  ``offload_images`` field, vLLM's ``At most N image(s)``, generic image-count wording, and 413 on
  a request that carries images;
- rate limit (``RATE_LIMITED``; an exhausted quota is not retryable), authentication
  (``UNAUTHENTICATED``), timeout (``TIMEOUT``), unavailable (``PROVIDER_UNAVAILABLE``: 5xx,
  Anthropic's 529, an error inside a 200 stream); anything else is ``PROVIDER_ERROR``.

Provider wording changes: a failure no rule recognizes is ``PROVIDER_ERROR`` (never a guess), and
a new provider is one more rule with its real body in the tests. Pure functions, no I/O.

Bodies come from providers and from runtimes' callers, so nothing in them is trusted: the table
reads at most the first ``MAX_BODY_BYTES`` of a body, JSON nesting deeper than
``MAX_BODY_DEPTH`` is read as text, and a stated figure no real request can have (above
``MAX_TOKEN_COUNT`` tokens, or ``MAX_IMAGE_COUNT`` images) counts as not stated. Classifying
any body therefore raises nothing and costs what those bounds cost.
"""

from __future__ import annotations

import email.utils
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any, Final

from compactd.core.limits import MAX_TOKEN_COUNT, json_depth
from compactd.reasons import Reason

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_BODY_DEPTH",
    "MAX_IMAGE_COUNT",
    "PROVIDER_ERROR",
    "TABLE",
    "ProviderFailure",
    "Rule",
    "classify",
    "parse_retry_after",
]

#: A failure no rule recognizes.
PROVIDER_ERROR: Final = "PROVIDER_ERROR"
#: The bytes of a body the table reads (real error bodies hold a few hundred): a longer body is
#: read by its start, so every rule's cost is bounded whatever the body's size.
MAX_BODY_BYTES: Final = 16 * 1024
#: The JSON nesting read as an error object (providers nest about five levels); deeper is text,
#: so a hostile body never makes the parser recurse.
MAX_BODY_DEPTH: Final = 32
#: The most images a figure may state (``offload_images`` is an int32 on the wire).
MAX_IMAGE_COUNT: Final = 2**31 - 1


@dataclass(frozen=True)
class ErrorBody:
    """A provider error response, read once: what every rule matches against.

    Attributes:
        status: HTTP status, or None for an error object inside a 200 stream.
        message: The provider's message (``error.message``, ``detail``, or the text itself).
        code: ``error.code`` as text (llama.cpp and Gemini send an integer).
        type: ``error.type``, or Gemini's ``error.status``.
        fields: The error object itself (``{}`` for a text body).
        request_images: Input images the failed request carried, when known.
    """

    status: int | None
    message: str
    code: str = ""
    type: str = ""
    fields: Mapping[str, Any] = field(default_factory=dict)
    request_images: int | None = None

    @property
    def text(self) -> str:
        """Type, code and message, for wording rules."""
        return f"{self.type} {self.code} {self.message}"


@dataclass(frozen=True)
class Figures:
    """What a provider said about sizes: its window and the prompt it refused (tokens)."""

    context_window: int = 0
    prompt_tokens: int = 0
    offload_images: int = 0


_NO_FIGURES: Final = Figures()


@dataclass(frozen=True)
class Rule:
    """One recognized failure.

    Attributes:
        name: ``family/what`` (``llama.cpp/exceed_context_size``), reported with the result.
        reason: The canonical reason it yields.
        retryable: Whether sending the same request again may succeed.
        matches: Whether a response is this failure.
        figures: The sizes the provider states in it.
    """

    name: str
    reason: str
    retryable: bool
    matches: Callable[[ErrorBody], bool]
    figures: Callable[[ErrorBody], Figures] = lambda _: _NO_FIGURES


@dataclass(frozen=True)
class ProviderFailure:
    """A classified provider failure.

    Attributes:
        reason: Canonical reason (module constants).
        message: ``HTTP <status>: <provider message>`` (or ``stream error: ...``), clipped.
        retryable: Whether the same request may succeed later (honour ``retry_after``).
        status: The HTTP status, when there was one.
        rule: The name of the table entry that recognized it (``""``: none did).
        retry_after: Seconds the provider asked to wait, when it said.
        offload_images: For ``IMAGE_OFFLOAD_REQUIRED``, input images to offload (0: unknown).
        context_window: The window the provider states, in tokens (0: not stated).
        prompt_tokens: The refused prompt's size the provider states, in tokens (0: not stated).
    """

    reason: str
    message: str
    retryable: bool
    status: int | None
    rule: str = ""
    retry_after: float | None = None
    offload_images: int = 0
    context_window: int = 0
    prompt_tokens: int = 0


# --- figures ---------------------------------------------------------------------------------

#: The figures a wording states, in order; None for one no real request can have.
Stated = tuple[int | None, ...]


def _ints(pattern: str, bound: int = MAX_TOKEN_COUNT) -> Callable[[str], Stated | None]:
    compiled = re.compile(pattern, re.IGNORECASE)

    def find(text: str) -> Stated | None:
        found = compiled.search(text)
        return tuple(_figure(g, bound) for g in found.groups()) if found else None

    return find


def _figure(digits: str, bound: int) -> int | None:
    """``digits`` as a count up to ``bound``, else None (the length test also spares ``int`` a
    digit run beyond its limit)."""
    digits = digits.lstrip("0") or "0"
    if len(digits) > len(str(bound)):
        return None
    value = int(digits)
    return value if value <= bound else None


def _nth(stated: Stated | None, index: int) -> int:
    """The ``index``th stated figure (0: not stated, or not a real one)."""
    return (stated[index] or 0) if stated else 0


def _count(value: Any, bound: int = MAX_TOKEN_COUNT) -> int:
    """A JSON figure: a positive integer up to ``bound``, else 0 (not stated)."""
    real = isinstance(value, int) and not isinstance(value, bool) and 0 < value <= bound
    return value if real else 0


_WINDOW_IS = _ints(r"maximum context length is (\d+) tokens")
_PROMPT_IS = _ints(
    r"(?:you requested|messages resulted in|request has|prompt contains) (\d+)(?: input)? tokens"
)
# Only a digit run's first digit starts a match (the lookbehind): one attempt per run, not one per
# digit, so a long run costs its length, not its square.
_ANTHROPIC_SIZES = _ints(r"(?<!\d)(\d+) tokens > (\d+) maximum")
_GEMINI_SIZES = _ints(
    r"input token count \(?(\d+)\)? exceeds the maximum number of tokens allowed \(?(\d+)"
)
_IMAGE_LIMIT = _ints(
    r"(?:at most|maximum of|max(?:imum)?(?: is)?|up to|limit(?: is| of)?)\s*(\d+)\s*images?",
    MAX_IMAGE_COUNT,
)


def _worded_figures(body: ErrorBody) -> Figures:
    window, prompt = _WINDOW_IS(body.message), _PROMPT_IS(body.message)
    return Figures(_nth(window, 0), _nth(prompt, 0))


def _llama_figures(body: ErrorBody) -> Figures:
    return Figures(_count(body.fields.get("n_ctx")), _count(body.fields.get("n_prompt_tokens")))


def _anthropic_figures(body: ErrorBody) -> Figures:
    sizes = _ANTHROPIC_SIZES(body.message)
    return Figures(_nth(sizes, 1), _nth(sizes, 0))


def _gemini_figures(body: ErrorBody) -> Figures:
    sizes = _GEMINI_SIZES(body.message)
    return Figures(_nth(sizes, 1), _nth(sizes, 0))


def _offload_count(body: ErrorBody) -> int:
    return _count(body.fields.get("offload_images"), MAX_IMAGE_COUNT)


def _stated_offload(body: ErrorBody) -> Figures:
    return Figures(offload_images=_offload_count(body))


def _offload_over_limit(body: ErrorBody) -> Figures:
    """Images beyond a stated limit, when the request's image count is known."""
    limit = _IMAGE_LIMIT(body.message)
    if limit is None or limit[0] is None or not body.request_images:
        return _NO_FIGURES
    return Figures(offload_images=max(1, body.request_images - limit[0]))


# --- matchers --------------------------------------------------------------------------------


def _worded(pattern: str) -> Callable[[ErrorBody], bool]:
    compiled = re.compile(pattern, re.IGNORECASE)
    return lambda body: bool(compiled.search(body.text))


def _not_rate_limit(match: Callable[[ErrorBody], bool]) -> Callable[[ErrorBody], bool]:
    # A 429 may talk about tokens (per-minute quotas) without being about the window.
    return lambda body: body.status != 429 and match(body)


def _status(*codes: int) -> Callable[[ErrorBody], bool]:
    return lambda body: body.status in codes


_GENERIC_CONTEXT = _worded(
    r"context[ _-]?length|context[ _-]?window|maximum context|context size|exceed_context"
    r"|too many tokens|prompt is too long|input is too long|reduce the length"
    r"|exceeds? the (?:model'?s? )?(?:maximum|max|available)"
)
_IMAGE_WORDING = _worded(
    r"too many images|images? (?:limit|exceed)|(?:number|count) of images|image_limit"
    r"|(?:at most|maximum of|max(?:imum)?|up to|limit of)\s*\d+\s*images?"
)

#: Every recognized failure, most specific first (the first match wins).
TABLE: Final[tuple[Rule, ...]] = (
    # --- the context window ---
    Rule(
        "openai/context_length_exceeded",
        Reason.CONTEXT_WINDOW_EXCEEDED,
        False,
        _not_rate_limit(lambda b: b.code == "context_length_exceeded"),
        _worded_figures,
    ),
    Rule(
        "llama.cpp/exceed_context_size",
        Reason.CONTEXT_WINDOW_EXCEEDED,
        False,
        lambda b: b.type == "exceed_context_size_error",
        _llama_figures,
    ),
    Rule(
        "anthropic/prompt_too_long",
        Reason.CONTEXT_WINDOW_EXCEEDED,
        False,
        _not_rate_limit(_worded(r"prompt is too long")),
        _anthropic_figures,
    ),
    Rule(
        "gemini/input_token_count",
        Reason.CONTEXT_WINDOW_EXCEEDED,
        False,
        # A bounded gap: ``.*`` rescans the line after every "input token count" (quadratic).
        _not_rate_limit(_worded(r"input token count.{0,64}exceeds the maximum number of tokens")),
        _gemini_figures,
    ),
    Rule(
        "deepseek-vllm/maximum_context_length",
        Reason.CONTEXT_WINDOW_EXCEEDED,
        False,
        _not_rate_limit(_worded(r"maximum context length is \d+ tokens")),
        _worded_figures,
    ),
    # --- the image budget (before the generic wording: "exceeds the maximum" of images) ---
    Rule(
        "compactd/offload_images",
        Reason.IMAGE_OFFLOAD_REQUIRED,
        False,
        lambda b: _offload_count(b) > 0,
        _stated_offload,
    ),
    Rule(
        "vllm/image_limit",
        Reason.IMAGE_OFFLOAD_REQUIRED,
        False,
        _worded(r"at most \d+ image\(s\) may be provided"),
        _offload_over_limit,
    ),
    Rule(
        "generic/too_many_images",
        Reason.IMAGE_OFFLOAD_REQUIRED,
        False,
        _IMAGE_WORDING,
        _offload_over_limit,
    ),
    Rule(
        "generic/context_wording",
        Reason.CONTEXT_WINDOW_EXCEEDED,
        False,
        _not_rate_limit(_GENERIC_CONTEXT),
        _worded_figures,
    ),
    Rule(
        "http/413_with_images",
        Reason.IMAGE_OFFLOAD_REQUIRED,
        False,
        lambda b: b.status == 413 and b.request_images != 0,
        _offload_over_limit,
    ),
    Rule("http/413", Reason.CONTEXT_WINDOW_EXCEEDED, False, _status(413)),
    # --- transient and account failures ---
    Rule(
        "openai/insufficient_quota",
        Reason.RATE_LIMITED,
        False,
        lambda b: b.status == 429 and b.code == "insufficient_quota",
    ),
    Rule("http/429", Reason.RATE_LIMITED, True, _status(429)),
    Rule("http/401_403", Reason.UNAUTHENTICATED, False, _status(401, 403)),
    Rule("http/408", Reason.TIMEOUT, True, _status(408)),
    Rule(
        "http/5xx",
        Reason.PROVIDER_UNAVAILABLE,
        True,
        lambda b: b.status is None or b.status >= 500,
    ),
)


def classify(
    status: int | None,
    body: bytes | str,
    headers: Mapping[str, str] | None = None,
    *,
    request_images: int | None = None,
    now: float | None = None,
) -> ProviderFailure:
    """Classify one provider error response with ``TABLE``; raises nothing, whatever the body.

    Args:
        status: HTTP status, or None for an error object inside a 200 stream.
        body: The response body (provider JSON or text); its first ``MAX_BODY_BYTES`` are read.
        headers: Response headers (``retry-after-ms`` / ``retry-after`` are honoured).
        request_images: Input images the failed request carried, when known; with a stated limit
            this gives ``offload_images``.
        now: Current POSIX time, needed only to read an HTTP-date ``retry-after``.
    """
    parsed = read_body(status, body, request_images)
    lowered = {key.lower(): value for key, value in (headers or {}).items()}
    prefix = f"HTTP {status}: " if status is not None else "stream error: "
    rule = next((r for r in TABLE if r.matches(parsed)), None)
    figures = rule.figures(parsed) if rule is not None else _NO_FIGURES
    return ProviderFailure(
        reason=rule.reason if rule is not None else PROVIDER_ERROR,
        message=prefix + _wire_text(_clip(parsed.message)),
        retryable=rule.retryable if rule is not None else False,
        status=status,
        rule=rule.name if rule is not None else "",
        retry_after=parse_retry_after(lowered, now=now),
        offload_images=figures.offload_images,
        context_window=figures.context_window,
        prompt_tokens=figures.prompt_tokens,
    )


def read_body(status: int | None, body: bytes | str, request_images: int | None) -> ErrorBody:
    """The provider's error object from a JSON body (OpenAI's ``{"error": {...}}``, Anthropic's
    ``{"type": "error", "error": {...}}``, vLLM's bare object, Gemini's one-element list) or a
    text body, from the body's first ``MAX_BODY_BYTES``."""
    start = body[:MAX_BODY_BYTES]
    text = start.decode("utf-8", "replace") if isinstance(start, bytes) else start
    parsed = _json(text)
    if parsed is _NOT_JSON:
        return ErrorBody(status, text.strip() or "(empty body)", request_images=request_images)
    if isinstance(parsed, list) and len(parsed) == 1:
        parsed = parsed[0]
    error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    if isinstance(error, str):
        return ErrorBody(status, error, request_images=request_images)
    if not isinstance(error, dict):
        return ErrorBody(status, text, request_images=request_images)
    message = error.get("message") or error.get("detail") or text
    code = error.get("code")
    kind = error.get("type") or error.get("status") or ""
    return ErrorBody(
        status,
        str(message),
        code="" if code is None else str(code),
        type=str(kind),
        fields=error,
        request_images=request_images,
    )


_NOT_JSON: Final = object()


def _json(text: str) -> Any:
    """``text``'s JSON value, or ``_NOT_JSON`` (also for nesting beyond ``MAX_BODY_DEPTH``, and
    for an integer beyond ``int``'s digit limit, which ``json`` refuses with a ValueError)."""
    if json_depth(text) > MAX_BODY_DEPTH:
        return _NOT_JSON
    try:
        return json.loads(text)
    except ValueError:
        return _NOT_JSON


def parse_retry_after(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds to wait from lower-cased ``retry-after-ms`` or ``retry-after`` headers, if any.

    An HTTP date (always GMT; a zone-less one is read as GMT) needs ``now``, POSIX seconds.
    """
    milliseconds = headers.get("retry-after-ms")
    if milliseconds is not None:
        seconds = _float(milliseconds)
        if seconds is not None:
            return max(0.0, seconds / 1000)
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = _float(value)
    if seconds is not None:
        return max(0.0, seconds)
    when = _http_date(value)
    return None if when is None or now is None else max(0.0, when - now)


def _http_date(value: str) -> float | None:
    """POSIX seconds of an HTTP date, or None for text that is none (or beyond ``datetime``)."""
    try:
        when = email.utils.parsedate_to_datetime(value)
        return (when if when.tzinfo is not None else when.replace(tzinfo=UTC)).timestamp()
    except (TypeError, ValueError, OverflowError):
        return None


def _float(value: str) -> float | None:
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _clip(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _wire_text(text: str) -> str:
    """``text`` as a proto string takes it: JSON escapes can make lone surrogates."""
    return text.encode("utf-8", "replace").decode("utf-8")

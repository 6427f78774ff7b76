"""``classify_raw`` and ``classification``: any raw provider error classifies, and fits the wire.

Runtimes hand RecoverFromError and ClassifyProviderError whatever their provider (or anything
between) answered, so the classification must hold for any status, body and headers: it raises
nothing, and every figure it sets is one a real request can have, inside its proto field.
"""

from __future__ import annotations

import email.utils
import json
import math
from datetime import UTC, datetime
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from compactd.core.limits import MAX_TOKEN_COUNT
from compactd.providers.errors import MAX_BODY_BYTES, MAX_IMAGE_COUNT
from compactd.service.recovery import classification, classify_raw
from compactd.v1 import compaction_service_pb2 as cpb

NOW = datetime(2026, 3, 2, 12, 0, tzinfo=UTC).timestamp()
INT32 = (-(2**31), 2**31 - 1)
EDGE_FIGURES = [0, -1, MAX_TOKEN_COUNT, MAX_TOKEN_COUNT + 1, MAX_IMAGE_COUNT + 1, 2**63, 10**20]

# ---- bodies -------------------------------------------------------------------------------------

figures = st.sampled_from(EDGE_FIGURES) | st.integers()
figure_texts = figures.map(str) | st.integers(1, 6000).map(lambda n: "9" * n)
#: The wordings the table reads figures from, with any figure in them.
TEMPLATES = [
    "This model's maximum context length is {} tokens. However, you requested {} tokens.",
    "prompt is too long: {} tokens > {} maximum",
    "The input token count ({}) exceeds the maximum number of tokens allowed ({}).",
    "At most {} image(s) may be provided in one request; limit is {} images",
    "request ({} tokens) exceeds the available context size ({} tokens)",
]
messages = st.builds(str.format, st.sampled_from(TEMPLATES), figure_texts, figure_texts)
json_values = st.recursive(
    st.none() | st.booleans() | figures | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)
error_objects = st.fixed_dictionaries(
    {},
    optional={
        "message": messages | json_values,
        "detail": messages | json_values,
        "type": st.sampled_from(["exceed_context_size_error", "invalid_request_error"]),
        "code": st.sampled_from(["context_length_exceeded", "insufficient_quota", 400]),
        "status": json_values,
        "n_ctx": figures | json_values,
        "n_prompt_tokens": figures | json_values,
        "offload_images": figures | json_values,
    },
)
json_documents: st.SearchStrategy[Any] = st.one_of(
    error_objects.map(lambda error: {"error": error}),
    error_objects.map(lambda error: [{"type": "error", "error": error}]),
    error_objects,
    json_values,
)
#: Bodies no fuzzer is likely to write: deep nesting, a digit run past int()'s limit, a lone
#: surrogate escape, a body longer than the table reads.
EDGE_BODIES = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"error":{"n_ctx":' + b"9" * 5000 + b"}}",
    b'{"error":{"message":"\\ud800 maximum context length is 5 tokens"}}',
    b'{"error":{"message":"' + b"\\u" * 40 + b'"}}',
    b'"' + b'\\"' * MAX_BODY_BYTES,
    b"maximum context length is 100 tokens " * (2 * MAX_BODY_BYTES // 37),
]
bodies = st.one_of(
    st.binary(max_size=2000),
    st.text(max_size=500).map(str.encode),
    messages.map(str.encode),
    json_documents.map(lambda document: json.dumps(document).encode()),
    st.sampled_from(EDGE_BODIES),
)

# ---- headers ------------------------------------------------------------------------------------

http_dates = st.datetimes(timezones=st.none() | st.just(UTC)).map(email.utils.format_datetime)
retry_values = st.one_of(
    http_dates,
    st.floats().map(repr),
    st.integers().map(str),
    st.text(max_size=30),
    st.sampled_from(["1 Jan 99999999999999999999 0:0:0 GMT", "Mon, 32 Jan 2000 00:00:00 GMT"]),
)
headers = st.dictionaries(
    st.sampled_from(["retry-after", "Retry-After", "retry-after-ms", "RETRY-AFTER-MS", "x-other"]),
    retry_values,
    max_size=3,
)


def fits_the_wire(result: cpb.ProviderErrorClassification) -> None:
    """Every figure is a real one, copied into the error, and the message survives a round trip."""
    assert 0 <= result.context_window <= MAX_TOKEN_COUNT
    assert 0 <= result.prompt_tokens <= MAX_TOKEN_COUNT
    assert 0 <= result.offload_images <= MAX_IMAGE_COUNT
    error = result.error
    assert (error.context_window, error.prompt_tokens, error.offload_images) == (
        result.context_window,
        result.prompt_tokens,
        result.offload_images,
    )
    if result.HasField("retry_after_seconds"):
        assert math.isfinite(result.retry_after_seconds)
        assert result.retry_after_seconds >= 0
    assert cpb.ProviderErrorClassification.FromString(result.SerializeToString()) == result


@settings(max_examples=400)
@given(
    status=st.sampled_from([0, 400, 408, 413, 429, 500, 529]) | st.integers(*INT32),
    body=bodies,
    response_headers=headers,
    stated_images=st.none() | st.integers(*INT32),
    session_images=st.none() | st.integers(0, 10_000),
)
def test_any_raw_error_classifies_and_every_figure_fits_its_field(
    status: int,
    body: bytes,
    response_headers: dict[str, str],
    stated_images: int | None,
    session_images: int | None,
) -> None:
    raw = cpb.RawProviderError(http_status=status, body=body, headers=response_headers)
    if stated_images is not None:
        raw.request_images = stated_images

    result = classification(classify_raw(raw, session_images, now=NOW))

    fits_the_wire(result)


@settings(max_examples=200)
@given(document=json_documents, status=st.sampled_from([0, 400, 413, 429, 503]))
def test_any_json_body_classifies_and_every_figure_fits_its_field(
    document: Any, status: int
) -> None:
    raw = cpb.RawProviderError(http_status=status, body=json.dumps(document).encode())

    fits_the_wire(classification(classify_raw(raw, 3, now=NOW)))


def test_an_http_date_retry_after_counts_from_now() -> None:
    in_an_hour = email.utils.formatdate(NOW + 3600, usegmt=True)
    raw = cpb.RawProviderError(http_status=429, headers={"Retry-After": in_an_hour})

    assert classify_raw(raw, now=NOW).retry_after == 3600.0
    assert classify_raw(raw).retry_after is None  # no clock, no date


def test_a_negative_stated_image_count_is_no_count() -> None:
    raw = cpb.RawProviderError(http_status=400, body=b"At most 2 image(s) may be provided.")
    raw.request_images = -4

    assert classify_raw(raw, 5).offload_images == 3  # the session's own count decides

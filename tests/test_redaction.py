"""Redaction: credentials never survive into what compactd logs, stores, traces or returns."""

from __future__ import annotations

import logging

import pytest

from compactd.redaction import REDACTED, RedactingFilter, Redactor, for_routes, install, url_secrets
from compactd.routes import Route

KEY = "sk-proj-AbCdEf0123456789xyzXYZ"


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        (f"Authorization: Bearer {KEY}", KEY),
        ('{"authorization": "Basic dXNlcjpwYXNzd29yZA=="}', "dXNlcjpwYXNzd29yZA=="),
        ("proxy-authorization=Token abcdefghij", "abcdefghij"),
        ("sent bearer eyJhbGciOiJIUzI1NiJ9.e30.sig", "eyJhbGciOiJIUzI1NiJ9"),
        ("api-key: 0123456789abcdef", "0123456789abcdef"),
        ('{"x-api-key":"k-9f8e7d6c5b4a"}', "k-9f8e7d6c5b4a"),
        ("GET /v1/models?key=AIzaFAKEFAKEFAKE&alt=json", "AIzaFAKEFAKEFAKE"),
        ("access_token=ya29.a0AfH6SMB", "ya29.a0AfH6SMB"),
        ("password=hunter22 and more", "hunter22"),
        (f"Incorrect API key provided: {KEY}.", KEY),
        ("key sk-ant-api03-abcdefghijklmnop123", "sk-ant-api03-abcdefghijklmnop123"),
        ("aws AKIAIOSFODNN7EXAMPLE here", "AKIAIOSFODNN7EXAMPLE"),
        ("token ghp_abcdefghijklmnopqrstuvwxyz0123456789", "ghp_abcdefghijklmnopqrstuvwx"),
        ("slack xoxb-1234567890-abcdef", "xoxb-1234567890-abcdef"),
        ("hf hf_abcdefghijklmnopqrstuvwxyz", "hf_abcdefghijklmnopqrstuvwxyz"),
        ("cannot reach https://alice:s3cret@api.example.com/v1", "alice:s3cret"),
        ("proxy http://token@proxy.internal:8080/", "token@"),
    ],
)
def test_credential_shapes_are_redacted(text: str, secret: str) -> None:
    redacted = Redactor()(text)
    assert secret not in redacted
    assert REDACTED in redacted


@pytest.mark.parametrize(
    "text",
    [
        "HTTP 400: This model's maximum context length is 8192 tokens.",
        "KeyError: 'COMPACTD_LISTEN' in tests/test_config.py",
        "max_tokens: 4096, input_tokens: 120",
        "see https://api.example.com/v1/chat/completions",
        "the summary (812 tokens framed) is not smaller than the span",
    ],
)
def test_ordinary_provider_text_is_left_alone(text: str) -> None:
    assert Redactor()(text) == text


def test_the_configured_key_values_are_redacted_in_any_shape() -> None:
    environ = {"LOOP_API_KEY": "plain-secret-value"}
    redact = Redactor(env_names=["LOOP_API_KEY", ""], environ=environ)
    assert redact("echo: plain-secret-value!") == f"echo: {REDACTED}!"
    environ["LOOP_API_KEY"] = "rotated-secret-value"  # read when redacting
    assert "rotated-secret-value" not in redact("now rotated-secret-value")


def test_short_literals_are_not_searched_for() -> None:
    assert Redactor(["abc"])("abc abc") == "abc abc"


def test_a_routes_key_variable_and_url_password_are_secrets() -> None:
    routes = [
        Route("p", "m", api_key_env="P_KEY", base_url="https://bob:pa%24%24word@host/v1"),
        Route("q", "n"),
    ]
    redact = for_routes(routes, environ={"P_KEY": "the-p-key-value"})
    text = redact("the-p-key-value and pa$$word and pa%24%24word")
    assert "the-p-key-value" not in text
    assert "pa$$word" not in text
    assert "pa%24%24word" not in text
    assert url_secrets("not a url") == []


def test_redacting_twice_changes_nothing_more() -> None:
    once = Redactor()(f"Authorization: Bearer {KEY}; api_key={KEY}")
    assert Redactor()(once) == once


def test_the_log_filter_redacts_messages_extras_and_tracebacks() -> None:
    logger = logging.getLogger("compactd.test.redaction")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logger.addHandler(handler)
    logger.propagate = False
    uninstall = install(Redactor(), logger)
    try:
        try:
            raise RuntimeError(f"provider said Bearer {KEY}")
        except RuntimeError:
            logger.exception("failed with %s", f"api_key={KEY}", extra={"error": KEY})
    finally:
        uninstall()
        logger.removeHandler(handler)
    (record,) = records
    assert KEY not in record.getMessage()
    assert KEY not in record.__dict__["error"]
    assert record.exc_text is not None
    assert KEY not in record.exc_text
    assert "RuntimeError" in record.exc_text
    assert not any(isinstance(f, RedactingFilter) for f in handler.filters)


def test_the_log_filter_redacts_strings_inside_structured_extras() -> None:
    record = logging.LogRecord("compactd.test", logging.INFO, "", 0, "summaries", (), None)
    url = f"https://user:{KEY}@host/v1"
    record.endpoints = {"local/m": url, "nested": [url, (url, 3)]}
    record.count = 3

    assert RedactingFilter(Redactor([KEY])).filter(record)

    assert KEY not in repr(record.__dict__)
    assert record.endpoints["local/m"] == f"https://{REDACTED}@host/v1"
    assert record.count == 3

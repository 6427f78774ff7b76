"""Idempotent calls are retried by gRPC's service config; mutations never are; deadlines hold."""

from __future__ import annotations

import json
import threading
from typing import Any

import grpc
import pytest
from fake_compactd import FakeCompactd

from compactd_client import (
    AsyncCompactdClient,
    CompactdClient,
    DeadlineExceededError,
    RetryPolicy,
    UnavailableError,
)
from compactd_client.config import IDEMPOTENT_METHODS, service_config
from compactd_client.events import user_message
from compactd_client.v1.session_service_pb2 import AppendEventsResponse, GetSurfaceResponse


def _unavailable_then(answer: Any, failures: int) -> Any:
    """A handler that answers UNAVAILABLE ``failures`` times, then ``answer``."""
    seen = {"n": 0}
    lock = threading.Lock()

    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        with lock:
            seen["n"] += 1
            fail = seen["n"] <= failures
        if fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "store briefly unreachable")
        return answer

    return handler


def test_service_config_retries_exactly_the_idempotent_methods() -> None:
    config = json.loads(service_config(RetryPolicy(max_attempts=3)))
    (method_config,) = config["methodConfig"]
    names = {(n["service"], n["method"]) for n in method_config["name"]}
    assert names == set(IDEMPOTENT_METHODS)
    assert ("compactd.v1.SessionService", "AppendEvents") not in names
    assert method_config["retryPolicy"]["maxAttempts"] == 3
    assert method_config["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]


def test_retry_policy_rejects_attempts_grpc_would_ignore() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=9)


def test_sync_get_surface_succeeds_after_transient_unavailable(fake: FakeCompactd) -> None:
    fake.on("GetSurface", _unavailable_then(GetSurfaceResponse(revision=7), failures=2))
    with CompactdClient(fake.target) as client:
        surface = client.get_surface("s1")
    assert surface.revision == 7
    assert fake.calls["GetSurface"] == 3


async def test_async_check_is_retried_too(fake: FakeCompactd) -> None:
    fake.on("GetSurface", _unavailable_then(GetSurfaceResponse(revision=2), failures=1))
    async with AsyncCompactdClient(fake.target) as client:
        surface = await client.get_surface("s1")
    assert surface.revision == 2
    assert fake.calls["GetSurface"] == 2


def test_append_is_never_retried(fake: FakeCompactd) -> None:
    fake.on("AppendEvents", _unavailable_then(AppendEventsResponse(revision=1), failures=1))
    with CompactdClient(fake.target) as client, pytest.raises(UnavailableError):
        client.append_events("s1", [user_message("hi")])
    assert fake.calls["AppendEvents"] == 1


def test_retries_can_be_disabled(fake: FakeCompactd) -> None:
    fake.on("GetSurface", _unavailable_then(GetSurfaceResponse(revision=1), failures=1))
    with CompactdClient(fake.target, retry=None) as client, pytest.raises(UnavailableError):
        client.get_surface("s1")
    assert fake.calls["GetSurface"] == 1


def test_exhausted_retries_surface_the_last_unavailable(fake: FakeCompactd) -> None:
    fake.on("GetSurface", _unavailable_then(GetSurfaceResponse(), failures=100))
    policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.01)
    with CompactdClient(fake.target, retry=policy) as client, pytest.raises(UnavailableError):
        client.get_surface("s1")
    assert fake.calls["GetSurface"] == 2


def test_deadline_exceeded_is_typed(fake: FakeCompactd) -> None:
    release = threading.Event()

    def stall(request: Any, context: grpc.ServicerContext) -> GetSurfaceResponse:
        release.wait(30)  # until the client gave up (released below)
        return GetSurfaceResponse()

    fake.on("GetSurface", stall)
    try:
        with CompactdClient(fake.target) as client, pytest.raises(DeadlineExceededError):
            client.get_surface("s1", timeout=0.2)
    finally:
        release.set()

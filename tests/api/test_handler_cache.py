"""An interceptor's handler is built once per method, and afresh when the handler under it
changes (``interceptors.HandlerCache``)."""

from __future__ import annotations

from typing import Any

import grpc

from compactd.api.interceptors import Handler, HandlerCache


async def _behavior(request: Any, context: Any) -> Any:
    return request


def _handler() -> Handler:
    return grpc.unary_unary_rpc_method_handler(_behavior)


def test_a_method_is_wrapped_once_while_its_handler_stays_the_same() -> None:
    cache, inner, built = HandlerCache(), _handler(), []

    def build(handler: Handler) -> Handler:
        built.append(handler)
        return _handler()

    first = cache.get("/s/M", inner, build)
    assert cache.get("/s/M", inner, build) is first
    assert built == [inner]


def test_another_handler_under_the_same_method_is_wrapped_afresh() -> None:
    cache, built = HandlerCache(), []

    def build(handler: Handler) -> Handler:
        built.append(handler)
        return _handler()

    old, new = _handler(), _handler()
    first = cache.get("/s/M", old, build)
    second = cache.get("/s/M", new, build)
    assert second is not first
    assert built == [old, new]
    assert cache.get("/s/Other", old, build) is not first  # per method

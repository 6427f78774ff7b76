"""Replies a handler has serialized itself: grpc sends their bytes as they are.

grpc.aio serializes a unary handler's reply on the event loop, in one call, after the handler
returns: for a reply of a surface at ``max_surface_bytes`` (``GetSurface``, ``BuildRequest``),
one long pause of every other call. A handler that made its reply's bytes in steps
(``service.requests``) returns them as ``Serialized``; ``add_servicer`` registers a generated
servicer's methods with a serializer that passes those through and serializes anything else as
the generated code does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from compactd.api.interceptors import Handler, rewrapped
from compactd.speed import let_others_run


@dataclass(frozen=True, slots=True)
class Serialized:
    """A reply's bytes, exactly as its message would serialize."""

    data: bytes


async def after_a_turn(data: bytes) -> Serialized:
    """``data`` as a reply, once other calls have had their turns of the loop: grpc copies a
    reply's bytes in the slice the handler returns in, and making ``data`` ended with a copy of
    its own (a join); both in one slice would pause every other call for two copies of a large
    reply."""
    await let_others_run()
    return Serialized(data)


class _Registration:
    """Stands in for the server while a generated ``add_*Servicer_to_server`` registers, and
    keeps its service name and method handlers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, Handler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: the generic handler is made again from the method handlers."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Handler]) -> None:
        self.service, self.handlers = service, dict(handlers)


def add_servicer(add: Callable[[Any, Any], None], servicer: object, server: Any) -> None:
    """``add(servicer, server)`` (a generated ``add_*Servicer_to_server``; ``server`` takes
    generic handlers, ``api.registration.GenericOnly``), each method's reply serializer taking
    ``Serialized`` bytes as they are."""
    registration = _Registration()
    add(servicer, registration)
    handlers = {name: _passing(handler) for name, handler in registration.handlers.items()}
    generic = grpc.method_handlers_generic_handler(registration.service, handlers)
    server.add_generic_rpc_handlers((generic,))


def _passing(handler: Handler) -> Handler:
    serialize = handler.response_serializer
    if serialize is None:
        return handler

    def serialized(reply: Any) -> bytes:
        if isinstance(reply, Serialized):
            return reply.data
        data: bytes = serialize(reply)
        return data

    return rewrapped(handler, lambda behavior: behavior, response_serializer=serialized)

"""compactd's services are served through generic handlers only, not as registered methods.

A generated ``add_*Servicer_to_server`` (grpc 1.62 on) hands the server its methods twice: as a
generic handler, and as "registered methods" the core matches by name. grpc.aio's server keeps
one task waiting for calls per registered method, plus one for every other call, and its loop
waits on all of them (``asyncio.wait``) again after each call it accepts: work per call that
grows with the number of methods (compactd serves 24). Through generic handlers alone one task
waits for every call, and a call finds its handler in a dict (``bench_percall``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class GenericOnly:
    """Stands in for the server while generated code registers a servicer: the generic handler
    reaches the server, the registered methods do not."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def add(self, add_servicer: Callable[[Any, Any], None], servicer: object) -> None:
        """Register ``servicer`` through a generated ``add_*Servicer_to_server``."""
        add_servicer(servicer, self)

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        """Dropped: the generic handler serves these methods."""

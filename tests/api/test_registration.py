"""compactd's services reach the server as generic handlers only (``api.registration``)."""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health_pb2_grpc

from compactd.api.health import HealthServicer
from compactd.api.registration import GenericOnly


class Recording:
    """A server that records what generated code hands it."""

    def __init__(self) -> None:
        self.generic: list[Any] = []
        self.registered: list[str] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        self.registered.append(service)


def test_a_generated_servicer_reaches_the_server_as_its_generic_handler_alone() -> None:
    server = Recording()
    GenericOnly(server).add(health_pb2_grpc.add_HealthServicer_to_server, HealthServicer())
    assert server.registered == []
    (generic,) = server.generic
    assert generic.service_name() == "grpc.health.v1.Health"

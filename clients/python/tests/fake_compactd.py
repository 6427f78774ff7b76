"""A scriptable gRPC server on loopback speaking both compactd services (test support).

The client is exercised against a real gRPC server (real HTTP/2, real status trailers, real
retries); each test scripts what the handlers answer. The scenario suite in ``scenarios/`` runs
the same client against the real compactd server.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import any_pb2, message_factory
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from compactd_client.v1 import compaction_service_pb2, session_service_pb2

Handler = Callable[[Any, grpc.ServicerContext], Any]

_SERVICES = (
    session_service_pb2.DESCRIPTOR.services_by_name["SessionService"],
    compaction_service_pb2.DESCRIPTOR.services_by_name["CompactionService"],
)


class FakeCompactd:
    """A loopback server whose handlers are set per test with :meth:`on`.

    Attributes:
        target: ``127.0.0.1:PORT`` to connect to.
        calls: How many times each method (``"GetSurface"``) was invoked, retries included.
    """

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self.calls: Counter[str] = Counter()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        for service in _SERVICES:
            self._server.add_generic_rpc_handlers((self._service_handler(service),))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{port}"

    def on(self, method: str, handler: Handler) -> None:
        """Scripts ``method`` (a bare RPC name); a stream handler returns an iterator."""
        self._handlers[method] = handler

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(None)

    def _service_handler(self, service: Any) -> grpc.GenericRpcHandler[Any, Any]:
        methods = {}
        for method in service.methods:
            request_class = message_factory.GetMessageClass(method.input_type)
            response_class = message_factory.GetMessageClass(method.output_type)
            behaviour = self._dispatcher(method.name)
            make = (
                grpc.unary_stream_rpc_method_handler
                if method.server_streaming
                else grpc.unary_unary_rpc_method_handler
            )
            methods[method.name] = make(
                behaviour,
                request_deserializer=request_class.FromString,
                response_serializer=response_class.SerializeToString,
            )
        return grpc.method_handlers_generic_handler(service.full_name, methods)

    def _dispatcher(self, name: str) -> Handler:
        def dispatch(request: Any, context: grpc.ServicerContext) -> Any:
            self.calls[name] += 1
            handler = self._handlers.get(name)
            if handler is None:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not scripted")
            return handler(request, context)

        return dispatch


def abort_rich(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    *,
    reason: str = "",
    metadata: dict[str, str] | None = None,
    violations: tuple[tuple[str, str], ...] = (),
) -> None:
    """Aborts like compactd does: a google.rpc.Status with one ErrorInfo (and BadRequest)."""
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    if reason:
        info = error_details_pb2.ErrorInfo(
            reason=reason, domain="compactd.dev", metadata=metadata or {}
        )
        status.details.append(_packed(info))
    if violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
                for f, d in violations
            ]
        )
        status.details.append(_packed(bad))
    context.abort_with_status(rpc_status.to_status(status))


def _packed(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed

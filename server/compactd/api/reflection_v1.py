"""Server reflection v1 (``grpc.reflection.v1.ServerReflection``) beside v1alpha.

grpcio-reflection serves only ``grpc.reflection.v1alpha``; current tools (grpcurl, Postman,
grpcui) ask for ``v1`` first. The two protocols are the same messages under another package
name, so the v1 service is v1alpha's servicer behind v1's method path, its messages encoded by
v1alpha's (identical on the wire). The v1 file descriptor, v1alpha's renamed, is added to the
default pool so ``describe grpc.reflection.v1.ServerReflection`` works too.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1ALPHA, _V1 = "grpc.reflection.v1alpha", "grpc.reflection.v1"


def _register_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(SERVICE_NAME)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    file.name, file.package = "grpc/reflection/v1/reflection.proto", _V1
    prefix = f".{_V1ALPHA}."
    for message in file.message_type:
        for item in message.field:
            if item.type_name.startswith(prefix):
                item.type_name = f".{_V1}." + item.type_name[len(prefix) :]
    for service in file.service:
        for method in service.method:
            method.input_type = method.input_type.replace(prefix, f".{_V1}.")
            method.output_type = method.output_type.replace(prefix, f".{_V1}.")
    pool.Add(file)


def enable(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha for ``service_names`` (both reflection services added)."""
    names = (*service_names, reflection.SERVICE_NAME, SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    _register_v1_descriptor()
    servicer = reflection.aio.ReflectionServicer(names)  # type: ignore[attr-defined]
    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))

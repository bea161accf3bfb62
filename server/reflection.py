"""Server reflection in both protocol versions: `grpc.reflection.v1` and `grpc.reflection.v1alpha`.

Runs in the `enginectl serve` process; grpc_server.py calls `enable_reflection` once, before
the server starts.

gRPC's Python package (grpcio-reflection) serves only v1alpha, the draft that v1 replaced;
Go, C++ and Java servers serve both, and clients that speak only v1 find no reflection on a
server that has only v1alpha. The two protocols are the same messages under another package
name (same fields, same numbers), so v1 is served by the same servicer, its messages read
and written with v1alpha's classes. So that a client can also describe the v1 service itself,
its file descriptor (`grpc/reflection/v1/reflection.proto`) is derived from v1alpha's and
added to the descriptor pool the servicer reads.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_SERVICE = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
SERVICES = (V1_SERVICE, V1ALPHA_SERVICE)
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection of `service_names` and of both reflection services on `server`."""
    _add_v1_descriptor(descriptor_pool.Default())
    servicer = reflection.aio.ReflectionServicer((*service_names, *SERVICES))
    for service in SERVICES:
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),)
        )


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Add the v1 reflection proto to `pool`, derived from v1alpha's (once per pool)."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    old, new = f".{file.package}.", ".grpc.reflection.v1."
    file.name, file.package = _V1_FILE, "grpc.reflection.v1"
    file.ClearField("options")  # v1alpha's language packages; none is needed to describe it
    for message in file.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old) :]
    for service in file.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old) :]
            method.output_type = new + method.output_type[len(old) :]
    pool.AddSerializedFile(file.SerializeToString())

"""``grpc.health.v1.Health``: grpc's asyncio servicer, completed with ``List``.

The asyncio servicer grpcio-health-checking ships implements ``Check`` and ``Watch`` only; its
``List`` is the generated stub's, which answers UNIMPLEMENTED *and* raises, so every call wrote a
traceback to the log. ``List`` here answers every service's status, as the synchronous servicer
does.
"""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2


class HealthServicer(health_aio.HealthServicer):  # type: ignore[misc]
    """Health checking: ``Check``, ``Watch`` and ``List`` of the services this server sets."""

    async def List(
        self, request: health_pb2.HealthListRequest, context: Any
    ) -> health_pb2.HealthListResponse:
        """Every known service and its current status."""
        statuses = {
            service: health_pb2.HealthCheckResponse(status=status)
            for service, status in self._server_status.items()
        }
        return health_pb2.HealthListResponse(statuses=statuses)

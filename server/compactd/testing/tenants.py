"""``MetadataTenants``: runs each call as the tenant its metadata names, with no credential.

A first-class fake of the authentication seam for tests and benchmarks of what is counted per
tenant (quotas, fairness) apart from how a tenant is proven: give it to ``create_server``'s
``tenant_binding``. A client chooses its tenant by sending ``x-compactd-test-tenant: ID``; a call
without it runs as the default tenant. Never put it in front of a real deployment: anyone could
claim any tenant.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final, cast

import grpc

from compactd.api.interceptors import Continuation, Handler, Interceptor, guarded, rewrapped
from compactd.tenancy import Tenant, bound_tenant

TENANT_METADATA: Final = "x-compactd-test-tenant"


def as_tenant(tenant: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that makes a call run as ``tenant``."""
    return ((TENANT_METADATA, tenant),)


class MetadataTenants(Interceptor):
    """Binds the tenant named by ``x-compactd-test-tenant`` for the whole call (streams too)."""

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler:
        handler: Handler | None = await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        name = metadata.get(TENANT_METADATA)
        if handler is None or not isinstance(name, str) or not name:
            return cast(Handler, handler)
        tenant = Tenant(name)

        @asynccontextmanager
        async def binding(request: Any, context: Any) -> AsyncIterator[Any]:
            with bound_tenant(tenant):
                yield request

        return rewrapped(handler, lambda behavior: guarded(behavior, binding))

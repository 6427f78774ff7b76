"""The tenant binding: one per call, restored after it, default outside any call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from compactd.tenancy import DEFAULT_TENANT, Tenant, bound_tenant, current_tenant


def test_outside_any_call_the_tenant_is_the_default() -> None:
    assert current_tenant() == DEFAULT_TENANT


def test_a_binding_is_restored_after_its_block() -> None:
    with bound_tenant(Tenant("a")):
        with bound_tenant(Tenant("b")):
            assert current_tenant() == Tenant("b")
        assert current_tenant() == Tenant("a")
    assert current_tenant() == DEFAULT_TENANT


def test_concurrent_calls_each_see_their_own_tenant() -> None:
    async def call(name: str) -> str:
        with bound_tenant(Tenant(name)):
            await asyncio.sleep(0)
            return current_tenant().id

    async def both() -> list[str]:
        return list(await asyncio.gather(call("a"), call("b")))

    assert asyncio.run(both()) == ["a", "b"]


def test_a_stream_closed_from_another_task_ends_without_an_error() -> None:
    async def stream() -> AsyncGenerator[str, None]:
        with bound_tenant(Tenant("a")):
            yield current_tenant().id
            yield "never"

    async def read_one_then_go_away() -> str:
        responses = stream()
        first = await anext(responses)
        # grpc closes an abandoned handler's generator from a task of its own (another context).
        await asyncio.create_task(responses.aclose())
        return first

    assert asyncio.run(read_one_then_go_away()) == "a"

"""Channel options: the caller's replace the client's defaults."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from fake_compactd import FakeCompactd

from compactd_client import AsyncCompactdClient, CompactdClient
from compactd_client.errors import ResourceExhaustedError
from compactd_client.v1.session_service_pb2 import BuildRequestResponse, Message

SMALL = [("grpc.max_receive_message_length", 1024)]


def large(request: Any, context: grpc.ServicerContext) -> BuildRequestResponse:
    return BuildRequestResponse(messages=[Message(name="x" * 4000)])


def test_a_message_limit_option_replaces_the_clients_default(fake: FakeCompactd) -> None:
    fake.on("BuildRequest", large)
    with CompactdClient(fake.target) as client:
        assert client.build_request("s").messages  # 4 KB: within the 64 MiB default
    with (
        CompactdClient(fake.target, options=SMALL) as client,
        pytest.raises(ResourceExhaustedError),
    ):
        client.build_request("s")


async def test_the_asyncio_client_takes_the_option_too(fake: FakeCompactd) -> None:
    fake.on("BuildRequest", large)
    async with AsyncCompactdClient(fake.target, options=SMALL) as client:
        with pytest.raises(ResourceExhaustedError):
            await client.build_request("s")

"""The server factory refuses what it cannot own: a port in use, a store another server holds."""

from __future__ import annotations

import dataclasses

import pytest

from compactd import config
from compactd.api.server import create_server
from compactd.errors import StartupError


async def test_a_port_in_use_is_refused_and_the_store_is_released(
    server_config: config.ServerConfig,
) -> None:
    first = await create_server(server_config)
    try:
        other_store = f"sqlite:///{first.config.store.removeprefix('sqlite:///')}.other"
        taken = dataclasses.replace(server_config, listen=first.address, store=other_store)
        with pytest.raises(StartupError) as caught:
            await create_server(taken)
        assert caught.value.reason == "ADDRESS_IN_USE"
        assert first.address in caught.value.message
        again = await create_server(dataclasses.replace(taken, listen="127.0.0.1:0"))
        await again.stop(0)  # the refused start left its store closed and unlocked
    finally:
        await first.stop(0)


async def test_one_store_has_one_owner_until_it_stops(server_config: config.ServerConfig) -> None:
    first = await create_server(server_config)
    try:
        with pytest.raises(StartupError) as caught:
            await create_server(server_config)
        assert caught.value.reason == "STORE_LOCKED"
    finally:
        await first.stop(0)
    second = await create_server(server_config)
    await second.stop(0)

"""Fixtures of the API tests: the loopback provider a server summarizes with."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from compactd.testing.openai_server import OpenAICompatServer


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    """A started loopback provider (stopped, cutting any delayed reply, after the test)."""
    with OpenAICompatServer() as server:
        yield server

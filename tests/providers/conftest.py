"""Fixtures of the summarizer tests: a real OpenAI-compatible server on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from compactd.testing import OpenAICompatServer


@pytest.fixture
def loopback() -> Iterator[OpenAICompatServer]:
    """A started loopback provider, stopped after the test."""
    with OpenAICompatServer() as server:
        yield server

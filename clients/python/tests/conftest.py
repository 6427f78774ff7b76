"""Fixtures of the client's own tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_compactd import FakeCompactd


@pytest.fixture
def fake() -> Iterator[FakeCompactd]:
    """A started :class:`FakeCompactd`; stopped after the test."""
    server = FakeCompactd()
    server.start()
    yield server
    server.stop()

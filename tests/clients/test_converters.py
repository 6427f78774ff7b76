"""The converters against a real server: imported transcripts come back from BuildRequest.

Every OpenAI and Anthropic transcript of ``testdata/transcripts`` is imported with the Python
client's converters, appended to a real server, and rebuilt with ``BuildRequest``: the rendered
request body holds the original messages, and its OpenAI messages are exactly what the server's
own wire encoding (the one its summary requests use) makes of the same surface, so the runtime's
request and compactd's summary request share their prefix byte for byte.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from compactd_client import AsyncCompactdClient, anthropic, openai

from compactd.api.server import RunningServer
from compactd.providers import openai_wire
from compactd.v1 import session_service_pb2

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python" / "tests"))
from transcripts import conversations

OPENAI = conversations("openai")
ANTHROPIC = conversations("anthropic")


async def _rebuilt(server: RunningServer, events: list[Any]) -> Any:
    async with AsyncCompactdClient(server.address) as client:
        session = await client.create_session()
        for start in range(0, len(events), 500):
            await client.append_events(session.session_id, events[start : start + 500])
        return await client.build_request(session.session_id)


@pytest.mark.parametrize("record", OPENAI, ids=[r["source"][-40:] for r in OPENAI])
async def test_an_imported_openai_transcript_is_rebuilt_as_sent(
    server: RunningServer, record: dict[str, Any]
) -> None:
    events = openai.events_from_messages(record["messages"], provider="openai", model="gpt-4o")
    request = await _rebuilt(server, events)
    body = openai.request_body(request)
    assert body["model"] == "gpt-4o"
    assert body["messages"] == record["messages"]
    server_side = openai_wire.encode_messages(
        [session_service_pb2.Message.FromString(m.SerializeToString()) for m in request.messages]
    )
    assert openai_wire.dumps(body["messages"]) == openai_wire.dumps(server_side)
    assert json.loads(openai_wire.dumps(body["messages"])) == record["messages"]


@pytest.mark.parametrize("record", ANTHROPIC, ids=[r["source"][-30:] for r in ANTHROPIC])
async def test_an_imported_anthropic_transcript_is_rebuilt_as_sent(
    server: RunningServer, record: dict[str, Any]
) -> None:
    events = anthropic.events_from_messages(record["messages"], model="claude-sonnet-4-5")
    request = await _rebuilt(server, events)
    body = anthropic.request_body(request, max_tokens=4096)
    assert (body["model"], body["max_tokens"]) == ("claude-sonnet-4-5", 4096)
    assert body["messages"] == record["messages"]

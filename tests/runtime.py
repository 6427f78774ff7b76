"""A runtime's side of the recovery tests: conversations written by the step rules, requests sent
to the loopback provider, and the recovery RPCs called to the end.

Conversations follow AGREEMENT.md's step rules: every ``assistant/message`` sits inside
``step/start`` .. ``step/end`` of an open turn, and tool results come after the step that made the
calls. ``send`` encodes a rebuilt request exactly as an OpenAI-compatible runtime would and posts
it to the loopback provider, so the provider's real error bodies come back over HTTP.
"""

from __future__ import annotations

from typing import Any

import httpx

from compactd.providers import openai_wire
from compactd.testing.openai_server import OpenAICompatServer
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as spb
from tests.builders import assistant, in_step, tool_result, turn_end, turn_start, user
from tests.compaction_fixtures import Harness, Run
from tests.compaction_fixtures import _collect as collect

SessionEvent = events_pb2.SessionEvent

#: Each provider whose overflow body ``testing.provider_errors`` answers with, and the table rule
#: that must recognize it.
OVERFLOW_RULES = [
    ("openai", "openai/context_length_exceeded"),
    ("deepseek", "deepseek-vllm/maximum_context_length"),
    ("vllm", "deepseek-vllm/maximum_context_length"),
    ("llama.cpp", "llama.cpp/exceed_context_size"),
    ("anthropic", "anthropic/prompt_too_long"),
    ("gemini", "gemini/input_token_count"),
]


def exchange(turn: int, i: int, *, result: str | None = None) -> list[SessionEvent]:
    """One balanced exchange of ``turn`` (~250 tokens): a request, a step calling a tool, its
    result, a step answering."""
    return [
        user(f"Step {i}: run the check for src/mod{i}.py and report. " + "Context. " * 40),
        *in_step(
            turn,
            1,
            assistant(text=f"Running step {i}.", calls=[(f"call-{i}", "run", '{"cmd":"ls"}')]),
        ),
        tool_result(f"call-{i}", result if result is not None else f"ok {i} " * 60, name="run"),
        *in_step(
            turn, 2, assistant(text=f"Step {i} is done; src/mod{i}.py passes. " + "Detail. " * 30)
        ),
    ]


def bulky_turn(turn: int) -> list[SessionEvent]:
    """A closed turn whose tool result (25,500 code points) the pruner shrinks."""
    return [
        turn_start(turn),
        user("Dump the build log."),
        *in_step(turn, 1, assistant(calls=[(f"log-{turn}", "run", '{"cmd":"make"}')])),
        tool_result(f"log-{turn}", "compiling module\n" * 1500, name="run"),
        *in_step(turn, 2, assistant(text="The build log ends with a linker error.")),
        turn_end(turn),
    ]


def closed_turns(count: int, start: int = 1) -> list[SessionEvent]:
    """``count`` closed turns, numbered from ``start``, one exchange each."""
    events: list[SessionEvent] = []
    for turn in range(start, start + count):
        events += [turn_start(turn), *exchange(turn, turn), turn_end(turn)]
    return events


def request_body(request: spb.BuildRequestResponse) -> dict[str, Any]:
    """The chat-completions body a runtime sends for a rebuilt request."""
    messages = openai_wire.encode_messages(request.messages)
    tools = openai_wire.encode_tools(request.tools)
    return openai_wire.encode_request(messages, tools, request.config, stream=False)


async def send(loop: OpenAICompatServer, request: spb.BuildRequestResponse) -> httpx.Response:
    """Post the rebuilt request to the loopback provider, as the runtime's step."""
    async with httpx.AsyncClient() as client:
        return await client.post(
            f"{loop.base_url}/chat/completions",
            content=openai_wire.dumps(request_body(request)),
            headers={"Content-Type": "application/json"},
        )


def raw_error(response: httpx.Response) -> cpb.ProviderError:
    """The failed response, for the service to classify."""
    raw = cpb.RawProviderError(
        http_status=response.status_code, body=response.content, headers=dict(response.headers)
    )
    return cpb.ProviderError(raw=raw)


def overflow_error(**figures: int) -> cpb.ProviderError:
    """A context overflow the runtime's adapter classified itself."""
    return cpb.ProviderError(kind=cpb.PROVIDER_ERROR_KIND_CONTEXT_WINDOW_EXCEEDED, **figures)


async def recover(h: Harness, turn: int, error: cpb.ProviderError, retries_so_far: int = 0) -> Run:
    """Run RecoverFromError to its end."""
    request = cpb.RecoverFromErrorRequest(
        session_id=h.session_id, turn=turn, error=error, retries_so_far=retries_so_far
    )
    return await collect(h.compaction.RecoverFromError(request))


async def switch(h: Harness, destination: events_pb2.Route, turn: int | None = None) -> Run:
    """Run SwitchModel to its end."""
    request = cpb.SwitchModelRequest(session_id=h.session_id, destination=destination)
    if turn is not None:
        request.turn = turn
    return await collect(h.compaction.SwitchModel(request))


def of_type(events: list[SessionEvent], name: str) -> list[SessionEvent]:
    """The events whose body is ``name``."""
    return [e for e in events if e.WhichOneof("body") == name]

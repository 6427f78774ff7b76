"""The "Recovering from provider errors" loop of docs/recovery.md runs as written against a live
server and a provider that overflows, then answers."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from compactd.providers import openai_wire
from compactd.testing import provider_errors as pe
from compactd.testing.openai_server import OpenAICompatServer
from compactd.v1 import session_service_pb2 as spb
from tests.builders import turn_start, user
from tests.compaction_fixtures import RELAXED, loopback, opening, started
from tests.runtime import closed_turns, of_type

PAGE = Path(__file__).resolve().parents[1] / "docs" / "recovery.md"


def readme_step() -> Callable[..., Any]:
    """The page's ``step`` function, executed from its Python block."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("## Recovering from provider errors") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "the section has no Python loop"
    assert match.group(1).count("\n") <= 20  # a few lines
    namespace: dict[str, Any] = {}
    exec(match.group(1), namespace)
    step: Callable[..., Any] = namespace["step"]
    return step


def provider(loop: OpenAICompatServer) -> Callable[[spb.BuildRequestResponse], Any]:
    """The runtime's provider call: the rebuilt request, encoded as chat completions."""

    def call_model(request: spb.BuildRequestResponse) -> tuple[int, bytes, dict[str, str]]:
        messages = openai_wire.encode_messages(request.messages)
        tools = openai_wire.encode_tools(request.tools)
        body = openai_wire.encode_request(messages, tools, request.config, stream=False)
        reply = httpx.post(f"{loop.base_url}/chat/completions", content=openai_wire.dumps(body))
        return reply.status_code, reply.content, dict(reply.headers)

    return call_model


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


async def test_the_readme_loop_recovers_from_an_overflow_and_retries(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    from compactd_client import CompactdClient

    step = readme_step()
    loop.enqueue(pe.overflow("llama.cpp", window=16000, prompt_tokens=16800))
    async with started(tmp_path, loop, policy=RELAXED) as h:
        await h.create(*opening(), *closed_turns(4), turn_start(5), user("And now?"))

        def run() -> bytes:
            with CompactdClient(h.address, timeout=30) as client:
                answer: bytes = step(client, h.session_id, 5, provider(loop))
                return answer

        answer = await asyncio.to_thread(run)

        assert json.loads(answer)["object"] == "chat.completion"
        (start,) = of_type(await h.events(), "compaction_start")
        assert start.compaction_start.turn == 5


async def test_the_readme_loop_lets_an_unrecoverable_error_stand(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    from compactd_client import CompactdClient

    step = readme_step()
    loop.enqueue(pe.unauthenticated("openai"))
    async with started(tmp_path, loop) as h:
        await h.create(*opening(), turn_start(1), user("Hi"))

        def run() -> None:
            with CompactdClient(h.address, timeout=30) as client:
                step(client, h.session_id, 1, provider(loop))

        with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
            await asyncio.to_thread(run)

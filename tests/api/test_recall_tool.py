"""The recall tool end to end: declared and priced by a live server, answered by the Python client.

With ``recallTool`` on, the rebuilt request declares the tool after the header's tools and the
pressure report prices it like them; the OpenAI and Anthropic converters pass it through; and
``answer_recall`` turns the model's call into an ordinary ``tool/result`` step of the log.
"""

from __future__ import annotations

from pathlib import Path

from compactd_client import AsyncCompactdClient, anthropic, openai
from compactd_client.events import (
    assistant_message,
    step_end,
    step_start,
    tool_call_block,
    turn_end,
)
from compactd_client.v1.events_pb2 import ContentBlock

from compactd.core.meter import recount
from compactd.core.pricing import price_tools
from compactd.core.recall import RECALL_TOOL_DESCRIPTION, recall_tool
from compactd.testing.openai_server import OpenAICompatServer
from compactd.v1 import session_service_pb2 as spb
from tests.api.test_recall import BIG, handles_in
from tests.builders import turn_start
from tests.compaction_fixtures import MODEL, PROVIDER, TOOLS, opening, started, unit, units

ON = {"recallTool": True}


async def test_the_policy_declares_the_recall_tool_after_the_headers_tools(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening(), *units(2), policy={**ON, "recallToolName": "fetch_original"})
        build = await h.build()
        assert [t.name for t in build.tools] == [*(t.name for t in TOOLS), "fetch_original"]
        assert build.tools[-1].description == RECALL_TOOL_DESCRIPTION

        h.session_id = "off"  # the default: no recall tool
        await h.create(*opening(), *units(2))
        assert [t.name for t in (await h.build()).tools] == [t.name for t in TOOLS]


async def test_the_recall_tool_is_priced_in_the_envelope_like_any_tool(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening(), *units(2), policy=ON)
        with_tool = await h.pressure()
        h.session_id = "off"
        await h.create(*opening(), *units(2))
        without = await h.pressure()

        assert h.server is not None
        assert h.server.pressure is not None
        route = h.server.pressure.routes.resolve(PROVIDER, MODEL)
        system = "You are a careful coding agent."
        declared = [*TOOLS, recall_tool("recall")]
        assert with_tool.breakdown.tools_tokens == price_tools(declared, route.pricing, system)
        assert without.breakdown.tools_tokens == price_tools(TOOLS, route.pricing, system)
        assert with_tool.breakdown.tools_tokens > without.breakdown.tools_tokens
        growth = with_tool.measured_tokens - without.measured_tokens
        assert growth == with_tool.breakdown.tools_tokens - without.breakdown.tools_tokens
        # The incremental meter and a from-scratch recount agree with the tool declared.
        h.session_id = "s1"
        handle = await h.server.manager.get("s1")
        meter = handle.context.meter
        declared_now = meter.declared_tools(handle.fold.header)
        assert [t.name for t in declared_now] == ["recall"]
        assert meter.measure(handle.fold, route, anchored=False).total == (
            recount(handle.fold, route, declared_now).total
        )


async def test_the_converters_pass_the_recall_tool_through(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(*opening(), *units(2), policy=ON)
        build = spb.BuildRequestResponse.FromString((await h.build()).SerializeToString())

        chat = openai.request_body(build)  # type: ignore[arg-type]
        assert chat["tools"][-1]["function"]["name"] == "recall"
        assert chat["tools"][-1]["function"]["description"] == RECALL_TOOL_DESCRIPTION
        messages = anthropic.request_body(build, max_tokens=100)  # type: ignore[arg-type]
        assert messages["tools"][-1]["name"] == "recall"


async def test_the_python_client_answers_a_recall_call_as_an_ordinary_step(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    async with started(tmp_path, loop, kind="extractive") as h:
        await h.create(
            *opening(), *units(2), *unit(2, result=BIG), *units(16, start=3), turn_start(1),
            policy=ON,
        )  # fmt: skip
        run = await h.prepare(1)
        assert run.result.compactions
        [checkpoint] = handles_in(await h.build())
        sid = h.session_id
        async with AsyncCompactdClient(h.address) as client:
            call = tool_call_block("r1", "recall", {"handle": f"[recall:{checkpoint}]"})
            await client.append_events(
                sid, [step_start(1, 1), assistant_message(tool_calls=[call]), step_end(1, 1)]
            )

            result = await client.answer_recall(sid, call)
            await client.append_events(sid, [result, turn_end(1)])

            assert result.tool_result.tool_call_id == "r1"
            assert not result.tool_result.is_error
            text = result.tool_result.content[0].text.text
            assert f"[recall:{checkpoint}]" in text
            assert "Step 0: run the check for src/mod0.py" in text  # the first shadowed request
            last = (await client.build_request(sid)).messages[-1]
            assert last.tool_call_id == "r1"
            assert last.content[0].text.text == text
            # OpenAI and Anthropic shapes of the same call, and an unknown handle.
            openai_call = {
                "id": "r2",
                "function": {"name": "recall", "arguments": '{"handle":"c1-0000"}'},
            }
            unknown = await client.answer_recall(sid, openai_call)
            assert unknown.tool_result.is_error
            assert "names nothing" in unknown.tool_result.content[0].text.text
            anthropic_call = {
                "id": "r3",
                "name": "recall",
                "input": {"handle": checkpoint, "query": "mod1.py"},
            }
            narrowed = await client.answer_recall(sid, anthropic_call)
            assert "mod1.py" in narrowed.tool_result.content[0].text.text
            assert "mod5.py" not in narrowed.tool_result.content[0].text.text
            as_block = await client.answer_recall(sid, ContentBlock(tool_call=call.tool_call))
            assert as_block.tool_result.content[0].text.text == text

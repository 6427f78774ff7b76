"""Screener.facts_beside: the span facts the gate extracts while a model writes its summary."""

from __future__ import annotations

import asyncio
import gc

from compactd.core.policy import TargetPolicy
from compactd.core.probes import SpanFacts, span_facts
from compactd.providers.base import SummaryRequest, SummaryResult
from compactd.providers.extractive import ExtractiveSummarizer
from compactd.service.screening import Screener, drop_facts
from compactd.testing.messages import assistant, system, tool_result, user
from compactd.v1 import events_pb2


class _Model:
    """A summarizer that is not the extractive one (a model's)."""

    name = "model"

    async def summarize(self, request: SummaryRequest) -> SummaryResult:
        raise AssertionError("not called")


def _request() -> SummaryRequest:
    return SummaryRequest(
        messages=[
            system("You are terse."),
            user("Fix src/app/main.py please"),
            assistant("Running it.", calls=[("c1", "run", '{"cmd": "pytest tests/test_main.py"}')]),
            tool_result("c1", "E   KeyError: 'x'\nFAILED tests/test_main.py", is_error=True),
        ],
        tools=[],
        config=events_pb2.RequestConfig(provider="openai", model="gpt-4o"),
        instruction="Summarize.",
        max_tokens=1000,
    )


async def test_facts_beside_a_models_summary_are_the_spans_facts() -> None:
    request = _request()

    facts = Screener().facts_beside(TargetPolicy(), request, _Model())

    assert facts is not None
    assert await facts == span_facts(request.messages[1:])
    assert (await facts).paths  # the span has facts to extract


async def test_no_facts_are_extracted_beside_the_extractive_summarizer_or_the_gate_off() -> None:
    screener, request = Screener(), _request()

    assert screener.facts_beside(TargetPolicy(), request, ExtractiveSummarizer()) is None
    assert screener.facts_beside(TargetPolicy(summary_gate=False), request, _Model()) is None


async def test_dropped_facts_stop_extracting_and_leave_no_failure_unretrieved() -> None:
    facts = Screener().facts_beside(TargetPolicy(), _request(), _Model())
    assert facts is not None

    drop_facts(facts)
    await asyncio.sleep(0)

    assert facts.cancelled()
    loop, unretrieved = asyncio.get_running_loop(), []
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    failed: asyncio.Future[SpanFacts] = loop.create_future()
    failed.set_exception(RuntimeError("extraction failed"))
    drop_facts(failed)
    del failed
    gc.collect()
    assert unretrieved == []  # asyncio logs a failure nobody retrieved when it is freed
    drop_facts(None)  # no task: nothing to end

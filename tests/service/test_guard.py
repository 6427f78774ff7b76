"""CompactionGuard.min_span_tokens: the smallest span a bracket may open on; the span facts the
gate extracts while a model writes its summary."""

from __future__ import annotations

import asyncio
import gc
import math

from compactd.core.policy import TargetPolicy
from compactd.core.probes import SpanFacts, span_facts
from compactd.providers.base import SummaryRequest, SummaryResult
from compactd.providers.extractive import MIN_CHECKPOINT_TOKENS, ExtractiveSummarizer
from compactd.routes import RouteCatalog
from compactd.service.guard import CompactionGuard, drop_facts
from compactd.testing.messages import assistant, system, tool_result, user
from compactd.v1 import events_pb2

ROUTE = RouteCatalog().resolve("openai", "gpt-4o")


def test_the_default_ratio_asks_only_for_a_span_larger_than_an_empty_checkpoint() -> None:
    minimum = CompactionGuard().min_span_tokens(ROUTE, TargetPolicy())

    assert 100 < minimum < MIN_CHECKPOINT_TOKENS


def test_a_ratio_of_085_asks_for_a_span_the_extractive_minimum_fits_in_15_percent() -> None:
    policy = TargetPolicy(min_reduction_ratio=0.85)

    minimum = CompactionGuard().min_span_tokens(ROUTE, policy)

    assert minimum == math.ceil(MIN_CHECKPOINT_TOKENS / 0.15)


# ---- the gate's span facts, extracted while a model writes ------------------------------------


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

    facts = CompactionGuard().facts_beside(TargetPolicy(), request, _Model())

    assert facts is not None
    assert await facts == span_facts(request.messages[1:])
    assert (await facts).paths  # the span has facts to extract


async def test_no_facts_are_extracted_beside_the_extractive_summarizer_or_the_gate_off() -> None:
    guard, request = CompactionGuard(), _request()

    assert guard.facts_beside(TargetPolicy(), request, ExtractiveSummarizer()) is None
    assert guard.facts_beside(TargetPolicy(summary_gate=False), request, _Model()) is None


async def test_dropped_facts_stop_extracting_and_leave_no_failure_unretrieved() -> None:
    facts = CompactionGuard().facts_beside(TargetPolicy(), _request(), _Model())
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

"""The default probe threshold against real summaries: Claude Code's own compaction summaries
of three real sessions pass it; an echo of the span's last message and the empty skeleton of the
same spans do not (see docs/benchmarks.md, "The quality gate", for the whole measurement)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from compactd.core import prompts
from compactd.core.gate import DEFAULT_MIN_PROBE_RETENTION
from compactd.core.probes import Probe, message_text, retention, select_probes, span_facts
from compactd.testing import messages as m
from compactd.v1 import session_service_pb2

DATA = Path(__file__).resolve().parents[1] / "data" / "compaction_summaries.jsonl.gz"


def _message(raw: dict[str, Any]) -> session_service_pb2.Message:
    text = raw.get("content") if isinstance(raw.get("content"), str) else ""
    if raw["role"] == "assistant":
        calls = [
            (c["id"], c["function"]["name"], c["function"]["arguments"] or "{}")
            for c in raw.get("tool_calls") or []
        ]
        return m.assistant(text, calls=calls)
    if raw["role"] == "tool":
        return m.tool_result(raw.get("tool_call_id", ""), text)
    return m.user(text)


def _boundaries() -> list[tuple[list[session_service_pb2.Message], str]]:
    with gzip.open(DATA, "rt", encoding="utf-8") as lines:
        records = [json.loads(line) for line in lines]
    return [([_message(raw) for raw in r["span"]], r["summary"]) for r in records]


BOUNDARIES = _boundaries()


def _probes(span: list[session_service_pb2.Message]) -> tuple[Probe, ...]:
    return select_probes(span_facts(span))


@pytest.mark.parametrize("index", range(len(BOUNDARIES)))
def test_a_real_compaction_summary_keeps_enough_probes(index: int) -> None:
    span, summary = BOUNDARIES[index]

    assert retention(_probes(span), summary).ratio >= DEFAULT_MIN_PROBE_RETENTION


@pytest.mark.parametrize("index", range(len(BOUNDARIES)))
def test_an_echo_or_the_skeleton_of_the_same_span_does_not(index: int) -> None:
    span, _ = BOUNDARIES[index]
    probes = _probes(span)

    assert retention(probes, message_text(span[-1])).ratio < DEFAULT_MIN_PROBE_RETENTION
    assert retention(probes, prompts.summary_skeleton()).ratio == 0

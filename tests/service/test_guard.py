"""CompactionGuard.min_span_tokens: the smallest span a bracket may open on."""

from __future__ import annotations

import math

from compactd.core.fold import SessionFold
from compactd.core.policy import TargetPolicy
from compactd.providers.extractive import MIN_CHECKPOINT_TOKENS
from compactd.routes import RouteCatalog
from compactd.service.guard import CompactionGuard
from tests.builders import pin, subagent_start

ROUTE = RouteCatalog().resolve("openai", "gpt-4o")


def test_the_default_ratio_asks_only_for_a_span_larger_than_an_empty_checkpoint() -> None:
    minimum = CompactionGuard().min_span_tokens(ROUTE, TargetPolicy())

    assert 100 < minimum < MIN_CHECKPOINT_TOKENS


def test_a_ratio_of_085_asks_for_a_span_the_extractive_minimum_fits_in_15_percent() -> None:
    policy = TargetPolicy(min_reduction_ratio=0.85)

    minimum = CompactionGuard().min_span_tokens(ROUTE, policy)

    assert minimum == math.ceil(MIN_CHECKPOINT_TOKENS / (0.15 * 0.9))  # with a margin to spare
    assert MIN_CHECKPOINT_TOKENS / minimum <= 0.135


def test_the_open_handles_every_checkpoint_carries_raise_the_minimum() -> None:
    fold = SessionFold()
    bare = CompactionGuard().min_span_tokens(ROUTE, TargetPolicy(), fold)
    fold.admit([pin("goal", "ship"), subagent_start("child", "c1", "audit the parser")])

    minimum = CompactionGuard().min_span_tokens(ROUTE, TargetPolicy(), fold)

    assert bare == CompactionGuard().min_span_tokens(ROUTE, TargetPolicy())
    assert minimum > bare + 10

"""Summarizers: the one seam through which compaction obtains a summary.

``base`` defines the seam (``Summarizer``, ``SummaryRequest``, ``SummaryResult``,
``SummaryError``); ``openai`` calls any OpenAI-compatible endpoint, ``extractive`` needs no model,
``chunking`` bounds requests larger than the summarizer's window. ``openai_wire`` is the pure wire
format shared with the runtime's conversation requests.
"""

from compactd.providers.base import (
    Summarizer,
    SummaryError,
    SummaryRequest,
    SummaryResult,
)
from compactd.providers.chunking import ChunkingSummarizer
from compactd.providers.extractive import ExtractiveSummarizer
from compactd.providers.openai import OpenAISummarizer, RetryPolicy, Timeouts

__all__ = [
    "ChunkingSummarizer",
    "ExtractiveSummarizer",
    "OpenAISummarizer",
    "RetryPolicy",
    "Summarizer",
    "SummaryError",
    "SummaryRequest",
    "SummaryResult",
    "Timeouts",
]

"""The quality gate never rejects compactd's own extractive checkpoint.

Every shipped transcript (``testdata/transcripts/*.jsonl`` and, when it is beside the repository,
the shared set) is cut into spans as repeated compaction at a 4k, 8k and 16k window would (each
span starts with the previous span's checkpoint, ``bench.folds``), summarized by the real
``ExtractiveSummarizer`` and judged by the real gate (``core.gate.judge``, the span's probes from
``core.probes.select_probes``) with replay's thresholds: a checkpoint at most 15% of its span and
half the probes kept.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import folds
from bench.strategies import SHARED, conversation, read_transcripts
from compactd import replay as rp
from compactd.tokenizers import pricing_profile

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "testdata" / "transcripts").glob("*.jsonl"))
SHARED_SET = SHARED / "data" / "trajectories" / "conversations.jsonl"


def _rejections(paths: list[Path], window: int) -> tuple[int, list[str]]:
    profile = pricing_profile("o200k_base")
    max_tokens = int(rp.window_policy(window)["maxTokens"])
    spans, rejected = 0, []
    for path in paths:
        for transcript in read_transcripts(path):
            talk = conversation(transcript, profile)
            for fold in folds.folds(talk.messages, window // 2, max_tokens, profile):
                spans += 1
                if not fold.verdict.passed:
                    rejected.append(f"{transcript.source}: {fold.verdict.describe()[:200]}")
    return spans, rejected


@pytest.mark.parametrize("window", [4000, 8000, 16000])
def test_the_gate_passes_every_extractive_checkpoint_of_the_shipped_transcripts(
    window: int,
) -> None:
    spans, rejected = _rejections(SHIPPED, window)

    assert spans > 10
    assert rejected == []


@pytest.mark.skipif(not SHARED_SET.exists(), reason="the shared transcripts are not beside it")
@pytest.mark.parametrize("window", [4000, 8000, 16000])
def test_the_gate_passes_every_extractive_checkpoint_of_the_shared_transcripts(
    window: int,
) -> None:
    spans, rejected = _rejections([SHARED_SET], window)

    assert spans > 50
    assert rejected == []

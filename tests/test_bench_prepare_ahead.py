"""``bench.prepare_ahead``: its loopback summary model's pace and what it counts, the sessions'
policy per arm, and the transcripts cut to their first steps."""

from __future__ import annotations

import json
import math

import httpx

from bench import prepare_ahead as pa
from compactd import replay as rp
from compactd.testing import OpenAICompatServer


def test_the_smollm2_pace_is_prompt_over_175_plus_completion_over_85() -> None:
    assert pa.PACES["smollm2"].seconds(1750, 170) == 12.0
    assert pa.PACES["3s"].seconds(100_000, 1000) == 3.0


def test_the_summary_model_answers_a_summary_and_counts_the_prompt_it_was_sent() -> None:
    model = pa.SummaryModel(pa.Pace("now", "no delay", lambda prompt, completion: 0.0))
    messages = [{"role": "user", "content": "Fix src/app/main.py: run `pytest tests`."},
                {"role": "user", "content": "Summarize."}]  # fmt: skip
    with OpenAICompatServer(responder=model) as server:
        answer = httpx.post(
            f"{server.base_url}/chat/completions",
            json={"model": "loopback", "messages": messages},
            headers={"X-Compactd-Purpose": "compaction"},
        ).json()

    assert "## " in answer["choices"][0]["message"]["content"]  # the eight-section summary
    assert model.requests == 1
    sent_messages = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
    assert model.prompt_tokens == math.ceil(len("[]" + sent_messages) / 4)  # no tools declared


def test_on_sets_prepare_ahead_beside_replays_policy_and_off_does_not() -> None:
    on = pa.policy(8000, 0.65)
    off = pa.policy(8000, None)

    assert on == {**off, "prepareAheadRatio": 0.65}
    assert off == {**rp.window_policy(8000), "summarizationProvider": "bench-summary",
                   "summarizationModel": "loopback"}  # fmt: skip


def test_a_transcript_is_cut_before_the_model_reply_past_the_limit() -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "x.py"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "ok"},
    ]  # fmt: skip
    transcript = rp.Transcript("t", messages)

    assert pa._first_steps(transcript, 1).messages == messages[:3]
    assert pa._first_steps(transcript, 2).messages == messages[:5]
    assert pa._first_steps(transcript, 9).messages == messages


def _step(index: int, before: int, sent: int, compactions: int = 0) -> rp.StepRecord:
    return rp.StepRecord(
        index=index, turn=1, before_tokens=before, sent_tokens=sent, trigger_tokens=800,
        window=1000, pruned=0, compactions=compactions, request_messages=0, request_bytes=0,
        seconds=0.0, first_seq=index,
    )  # fmt: skip


def test_a_step_that_compacted_straight_from_below_the_ratio_counts_as_jumped() -> None:
    steps = [
        _step(1, 500, 500),
        _step(2, 900, 400, compactions=1),  # from 500 (< 650) to 900 (>= 800): jumped
        _step(3, 700, 700),
        _step(4, 850, 400, compactions=1),  # from 700 (>= 650): there was time to prepare
        _step(5, 600, 600, compactions=1),  # compacted below the trigger: not a jump
    ]
    result = rp.SessionReplay("t", "s", 0, steps=steps)
    arm = pa.Arm(pa.PACES["3s"], 0.65, replays=[(result, [])])

    assert pa.jumped(arm, 0.65) == 1
    assert rp.compacted_steps(result) == {2, 4, 5}

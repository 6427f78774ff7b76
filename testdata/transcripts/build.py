#!/usr/bin/env python3
"""Rebuilds this folder's transcripts from the shared agent trajectories (see SOURCES.md).

``openai.jsonl``: a subset of ``conversations.jsonl`` (OpenAI chat messages), copied unchanged,
one conversation per line (``{"source", "messages"}``).

``coding.jsonl``: longer coding-agent sessions of ``conversations.jsonl`` (paths, commands, error
output), copied unchanged the same way: what ``compactd replay`` and ``bench/strategies.py`` play
with a small window so that each compacts several times.

``anthropic.jsonl``: Anthropic Messages built from the original Claude Code transcript lines of
the ``spotter`` source: the lines of one API message (same ``message.id``) are merged, consecutive
user lines become one user message, sidechain and non-message lines are skipped, and three
differences without meaning to the API are written in one canonical form: a content list that is
one text block is that string (the form Claude Code writes a typed prompt in), ``is_error: false``
is left out, and Claude Code's own ``caller`` key of ``tool_use`` blocks (not part of the
Messages API) is dropped.

Usage: testdata/transcripts/build.py [SHARED_TRAJECTORIES_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_SHARED = HERE.parents[2] / "shared" / "data" / "trajectories"

OPENAI_SOURCES = (
    "inspect-ai/tests/analysis/test_logs/2025-05-12T20-27-36-04-00_browser.json#sample1-epoch1",
    "inspect-ai/tests/log/test_eval_log/log_images_tc.json#sample1-epoch1",
    "letta-agent-file/composio_github_star_agent/composio_github_star_agent.af#composio_github_star_agent",
    "letta-agent-file/customer_service_agent/customer_service.af#customer_service",
    "letta-agent-file/workflow_agent/outreach_workflow_agent.af#outreach_workflow_agent",
    "mini-swe-agent/tests/test_data/local.traj.json#messages",
    "openhands/evaluation/benchmarks/multi_swe_bench/examples/output.jsonl#ponylang__ponyc-4595",
    "openhands/tests/runtime/trajs/basic.json#events",
    "openhands/tests/runtime/trajs/basic_interactions.json#events",
    "openhands/tests/runtime/trajs/wrong_initial_state.json#events",
    "openhands/tests/unit/resolver/mock_output/output.jsonl#5",
    "spotter/test/fixtures/transcripts/short.jsonl#session",
    "spotter/test/fixtures/transcripts/tool_heavy.jsonl#session",
    "swe-agent/trajectories/demonstrations/function_calling_simple.traj#history",
    "swe-agent/trajectories/demonstrations/ctf/crypto/BabyEncryption.traj#history",
    "tau-bench/historical_trajectories/gpt-4o-airline.json#task0-trial0",
    "tau-bench/historical_trajectories/gpt-4o-airline.json#task2-trial0",
    "tau-bench/historical_trajectories/gpt-4o-airline.json#task3-trial0",
)
CODING_SOURCES = (
    "openhands/evaluation/benchmarks/multi_swe_bench/examples/output.jsonl#ponylang__ponyc-4593",
    "openhands/evaluation/benchmarks/multi_swe_bench/examples/output.jsonl#ponylang__ponyc-4588",
    "openhands/tests/unit/resolver/mock_output/output.jsonl#1",
    "spotter/test/fixtures/transcripts/fa812bfe-b295-4cca-9c2f-fdf01028cb46/subagents/agent-a93ccab.jsonl#session",
    "spotter/test/fixtures/transcripts/6c2214d7-b87e-4432-8e41-22ba294ea584/subagents/agent-afc096d.jsonl#session",
    "spotter/test/fixtures/transcripts/fa812bfe-b295-4cca-9c2f-fdf01028cb46/subagents/agent-aa84377.jsonl#session",
    "spotter/test/fixtures/transcripts/4d5611e5-241a-462a-8d15-5122611a9569/subagents/agent-a2898e3.jsonl#session",
    "swe-agent/trajectories/demonstrations/replay__marshmallow-code__marshmallow-1867__function_calling__install-1/marshmallow-code__marshmallow-1867.traj#history",
)
CLAUDE_CODE_FILES = (
    "spotter/test/fixtures/transcripts/short.jsonl",
    "spotter/test/fixtures/transcripts/tool_heavy.jsonl",
    "spotter/test/fixtures/transcripts/ae4a77f8-aedd-4bc1-888f-c94edc91af04/subagents/agent-aac57f5.jsonl",
    "spotter/test/fixtures/transcripts/subagent.jsonl",
)


def openai_subset(shared: Path, sources: tuple[str, ...] = OPENAI_SOURCES) -> list[dict[str, Any]]:
    wanted = {source: None for source in sources}
    with (shared / "conversations.jsonl").open(encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            if record["source"] in wanted:
                wanted[record["source"]] = record
    missing = [source for source, record in wanted.items() if record is None]
    if missing:
        raise SystemExit(f"not in conversations.jsonl: {missing}")
    return [record for record in wanted.values() if record is not None]


def _canonical(content: Any) -> Any:
    if isinstance(content, list) and len(content) == 1 and content[0].get("type") == "text":
        return content[0]["text"]
    return content


def anthropic_conversation(path: Path) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    last_id: str | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        message = entry.get("message")
        if entry.get("type") not in ("user", "assistant") or entry.get("isSidechain"):
            continue
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            continue
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        role = message["role"]
        same_message = role == "assistant" and message.get("id") == last_id
        if messages and messages[-1]["role"] == role and (role == "user" or same_message):
            messages[-1]["content"].extend(blocks)
        else:
            messages.append({"role": role, "content": list(blocks)})
        last_id = message.get("id") if role == "assistant" else None
    for message in messages:
        for block in message["content"]:
            block.pop("caller", None)
            if block.get("is_error") is False:
                del block["is_error"]
        if message["role"] == "user":
            for block in message["content"]:
                if block.get("type") == "tool_result":
                    block["content"] = _canonical(block.get("content", ""))
            message["content"] = _canonical(message["content"])
    return messages


def main(argv: list[str]) -> int:
    shared = Path(argv[0]) if argv else DEFAULT_SHARED
    with (HERE / "openai.jsonl").open("w", encoding="utf-8") as out:
        for record in openai_subset(shared):
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    with (HERE / "coding.jsonl").open("w", encoding="utf-8") as out:
        for record in openai_subset(shared, CODING_SOURCES):
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    with (HERE / "anthropic.jsonl").open("w", encoding="utf-8") as out:
        for name in CLAUDE_CODE_FILES:
            messages = anthropic_conversation(shared / name)
            out.write(json.dumps({"source": name, "messages": messages}, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

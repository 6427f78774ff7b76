"""Sample texts for exact-count tests: one per content type an agent session carries.

Written for these tests (no third-party text), each chosen to stress a tokenizer differently:
prose, CJK, source code, JSON tool output, whitespace runs, emoji and astral characters, and text
that spells special tokens.
"""

from __future__ import annotations

from typing import Final

SAMPLES: Final[dict[str, str]] = {
    "prose": (
        "The meter prices the whole request before the step runs. When the envelope crosses the "
        "trigger, the oldest balanced span is summarized; the recent tail stays verbatim, and "
        "the log keeps every original event so the session can be audited later."
    ),
    "chinese": (
        "上下文窗口快满了\uff1a先修剪过长的工具输出\uff0c再把最早的一段对话压缩成摘要\uff0c"
        "最近的消息原样保留。"
    ),
    "code": (
        "def fold(events: list[Event]) -> Surface:\n"
        "    surface = Surface()\n"
        "    for event in events:\n"
        "        if event.kind == 'replace':\n"
        "            surface.shadow(event.start, event.end)\n"
        "        surface.append(event)  # O(1)\n"
        "    return surface\n"
    ),
    "json": (
        '{"status": "ok", "files": [{"path": "src/io.py", "size": 2048, "mtime": 1712345678},'
        ' {"path": "tests/test_io.py", "size": 512}], "exit_code": 0, "stderr": ""}'
    ),
    "whitespace": "a    b\n\n\n  c\t\td\r\n   \n",
    "emoji": "Build passed ✅ 🎉 — 3 warnings 😀𝄞 naïve café",
    "special": "<|endoftext|> <|im_start|>user <|im_end|> <tool_call></tool_call> <think>",
}

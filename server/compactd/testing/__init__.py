"""First-class fakes of compactd's external dependencies, for tests, examples and benchmarks.

``openai_server`` is a real OpenAI-compatible HTTP server on loopback; ``messages`` builds
projected messages tersely.
"""

from compactd.testing.openai_server import (
    OpenAICompatServer,
    RecordedRequest,
    Reply,
    ScriptedToolCall,
    default_reply_text,
)

__all__ = [
    "OpenAICompatServer",
    "RecordedRequest",
    "Reply",
    "ScriptedToolCall",
    "default_reply_text",
]

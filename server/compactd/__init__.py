"""compactd: keeps long-running LLM agent conversations working near the context limit."""

__version__ = "0.1.0"

"""Real providers' error responses, as loopback ``Reply`` values.

Each function answers with the status code and body shape the named provider sends for one
failure, with the figures filled in, so tests replay them through real HTTP (the loopback
``OpenAICompatServer``) into the summarizer, ``ClassifyProviderError`` and ``RecoverFromError``.
Sources: llama.cpp's body is the one recorded from ``llama-server`` in
``shared/tools/oai-server/README.md``; the others follow each provider's documented error format
(OpenAI's ``{"error": {message, type, param, code}}``, DeepSeek's ``invalid_request_error``
code, vLLM's bare ``{"object": "error", ..., "code": 400}``, Anthropic's ``{"type": "error",
"error": {type, message}}``, Gemini's ``{"error": {code, message, status}}``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Final

from compactd.testing.openai_server import Reply

#: Providers whose context-window overflow ``overflow`` can answer with.
OVERFLOW_PROVIDERS: Final = ("openai", "deepseek", "vllm", "llama.cpp", "anthropic", "gemini")


def _reply(status: int, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> Reply:
    return Reply(status=status, body=json.dumps(body), headers=dict(headers or {}))


def _requested(window: int, prompt: int) -> str:
    return (
        f"This model's maximum context length is {window} tokens. However, you requested "
        f"{prompt} tokens ({prompt} in the messages, 0 in the completion). Please reduce the "
        "length of the messages or completion."
    )


def _openai(window: int, prompt: int) -> Reply:
    message = (
        f"This model's maximum context length is {window} tokens. However, your messages "
        f"resulted in {prompt} tokens. Please reduce the length of the messages."
    )
    error = {
        "message": message,
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    return _reply(400, {"error": error})


def _deepseek(window: int, prompt: int) -> Reply:
    error = {
        "message": _requested(window, prompt),
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_request_error",
    }
    return _reply(400, {"error": error})


def _vllm(window: int, prompt: int) -> Reply:
    body = {
        "object": "error",
        "message": _requested(window, prompt),
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    return _reply(400, body)


def _llama_cpp(window: int, prompt: int) -> Reply:
    error = {
        "code": 400,
        "message": (
            f"request ({prompt} tokens) exceeds the available context size ({window} tokens), "
            "try increasing it"
        ),
        "type": "exceed_context_size_error",
        "n_prompt_tokens": prompt,
        "n_ctx": window,
    }
    return _reply(400, {"error": error})


def _anthropic(window: int, prompt: int) -> Reply:
    error = {
        "type": "invalid_request_error",
        "message": f"prompt is too long: {prompt} tokens > {window} maximum",
    }
    return _reply(400, {"type": "error", "error": error})


def _gemini(window: int, prompt: int) -> Reply:
    error = {
        "code": 400,
        "message": (
            f"The input token count ({prompt}) exceeds the maximum number of tokens allowed "
            f"({window})."
        ),
        "status": "INVALID_ARGUMENT",
    }
    return _reply(400, {"error": error})


_OVERFLOWS: Final[dict[str, Callable[[int, int], Reply]]] = {
    "openai": _openai,
    "deepseek": _deepseek,
    "vllm": _vllm,
    "llama.cpp": _llama_cpp,
    "anthropic": _anthropic,
    "gemini": _gemini,
}


def overflow(provider: str, *, window: int, prompt_tokens: int) -> Reply:
    """``provider``'s answer to a prompt of ``prompt_tokens`` over a ``window``-token context.

    Raises:
        KeyError: ``provider`` is not one of ``OVERFLOW_PROVIDERS``.
    """
    return _OVERFLOWS[provider](window, prompt_tokens)


def vllm_image_limit(limit: int) -> Reply:
    """vLLM refusing more images than ``--limit-mm-per-prompt`` allows (400)."""
    message = f"At most {limit} image(s) may be provided in one request."
    body = {"object": "error", "message": message, "type": "BadRequestError", "code": 400}
    return _reply(400, body)


def gateway_image_budget(offload_images: int) -> Reply:
    """A gateway that says how many input images to drop (413 with ``offload_images``)."""
    return Reply.too_many_images(limit=0, offload_images=offload_images)


def rate_limited(provider: str, retry_after: float = 1.0) -> Reply:
    """A 429 from ``provider`` (``openai``, ``anthropic``, ``gemini``) with ``retry-after``."""
    headers = {"retry-after": f"{retry_after:g}"}
    if provider == "anthropic":
        error: dict[str, Any] = {
            "type": "rate_limit_error",
            "message": "Number of request tokens has exceeded your per-minute rate limit",
        }
        return _reply(429, {"type": "error", "error": error}, headers)
    if provider == "gemini":
        error = {
            "code": 429,
            "message": "Resource has been exhausted (e.g. check quota).",
            "status": "RESOURCE_EXHAUSTED",
        }
        return _reply(429, {"error": error}, headers)
    message = (
        "Rate limit reached for gpt-4o on tokens per min (TPM): Limit 30000, Used 29500, "
        "Requested 1200. Please try again in 1s."
    )
    error = {"message": message, "type": "tokens", "param": None, "code": "rate_limit_exceeded"}
    return _reply(429, {"error": error}, headers)


def quota_exhausted() -> Reply:
    """OpenAI's 429 for an account without quota (retrying does not help)."""
    error = {
        "message": "You exceeded your current quota, please check your plan and billing details.",
        "type": "insufficient_quota",
        "param": None,
        "code": "insufficient_quota",
    }
    return _reply(429, {"error": error})


def unauthenticated(provider: str) -> Reply:
    """A 401 from ``provider`` (``openai``, ``anthropic``, ``llama.cpp``)."""
    if provider == "anthropic":
        error: dict[str, Any] = {"type": "authentication_error", "message": "invalid x-api-key"}
        return _reply(401, {"type": "error", "error": error})
    if provider == "llama.cpp":
        error = {"message": "Invalid API Key", "type": "authentication_error", "code": 401}
        return _reply(401, {"error": error})
    error = {
        "message": "Incorrect API key provided: sk-test. You can find your API key at "
        "https://platform.openai.com/account/api-keys.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    return _reply(401, {"error": error})


def unavailable(provider: str) -> Reply:
    """``provider`` overloaded or down (``anthropic``: 529, ``openai``: 503, else 500)."""
    if provider == "anthropic":
        error: dict[str, Any] = {"type": "overloaded_error", "message": "Overloaded"}
        return _reply(529, {"type": "error", "error": error})
    if provider == "openai":
        error = {
            "message": "The engine is currently overloaded, please try again later.",
            "type": "server_error",
            "param": None,
            "code": None,
        }
        return _reply(503, {"error": error})
    error = {"code": 500, "message": "slot unavailable", "type": "server_error"}
    return _reply(500, {"error": error})

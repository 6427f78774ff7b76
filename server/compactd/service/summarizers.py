"""Which summarizer writes a summary, and for which target.

Target resolution follows the spec: the configured ``summarizationProvider``/``summarizationModel``
pair, else the latest routed ``request/header``, else the service default; with none of them
the call fails with ``SUMMARY_TARGET_UNKNOWN`` saying what to configure (unless the summarizer
is ``extractive``, which needs no model). The summarizer for a
target is chosen by ``[summarizer] kind``: ``extractive`` (no model), ``openai`` (the route's
OpenAI-compatible endpoint), or ``auto`` (openai when the route names a ``base_url``, else
extractive). A model-backed summarizer is bounded by its route's window through
``ChunkingSummarizer``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compactd.core.policy import TargetPolicy
from compactd.core.pricing import price_message, price_tools
from compactd.errors import ConfigError, FailedPrecondition
from compactd.providers.base import Summarizer
from compactd.providers.chunking import ChunkingSummarizer
from compactd.providers.extractive import ExtractiveSummarizer
from compactd.providers.openai import OpenAISummarizer, RetryPolicy, Timeouts
from compactd.routes import Route, RouteCatalog
from compactd.v1 import events_pb2, session_service_pb2

KINDS = ("auto", "extractive", "openai")
#: The target recorded for an extractive summary when no model route was resolved.
EXTRACTIVE_TARGET = Route("compactd", "extractive")


@dataclass(frozen=True)
class SummarizerSettings:
    """The ``[summarizer]`` table: the summarizer kind, a default target, and HTTP limits."""

    kind: str = "auto"
    provider: str = ""
    model: str = ""
    timeout_s: float = 120.0
    max_attempts: int = 4

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SummarizerSettings:
        """Parse and validate (``ConfigError`` names the bad key)."""
        known = {"kind", "provider", "model", "timeout_s", "max_attempts"}
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
        return settings


class SummarizerRegistry:
    """Builds (and caches) the summarizer for each target route."""

    def __init__(
        self,
        routes: RouteCatalog,
        settings: SummarizerSettings,
        *,
        override: Summarizer | None = None,
    ) -> None:
        self._routes = routes
        self.settings = settings
        self._override = override
        self._cache: dict[tuple[str, str], Summarizer] = {}

    def target(self, policy: TargetPolicy, header: events_pb2.RequestHeader | None) -> Route:
        """The route that writes the summary (see the module docstring)."""
        if policy.summarization_provider and policy.summarization_model:
            return self._routes.resolve(policy.summarization_provider, policy.summarization_model)
        if header is not None and header.config.provider and header.config.model:
            return self._routes.resolve(header.config.provider, header.config.model)
        if self.settings.provider and self.settings.model:
            return self._routes.resolve(self.settings.provider, self.settings.model)
        if self.settings.kind == "extractive":
            return EXTRACTIVE_TARGET  # needs no model, so no target either
        raise FailedPrecondition(
            "no model can write the summary: set compaction.summarizationProvider and "
            "compaction.summarizationModel (or [summarizer] provider/model), or log a "
            "request/header that routes a model first",
            reason="SUMMARY_TARGET_UNKNOWN",
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
        if kind == "extractive" or (kind == "auto" and not route.base_url):
            return ExtractiveSummarizer()
        if not route.base_url:
            raise FailedPrecondition(
                f"summarizer kind 'openai' needs a base_url for route {route.name}",
                reason="SUMMARIZER_MISCONFIGURED",
            )
        model: Summarizer = OpenAISummarizer(
            base_url=route.base_url,
            api_key_env=route.api_key_env or None,
            provider=route.provider,
            include_reasoning=route.sends_reasoning,
            timeouts=Timeouts(read=self.settings.timeout_s, total=self.settings.timeout_s),
            retry=RetryPolicy(max_attempts=self.settings.max_attempts),
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

        return ChunkingSummarizer(model, window_tokens=route.context_window, count_tokens=count)

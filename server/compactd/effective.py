"""The effective configuration as TOML (``compactd check-config``) and as start-up log lines.

Both describe what ``compactd serve`` will do with a configuration once every source is applied:
the scalar settings, the owned tables with their defaults filled in, and every route, the
built-in catalog included. The TOML reads back as the same configuration: routes the file names
are active ``[[routes]]`` tables; built-in routes it does not name are printed commented out
(they are always present, and naming one would let its public endpoint receive summaries).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import tomli_w

from compactd import __version__
from compactd.config import SCALARS, TABLES, ServerConfig
from compactd.routes import Route

#: Route attributes whose config key differs from the attribute name.
_ROUTE_KEYS = {"default_output_tokens": "max_output_tokens"}
#: Tables printed from what their owner parsed (defaults filled in); every other table in
#: ``TABLES`` is printed as set, so a table added to ``ServerConfig`` is never dropped.
_PARSED = frozenset({"routes", "summarizer", "pruner"})


def route_table(route: Route) -> dict[str, Any]:
    """A route as the ``[[routes]]`` table that declares it (unset values left out)."""
    table: dict[str, Any] = {}
    for item in dataclasses.fields(route):
        value = getattr(route, item.name)
        if value is None or value == "":
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
        table[_ROUTE_KEYS.get(item.name, item.name)] = value
    return table


def effective_toml(
    config: ServerConfig,
    *,
    routes: Iterator[Route] | list[Route],
    summarizer: Any,
    pruner: Any,
) -> str:
    """The effective configuration as a TOML document (see the module docstring)."""
    named = {(str(t.get("provider")), str(t.get("model"))) for t in config.routes}
    active: list[dict[str, Any]] = []
    builtin: list[dict[str, Any]] = []
    for route in routes:
        (active if (route.provider, route.model) in named else builtin).append(route_table(route))
    document: dict[str, Any] = {name: getattr(config, name) for name in SCALARS}
    document.update({name: dict(getattr(config, name)) for name in TABLES if name not in _PARSED})
    document["summarizer"] = dataclasses.asdict(summarizer)
    document["pruner"] = dataclasses.asdict(pruner)
    if active:
        document["routes"] = active
    header = (
        f"# compactd {__version__}: the effective configuration (defaults, then the file, then\n"
        "# COMPACTD_* variables, then flags). [summarizer] and [pruner] have the README's\n"
        "# defaults filled in; the other tables hold the keys set.\n"
    )
    commented = "".join(
        "\n# built-in route (always present; uncomment to override):\n"
        + "".join(f"# {line}\n" for line in tomli_w.dumps({"routes": [t]}).splitlines())
        for t in builtin
    )
    return header + tomli_w.dumps(_without_none(document)) + commented


def _without_none(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_without_none(v) for v in value]
    return value


def startup_report(running: Any, parts: Any, summarizers: Any) -> list[tuple[str, dict[str, Any]]]:
    """The start-up log lines of a running server: what it will do, as message and fields.

    ``compactd serving`` (listen address, store, tracing and metrics targets), one line about the
    summaries (the summarizer kind and every endpoint a conversation may be sent to, or that
    summaries are extractive because none is configured), one about the tenant quotas, and one
    line per route (its tokenizer, window and whether summaries may use its endpoint).
    """
    from compactd import telemetry

    config = running.config
    metrics = telemetry.export_target("metrics")
    if running.prometheus is not None:
        metrics = f"prometheus {running.prometheus.url}" + (
            "" if metrics.startswith("off") else f", {metrics}"
        )
    lines: list[tuple[str, dict[str, Any]]] = [
        (
            "compactd serving",
            {
                "listen": running.address,
                "store": config.store,
                "tracing": telemetry.export_target("traces"),
                "metrics": metrics,
            },
        )
    ]
    kind, endpoints = parts.summarizer.kind, summarizers.model_endpoints
    if summarizers.writes_with_models:
        message = f"summaries: {kind} summarizer; model endpoints: " + (
            ", ".join(f"{name} -> {url}" for name, url in endpoints.items()) or "none"
        )
    elif kind == "extractive":
        message = "summaries: extractive summarizer (configured); no conversation leaves compactd"
    else:
        message = (
            "summaries: extractive summarizer, since no model endpoint is configured; to use a "
            "model, name its route in [[routes]] (with base_url) and in [summarizer] "
            "provider/model or compaction.summarizationProvider/summarizationModel"
        )
    lines.append((message, {"summarizer": kind, "endpoints": endpoints}))
    lines.append(_quotas_line(parts.quotas))
    for route in parts.routes:
        fields: dict[str, Any] = {"route": route.name, "tokenizer": route.tokenizer,
                                  "context_window": route.context_window}  # fmt: skip
        if route.tokenizer_file:  # priced through its chat template; ``tokenizer`` is ignored
            fields.update(tokenizer="chat template", tokenizer_file=route.tokenizer_file)
        if summarizers.may_send(route):
            fields["summary_endpoint"] = route.base_url
        lines.append(("route", fields))
    return lines


def _quotas_line(settings: Any) -> tuple[str, dict[str, Any]]:
    """The quotas every tenant is held to (the limits set) and the tenants with their own."""
    default = {k: v for k, v in dataclasses.asdict(settings.default).items() if v}
    tenants = sorted(settings.tenants)
    if not default and not tenants:
        return "quotas: none (no tenant is limited)", {"quotas": {}, "tenants": []}
    return "quotas", {"quotas": default, "tenants": tenants}

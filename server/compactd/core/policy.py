"""The pressure policy: when a route's envelope is under pressure and how much history to keep.

Settings use the spec's camelCase names and defaults:

=====================  =========  ==========================================================
``thresholdRatio``     0.8        trigger = ``floor(min(W * thresholdRatio, W - O - B))``, (0, 1]
``headroomTokens``     65536      B, headroom beyond the output reservation (integer >= 0)
``retainRatio``        0.16       retained budget = ``floor(retainRatio * (W - O))``, in (0, 1]
``retainTokens``       --         absolute retained budget (excludes ``retainRatio``)
``summarizationProvider`` / ``summarizationModel``  ``''``  the summary target, set together
``maxTokens``          B          summary output cap (integer > 0)
``compactionRetries``  1          extra compactions while pressure stays above the trigger
``maxOverflowRetries`` 1          retries after a provider-confirmed overflow
``modelPolicies``      ``[]``     exact ``{provider, model, ...}`` overrides
``auto``               true       automatic compaction and overflow recovery
``prepareAheadRatio``  0 (off)    prepare the summary ahead once the envelope reaches
                                  ``floor(min(W * prepareAheadRatio, W - O - B))``, in
                                  (0, thresholdRatio); 0 or absent: off (``core.ahead``)
``prepareAheadWaitMs`` 30000      how long a step at the trigger waits for a candidate still
                                  being prepared before it summarizes itself (integer >= 0)
=====================  =========  ==========================================================

The summary quality gate and failure memory (``core.gate``, ``core.attempts``):

============================  =======  ===================================================
``summaryGate``               true     check every summary before it may replace history
``minReductionRatio``         0.1      the checkpoint is at least this much smaller, [0, 1)
``minProbeRetention``         0.5      share of the span's probes a summary keeps, [0, 1]
``extractiveFallback``        false    a rejected summary is replaced by the extractive one
``failureBackoffSeconds``     300      first wait before a span that failed transiently is
                                       sent again (0: no failure memory)
``failureBackoffMaxSeconds``  3600     the longest wait (the backoff doubles up to it)
============================  =======  ===================================================

The recall tool (``core.recall``): with ``recallTool`` true, a rebuilt request for the route
declares a tool named ``recallToolName`` (default ``recall``; 1-64 of ``[A-Za-z0-9_-]``) whose
call the runtime answers through ``Recall``; it is priced in the envelope like any tool.

``W`` is the route's context window and ``O`` the effective output reservation (the envelope's
max output tokens, else the route's default, else 0). Token settings are at most
``MAX_TOKEN_COUNT``, retries at most ``MAX_RETRIES``, backoffs at most ``MAX_BACKOFF_SECONDS``.
Parsing fails fast with a ``ConfigError``
naming the field; the rules that need ``W`` and ``O`` are checked at first use by
``compact_spec``. All arithmetic on ratios is exact (decimal ratios are read as fractions), so a
ratio written ``0.29`` never floors ``100 * 0.29`` to 28.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from typing import Any, Final, NoReturn, TypeVar

from compactd.core.gate import (
    DEFAULT_MIN_PROBE_RETENTION,
    DEFAULT_MIN_REDUCTION_RATIO,
    GateSettings,
)
from compactd.core.limits import MAX_TOKEN_COUNT
from compactd.errors import CapacityUnknown, ConfigError, FailedPrecondition
from compactd.reasons import Reason

DEFAULT_THRESHOLD_RATIO: Final = 0.8
DEFAULT_HEADROOM_TOKENS: Final = 65536
DEFAULT_RETAIN_RATIO: Final = 0.16
DEFAULT_COMPACTION_RETRIES: Final = 1
DEFAULT_MAX_OVERFLOW_RETRIES: Final = 1
DEFAULT_FAILURE_BACKOFF_SECONDS: Final = 300.0
DEFAULT_FAILURE_BACKOFF_MAX_SECONDS: Final = 3600.0
DEFAULT_RECALL_TOOL_NAME: Final = "recall"
#: A candidate still being written is nearer to done than a summary the step would start now
#: (the same span to the same model): the bound is for a preparer that hangs.
DEFAULT_PREPARE_AHEAD_WAIT_MS: Final = 30_000
#: The longest bounded wait for a candidate a policy may ask for (ten minutes).
MAX_PREPARE_AHEAD_WAIT_MS: Final = 600_000

# camelCase setting -> PolicyLayer attribute.
_SETTINGS: Final[dict[str, str]] = {
    "thresholdRatio": "threshold_ratio",
    "headroomTokens": "headroom_tokens",
    "retainRatio": "retain_ratio",
    "retainTokens": "retain_tokens",
    "summarizationProvider": "summarization_provider",
    "summarizationModel": "summarization_model",
    "maxTokens": "max_tokens",
    "compactionRetries": "compaction_retries",
    "maxOverflowRetries": "max_overflow_retries",
    "auto": "auto",
    "summaryGate": "summary_gate",
    "minReductionRatio": "min_reduction_ratio",
    "minProbeRetention": "min_probe_retention",
    "extractiveFallback": "extractive_fallback",
    "failureBackoffSeconds": "failure_backoff_seconds",
    "failureBackoffMaxSeconds": "failure_backoff_max_seconds",
    "recallTool": "recall_tool",
    "recallToolName": "recall_tool_name",
    "prepareAheadRatio": "prepare_ahead_ratio",
    "prepareAheadWaitMs": "prepare_ahead_wait_ms",
}

RouteKey = tuple[str, str]
_T = TypeVar("_T")
_Validator = Callable[[object, str], object]


@dataclass(frozen=True, slots=True)
class PolicyLayer:
    """One level of settings (service, session, or one model override); None means unset."""

    threshold_ratio: float | None = None
    headroom_tokens: int | None = None
    retain_ratio: float | None = None
    retain_tokens: int | None = None
    summarization_provider: str | None = None
    summarization_model: str | None = None
    max_tokens: int | None = None
    compaction_retries: int | None = None
    max_overflow_retries: int | None = None
    auto: bool | None = None
    summary_gate: bool | None = None
    min_reduction_ratio: float | None = None
    min_probe_retention: float | None = None
    extractive_fallback: bool | None = None
    failure_backoff_seconds: float | None = None
    failure_backoff_max_seconds: float | None = None
    recall_tool: bool | None = None
    recall_tool_name: str | None = None
    prepare_ahead_ratio: float | None = None
    prepare_ahead_wait_ms: int | None = None

    def over(self, base: PolicyLayer) -> PolicyLayer:
        """This layer's settings over ``base``'s.

        The two retention forms replace each other, and the summary pair moves as one.
        """
        merged = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in merged.items():
            if value is None:
                merged[name] = getattr(base, name)
        if self.retain_ratio is not None or self.retain_tokens is not None:
            merged["retain_ratio"], merged["retain_tokens"] = self.retain_ratio, self.retain_tokens
        return PolicyLayer(**merged)


@dataclass(frozen=True, slots=True)
class TargetPolicy:
    """The resolved policy of one provider/model route (every setting has its value)."""

    threshold_ratio: float = DEFAULT_THRESHOLD_RATIO
    headroom_tokens: int = DEFAULT_HEADROOM_TOKENS
    retain_ratio: float | None = DEFAULT_RETAIN_RATIO
    retain_tokens: int | None = None
    summarization_provider: str = ""
    summarization_model: str = ""
    max_tokens: int = DEFAULT_HEADROOM_TOKENS
    compaction_retries: int = DEFAULT_COMPACTION_RETRIES
    max_overflow_retries: int = DEFAULT_MAX_OVERFLOW_RETRIES
    auto: bool = True
    summary_gate: bool = True
    min_reduction_ratio: float = DEFAULT_MIN_REDUCTION_RATIO
    min_probe_retention: float = DEFAULT_MIN_PROBE_RETENTION
    extractive_fallback: bool = False
    failure_backoff_seconds: float = DEFAULT_FAILURE_BACKOFF_SECONDS
    failure_backoff_max_seconds: float = DEFAULT_FAILURE_BACKOFF_MAX_SECONDS
    recall_tool: bool = False
    recall_tool_name: str = DEFAULT_RECALL_TOOL_NAME
    prepare_ahead_ratio: float = 0.0  # 0: off
    prepare_ahead_wait_ms: int = DEFAULT_PREPARE_AHEAD_WAIT_MS

    @property
    def prepares_ahead(self) -> bool:
        """Whether summaries are prepared ahead of the trigger (``prepareAheadRatio`` > 0)."""
        return self.prepare_ahead_ratio > 0

    @property
    def gate(self) -> GateSettings | None:
        """The quality gate's thresholds, or None when ``summaryGate`` is off."""
        if not self.summary_gate:
            return None
        return GateSettings(self.min_reduction_ratio, self.min_probe_retention)

    @property
    def remembers_failures(self) -> bool:
        """Whether failure memory and the per-crossing budget are on."""
        return self.failure_backoff_seconds > 0


@dataclass(frozen=True, slots=True)
class CompactSpec:
    """A policy resolved against one route's window: the numbers of a pressure report.

    Attributes:
        window: W, the route's context window.
        output_reservation: O, the effective output reservation.
        headroom: B, the headroom tokens.
        trigger: ``floor(min(W * thresholdRatio, W - O - B))``.
        retained_budget: ``floor(retainRatio * (W - O))`` or ``retainTokens``.
        prepare_ahead: ``floor(min(W * prepareAheadRatio, W - O - B))``, where a summary starts
            being prepared ahead of the trigger; 0 when ``prepareAheadRatio`` is off.
    """

    window: int
    output_reservation: int
    headroom: int
    trigger: int
    retained_budget: int
    prepare_ahead: int = 0

    def prepares_ahead(self, measured: int) -> bool:
        """Whether ``measured`` tokens are at or past the prepare-ahead point (and the option
        is on)."""
        return self.prepare_ahead > 0 and measured >= self.prepare_ahead

    def is_above(self, measured: int) -> bool:
        """Whether ``measured`` tokens are under pressure (at or over the trigger)."""
        return measured >= self.trigger


@dataclass(frozen=True)
class PressurePolicy:
    """A validated policy: base settings and exact per-route overrides.

    Build one with ``from_settings`` (service-wide) and layer a session's settings over it
    with ``with_overrides``; resolve a route with ``for_target``.
    """

    base: PolicyLayer = field(default_factory=PolicyLayer)
    models: Mapping[RouteKey, PolicyLayer] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any] | None) -> PressurePolicy:
        """Parse and validate camelCase settings (``ConfigError`` names the bad field)."""
        return PressurePolicy().with_overrides(settings)

    def with_overrides(self, settings: Mapping[str, Any] | None) -> PressurePolicy:
        """This policy with ``settings`` layered over it (``ConfigError`` names the bad field).

        Base settings override base settings; a model override for a route is layered over this
        policy's override for the same route. Resolution takes the merged model override over
        the merged base.
        """
        base, models = _parse(settings or {})
        merged_models = dict(self.models)
        for key, layer in models.items():
            merged_models[key] = layer.over(self.models.get(key, PolicyLayer()))
        policy = PressurePolicy(base.over(self.base), merged_models)
        policy._check_resolved(_model_paths(settings or {}))
        return policy

    def for_target(self, provider: str, model: str) -> TargetPolicy:
        """The resolved policy of the exact ``provider``/``model`` route."""
        layer = self.models.get((provider, model), PolicyLayer()).over(self.base)
        return _resolve(layer)

    def _check_resolved(self, paths: Mapping[RouteKey, str]) -> None:
        _check_layer(self.base, "")
        for key, layer in self.models.items():
            _check_layer(layer.over(self.base), paths.get(key, _model_label(key)) + ".")


def output_reservation(envelope_max_output: int | None, route_default: int | None) -> int:
    """O: the envelope's max output tokens, else the route's default, else 0."""
    if envelope_max_output is not None:
        return envelope_max_output
    if route_default is not None:
        return route_default
    return 0


def compact_spec(
    policy: TargetPolicy, *, route: str, window: int | None, output_reservation: int
) -> CompactSpec:
    """Resolve ``policy`` against a route's window: trigger and retained budget.

    Raises:
        CapacityUnknown: The route declares no context window (``route`` names it).
        FailedPrecondition: reason ``POLICY_INVALID`` when ``W - O - B`` is not positive or the
            retained budget is not below the trigger.
    """
    if window is None:
        raise CapacityUnknown(
            f"route {route} declares no context window; capacity is never guessed",
            metadata={"route": route},
        )
    headroom = policy.headroom_tokens
    if output_reservation < 0:
        _invalid(route, f"output reservation {output_reservation} is negative")
    room = window - output_reservation - headroom
    if room <= 0:
        _invalid(
            route,
            f"W - O - B = {window} - {output_reservation} - {headroom} = {room} is not positive; "
            "set headroomTokens (or a modelPolicies entry) that fits this window",
        )
    trigger = min(math.floor(_exact(policy.threshold_ratio) * window), room)
    retained = _retained_budget(policy, window - output_reservation)
    if retained >= trigger:
        _invalid(route, f"retained budget {retained} is not below the trigger {trigger}")
    ahead = 0
    if policy.prepare_ahead_ratio > 0:
        ahead = min(math.floor(_exact(policy.prepare_ahead_ratio) * window), room)
    return CompactSpec(window, output_reservation, headroom, trigger, retained, ahead)


def _retained_budget(policy: TargetPolicy, usable: int) -> int:
    if policy.retain_tokens is not None:
        return policy.retain_tokens
    ratio = policy.retain_ratio if policy.retain_ratio is not None else DEFAULT_RETAIN_RATIO
    return math.floor(_exact(ratio) * usable)


def _exact(ratio: float) -> Fraction:
    """The ratio as the decimal it was written as (``0.8`` is 4/5, not its binary neighbour)."""
    return Fraction(repr(ratio))


def _invalid(route: str, detail: str) -> NoReturn:
    raise FailedPrecondition(
        f"pressure policy does not fit route {route}: {detail}",
        reason=Reason.POLICY_INVALID,
        metadata={"route": route},
    )


def _resolve(layer: PolicyLayer) -> TargetPolicy:
    defaults = TargetPolicy()
    headroom = _pick(layer.headroom_tokens, defaults.headroom_tokens)
    retain_ratio = layer.retain_ratio
    if layer.retain_tokens is None and retain_ratio is None:
        retain_ratio = DEFAULT_RETAIN_RATIO
    return replace(
        defaults,
        threshold_ratio=_pick(layer.threshold_ratio, defaults.threshold_ratio),
        headroom_tokens=headroom,
        retain_ratio=retain_ratio,
        retain_tokens=layer.retain_tokens,
        summarization_provider=layer.summarization_provider or "",
        summarization_model=layer.summarization_model or "",
        max_tokens=_pick(layer.max_tokens, headroom),
        compaction_retries=_pick(layer.compaction_retries, defaults.compaction_retries),
        max_overflow_retries=_pick(layer.max_overflow_retries, defaults.max_overflow_retries),
        auto=_pick(layer.auto, defaults.auto),
        summary_gate=_pick(layer.summary_gate, defaults.summary_gate),
        min_reduction_ratio=_pick(layer.min_reduction_ratio, defaults.min_reduction_ratio),
        min_probe_retention=_pick(layer.min_probe_retention, defaults.min_probe_retention),
        extractive_fallback=_pick(layer.extractive_fallback, defaults.extractive_fallback),
        failure_backoff_seconds=_pick(
            layer.failure_backoff_seconds, defaults.failure_backoff_seconds
        ),
        failure_backoff_max_seconds=_pick(
            layer.failure_backoff_max_seconds, defaults.failure_backoff_max_seconds
        ),
        recall_tool=_pick(layer.recall_tool, defaults.recall_tool),
        recall_tool_name=_pick(layer.recall_tool_name, defaults.recall_tool_name),
        prepare_ahead_ratio=_pick(layer.prepare_ahead_ratio, defaults.prepare_ahead_ratio),
        prepare_ahead_wait_ms=_pick(layer.prepare_ahead_wait_ms, defaults.prepare_ahead_wait_ms),
    )


def _pick(value: _T | None, default: _T) -> _T:
    return default if value is None else value


# ---- parsing -------------------------------------------------------------------------------


def _parse(settings: Mapping[str, Any]) -> tuple[PolicyLayer, dict[RouteKey, PolicyLayer]]:
    if not isinstance(settings, Mapping):
        _bad("", "policy settings must be a table of settings")
    top = {k: v for k, v in settings.items() if k != "modelPolicies"}
    base = _parse_layer(top, "")
    models: dict[RouteKey, PolicyLayer] = {}
    first_at: dict[RouteKey, int] = {}
    entries = settings.get("modelPolicies", [])
    if not isinstance(entries, Sequence) or isinstance(entries, str):
        _bad("modelPolicies", "must be a list of {provider, model, ...} tables")
    for index, entry in enumerate(entries):
        path = f"modelPolicies[{index}]"
        key = _route_key(entry, path)
        if key in first_at:
            _bad(path, f"duplicate override for {_model_label(key)} (first at [{first_at[key]}])")
        first_at[key] = index
        rest = {k: v for k, v in entry.items() if k not in ("provider", "model")}
        models[key] = _parse_layer(rest, path + ".")
    return base, models


def _route_key(entry: object, path: str) -> RouteKey:
    if not isinstance(entry, Mapping):
        _bad(path, "must be a table with provider and model")
    key = []
    for name in ("provider", "model"):
        value = entry.get(name)
        if not isinstance(value, str) or not value:
            _bad(f"{path}.{name}", "required, a non-empty string")
        key.append(value)
    return key[0], key[1]


def _parse_layer(values: Mapping[str, Any], prefix: str) -> PolicyLayer:
    parsed: dict[str, Any] = {}
    for name, value in values.items():
        path = prefix + str(name)
        attribute = _SETTINGS.get(name) if isinstance(name, str) else None
        if attribute is None:
            _bad(path, "unknown setting")
        parsed[attribute] = _VALIDATORS[attribute](value, path)
    if parsed.get("retain_ratio") is not None and parsed.get("retain_tokens") is not None:
        _bad(prefix + "retainTokens", "retainRatio and retainTokens are mutually exclusive")
    _check_pair(parsed, prefix)
    return PolicyLayer(**parsed)


def _check_pair(parsed: Mapping[str, Any], prefix: str) -> None:
    provider = parsed.get("summarization_provider")
    model = parsed.get("summarization_model")
    if bool(provider) == bool(model) and (provider is None) == (model is None):
        return
    missing = "summarizationProvider" if model else "summarizationModel"
    _bad(prefix + missing, "summarizationProvider and summarizationModel are set together")


def _check_layer(layer: PolicyLayer, prefix: str) -> None:
    """Rules on a resolved layer that do not need the route's window."""
    resolved = _resolve(layer)
    if resolved.retain_ratio is not None and resolved.retain_ratio >= resolved.threshold_ratio:
        _bad(
            prefix + "retainRatio",
            f"{resolved.retain_ratio} must be below thresholdRatio {resolved.threshold_ratio}",
        )
    if resolved.headroom_tokens == 0 and layer.max_tokens is None:
        _bad(prefix + "headroomTokens", "zero headroom requires an explicit positive maxTokens")
    if resolved.failure_backoff_max_seconds < resolved.failure_backoff_seconds:
        _bad(
            prefix + "failureBackoffMaxSeconds",
            f"{resolved.failure_backoff_max_seconds} must not be below failureBackoffSeconds "
            f"{resolved.failure_backoff_seconds}",
        )
    if resolved.prepare_ahead_ratio >= resolved.threshold_ratio:
        _bad(
            prefix + "prepareAheadRatio",
            f"{resolved.prepare_ahead_ratio} must be below thresholdRatio "
            f"{resolved.threshold_ratio} (0: off)",
        )


def _model_paths(settings: Mapping[str, Any]) -> dict[RouteKey, str]:
    entries = settings.get("modelPolicies", []) if isinstance(settings, Mapping) else []
    paths = {}
    for index, entry in enumerate(entries):
        paths[(entry["provider"], entry["model"])] = f"modelPolicies[{index}]"
    return paths


def _model_label(key: RouteKey) -> str:
    return f"modelPolicies[{key[0]}/{key[1]}]"


def _ratio(*, low_open: bool, high: float, high_open: bool) -> _Validator:
    def check(value: object, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            _bad(path, f"must be a number, got {value!r}")
        low_ok = value > 0 if low_open else value >= 0
        high_ok = value < high if high_open else value <= high
        if not (low_ok and high_ok):
            interval = f"{'(' if low_open else '['}0, {high}{')' if high_open else ']'}"
            _bad(path, f"must be in {interval}, got {value!r}")
        return float(value)

    return check


#: The most retries a policy may ask for: each is a compaction or a provider call.
MAX_RETRIES: Final = 100
#: The longest failure backoff a policy may set (about 31 years): any wait a clock can add.
MAX_BACKOFF_SECONDS: Final = 10**9


def _count(minimum: int, maximum: int) -> _Validator:
    """An integer in ``[minimum, maximum]``: the maximum keeps every value inside the typed
    policy's int64 fields and the arithmetic done on them."""

    def check(value: object, path: str) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # JSON and protobuf Structs carry every number as a float
        if isinstance(value, bool) or not isinstance(value, int):
            _bad(path, f"must be an integer, got {value!r}")
        number = value
        if number < minimum:
            kind = "positive" if minimum > 0 else "non-negative"
            _bad(path, f"must be a {kind} integer, got {number}")
        if number > maximum:
            _bad(path, f"must be at most {maximum:,}, got {number:,}")
        return number

    return check


def _seconds(value: object, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        _bad(path, f"must be a number of seconds, got {value!r}")
    if not 0 <= value <= MAX_BACKOFF_SECONDS:
        _bad(path, f"must be a number of seconds in [0, {MAX_BACKOFF_SECONDS:,}], got {value!r}")
    return float(value)


def _text(value: object, path: str) -> str:
    if not isinstance(value, str):
        _bad(path, f"must be a string, got {value!r}")
    return value


def _tool_name(value: object, path: str) -> str:
    if not isinstance(value, str) or not _TOOL_NAME.match(value):
        _bad(path, f"must be 1-64 characters of [A-Za-z0-9_-], got {value!r}")
    return value


_TOOL_NAME: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _flag(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        _bad(path, f"must be true or false, got {value!r}")
    return value


_VALIDATORS: Final[dict[str, _Validator]] = {
    "threshold_ratio": _ratio(low_open=True, high=1.0, high_open=False),
    "headroom_tokens": _count(0, MAX_TOKEN_COUNT),
    # The reference's range for both of its ratios: (0, 1]. A retainRatio of 1 (or any at least
    # thresholdRatio) is then refused by the rule that it be below thresholdRatio.
    "retain_ratio": _ratio(low_open=True, high=1.0, high_open=False),
    "retain_tokens": _count(0, MAX_TOKEN_COUNT),
    "summarization_provider": _text,
    "summarization_model": _text,
    "max_tokens": _count(1, MAX_TOKEN_COUNT),
    "compaction_retries": _count(0, MAX_RETRIES),
    "max_overflow_retries": _count(0, MAX_RETRIES),
    "auto": _flag,
    "summary_gate": _flag,
    "min_reduction_ratio": _ratio(low_open=False, high=1.0, high_open=True),
    "min_probe_retention": _ratio(low_open=False, high=1.0, high_open=False),
    "extractive_fallback": _flag,
    "failure_backoff_seconds": _seconds,
    "failure_backoff_max_seconds": _seconds,
    "recall_tool": _flag,
    "recall_tool_name": _tool_name,
    # 0 is "off", as absent is; any other value is a ratio below thresholdRatio (checked on
    # the resolved layer).
    "prepare_ahead_ratio": _ratio(low_open=False, high=1.0, high_open=True),
    "prepare_ahead_wait_ms": _count(0, MAX_PREPARE_AHEAD_WAIT_MS),
}


def _bad(path: str, description: str) -> NoReturn:
    name = path or "policy"
    raise ConfigError(f"{name}: {description}", metadata={"field": name})


# ---- explaining a resolution ------------------------------------------------------------------

#: Where a resolved setting came from, highest precedence first after the default.
ORIGIN_DEFAULT: Final = "DEFAULT"
ORIGIN_SERVICE: Final = "SERVICE"
ORIGIN_SESSION: Final = "SESSION"
ORIGIN_SERVICE_ROUTE: Final = "SERVICE_ROUTE"
ORIGIN_SESSION_ROUTE: Final = "SESSION_ROUTE"
_RETENTION: Final = ("retain_ratio", "retain_tokens")


def resolved_settings(policy: TargetPolicy) -> dict[str, object]:
    """Every setting of a resolved policy by its camelCase name, in the table's order."""
    return {name: getattr(policy, attribute) for name, attribute in _SETTINGS.items()}


def setting_origins(
    service: PressurePolicy, session: Mapping[str, Any] | None, provider: str, model: str
) -> dict[str, str]:
    """Which layer each setting of ``provider``/``model``'s resolved policy came from.

    The precedence is ``with_overrides`` then ``for_target``'s: the session's override for the
    route, the service's override for it, the session's settings, the service's, the default.
    The two retention forms come together from the first layer that sets either. ``session``
    must be valid (it was validated when the session was created).
    """
    session_base, session_models = _parse(session or {})
    key = (provider, model)
    layers = (
        (ORIGIN_SESSION_ROUTE, session_models.get(key)),
        (ORIGIN_SERVICE_ROUTE, service.models.get(key)),
        (ORIGIN_SESSION, session_base),
        (ORIGIN_SERVICE, service.base),
    )
    origins = {}
    for name, attribute in _SETTINGS.items():
        origins[name] = next(
            (origin for origin, layer in layers if layer is not None and _sets(layer, attribute)),
            ORIGIN_DEFAULT,
        )
    return origins


def _sets(layer: PolicyLayer, attribute: str) -> bool:
    if attribute in _RETENTION:
        return any(getattr(layer, name) is not None for name in _RETENTION)
    return getattr(layer, attribute) is not None

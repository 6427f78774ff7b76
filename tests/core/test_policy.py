"""The pressure policy: the spec's defaults, formulas, overrides and every validation rule."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compactd.core.policy import (
    CompactSpec,
    PressurePolicy,
    TargetPolicy,
    compact_spec,
    output_reservation,
)
from compactd.errors import CapacityUnknown, ConfigError, FailedPrecondition
from compactd.reasons import Reason


def spec(
    settings: dict[str, Any] | None = None,
    *,
    window: int | None = 128_000,
    output: int = 0,
    target: tuple[str, str] = ("p", "m"),
) -> CompactSpec:
    policy = PressurePolicy.from_settings(settings).for_target(*target)
    return compact_spec(policy, route="p/m", window=window, output_reservation=output)


def config_error(settings: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        PressurePolicy.from_settings(settings)
    return caught.value


def test_defaults_are_the_spec_table() -> None:
    assert PressurePolicy.from_settings(None).for_target("p", "m") == TargetPolicy(
        threshold_ratio=0.8,
        headroom_tokens=65536,
        retain_ratio=0.16,
        retain_tokens=None,
        summarization_provider="",
        summarization_model="",
        max_tokens=65536,
        compaction_retries=1,
        max_overflow_retries=1,
        auto=True,
        summary_gate=True,
        min_reduction_ratio=0.1,
        min_probe_retention=0.5,
        extractive_fallback=False,
        failure_backoff_seconds=300.0,
        failure_backoff_max_seconds=3600.0,
        prepare_ahead_ratio=0.0,
        prepare_ahead_wait_ms=30_000,
    )


def test_prepare_ahead_is_off_unless_set_and_uses_the_triggers_formula() -> None:
    assert spec(window=128_000, output=8192).prepare_ahead == 0
    assert not PressurePolicy.from_settings(None).for_target("p", "m").prepares_ahead
    # floor(min(128000 * 0.3, 128000 - 8192 - 65536)) = min(38400, 54272)
    assert spec({"prepareAheadRatio": 0.3}, window=128_000, output=8192).prepare_ahead == 38400
    # W - O - B bounds it as it bounds the trigger (then both are the same point)
    capped = spec({"prepareAheadRatio": 0.7}, window=128_000, output=8192)
    assert capped.prepare_ahead == capped.trigger == 54272
    assert spec({"prepareAheadRatio": 0}).prepare_ahead == 0


def test_worked_example_w128000_o8192_b65536_triggers_at_54272() -> None:
    result = spec(window=128_000, output=8192)
    assert result.trigger == 54272  # min(102400, 128000 - 8192 - 65536)
    assert result.retained_budget == 19169  # floor(0.16 * 119808)
    assert (result.window, result.output_reservation, result.headroom) == (128_000, 8192, 65536)


def test_the_ratio_bounds_the_trigger_on_large_windows() -> None:
    assert spec(window=1_048_576, output=0).trigger == 838860  # floor(0.8 * 1048576)


def test_ratios_are_exact_decimals() -> None:
    # 0.29 * 100 is 28.999999999999996 in binary floating point.
    result = spec(
        {"thresholdRatio": 0.29, "headroomTokens": 0, "maxTokens": 10, "retainRatio": 0.1},
        window=100,
    )
    assert result.trigger == 29
    assert result.retained_budget == 10


def test_retain_tokens_replaces_the_ratio() -> None:
    assert spec({"retainTokens": 5000}, window=128_000).retained_budget == 5000


def test_pressure_is_above_at_equal_counts() -> None:
    result = spec(window=128_000, output=8192)
    assert result.is_above(54272)
    assert not result.is_above(54271)


def test_output_reservation_prefers_the_envelope_then_the_route_then_zero() -> None:
    assert output_reservation(8192, 4096) == 8192
    assert output_reservation(None, 4096) == 4096
    assert output_reservation(None, None) == 0
    assert output_reservation(0, 4096) == 0


def test_missing_capacity_names_the_route() -> None:
    with pytest.raises(CapacityUnknown) as caught:
        spec(window=None)
    assert caught.value.reason == "CAPACITY_UNKNOWN"
    assert caught.value.metadata["route"] == "p/m"
    assert "p/m" in caught.value.message


def test_output_and_headroom_exhausting_the_window_fail_at_first_use() -> None:
    with pytest.raises(FailedPrecondition) as caught:
        spec(window=65536)  # the default headroom alone fills it
    assert caught.value.reason == Reason.POLICY_INVALID
    assert "headroomTokens" in caught.value.message


def test_a_retained_budget_not_below_the_trigger_fails_at_first_use() -> None:
    with pytest.raises(FailedPrecondition) as caught:
        spec({"retainTokens": 54272}, window=128_000, output=8192)
    assert caught.value.reason == Reason.POLICY_INVALID


def test_a_negative_output_reservation_fails_at_first_use() -> None:
    with pytest.raises(FailedPrecondition) as caught:
        spec(window=128_000, output=-1)
    assert caught.value.reason == Reason.POLICY_INVALID


def test_model_policies_override_exact_routes_only() -> None:
    settings = {
        "thresholdRatio": 0.8,
        "retainRatio": 0.16,
        "modelPolicies": [
            {
                "provider": "local",
                "model": "small-context",
                "thresholdRatio": 0.7,
                "headroomTokens": 4096,
                "maxTokens": 4096,
                "retainTokens": 2048,
            }
        ],
    }
    policy = PressurePolicy.from_settings(settings)
    small = policy.for_target("local", "small-context")
    assert (small.threshold_ratio, small.headroom_tokens, small.max_tokens) == (0.7, 4096, 4096)
    assert (small.retain_ratio, small.retain_tokens) == (None, 2048)
    assert policy.for_target("local", "small-context-2") == policy.for_target("p", "m")
    result = compact_spec(small, route="local/small-context", window=16384, output_reservation=2048)
    assert result.trigger == 10240  # min(floor(0.7 * 16384) = 11468, 16384 - 2048 - 4096)
    assert result.retained_budget == 2048


def test_max_tokens_follows_model_then_global_then_headroom() -> None:
    route = {"provider": "p", "model": "m"}
    assert (
        PressurePolicy.from_settings({"headroomTokens": 1000}).for_target("p", "m").max_tokens
        == 1000
    )
    both = {"maxTokens": 300, "modelPolicies": [{**route, "maxTokens": 200}]}
    assert PressurePolicy.from_settings(both).for_target("p", "m").max_tokens == 200
    global_only = {"maxTokens": 300, "modelPolicies": [{**route, "headroomTokens": 1000}]}
    assert PressurePolicy.from_settings(global_only).for_target("p", "m").max_tokens == 300
    headroom = {"modelPolicies": [{**route, "headroomTokens": 1000}]}
    assert PressurePolicy.from_settings(headroom).for_target("p", "m").max_tokens == 1000


def test_a_model_retention_form_replaces_the_inherited_one() -> None:
    settings = {
        "retainTokens": 100,
        "modelPolicies": [{"provider": "p", "model": "m", "retainRatio": 0.1}],
    }
    target = PressurePolicy.from_settings(settings).for_target("p", "m")
    assert (target.retain_ratio, target.retain_tokens) == (0.1, None)


def test_session_settings_layer_over_the_service_policy() -> None:
    service = PressurePolicy.from_settings(
        {
            "thresholdRatio": 0.7,
            "compactionRetries": 3,
            "modelPolicies": [
                {"provider": "p", "model": "m", "headroomTokens": 1000, "maxTokens": 50}
            ],
        }
    )
    session = service.with_overrides(
        {
            "thresholdRatio": 0.6,
            "modelPolicies": [{"provider": "p", "model": "m", "retainTokens": 10}],
        }
    )
    target = session.for_target("p", "m")
    assert target.threshold_ratio == 0.6
    assert target.compaction_retries == 3
    assert (target.headroom_tokens, target.max_tokens, target.retain_tokens) == (1000, 50, 10)
    assert service.for_target("p", "m").retain_tokens is None


def test_summarization_pair_and_flags_are_carried() -> None:
    target = PressurePolicy.from_settings(
        {
            "summarizationProvider": "deepseek",
            "summarizationModel": "deepseek-chat",
            "auto": False,
            "maxOverflowRetries": 0,
        }
    ).for_target("p", "m")
    assert (target.summarization_provider, target.summarization_model) == (
        "deepseek",
        "deepseek-chat",
    )
    assert (target.auto, target.max_overflow_retries) == (False, 0)


def test_json_numbers_that_are_integral_floats_are_counts() -> None:
    target = PressurePolicy.from_settings({"headroomTokens": 4096.0}).for_target("p", "m")
    assert target.headroom_tokens == 4096
    assert isinstance(target.headroom_tokens, int)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"thresholdRaito": 0.8}, "thresholdRaito"),
        (
            {"modelPolicies": [{"provider": "p", "model": "m", "colour": 1}]},
            "modelPolicies[0].colour",
        ),
        (
            {"modelPolicies": [{"provider": "p", "model": "m", "modelPolicies": []}]},
            "modelPolicies[0].modelPolicies",
        ),
    ],
)
def test_unknown_settings_are_rejected(settings: dict[str, Any], field: str) -> None:
    error = config_error(settings)
    assert error.metadata["field"] == field
    assert error.message.startswith(field)


def test_duplicate_model_overrides_are_rejected() -> None:
    entry = {"provider": "p", "model": "m", "thresholdRatio": 0.7}
    error = config_error({"modelPolicies": [entry, {"provider": "q", "model": "m"}, entry]})
    assert error.metadata["field"] == "modelPolicies[2]"
    assert "duplicate" in error.message


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"headroomTokens": -1}, "headroomTokens"),
        ({"headroomTokens": 1.5}, "headroomTokens"),
        ({"headroomTokens": True}, "headroomTokens"),
        ({"headroomTokens": "64k"}, "headroomTokens"),
        ({"maxTokens": 0}, "maxTokens"),
        ({"retainTokens": -5}, "retainTokens"),
        ({"compactionRetries": -1}, "compactionRetries"),
        ({"maxOverflowRetries": 0.5}, "maxOverflowRetries"),
        ({"thresholdRatio": 0}, "thresholdRatio"),
        ({"thresholdRatio": 1.2}, "thresholdRatio"),
        ({"thresholdRatio": float("nan")}, "thresholdRatio"),
        ({"retainRatio": 1}, "retainRatio"),
        ({"retainRatio": -0.1}, "retainRatio"),
        ({"retainRatio": 0}, "retainRatio"),
        ({"retainRatio": -0.0}, "retainRatio"),
        ({"retainRatio": float("inf")}, "retainRatio"),
        (
            {"modelPolicies": [{"provider": "p", "model": "m", "retainRatio": 0}]},
            "modelPolicies[0].retainRatio",
        ),
        ({"auto": "yes"}, "auto"),
        ({"summaryGate": 1}, "summaryGate"),
        ({"minReductionRatio": 1}, "minReductionRatio"),
        ({"minReductionRatio": -0.1}, "minReductionRatio"),
        ({"minProbeRetention": 1.5}, "minProbeRetention"),
        ({"extractiveFallback": "on"}, "extractiveFallback"),
        ({"failureBackoffSeconds": -1}, "failureBackoffSeconds"),
        ({"failureBackoffSeconds": float("inf")}, "failureBackoffSeconds"),
        ({"failureBackoffMaxSeconds": "1h"}, "failureBackoffMaxSeconds"),
        ({"failureBackoffMaxSeconds": 1e10}, "failureBackoffMaxSeconds"),
        ({"headroomTokens": 10**12 + 1}, "headroomTokens"),
        ({"retainTokens": 2**63}, "retainTokens"),
        ({"maxTokens": 1e300}, "maxTokens"),
        ({"compactionRetries": 101}, "compactionRetries"),
        ({"maxOverflowRetries": 2**62}, "maxOverflowRetries"),
        (
            {"failureBackoffSeconds": 120, "failureBackoffMaxSeconds": 60},
            "failureBackoffMaxSeconds",
        ),
        ({"summarizationModel": 5, "summarizationProvider": "x"}, "summarizationModel"),
        (
            {"modelPolicies": [{"provider": "p", "model": "m", "maxTokens": -3}]},
            "modelPolicies[0].maxTokens",
        ),
        ({"modelPolicies": [{"model": "m"}]}, "modelPolicies[0].provider"),
        ({"modelPolicies": [{"provider": "p", "model": ""}]}, "modelPolicies[0].model"),
        ({"modelPolicies": "p/m"}, "modelPolicies"),
        ({"modelPolicies": ["p/m"]}, "modelPolicies[0]"),
        ({"prepareAheadRatio": 0.8}, "prepareAheadRatio"),  # not below thresholdRatio
        ({"prepareAheadRatio": 0.5, "thresholdRatio": 0.4}, "prepareAheadRatio"),
        ({"prepareAheadRatio": -0.1}, "prepareAheadRatio"),
        ({"prepareAheadRatio": "half"}, "prepareAheadRatio"),
        ({"prepareAheadWaitMs": -1}, "prepareAheadWaitMs"),
        ({"prepareAheadWaitMs": 600_001}, "prepareAheadWaitMs"),
        (
            {
                "modelPolicies": [
                    {"provider": "p", "model": "m", "thresholdRatio": 0.2, "prepareAheadRatio": 0.3}
                ]
            },
            "modelPolicies[0].prepareAheadRatio",
        ),
    ],
)
def test_invalid_values_are_rejected_naming_the_field(settings: dict[str, Any], field: str) -> None:
    assert config_error(settings).metadata["field"] == field


def test_both_retention_forms_are_rejected() -> None:
    assert (
        config_error({"retainRatio": 0.1, "retainTokens": 100}).metadata["field"] == "retainTokens"
    )
    entry = {"provider": "p", "model": "m", "retainRatio": 0.1, "retainTokens": 100}
    assert (
        config_error({"modelPolicies": [entry]}).metadata["field"]
        == "modelPolicies[0].retainTokens"
    )


def test_a_retain_ratio_at_least_the_threshold_ratio_is_rejected() -> None:
    assert config_error({"retainRatio": 0.8}).metadata["field"] == "retainRatio"
    assert config_error({"thresholdRatio": 0.1}).metadata["field"] == "retainRatio"  # 0.16 default
    # 1 is inside the reference's (0, 1] range; it is refused as not below thresholdRatio.
    error = config_error({"thresholdRatio": 1, "retainRatio": 1})
    assert error.metadata["field"] == "retainRatio"
    assert "below thresholdRatio" in error.message
    entry = {"provider": "p", "model": "m", "thresholdRatio": 0.15}
    assert (
        config_error({"modelPolicies": [entry]}).metadata["field"] == "modelPolicies[0].retainRatio"
    )


def test_zero_headroom_needs_an_explicit_positive_max_tokens() -> None:
    assert config_error({"headroomTokens": 0}).metadata["field"] == "headroomTokens"
    PressurePolicy.from_settings({"headroomTokens": 0, "maxTokens": 4096})
    entry = {"provider": "p", "model": "m", "headroomTokens": 0}
    error = config_error({"modelPolicies": [entry]})
    assert error.metadata["field"] == "modelPolicies[0].headroomTokens"
    PressurePolicy.from_settings({"maxTokens": 4096, "modelPolicies": [entry]})
    PressurePolicy.from_settings({"modelPolicies": [{**entry, "maxTokens": 100}]})


def test_the_summarization_pair_is_set_together() -> None:
    assert (
        config_error({"summarizationProvider": "deepseek"}).metadata["field"]
        == "summarizationModel"
    )
    assert config_error({"summarizationModel": "m"}).metadata["field"] == "summarizationProvider"
    error = config_error({"summarizationProvider": "deepseek", "summarizationModel": ""})
    assert error.metadata["field"] == "summarizationModel"
    PressurePolicy.from_settings({"summarizationProvider": "", "summarizationModel": ""})


def test_session_overrides_are_validated_too() -> None:
    with pytest.raises(ConfigError) as caught:
        PressurePolicy.from_settings(None).with_overrides({"retainRatio": 0.9})
    assert caught.value.metadata["field"] == "retainRatio"


@given(
    window=st.integers(1, 2_000_000),
    output=st.integers(0, 100_000),
    headroom=st.integers(0, 100_000),
    ratio=st.sampled_from([0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 1.0]),
)
def test_trigger_is_floor_of_min_ratio_window_and_room(
    window: int, output: int, headroom: int, ratio: float
) -> None:
    settings = {
        "thresholdRatio": ratio,
        "headroomTokens": headroom,
        "maxTokens": 1,
        "retainTokens": 0,
    }
    room = window - output - headroom
    if room <= 0:
        with pytest.raises(FailedPrecondition):
            spec(settings, window=window, output=output)
        return
    expected = min(window * round(ratio * 100) // 100, room)
    if expected <= 0:
        with pytest.raises(FailedPrecondition):
            spec(settings, window=window, output=output)
        return
    assert spec(settings, window=window, output=output).trigger == expected


def test_gate_and_memory_settings_resolve_per_route() -> None:
    policy = PressurePolicy.from_settings(
        {
            "minProbeRetention": 0.3,
            "modelPolicies": [
                {
                    "provider": "p",
                    "model": "small",
                    "summaryGate": False,
                    "failureBackoffSeconds": 0,
                }
            ],
        }
    )

    big, small = policy.for_target("p", "m"), policy.for_target("p", "small")
    assert big.gate is not None
    assert (big.gate.min_probe_retention, big.gate.min_reduction_ratio) == (0.3, 0.1)
    assert big.remembers_failures
    assert small.gate is None
    assert not small.remembers_failures


# ---- explaining a resolution -------------------------------------------------------------------

_LAYER_VALUES: dict[str, list[Any]] = {
    "thresholdRatio": [0.7, 0.9],
    "headroomTokens": [1000, 2000],
    "retainRatio": [0.1, 0.2],
    "retainTokens": [100, 300],
    "maxTokens": [10, 20],
    "compactionRetries": [0, 3],
    "auto": [True, False],
    "minProbeRetention": [0.3, 0.6],
}


@st.composite
def _layer(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.sets(st.sampled_from(sorted(_LAYER_VALUES))))
    layer = {name: draw(st.sampled_from(_LAYER_VALUES[name])) for name in names}
    if "retainRatio" in layer and "retainTokens" in layer:
        del layer[draw(st.sampled_from(["retainRatio", "retainTokens"]))]
    return layer


def _with_route(base: dict[str, Any], route: dict[str, Any]) -> dict[str, Any]:
    return {**base, "modelPolicies": [{"provider": "p", "model": "m", **route}]}


@given(_layer(), _layer(), _layer(), _layer())
def test_each_resolved_setting_has_the_value_of_the_layer_its_origin_names(
    service_base: dict[str, Any],
    service_route: dict[str, Any],
    session_base: dict[str, Any],
    session_route: dict[str, Any],
) -> None:
    from compactd.core.policy import resolved_settings, setting_origins

    service_settings = _with_route(service_base, service_route)
    session = _with_route(session_base, session_route)
    try:
        service = PressurePolicy.from_settings(service_settings)
        resolved = service.with_overrides(session).for_target("p", "m")
    except ConfigError:
        return  # an invalid combination is refused before anything resolves it
    layers = {
        "SERVICE": service_base, "SERVICE_ROUTE": service_route,
        "SESSION": session_base, "SESSION_ROUTE": session_route,
    }  # fmt: skip
    origins = setting_origins(service, session, "p", "m")
    values = resolved_settings(resolved)
    assert origins.keys() == values.keys()
    for name, origin in origins.items():
        if origin == "DEFAULT":
            assert name not in {k for layer in layers.values() for k in layer} or name in (
                "retainRatio", "retainTokens",
            )  # fmt: skip
            continue
        layer = layers[origin]
        if name in ("retainRatio", "retainTokens"):
            assert layer.get(name) == values[name]  # the layer's form, the other one unset
        else:
            assert layer[name] == values[name]

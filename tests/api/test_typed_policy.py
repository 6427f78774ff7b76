"""CreateSession's typed ``policy``: the same settings, validation and errors as the Struct form."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import json_format, struct_pb2

from compactd.service.policy_message import policy_of, settings_of
from compactd.v1 import session_service_pb2 as pb
from compactd.v1.session_service_pb2_grpc import SessionServiceStub
from tests.api.rpc import ErrorDetails, details

TYPED = pb.CompactionPolicy(
    threshold_ratio=0.5,
    headroom_tokens=1000,
    retain_tokens=1200,
    auto=False,
    summary_gate=True,
    min_reduction_ratio=0.2,
    failure_backoff_seconds=10,
    model_policies=[pb.ModelCompactionPolicy(provider="p", model="m", max_tokens=500)],
)
#: ``TYPED`` as the deprecated Struct form spells it.
SETTINGS: dict[str, Any] = {
    "thresholdRatio": 0.5,
    "headroomTokens": 1000,
    "retainTokens": 1200,
    "auto": False,
    "summaryGate": True,
    "minReductionRatio": 0.2,
    "failureBackoffSeconds": 10,
    "modelPolicies": [{"provider": "p", "model": "m", "maxTokens": 500}],
}


def _struct(values: dict[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(values)
    return struct


async def _refused(sessions: SessionServiceStub, request: pb.CreateSessionRequest) -> ErrorDetails:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await sessions.CreateSession(request)
    return details(caught.value)


def test_every_setting_of_the_policy_table_has_a_typed_field() -> None:
    from compactd.core.policy import _SETTINGS

    typed = {f.json_name for f in pb.CompactionPolicy.DESCRIPTOR.fields} - {"modelPolicies"}
    per_model = {f.json_name for f in pb.ModelCompactionPolicy.DESCRIPTOR.fields}
    assert typed == set(_SETTINGS)
    assert per_model == set(_SETTINGS) | {"provider", "model"}


def test_the_typed_form_converts_to_the_settings_and_back() -> None:
    assert settings_of(TYPED) == json_format.MessageToDict(_struct(SETTINGS))
    assert policy_of(settings_of(TYPED)) == TYPED


def test_a_stored_policy_from_before_the_bounds_still_reads_as_a_typed_policy() -> None:
    # Settings validated before token counts were bounded: 2**63 does not fit the int64 field.
    policy = policy_of({"headroomTokens": float(2**63), "retainTokens": -float(2**64)})
    assert (policy.headroom_tokens, policy.retain_tokens) == (2**63 - 1, -(2**63))


async def test_a_typed_policy_is_stored_and_answered_in_both_forms(
    sessions: SessionServiceStub,
) -> None:
    reply = await sessions.CreateSession(pb.CreateSessionRequest(session_id="s1", policy=TYPED))
    assert reply.session.policy == TYPED
    assert json_format.MessageToDict(reply.session.compaction_policy) == settings_of(TYPED)


async def test_a_retried_create_in_the_other_form_of_the_same_policy_is_idempotent(
    sessions: SessionServiceStub,
) -> None:
    await sessions.CreateSession(pb.CreateSessionRequest(session_id="s1", policy=TYPED))
    legacy = pb.CreateSessionRequest(session_id="s1", compaction_policy=_struct(SETTINGS))
    again = await sessions.CreateSession(legacy)
    assert again.session.policy == TYPED
    other = pb.CreateSessionRequest(session_id="s1", policy=pb.CompactionPolicy(auto=True))
    got = await _refused(sessions, other)
    assert got.code == grpc.StatusCode.ALREADY_EXISTS


async def test_both_forms_at_once_are_invalid_argument_naming_policy(
    sessions: SessionServiceStub,
) -> None:
    request = pb.CreateSessionRequest(policy=TYPED, compaction_policy=_struct(SETTINGS))
    got = await _refused(sessions, request)
    assert (got.code, got.reason, got.fields) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "POLICY_INVALID",
        ["policy"],
    )


@pytest.mark.parametrize(
    ("typed", "settings", "typed_field", "struct_field"),
    [
        (
            pb.CompactionPolicy(threshold_ratio=1.5),
            {"thresholdRatio": 1.5},
            "policy.threshold_ratio",
            "compaction_policy.thresholdRatio",
        ),
        (
            pb.CompactionPolicy(threshold_ratio=0.5, retain_ratio=0.6),
            {"thresholdRatio": 0.5, "retainRatio": 0.6},
            "policy.retain_ratio",
            "compaction_policy.retainRatio",
        ),
        (
            pb.CompactionPolicy(retain_ratio=0),
            {"retainRatio": 0},
            "policy.retain_ratio",
            "compaction_policy.retainRatio",
        ),
        (
            pb.CompactionPolicy(retain_ratio=0.1, retain_tokens=10),
            {"retainRatio": 0.1, "retainTokens": 10},
            "policy.retain_tokens",
            "compaction_policy.retainTokens",
        ),
        (
            pb.CompactionPolicy(summarization_provider="openai"),
            {"summarizationProvider": "openai"},
            "policy.summarization_model",
            "compaction_policy.summarizationModel",
        ),
        (
            pb.CompactionPolicy(failure_backoff_seconds=100, failure_backoff_max_seconds=10),
            {"failureBackoffSeconds": 100, "failureBackoffMaxSeconds": 10},
            "policy.failure_backoff_max_seconds",
            "compaction_policy.failureBackoffMaxSeconds",
        ),
        (
            pb.CompactionPolicy(min_probe_retention=float("nan")),
            {"minProbeRetention": 2},
            "policy.min_probe_retention",
            "compaction_policy.minProbeRetention",
        ),
        (
            pb.CompactionPolicy(model_policies=[pb.ModelCompactionPolicy(model="m")]),
            {"modelPolicies": [{"provider": "", "model": "m"}]},
            "policy.model_policies[0].provider",
            "compaction_policy.modelPolicies[0].provider",
        ),
        (
            pb.CompactionPolicy(
                model_policies=[pb.ModelCompactionPolicy(provider="p", model="m", max_tokens=0)]
            ),
            {"modelPolicies": [{"provider": "p", "model": "m", "maxTokens": 0}]},
            "policy.model_policies[0].max_tokens",
            "compaction_policy.modelPolicies[0].maxTokens",
        ),
        (
            pb.CompactionPolicy(headroom_tokens=2**63 - 1),
            {"headroomTokens": 1e300},
            "policy.headroom_tokens",
            "compaction_policy.headroomTokens",
        ),
        (
            pb.CompactionPolicy(compaction_retries=2**63 - 1),
            {"compactionRetries": 101},
            "policy.compaction_retries",
            "compaction_policy.compactionRetries",
        ),
        (
            pb.CompactionPolicy(failure_backoff_max_seconds=1e300),
            {"failureBackoffMaxSeconds": 1e300},
            "policy.failure_backoff_max_seconds",
            "compaction_policy.failureBackoffMaxSeconds",
        ),
    ],
    ids=[
        "threshold", "retain-above-threshold", "zero-retain-ratio", "both-retentions",
        "half-a-pair", "backoff",
        "probe-retention", "model-without-provider", "model-max-tokens", "int64-max-headroom",
        "retries-above-the-bound", "backoff-above-the-bound",
    ],
)  # fmt: skip
async def test_a_bad_typed_policy_fails_as_the_struct_form_does_naming_its_field(
    sessions: SessionServiceStub,
    typed: pb.CompactionPolicy,
    settings: dict[str, Any],
    typed_field: str,
    struct_field: str,
) -> None:
    got = await _refused(sessions, pb.CreateSessionRequest(policy=typed))
    legacy = await _refused(sessions, pb.CreateSessionRequest(compaction_policy=_struct(settings)))
    assert (got.code, got.reason, got.fields) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "POLICY_INVALID",
        [typed_field],
    )
    assert (legacy.code, legacy.reason, legacy.fields) == (got.code, got.reason, [struct_field])

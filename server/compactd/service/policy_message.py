"""The typed ``CompactionPolicy`` message and the spec's camelCase settings, both ways.

The message's fields are the policy table's settings under their snake_case names; their proto
JSON names are the spec's camelCase keys, so the conversion reads the descriptor instead of
listing the settings a second time. A typed policy becomes exactly the settings a
``google.protobuf.Struct`` with the same values would (every number a float, as a Struct carries
it), so both forms validate, store and compare alike.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from compactd.v1 import session_service_pb2 as pb

_ROUTE_KEYS = ("provider", "model")
_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def settings_of(policy: pb.CompactionPolicy) -> dict[str, object]:
    """The camelCase settings a typed policy sets (absent fields are left out: they inherit)."""
    settings = _layer(policy)
    if policy.model_policies:
        settings["modelPolicies"] = [_entry(entry) for entry in policy.model_policies]
    return settings


def policy_of(settings: Mapping[str, Any]) -> pb.CompactionPolicy:
    """The typed form of validated camelCase settings (a stored session policy, say)."""
    policy = pb.CompactionPolicy()
    _fill(policy, settings)
    for entry in settings.get("modelPolicies", []):
        _fill(policy.model_policies.add(), entry)
    return policy


def field_path(setting_path: str, prefix: str = "policy") -> str:
    """A settings path (``modelPolicies[0].retainRatio``) as the typed message's field path
    (``policy.model_policies[0].retain_ratio``)."""
    if setting_path in ("", "policy"):
        return prefix
    parts = [_snake(part) for part in setting_path.split(".")]
    return ".".join([prefix, *parts])


def _layer(message: Message) -> dict[str, object]:
    out: dict[str, object] = {}
    for field in message.DESCRIPTOR.fields:
        if field.name in _ROUTE_KEYS or field.is_repeated:
            continue
        if message.HasField(field.name):
            out[field.json_name] = _wire_value(getattr(message, field.name))
    return out


def _entry(entry: pb.ModelCompactionPolicy) -> dict[str, object]:
    # provider and model are written even when empty, so validation names the missing one.
    return {"provider": entry.provider, "model": entry.model, **_layer(entry)}


def _wire_value(value: object) -> object:
    """Numbers as a Struct carries them (floats), so both forms store the same JSON."""
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _fill(message: Message, settings: Mapping[str, Any]) -> None:
    by_json = {field.json_name: field for field in message.DESCRIPTOR.fields}
    for key, value in settings.items():
        field = by_json.get(key)
        if field is None or field.is_repeated:
            continue
        if field.type == FieldDescriptor.TYPE_INT64:
            # Within int64: a policy stored before its settings were bounded may exceed it.
            value = min(max(int(value), _INT64_MIN), _INT64_MAX)
        elif field.type == FieldDescriptor.TYPE_DOUBLE:
            value = float(value)
        setattr(message, field.name, value)


def _snake(part: str) -> str:
    name, bracket, rest = part.partition("[")
    return _CAMEL.sub("_", name).lower() + bracket + rest


def resolved_policy(values: Mapping[str, object]) -> pb.CompactionPolicy:
    """A resolved policy (camelCase setting -> value, None for unset) as the typed message."""
    return policy_of({key: value for key, value in values.items() if value is not None})

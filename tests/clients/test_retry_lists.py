"""The three clients retry the same RPCs: exactly the reads, and every RPC is classified."""

from __future__ import annotations

import json
import re
from pathlib import Path

from compactd_client.config import IDEMPOTENT_METHODS

from compactd.v1 import compaction_service_pb2, session_service_pb2

ROOT = Path(__file__).resolve().parents[2]

#: RPCs that change nothing a later call can see: a retry cannot change the outcome.
READS = {
    ("compactd.v1.SessionService", "ListEvents"),
    ("compactd.v1.SessionService", "GetSurface"),
    ("compactd.v1.SessionService", "BuildRequest"),
    ("compactd.v1.SessionService", "ListSessions"),
    ("compactd.v1.SessionService", "Recall"),
    ("compactd.v1.CompactionService", "CheckPressure"),
    ("compactd.v1.CompactionService", "WatchPressure"),
    ("compactd.v1.CompactionService", "ClassifyProviderError"),
    ("compactd.v1.CompactionService", "PlanCompaction"),
    ("compactd.v1.CompactionService", "ListBrackets"),
}
#: RPCs that append to, create or delete a log: never retried blindly.
WRITES = {
    ("compactd.v1.SessionService", "CreateSession"),
    ("compactd.v1.SessionService", "AppendEvents"),
    ("compactd.v1.SessionService", "DeleteSession"),
    ("compactd.v1.CompactionService", "PrepareStep"),
    ("compactd.v1.CompactionService", "PrepareStepUnary"),
    ("compactd.v1.CompactionService", "Compact"),
    ("compactd.v1.CompactionService", "RecoverFromError"),
    ("compactd.v1.CompactionService", "SwitchModel"),
    ("compactd.v1.CompactionService", "RevertCompaction"),
}


def _declared() -> set[tuple[str, str]]:
    services = [
        session_service_pb2.DESCRIPTOR.services_by_name["SessionService"],
        compaction_service_pb2.DESCRIPTOR.services_by_name["CompactionService"],
    ]
    return {(s.full_name, m.name) for s in services for m in s.methods}


def _streaming(service: str, method: str) -> bool:
    module = session_service_pb2 if "Session" in service else compaction_service_pb2
    name = service.rsplit(".", 1)[1]
    return bool(module.DESCRIPTOR.services_by_name[name].methods_by_name[method].server_streaming)


def test_every_declared_rpc_is_classified_as_a_read_or_a_write() -> None:
    assert READS.isdisjoint(WRITES)
    assert _declared() == READS | WRITES


def test_the_python_client_retries_exactly_the_reads() -> None:
    assert set(IDEMPOTENT_METHODS) == READS


def test_the_go_client_retries_exactly_the_reads() -> None:
    source = (ROOT / "clients/go/compactd/client.go").read_text()
    config = re.search(r"const ServiceConfig = `(.*?)`", source, re.S)
    assert config is not None
    (method_config,) = json.loads(config.group(1))["methodConfig"]
    assert {(n["service"], n["method"]) for n in method_config["name"]} == READS


def test_the_typescript_client_retries_exactly_the_unary_reads() -> None:
    # connect-es has no service config: the client retries unary calls itself.
    source = (ROOT / "clients/typescript/src/client.ts").read_text()
    found = re.search(r"IDEMPOTENT_METHODS[^=]*= new Set\(\[(.*?)\]\)", source, re.S)
    assert found is not None
    names = set(re.findall(r'"(\w+)"', found.group(1)))
    assert names == {m for s, m in READS if not _streaming(s, m)}

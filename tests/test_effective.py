"""The effective configuration ``check-config`` prints reads back as the same configuration."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from compactd import config
from compactd.api.auth import hash_token
from compactd.cli import main
from tests.api.test_jwt_auth import Provider
from tests.certs import Authority

#: Tables printed from their owner's parse (defaults filled in), not as set.
PARSED = {"routes", "summarizer", "pruner"}


def _every_table(tmp_path: Path) -> str:
    """A configuration that sets every table ``ServerConfig`` has (TLS and JWKS files real)."""
    authority = Authority(tmp_path / "ca")
    server = authority.server()
    jwks = Provider(tmp_path).jwks_file
    return f"""\
tls_cert_file = "{server.cert_file}"
tls_key_file = "{server.key_file}"
tls_client_ca_file = "{authority.cert_file}"
[auth_tokens]
a = "{hash_token("token-of-tenant-a")}"
b = ["{hash_token("b-one")}", "{hash_token("b-two")}"]
[auth_identities]
"spiffe://example.org/ns/agents/sa/runner" = "agents"
[auth_jwt]
issuer = "https://idp.example.org"
audience = "compactd"
jwks_file = "{jwks}"
[session_retention_s]
default = 3600
agents = 86400.5
[compaction]
thresholdRatio = 0.7
[[routes]]
provider = "local"
model = "m"
context_window = 32768
[summarizer]
kind = "extractive"
[pruner]
max_code_points = 9000
[quotas]
appends_per_second = 50
[quotas.tenants.agents]
max_sessions = 10
"""


def test_a_configuration_of_every_table_reads_back_as_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    given = tmp_path / "given.toml"
    given.write_text(_every_table(tmp_path))
    assert set(config.TABLES) <= set(tomllib.loads(given.read_text()))  # a new table joins here
    assert main(["check-config", "--config", str(given)]) == 0
    printed = capsys.readouterr().out
    again = tmp_path / "again.toml"
    again.write_text(printed)
    assert main(["check-config", "--config", str(again)]) == 0
    assert capsys.readouterr().out == printed

    before, after = config.load(given, environ={}), config.load(again, environ={})
    for name in (*config.SCALARS, *(t for t in config.TABLES if t not in PARSED)):
        assert getattr(after, name) == getattr(before, name), name
    assert tomllib.loads(printed)["summarizer"]["kind"] == "extractive"
    assert tomllib.loads(printed)["routes"][0]["model"] == "m"

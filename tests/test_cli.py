"""The command line documents every command and reports bad configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from compactd.cli import main


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "serve" in out
    assert "check-config" in out


def test_serve_help_documents_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for option in ("--listen", "--store", "--config", "--log-level", "--log-format"):
        assert option in out
    for store in ("sqlite:///PATH", "postgresql://...", "memory://"):
        assert store in out


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("[server]\nkeepalive_time_s = -1\n", "server.keepalive_time_s: must be positive"),
        ("[compaction]\nbogus = 1\n", "compaction.bogus: unknown setting"),  # named in its table
    ],
    ids=["scalar", "policy-key"],
)
def test_check_config_prints_the_error_naming_the_key_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, line: str
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    assert main(["check-config", "--config", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"compactd: configuration error: {line}")


def test_check_config_validates_the_policy_and_routes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[compaction]\nthresholdRatio = 0.5\nretainRatio = 0.6\n")
    assert main(["check-config", "--config", str(bad)]) == 2
    assert "compaction.retainRatio: " in capsys.readouterr().err
    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes]]\nprovider = "p"\nmodel = "m"\ncontext_window = -1\n')
    assert main(["check-config", "--config", str(routes)]) == 2
    assert "routes[0].context_window" in capsys.readouterr().err


#: Configurations only serve's loading of the TLS, tokens and JWKS files refuses.
_REFUSED_WHEN_LOADED = {
    "jwt-without-audience": '[auth_jwt]\nissuer = "https://idp.example.org"\n',
    "token-not-hex": '[auth_tokens]\na = "nothex"\n',
    "tokens-file-missing": 'auth_tokens_file = "{tmp}/absent-tokens"\n',
    "cert-file-missing": 'tls_cert_file = "{tmp}/absent.pem"\ntls_key_file = "{tmp}/absent.key"\n',
}


@pytest.mark.parametrize("text", _REFUSED_WHEN_LOADED.values(), ids=_REFUSED_WHEN_LOADED.keys())
def test_check_config_refuses_what_serve_refuses_with_its_exit_code_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text.format(tmp=tmp_path))
    served = subprocess.run(
        [sys.executable, "-m", "compactd.cli", "serve", "--config", str(path), "--store",
         "memory://"], capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert served.returncode == 2, served.stderr
    assert main(["check-config", "--config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", served.stderr)
    assert err.startswith("compactd: configuration error: ")
    assert err.count("\n") == 1


def test_bad_json_in_a_table_variable_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COMPACTD_PRUNER", "{bad")
    assert main(["check-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compactd: configuration error: COMPACTD_PRUNER: expected JSON")
    assert err.count("\n") == 1


def test_check_config_prints_the_effective_configuration_as_toml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        '[summarizer]\nkind = "extractive"\n[pruner]\nmax_code_points = 9000\n'
        '[[routes]]\nprovider = "local"\nmodel = "m"\ncontext_window = 32768\n'
    )
    monkeypatch.setenv("COMPACTD_MAX_BATCH_EVENTS", "7")
    assert main(["check-config", "--config", str(good)]) == 0
    out = capsys.readouterr().out
    effective = tomllib.loads(out)
    assert effective["max_batch_events"] == 7
    assert effective["summarizer"]["kind"] == "extractive"
    assert effective["summarizer"]["max_attempts"] == 4  # defaults filled in
    assert effective["pruner"] == {"max_code_points": 9000, "head_code_points": 4096,
                                   "tail_code_points": 1024}  # fmt: skip
    assert effective["routes"] == [
        {"provider": "local", "model": "m", "context_window": 32768, "tokenizer": "heuristic",
         "sends_reasoning": True, "protocol": "openai"}
    ]  # fmt: skip
    # Built-in routes are shown, commented out: naming one would make its endpoint usable.
    assert '# model = "gpt-4o"' in out
    assert '# base_url = "https://api.openai.com/v1"' in out

    again = tmp_path / "again.toml"
    again.write_text(out)
    assert main(["check-config", "--config", str(again)]) == 0
    assert capsys.readouterr().out == out  # the printed configuration reads back as itself


def test_check_config_names_ignored_variables(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith("COMPACTD_")]:
        monkeypatch.delenv(name)  # the caller's own (COMPACTD_SHARED for the benches, say)
    monkeypatch.setenv("COMPACTD_ADDRESS", "127.0.0.1:1")
    assert main(["check-config"]) == 0
    printed = capsys.readouterr()
    assert "# ignored: COMPACTD_ADDRESS is not a compactd setting" in printed.out
    # Warned where a check reads its warnings, also when the TOML goes to a file.
    assert printed.err == "compactd: warning: ignored: COMPACTD_ADDRESS is not a compactd setting\n"


def test_config_schema_prints_the_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config-schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "compactd configuration"
    assert "listen" in schema["properties"]["server"]["properties"]

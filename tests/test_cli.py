"""The command line documents every command and reports bad configuration."""

from __future__ import annotations

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


def test_check_config_prints_the_error_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nkeepalive_time_s = -1\n")
    assert main(["check-config", "--config", str(bad)]) == 2
    assert "keepalive_time_s: must be positive" in capsys.readouterr().err


def test_check_config_validates_the_policy_and_routes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[compaction]\nthresholdRatio = 0.5\nretainRatio = 0.6\n")
    assert main(["check-config", "--config", str(bad)]) == 2
    assert "retainRatio" in capsys.readouterr().err
    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes]]\nprovider = "p"\nmodel = "m"\ncontext_window = -1\n')
    assert main(["check-config", "--config", str(routes)]) == 2
    assert "routes[0].context_window" in capsys.readouterr().err


def test_check_config_accepts_a_valid_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[summarizer]\nkind = "extractive"\n[pruner]\nmax_code_points = 9000\n')
    assert main(["check-config", "--config", str(good)]) == 0
    assert "max_code_points=9000" in capsys.readouterr().out

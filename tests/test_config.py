"""Configuration: defaults, file, environment and flags, with errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from compactd import config
from compactd.errors import ConfigError


def test_defaults_are_the_documented_ones() -> None:
    settings = config.load(None, environ={})
    assert settings.listen == "127.0.0.1:50051"
    assert settings.store == "sqlite:///./compactd.db"
    assert settings.sqlite_synchronous == "FULL"


def test_flags_win_over_environment_which_wins_over_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('listen = "127.0.0.1:1"\n[server]\nmax_batch_events = 5\n')
    from_file = config.load(path, environ={})
    assert (from_file.listen, from_file.max_batch_events) == ("127.0.0.1:1", 5)
    from_env = config.load(path, environ={"COMPACTD_LISTEN": "127.0.0.1:2"})
    assert from_env.listen == "127.0.0.1:2"
    from_flag = config.load(
        path, environ={"COMPACTD_LISTEN": "127.0.0.1:2"}, overrides={"listen": "127.0.0.1:3"}
    )
    assert from_flag.listen == "127.0.0.1:3"


def test_sections_are_carried_for_their_owners(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        "[compaction]\nthresholdRatio = 0.7\n"
        '[[routes]]\nprovider = "local"\nmodel = "m"\ncontext_window = 32000\n'
    )
    settings = config.load(path, environ={})
    assert settings.compaction == {"thresholdRatio": 0.7}
    assert settings.routes[0]["model"] == "m"


@pytest.mark.parametrize(
    ("text", "environ", "named"),
    [
        ("bogus = 1\n", {}, "bogus: unknown setting"),
        ("[server]\nbogus = 1\n", {}, "server.bogus: unknown setting"),
        ("[server]\nmax_message_bytes = 'big'\n", {}, "server.max_message_bytes: expected int"),
        ("[server]\nmax_batch_events = 0\n", {}, "max_batch_events: must be positive"),
        ("", {"COMPACTD_MAX_MESSAGE_BYTES": "x"}, "COMPACTD_MAX_MESSAGE_BYTES: expected int"),
        ("", {"COMPACTD_NOPE": "1"}, "COMPACTD_NOPE: unknown setting"),
        ("", {"COMPACTD_LOG_FORMAT": "xml"}, "log_format"),
        ("routes = 3\n", {}, "routes: must be an array"),
        ("listen = [\n", {}, "not valid TOML"),
    ],
)
def test_errors_name_the_bad_key(
    tmp_path: Path, text: str, environ: dict[str, str], named: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        config.load(path, environ=environ)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "absent.toml", environ={})

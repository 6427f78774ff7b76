"""Configuration: defaults, file, environment and flags, with errors that name the key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

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
        ("[server]\nlisten = 5\n", {}, "server.listen: expected str, got 5"),
        ("summarizer = 3\n", {}, "summarizer: must be a table"),
        ("routes = [1]\n", {}, r"routes\[0\]: must be a table"),
        ("", {"COMPACTD_KEEPALIVE_TIME_S": "-1"}, "COMPACTD_KEEPALIVE_TIME_S: must be positive"),
        ("", {"COMPACTD_SHUTDOWN_GRACE_S": "-1"}, "COMPACTD_SHUTDOWN_GRACE_S: must be >= 0"),
        ("", {"COMPACTD_LISTEN": "nowhere"}, "COMPACTD_LISTEN: expected HOST:PORT"),
        (
            "",
            {"COMPACTD_STORE": "pg://x"},
            "COMPACTD_STORE: expected sqlite:///PATH, postgresql://... or memory://",
        ),
        (
            "",
            {"COMPACTD_LOG_FORMAT": "xml"},
            "COMPACTD_LOG_FORMAT: input should be 'json' or 'text'",
        ),
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


@pytest.mark.parametrize("table", ["PRUNER", "ROUTES", "COMPACTION", "AUTH_TOKENS"])
def test_bad_json_in_a_table_variable_is_a_config_error_naming_it(table: str) -> None:
    variable = f"COMPACTD_{table}"
    with pytest.raises(ConfigError, match=f"^{variable}: expected JSON"):
        config.load(None, environ={variable: "{bad"})


def test_a_bad_flag_is_named_as_the_flag() -> None:
    with pytest.raises(ConfigError, match="--metrics-listen: expected HOST:PORT"):
        config.load(None, environ={}, overrides={"metrics_listen": "nowhere"})


def test_nested_variables_set_keys_of_owned_tables() -> None:
    settings = config.load(
        None,
        environ={
            "COMPACTD_SUMMARIZER__KIND": "openai",
            "COMPACTD_SUMMARIZER__MAX_ATTEMPTS": "2",
            "COMPACTD_COMPACTION__THRESHOLD_RATIO": "0.7",
            "COMPACTD_PRUNER": '{"max_code_points": 9000}',
        },
    )
    assert settings.summarizer == {"kind": "openai", "max_attempts": 2}
    assert settings.compaction == {"thresholdRatio": 0.7}  # the spec's camelCase key
    assert settings.pruner == {"max_code_points": 9000}


def test_variables_merge_into_the_files_tables(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[summarizer]\nkind = "extractive"\ntimeout_s = 5\n')
    settings = config.load(path, environ={"COMPACTD_SUMMARIZER__TIMEOUT_S": "9"})
    assert settings.summarizer == {"kind": "extractive", "timeout_s": 9}


def test_unknown_variables_are_ignored_and_listed() -> None:
    environ = {"COMPACTD_ADDRESS": "127.0.0.1:1", "COMPACTD_LISTEN": "127.0.0.1:2",
               "COMPACTD_CONFIG": "c.toml", "COMPACTD_SUMMARIZER__KIND": "openai"}  # fmt: skip
    assert config.load(None, environ=environ).listen == "127.0.0.1:2"
    assert config.unknown_variables(environ) == ["COMPACTD_ADDRESS"]


def test_the_configuration_is_a_frozen_value_revalidated_on_change() -> None:
    settings = config.load(None, environ={})
    assert dataclasses.replace(settings, max_batch_events=2).max_batch_events == 2
    with pytest.raises(ValidationError):
        dataclasses.replace(settings, max_batch_events=0)


def test_the_json_schema_describes_every_setting() -> None:
    schema = config.json_schema()
    properties = schema["properties"]
    assert set(properties) == {*config.SCALARS, *config.TABLES, "server"}
    assert set(properties["server"]["properties"]) == set(config.SCALARS)
    assert properties["max_batch_events"]["exclusiveMinimum"] == 0
    assert properties["log_format"]["enum"] == ["json", "text"]
    assert schema["additionalProperties"] is False
    json.dumps(schema)  # serializable as written for editors


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "absent.toml", environ={})

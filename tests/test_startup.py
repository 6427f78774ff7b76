"""`compactd serve` says at start what it will do, and ignores foreign COMPACTD_* variables.

Runs the real process with JSON logs and reads its start-up lines: the listen address, the store,
where traces and metrics go, the summarizer and every endpoint a conversation may be sent to (or
that summaries are extractive), and each route's tokenizer. Server reflection answers on v1 and
v1alpha.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from compactd.api.server import create_server
from compactd.testing.openai_server import OpenAICompatServer
from compactd.tokenizers import QWEN3_TOKENIZER
from tests.compaction_fixtures import loopback, server_config

_LISTENING = re.compile(r"compactd listening on (\S+)")


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


def start_up_lines(tmp_path: Path, *options: str, **env: str) -> tuple[str, list[dict[str, Any]]]:
    """The address and the JSON log lines of a `compactd serve` that is stopped once listening."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("COMPACTD_", "OTEL_"))}
    command = [sys.executable, "-m", "compactd", "serve", "--listen", "127.0.0.1:0",
               "--store", f"sqlite:///{tmp_path / 's.db'}", *options]  # fmt: skip
    lines: list[str] = []
    address = ""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ | env
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            match = _LISTENING.search(line)
            if match:
                address = match.group(1)
                proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert address, "".join(lines)
    return address, [json.loads(line) for line in lines if line.startswith("{")]


def test_serve_logs_what_it_will_do_and_warns_about_foreign_variables(tmp_path: Path) -> None:
    address, entries = start_up_lines(tmp_path, COMPACTD_ADDRESS="127.0.0.1:1")
    by_message = {e["message"]: e for e in entries}
    assert "ignored: COMPACTD_ADDRESS is not a compactd setting" in by_message
    serving = by_message["compactd serving"]
    assert serving["listen"] == address
    assert serving["store"] == f"sqlite:///{tmp_path / 's.db'}"
    assert (serving["tracing"], serving["metrics"]) == ("off", "off")
    (summaries,) = [e for e in entries if e["message"].startswith("summaries:")]
    assert summaries["summarizer"] == "auto"
    assert summaries["endpoints"] == {}
    assert "extractive summarizer, since no model endpoint is configured" in summaries["message"]
    routes = {e["route"]: e for e in entries if e["message"] == "route"}
    assert routes["deepseek/deepseek-chat"]["tokenizer"] == "deepseek-v4"
    assert routes["openai/gpt-4o"]["tokenizer"] == "o200k_base"
    qwen = routes["vllm/Qwen/Qwen3-8B"]  # priced exactly, through its chat template
    assert (qwen["tokenizer"], qwen["tokenizer_file"]) == ("chat template", QWEN3_TOKENIZER)
    assert not [r for r in routes.values() if "summary_endpoint" in r]  # no public endpoint


def test_serve_names_the_configured_summary_endpoint(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        '[summarizer]\nprovider = "local"\nmodel = "m"\n'
        '[[routes]]\nprovider = "local"\nmodel = "m"\ncontext_window = 32768\n'
        'tokenizer = "cl100k_base"\nbase_url = "http://127.0.0.1:9/v1"\n'
    )
    _, entries = start_up_lines(
        tmp_path,
        "--config",
        str(config),
        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
        OTEL_METRICS_EXPORTER="none",  # nothing listens there: no final metrics push to wait on
    )
    serving = next(e for e in entries if e["message"] == "compactd serving")
    assert serving["tracing"] == "otlp_proto_grpc http://127.0.0.1:9"
    (summaries,) = [e for e in entries if e["message"].startswith("summaries:")]
    assert summaries["endpoints"] == {"local/m": "http://127.0.0.1:9/v1"}
    route = next(e for e in entries if e.get("route") == "local/m")
    assert (route["tokenizer"], route["summary_endpoint"]) == (
        "cl100k_base",
        "http://127.0.0.1:9/v1",
    )


def test_a_key_in_a_summary_routes_url_is_in_no_start_up_field(tmp_path: Path) -> None:
    key = "url-key-0123456789abcdef"
    config = tmp_path / "c.toml"
    config.write_text(
        '[summarizer]\nprovider = "local"\nmodel = "m"\n'
        '[[routes]]\nprovider = "local"\nmodel = "m"\ncontext_window = 32768\n'
        f'tokenizer = "cl100k_base"\nbase_url = "https://user:{key}@127.0.0.1:9/v1"\n'
    )
    _, entries = start_up_lines(tmp_path, "--config", str(config))
    (summaries,) = [e for e in entries if e["message"].startswith("summaries:")]
    assert summaries["endpoints"] == {"local/m": "https://[REDACTED]@127.0.0.1:9/v1"}
    assert not [e for e in entries if key in json.dumps(e)]


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_server_reflection_answers_on_v1_and_v1alpha(
    tmp_path: Path, loop: OpenAICompatServer, version: str
) -> None:
    running = await create_server(server_config(tmp_path, loop))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            # v1 and v1alpha are the same messages under another package name.
            call = channel.stream_stream(
                f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            requests = [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="grpc.reflection.v1.ServerReflection"
                ),
            ]
            listed, described = [r async for r in call(iter(requests))]
    finally:
        await running.stop(0)
    names = {s.name for s in listed.list_services_response.service}
    assert {"compactd.v1.SessionService", "compactd.v1.CompactionService",
            "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names  # fmt: skip
    (file,) = described.file_descriptor_response.file_descriptor_proto
    assert b"grpc/reflection/v1/reflection.proto" in file

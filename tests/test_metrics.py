"""Metrics: a real server's Prometheus endpoint, scraped after real work.

The server builds its own meter provider with the Prometheus reader (``metrics_listen`` on port
0); a PrepareStep that prunes and compacts through the loopback provider, and an append, must
show up in the scrape with the instruments and attributes ``compactd.metrics`` documents.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from compactd.api.server import create_server
from compactd.testing.openai_server import OpenAICompatServer
from tests.builders import turn_start
from tests.compaction_fixtures import (
    MODEL,
    PROVIDER,
    Harness,
    loopback,
    opening,
    server_config,
    unit,
    units,
)


@pytest.fixture
def loop() -> Iterator[OpenAICompatServer]:
    with loopback() as server:
        yield server


def scrape(url: str) -> dict[str, list[Sample]]:
    """Every sample of the endpoint, by family name."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def labelled(samples: list[Sample], suffix: str, **labels: str) -> list[Sample]:
    return [
        s
        for s in samples
        if s.name.endswith(suffix) and all(s.labels.get(k) == v for k, v in labels.items())
    ]


async def test_the_prometheus_endpoint_reports_what_compaction_did(
    tmp_path: Path, loop: OpenAICompatServer, caplog: pytest.LogCaptureFixture
) -> None:
    settings = dataclasses.replace(server_config(tmp_path, loop), metrics_listen="127.0.0.1:0")
    caplog.set_level(logging.INFO, logger="compactd")
    running = await create_server(settings)
    try:
        assert running.prometheus is not None
        async with grpc.aio.insecure_channel(running.address) as channel:
            h = Harness(channel, loop, running)
            await h.create(*opening(), *unit(0, result="z" * 40_000), *units(18, 1), turn_start(1))
            run = await h.prepare(1)
            metrics = scrape(running.prometheus.url)
    finally:
        await running.stop(0)

    (outcome,) = run.result.compactions
    route = f"{PROVIDER}/{MODEL}"
    ratio = metrics["compactd_pressure_ratio"]
    assert labelled(ratio, "_count", compactd_route=route, compactd_pressure_state="ABOVE")
    assert labelled(ratio, "_count", compactd_route=route, compactd_pressure_state="BELOW")
    (committed,) = labelled(metrics["compactd_compactions"], "_total", compactd_outcome="committed")
    assert committed.value == 1
    (freed,) = labelled(metrics["compactd_compaction_tokens_freed"], "_total")
    assert freed.value == outcome.tokens_freed
    (pruned,) = labelled(metrics["compactd_prunes"], "_total")
    assert pruned.value == run.result.pruned_count == 1
    steps = {s.labels["compactd_step"] for s in metrics["compactd_bracket_step_duration_seconds"]}
    assert {"prune", "start", "summarize", "summary", "replace", "end", "bracket"} <= steps
    calls = labelled(metrics["gen_ai_client_operation_duration_seconds"], "_count",
                     gen_ai_request_model=MODEL, gen_ai_provider_name=PROVIDER)  # fmt: skip
    assert calls[0].value == 1
    tokens = metrics["gen_ai_client_token_usage"]
    assert labelled(tokens, "_sum", gen_ai_token_type="input")[0].value > 0
    assert labelled(tokens, "_sum", gen_ai_token_type="output")[0].value > 0
    (summaries,) = labelled(metrics["compactd_summary_duration_seconds"], "_count",
                            compactd_summarizer="openai", compactd_outcome="ok")  # fmt: skip
    assert summaries.value == 1
    (appended,) = labelled(metrics["compactd_events_appended"], "_total")
    assert appended.value == len(opening()) + len(unit(0)) + len(units(18, 1)) + 1
    assert metrics["compactd_sessions_live"][0].value == 1
    # The store's own figures: its commits, their transactions' time and their writes' wait.
    (commits,) = labelled(metrics["compactd_store_commits"], "_total")
    assert commits.value >= 4  # the session, its opening batch, the bracket's three appends
    (commit_time,) = labelled(metrics["compactd_store_commit_time_seconds"], "_total")
    (queue_time,) = labelled(metrics["compactd_store_queue_time_seconds"], "_total")
    assert commit_time.value > 0
    assert queue_time.value > 0
    assert running.store.stats.commits >= commits.value  # read when scraped, not later
    rpcs = metrics["rpc_server_call_duration_seconds"]
    prepare = labelled(rpcs, "_count", rpc_method="PrepareStep", rpc_grpc_status_code="0")
    assert prepare[0].value == 1
    # The start-up log says where metrics go.
    serving = [r for r in caplog.records if r.getMessage() == "compactd serving"]
    assert serving[0].__dict__["metrics"] == f"prometheus {running.prometheus.url}"


async def test_a_failed_rpc_is_timed_with_its_status_code(
    tmp_path: Path, loop: OpenAICompatServer
) -> None:
    settings = dataclasses.replace(server_config(tmp_path, loop), metrics_listen="127.0.0.1:0")
    running = await create_server(settings)
    try:
        assert running.prometheus is not None
        async with grpc.aio.insecure_channel(running.address) as channel:
            h = Harness(channel, loop, running, session_id="missing")
            with pytest.raises(grpc.aio.AioRpcError):
                await h.pressure()
            # The server times a call once it has answered: the client may scrape first.
            for _ in range(100):
                metrics = scrape(running.prometheus.url)
                if "rpc_server_call_duration_seconds" in metrics:
                    break
                await asyncio.sleep(0.02)
    finally:
        await running.stop(0)
    not_found = str(grpc.StatusCode.NOT_FOUND.value[0])
    rpcs = metrics["rpc_server_call_duration_seconds"]
    assert labelled(rpcs, "_count", rpc_method="CheckPressure", rpc_grpc_status_code=not_found)


async def test_with_the_sdk_disabled_the_prometheus_endpoint_keeps_compactd_s_metrics(
    tmp_path: Path,
    loop: OpenAICompatServer,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OTEL_SDK_DISABLED turns OpenTelemetry's exporters off, not compactd's own endpoint."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    settings = dataclasses.replace(server_config(tmp_path, loop), metrics_listen="127.0.0.1:0")
    caplog.set_level(logging.INFO, logger="compactd")
    running = await create_server(settings)
    try:
        assert running.prometheus is not None
        async with grpc.aio.insecure_channel(running.address) as channel:
            await Harness(channel, loop, running).create(*opening())
        metrics = scrape(running.prometheus.url)
    finally:
        await running.stop(0)
    (appended,) = labelled(metrics["compactd_events_appended"], "_total")
    assert appended.value == len(opening())
    (serving,) = [r for r in caplog.records if r.getMessage() == "compactd serving"]
    assert serving.__dict__["tracing"] == "off (OTEL_SDK_DISABLED)"
    assert serving.__dict__["metrics"] == f"prometheus {running.prometheus.url}"

"""``compactd replay``: transcripts played through an embedded server, and what the report says.

The report's figures are checked against the session's log read back with ``ListEvents`` and
recomputed here, by their own walk of the events; and replay runs on every transcript the
repository ships (``testdata/transcripts``).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from compactd_client import AsyncCompactdClient

from compactd import cli, config
from compactd import replay as rp
from compactd import replay_report as report
from compactd.api.auth import hash_token
from compactd.api.server import create_server
from compactd.v1 import events_pb2
from compactd.v1 import session_service_pb2 as spb
from compactd.v1 import session_service_pb2_grpc as sgrpc
from tests.certs import Authority

ROOT = Path(__file__).resolve().parents[1]
TRANSCRIPTS = ROOT / "testdata" / "transcripts"
SHIPPED = [
    *rp.read_transcripts(TRANSCRIPTS / "openai.jsonl"),
    *rp.read_transcripts(TRANSCRIPTS / "coding.jsonl"),
]
WINDOW = 8000
#: A short coding session that compacts four times at ``WINDOW`` and prunes no result.
SHORT = "mock_output/output.jsonl#1"


@pytest.fixture
async def address(tmp_path: Path) -> AsyncIterator[str]:
    """An embedded replay server whose default route has an ``WINDOW``-token window."""
    config = rp.embedded_config(None, tmp_path, window=WINDOW, environ={})
    async with rp.embedded_server(config) as served:
        yield served


async def _replayed(address: str, transcript: rp.Transcript) -> rp.SessionReplay:
    [result] = await rp.replay_all(address, [transcript], policy=rp.window_policy(WINDOW))
    return result


async def _log(address: str, session_id: str) -> list[events_pb2.SessionEvent]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = sgrpc.SessionServiceStub(channel)
        request = spb.ListEventsRequest(session_id=session_id)
        return [response.event async for response in stub.ListEvents(request)]


def _brackets_of(log: list[events_pb2.SessionEvent]) -> list[dict[str, Any]]:
    """Each bracket's figures, walked from the log without the replay module."""
    rows: dict[str, dict[str, Any]] = {}
    for event in log:
        if event.HasField("compaction_start"):
            start = event.compaction_start
            rows[start.compaction_id] = {
                "shadowed": len(start.shadowed_seqs),
                "span": (start.range.start_seq, start.range.end_seq),
                "opened": event.time.ToNanoseconds(),
            }
        elif event.HasField("compaction_summary"):
            summary = event.compaction_summary
            rows[summary.compaction_id].update(
                before=summary.tokens.envelope_before,
                after=summary.tokens.envelope_after,
                chars=len(summary.summary),
                checkpoint=summary.tokens.checkpoint_route_tokens,
            )
        elif event.HasField("compaction_end"):
            row = rows[event.compaction_end.compaction_id]
            row["ms"] = (event.time.ToNanoseconds() - row.pop("opened")) / 1e6
            row["ok"] = not event.compaction_end.error_reason
    return list(rows.values())


async def test_a_replay_reports_the_brackets_and_prunes_its_log_holds(address: str) -> None:
    [transcript] = [t for t in SHIPPED if SHORT in t.source]
    result = await _replayed(address, transcript)
    log = await _log(address, result.session_id)
    expected = _brackets_of(log)
    assert len(expected) >= 3, "the window makes the short transcript compact several times"
    assert [
        {
            "shadowed": c.shadowed,
            "span": (c.start_seq, c.end_seq),
            "before": c.tokens_before,
            "after": c.tokens_after,
            "chars": c.summary_chars,
            "checkpoint": c.checkpoint_tokens,
            "ms": pytest.approx(c.seconds * 1000, abs=0.01),
            "ok": c.committed,
        }
        for c in result.compactions
    ] == expected
    assert len(result.prunes) == sum(e.HasField("compaction_prune") for e in log)
    assert result.events == len(log)
    steps = [e for e in log if e.HasField("step_start")]
    assigned = [e for e in log if e.HasField("assistant_message")]
    assert len(result.steps) == len(steps) == len(assigned)
    assert sum(step.compactions for step in result.steps) == sum(r["ok"] for r in expected)
    # Each bracket is tied to the step whose PrepareStep wrote it: it opens after the events
    # appended before that call and before that step's step/start.
    opened = {
        e.compaction_start.compaction_id: e.seq for e in log if e.HasField("compaction_start")
    }
    for record in result.compactions:
        seq = opened[record.compaction_id]
        assert result.steps[record.step - 1].first_seq <= seq < steps[record.step - 1].seq


async def test_kept_requests_are_each_steps_own(address: str) -> None:
    """The client's default step extends its held request in place: the replay keeps copies."""
    [transcript] = [t for t in SHIPPED if SHORT in t.source]
    [result] = await rp.replay_all(
        address, [transcript], policy=rp.window_policy(WINDOW), keep_requests=True
    )
    assert len(result.requests) == len(result.steps) > 2
    assert [len(r.messages) for r in result.requests] == [s.request_messages for s in result.steps]
    revisions = [r.revision for r in result.requests]
    assert revisions == sorted(set(revisions))


async def test_the_report_shows_the_log_figures(address: str) -> None:
    [transcript] = [t for t in SHIPPED if SHORT in t.source]
    result = await _replayed(address, transcript)
    expected = _brackets_of(await _log(address, result.session_id))
    page = report.render_html([result], title="t", settings="s")
    for row in expected:
        cells = f"<td class=n>{row['shadowed']}</td><td class=n>{row['before']:,}</td>"
        assert cells + f"<td class=n>{row['after']:,}</td>" in page
        assert f"<td class=n>{row['chars']:,}</td>" in page
    rows = [line.split() for line in report.bracket_table([result]).splitlines()[1:]]
    assert [(r[3], r[4], r[5], r[8]) for r in rows] == [
        (str(e["shadowed"]), f"{e['before']:,}", f"{e['after']:,}", f"{e['chars']:,}")
        for e in expected
    ]
    [line] = [r for r in report.table([result]).splitlines() if r.startswith("…")]
    committed = sum(r["ok"] for r in expected)
    assert f"{result.tokens_sent:,}" in line
    assert re.search(rf"\s{committed}\s+{sum(r['shadowed'] for r in expected)}\s", line)


async def test_the_html_report_is_self_contained(address: str) -> None:
    [transcript] = [t for t in SHIPPED if SHORT in t.source]
    page = report.render_html([await _replayed(address, transcript)], title="t", settings="s")
    assert "<script" not in page
    assert "<link" not in page
    assert re.findall(r"https?://[^'\"\s]+", page) == ["http://www.w3.org/2000/svg"]
    [svg] = re.findall(r"<svg.*?</svg>", page, re.DOTALL)
    drawing = ET.fromstring(svg)  # well-formed: every attribute quoted
    lines = drawing.findall("{http://www.w3.org/2000/svg}line")
    titles = [line.findtext("{http://www.w3.org/2000/svg}title") or "" for line in lines]
    assert sum("compaction" in title for title in titles) >= 3


def test_broken_tool_pairs_counts_orphan_results_and_unanswered_calls() -> None:
    call = {"role": "assistant", "tool_calls": [{"id": "a"}, {"id": "b"}, {"id": "never"}]}
    answers = [{"role": "tool", "tool_call_id": "a"}, {"role": "tool", "tool_call_id": "b"}]
    answered = {"a", "b"}
    assert rp.broken_tool_pairs([call, *answers], answered) == 0
    assert rp.broken_tool_pairs(answers, answered) == 2  # results without their call
    assert rp.broken_tool_pairs([call, answers[0]], answered) == 1  # b's result cut away


@pytest.mark.timeout(240)  # all shipped transcripts in one embedded server: about 3 s here
@pytest.mark.parametrize("transcript", SHIPPED, ids=[t.source[-36:] for t in SHIPPED])
async def test_replay_runs_on_every_shipped_transcript(
    address: str, transcript: rp.Transcript
) -> None:
    result = await _replayed(address, transcript)
    assistants = sum(1 for m in transcript.messages if m.get("role") == "assistant")
    assert len(result.steps) == assistants
    for record in result.committed:
        assert record.tokens_after < record.tokens_before
    assert all(step.sent_tokens <= step.before_tokens for step in result.steps)
    assert [step.broken_pairs for step in result.steps] == [0] * len(result.steps)


@pytest.mark.parametrize("window", [6000, 10000])
async def test_every_checkpoint_takes_at_most_15_percent_of_its_span_and_none_is_larger(
    tmp_path: Path, window: int
) -> None:
    transcripts = [t for name in ("coding.jsonl", "openai.jsonl")
                   for t in rp.read_transcripts(TRANSCRIPTS / name)]  # fmt: skip
    config = rp.embedded_config(None, tmp_path, window=window, environ={})
    async with rp.embedded_server(config) as served:
        results = await rp.replay_all(served, transcripts, policy=rp.window_policy(window))
    brackets = [record for result in results for record in result.compactions]
    committed = [r for r in brackets if r.committed]
    # A bracket may fail only at the gate's probe check (a span of huge tool output sent as user
    # messages), never because its checkpoint is not smaller (SUMMARY_NOT_SMALLER).
    assert {r.outcome for r in brackets} <= {"committed", "SUMMARY_REJECTED"}
    assert len(committed) > len(transcripts) // 2
    assert max(r.checkpoint_tokens / r.span_tokens for r in committed) <= 0.15


def test_the_command_prints_the_table_and_writes_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "report.html"
    argv = ["replay", str(TRANSCRIPTS / "coding.jsonl"), "--match", SHORT, "--window",
            str(WINDOW), "--html", str(page), "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["conversation", "msgs", "steps"]
    assert f"report: {page}" in out
    assert "<svg" in page.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--target", "127.0.0.1:1", "--window", "4000"], "configure the embedded server"),
        (["--route", "gpt-4o"], "expected PROVIDER/MODEL"),
        (["--match", "no such conversation"], "no conversation matches"),
        (["--window", "10"], "--window: expected at least 256"),
        (["--token-file", "t"], "apply to a --target server"),
        (["--target", "localhost:1", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go"),
        (["--target", "localhost:1", "--tls-ca", "missing.pem"], "missing.pem"),
        (["--prepare-ahead", "0"], "--prepare-ahead: expected a ratio in (0, 1), got 0"),
        (["--prepare-ahead", "1"], "--prepare-ahead: expected a ratio in (0, 1), got 1"),
        (["--prepare-ahead", "-0.5"], "--prepare-ahead: expected a ratio in (0, 1)"),
        (["--think", "-1"], "--think: expected seconds >= 0, got -1"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    argv = ["replay", str(TRANSCRIPTS / "coding.jsonl"), "--html", str(tmp_path / "r.html"),
            "--no-progress", *extra]  # fmt: skip
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_an_unwritable_report_path_exits_2_before_replaying(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "missing" / "r.html"
    argv = ["replay", str(TRANSCRIPTS / "coding.jsonl"), "--match", SHORT, "--html", str(page),
            "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing was replayed
    assert err == f"compactd replay: --html: cannot write {page}: No such file or directory\n"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_report_that_fails_to_write_after_the_replay_exits_2_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # /dev/full opens for writing (the check passes) and refuses every byte written.
    argv = ["replay", str(TRANSCRIPTS / "coding.jsonl"), "--match", SHORT, "--window",
            str(WINDOW), "--html", "/dev/full", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out.startswith("conversation")  # the replay ran and printed its table
    assert err == "compactd replay: --html: cannot write /dev/full: No space left on device\n"


def test_a_missing_transcript_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["replay", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err


def test_a_server_only_install_names_the_extra_that_brings_the_client(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in sys.modules if n.startswith("compactd_client")] + ["compactd_client"]:
        monkeypatch.setitem(sys.modules, name, None)  # not installed
    assert cli.main(["replay", str(TRANSCRIPTS / "coding.jsonl"), "--no-progress"]) == 2
    assert "pip install 'compactd[client]'" in capsys.readouterr().err


def test_the_client_extra_declares_the_client_package() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (client,) = pyproject["project"]["optional-dependencies"]["client"]
    assert client.startswith("compactd-client")
    # scripts/setup installs the locked dependencies, then the client editable beside compactd.
    assert "-e clients/python" in (ROOT / "scripts" / "setup").read_text(encoding="utf-8")


def test_the_report_counts_in_words_and_names_the_file_as_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    one = tmp_path / "one.jsonl"
    line = (TRANSCRIPTS / "openai.jsonl").read_text(encoding="utf-8").splitlines()[0]
    one.write_text(line + "\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    argv = ["replay", "one.jsonl", "--window", "3000", "--html", "r.html", "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "1 conversation of one.jsonl, route" in page
    counts = re.search(r" (\d+) (prunes?), (\d+) (compactions?);", page)
    assert counts is not None
    for number, noun in ((counts[1], counts[2]), (counts[3], counts[4])):
        assert noun.endswith("s") == (number != "1")  # "1 compaction", "0 prunes"
    assert "1 conversations" not in page
    assert str(tmp_path) not in out + page  # the path as given, never made absolute


def test_the_server_commands_never_import_the_python_client() -> None:
    # A server-only install (the Docker image) has no compactd_client: serve must not need it.
    code = (
        "import sys; import compactd.cli as cli; cli.build_parser(); "
        "sys.exit('compactd_client' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_the_readme_quick_start_prints_what_the_readme_shows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    readme = (TRANSCRIPTS.parents[1] / "README.md").read_text(encoding="utf-8")
    start = readme.index("## Quick start: replay a recorded session")
    command, shown = re.findall(r"```(?:sh)?\n(.*?)```", readme[start:], re.DOTALL)[:2]
    argv = command.split()
    assert argv[:2] == ["compactd", "replay"]
    monkeypatch.chdir(TRANSCRIPTS.parents[1])
    assert cli.main([*argv[1:], "--html", str(tmp_path / "r.html"), "--no-progress"]) == 0
    printed = capsys.readouterr().out

    def figures(text: str) -> list[list[str]]:  # every cell but a bracket's duration (ms)
        rows = [line.split() for line in text.splitlines() if line and "report:" not in line]
        return [row[:9] + row[10:] if re.fullmatch(r"\d+\.\d+", row[0]) else row for row in rows]

    assert figures(printed) == figures(shown)


# ---- --prepare-ahead and --think -------------------------------------------------------------


def test_prepare_ahead_sets_the_policy_key_beside_the_window_policy() -> None:
    policy = rp.prepare_ahead_policy(rp.window_policy(WINDOW), 0.6)

    assert policy == {**rp.window_policy(WINDOW), "prepareAheadRatio": 0.6}
    assert rp.prepare_ahead_policy(None, 0.5) == {"prepareAheadRatio": 0.5}
    assert rp.prepare_ahead_policy(None, None) is None


@pytest.fixture
async def fitted(tmp_path: Path) -> AsyncIterator[str]:
    """A server like ``address`` whose service-wide policy is replay's for ``WINDOW`` (a
    ``--target``'s policy is its own)."""
    config = rp.embedded_config(None, tmp_path, window=WINDOW, environ={})
    config = replace(config, compaction=rp.window_policy(WINDOW))
    async with rp.embedded_server(config) as served:
        yield served


async def test_the_replayed_sessions_carry_the_prepare_ahead_ratio(
    fitted: str, tmp_path: Path
) -> None:
    argv = ["replay", str(TRANSCRIPTS / "coding.jsonl"), "--match", SHORT, "--target", fitted,
            "--prepare-ahead", "0.6", "--html", str(tmp_path / "r.html"),
            "--no-progress"]  # fmt: skip

    assert await asyncio.to_thread(cli.main, argv) == 0
    async with AsyncCompactdClient(fitted) as client:
        (session,) = (await client.list_sessions()).sessions
    assert dict(session.compaction_policy)["prepareAheadRatio"] == 0.6


async def test_think_time_passes_between_steps_and_the_wait_line_is_printed(
    fitted: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", str(TRANSCRIPTS / "coding.jsonl"), "--match", SHORT, "--target", fitted,
            "--think", "0.01", "--html", str(tmp_path / "r.html"), "--no-progress"]  # fmt: skip

    assert await asyncio.to_thread(cli.main, argv) == 0

    out = capsys.readouterr().out
    assert re.search(
        r"agent-visible wait added by compaction over \d+ steps? that compacted: p50 [\d,]+ ms, "
        r"p95 [\d,]+ ms, total [\d,.]+ s",
        out,
    ), out


async def test_compaction_waits_are_measured_at_the_steps_that_compacted(address: str) -> None:
    (transcript,) = rp.read_transcripts(TRANSCRIPTS / "coding.jsonl", match=SHORT)
    result = await _replayed(address, transcript)

    waits = rp.compaction_waits(result)

    compacted = {r.step for r in result.compactions if r.step} | {
        s.index for s in result.steps if s.compactions
    }
    assert len(waits) == len(compacted) >= 3
    assert all(wait >= 0 for wait in waits)
    assert all(step.append_seconds > 0 for step in result.steps)  # the boundary is timed too
    assert report.percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert report.percentile([3.0, 1.0, 2.0, 4.0], 0.95) == 4.0


# ---- a --target behind TLS and tokens --------------------------------------------------------


async def _replay_target(tmp_path: Path, port: int, *options: str) -> int:
    argv = ["replay", str(TRANSCRIPTS / "coding.jsonl"), "--match", SHORT, "--target",
            f"localhost:{port}", "--html", str(tmp_path / "r.html"), "--no-progress",
            *options]  # fmt: skip
    # The command runs its own event loop; the server keeps running on this one.
    return await asyncio.to_thread(cli.main, argv)


async def test_replay_reaches_a_tls_server_with_a_bearer_token(
    server_config: config.ServerConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = Authority(tmp_path / "ca")
    issued = ca.server()
    (tmp_path / "token").write_text("replay-token-a\n")
    running = await create_server(
        replace(
            server_config,
            tls_cert_file=str(issued.cert_file),
            tls_key_file=str(issued.key_file),
            auth_tokens={"a": hash_token("replay-token-a")},
        )
    )
    try:
        assert await _replay_target(
            tmp_path, running.port, "--tls-ca", str(ca.cert_file),
            "--token-file", str(tmp_path / "token"),
        ) == 0  # fmt: skip
        assert capsys.readouterr().out.splitlines()[1].startswith("…/mock_output/output.jsonl#1")
        # The same server without the token: refused, said in one line, exit 1.
        assert await _replay_target(tmp_path, running.port, "--tls-ca", str(ca.cert_file)) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
    finally:
        await running.stop(0)


async def test_replay_presents_a_client_certificate_to_a_mutual_tls_server(
    server_config: config.ServerConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = Authority(tmp_path / "ca")
    issued, agent = ca.server(), ca.client("agent", dns="agent-a.example.org")
    running = await create_server(
        replace(
            server_config,
            tls_cert_file=str(issued.cert_file),
            tls_key_file=str(issued.key_file),
            tls_client_ca_file=str(ca.cert_file),
            auth_identities={"agent-a.example.org": "a"},
        )
    )
    try:
        assert await _replay_target(
            tmp_path, running.port, "--tls-ca", str(ca.cert_file),
            "--tls-cert", str(agent.cert_file), "--tls-key", str(agent.key_file),
        ) == 0  # fmt: skip
        assert "compactions" in capsys.readouterr().out
    finally:
        await running.stop(0)


def test_the_report_marks_a_bracket_prepared_ahead() -> None:
    def record(*, ahead: bool) -> rp.CompactionRecord:
        return rp.CompactionRecord(
            compaction_id="c", step=3, trigger="threshold", start_position=1, end_position=9,
            start_seq=3, end_seq=40, shadowed=9, tokens_before=5400, tokens_after=1500,
            span_tokens=4000, checkpoint_tokens=300, summary_chars=900, summarizer="openai",
            seconds=0.01, outcome="committed", prepared_ahead=ahead,
        )  # fmt: skip

    replay = rp.SessionReplay(source="t", session_id="s", messages=9)
    replay.compactions = [record(ahead=True), record(ahead=False)]

    rows = report.bracket_table([replay]).splitlines()[1:]
    page = report.render_html([replay], title="t", settings="s")

    assert rows[0].endswith("committed (ahead)")
    assert rows[1].endswith("committed")
    assert page.count("committed (ahead)") == 1

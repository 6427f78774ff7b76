"""Priced 1,000-event batches over gRPC, each comparison against its reference in the same run.

Servers: ``compactd`` (``create_server`` on a SQLite file, ``synchronous=FULL``, the
interpreter settled as ``compactd serve`` settles it), each in a child process of its own; the
clients and the references run in this process. Events are the repository's transcripts
(``testdata/transcripts``), cycled, in steps as a runtime appends them.

1. **A priced batch**: ``AppendEvents`` of 1,000 events on a session routed to a tokenizer
   route, against the fastest raw way to do the same work: counting the same texts with the
   raw tokenizer, whichever of its ways is fastest in this run (each measured every round: the
   batch API on 2 threads; the texts joined into two halves, each encoded in one call on a
   thread of its own; for tiktoken also the halves joined by its end-of-text token, encoded to
   numpy, which gives each text's count), plus a raw SQLite insert of the same serialized rows
   in one fsync'd transaction. Goal: ≥ 0.8x (reference time / append time).
2. **Another session's checks beside 1,000-event batches**: ``CheckPressure`` p99 of caller B
   while caller A (a child process of its own, its batches built and serialized before the
   first is sent) appends 1,000-event batches, in three phases per round, in rotating order:
   A idle; A's batches to B's server; A's batches to *another* compactd process on the same
   machine (the isolation floor: what B's calls meet when A's work only takes the cores, not
   B's server). Goal: B's p99 beside A ≤ 1.3x the floor. The idle p99 is printed beside, and
   B's server's own view of each phase (``bench_neighbours.LoopPauses``): the longest its event
   loop paused, and its longest slice of CPU on the loop, which the machine's load does not
   lengthen.

    python -m bench.bench_batches [--rounds 5] [--checks 300]

``readme_rows()`` returns rows of docs/benchmarks.md (goal, measured, reference):
``python -m bench.readme``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy

from bench import bench_neighbours
from bench.children import ROOT, identity, served
from bench.corpus import SessionEvent, header, in_steps, surface_events, texts_of, turn_start
from compactd.tokenizers import load_tokenizer
from compactd.v1 import (
    compaction_service_pb2,
    compaction_service_pb2_grpc,
    session_service_pb2,
    session_service_pb2_grpc,
)

ROUTES = {"cl100k_base": ("openai", "gpt-4-turbo"), "deepseek-v4": ("deepseek", "deepseek-chat")}
BATCH = 1000
SETTLE_S = 0.5  # after A stops: longer than its last batch's background work takes
Row = tuple[str, str, str]


class Client:
    """One server's stubs and a source of transcript events, per session."""

    def __init__(self, channel: grpc.aio.Channel, prefix: str = "s") -> None:
        self.channel = channel
        self.prefix = prefix
        self.sessions = session_service_pb2_grpc.SessionServiceStub(channel)
        self.compaction = compaction_service_pb2_grpc.CompactionServiceStub(channel)
        self.names = itertools.count()
        self.steps: dict[str, int] = {}
        self.sources: dict[str, Iterator[SessionEvent]] = {}  # a session's own calls and results

    async def session(self, route: tuple[str, str]) -> str:
        name = f"{self.prefix}{next(self.names)}"
        await self.sessions.CreateSession(session_service_pb2.CreateSessionRequest(session_id=name))
        await self.append(name, [turn_start(), header(*route)])
        self.steps[name] = 1
        await self.check(name)  # the route's prices are kept from here on
        return name

    async def append(self, name: str, events: list[SessionEvent]) -> None:
        request = session_service_pb2.AppendEventsRequest(session_id=name, events=events)
        await self.sessions.AppendEvents(request)

    def batch(self, name: str, size: int) -> list[SessionEvent]:
        source = self.sources.setdefault(name, surface_events(name))
        raw = [next(source) for _ in range(size)]
        events, self.steps[name] = in_steps(raw, self.steps[name])
        return events

    async def check(self, name: str) -> None:
        request = compaction_service_pb2.CheckPressureRequest(session_id=name)
        await self.compaction.CheckPressure(request)


def fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- 1. the priced batch ----------------------------------------------------------------------


def _halves(texts: list[str]) -> list[list[str]]:
    """``texts`` cut in two runs of about equal length."""
    total, running = sum(map(len, texts)), 0
    for index, text in enumerate(texts):
        running += len(text)
        if running >= total / 2:
            return [texts[: index + 1], texts[index + 1 :]]
    return [texts, []]


def _on_two_threads(count: Callable[[list[str]], object], halves: list[list[str]]) -> None:
    threads = [threading.Thread(target=count, args=(half,)) for half in halves]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def raw_counts(tokenizer: str) -> dict[str, Callable[[list[str]], object]]:
    """The raw tokenizer's ways of counting a batch's texts on 2 cores, by name."""
    counter: Any = load_tokenizer(tokenizer)
    encoding = getattr(counter, "_encoding", None)
    ways: dict[str, Callable[[list[str]], object]] = {}
    if encoding is not None:
        end = "<|endoftext|>"
        ends = frozenset({end})

        def separated(texts: list[str]) -> object:
            ids = encoding.encode_to_numpy(end.join(texts), allowed_special=ends)
            return numpy.diff(numpy.flatnonzero(ids == encoding.eot_token))

        ways["encode_ordinary_batch, 2 threads"] = functools.partial(
            encoding.encode_ordinary_batch, num_threads=2
        )
        ways["joined halves, encode_ordinary on 2 threads"] = lambda texts: _on_two_threads(
            lambda half: len(encoding.encode_ordinary("".join(half))), _halves(texts)
        )
        ways["halves joined by the end-of-text token, encode_to_numpy on 2 threads"] = (
            lambda texts: _on_two_threads(separated, _halves(texts))
        )
        return ways
    raw = counter._tokenizer
    ways["encode_batch_fast"] = lambda texts: raw.encode_batch_fast(texts, add_special_tokens=False)
    ways["joined halves, encode_batch_fast"] = lambda texts: raw.encode_batch_fast(
        ["".join(half) for half in _halves(texts)], add_special_tokens=False
    )
    return ways


def raw_insert(path: Path) -> Callable[[list[SessionEvent]], None]:
    """A raw SQLite insert of a batch's serialized rows, one fsync'd transaction."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS events (session_id TEXT, seq INTEGER, event_id TEXT,"
        " type TEXT, data BLOB, PRIMARY KEY (session_id, seq))"
    )
    seqs = itertools.count()

    def insert(events: list[SessionEvent]) -> None:
        rows = [
            ("raw", next(seqs), None, e.WhichOneof("body"), e.SerializeToString(deterministic=True))
            for e in events
        ]
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?)", rows)
        conn.execute("COMMIT")

    return insert


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


async def priced_batches(client: Client, folder: Path, rounds: int, tokenizer: str) -> Row:
    name = await client.session(ROUTES[tokenizer])
    ways = raw_counts(tokenizer)
    own = load_tokenizer(tokenizer).count_batch  # type: ignore[attr-defined]
    insert = raw_insert(folder / f"raw-{tokenizer}.db")
    counts: dict[str, list[float]] = {way: [] for way in ways}
    appends: list[float] = []
    owns: list[float] = []
    inserts: list[float] = []
    for round_ in range(rounds):
        events = client.batch(name, BATCH)
        texts = [t for e in events for t in texts_of(e)]
        steps: list[Callable[[], None]] = [
            *(functools.partial(_add, counts[w], way, texts) for w, way in ways.items()),
            functools.partial(_add, owns, own, texts),  # shown beside, never the reference
            functools.partial(_add, inserts, insert, events),
        ]
        order = round_ % (len(steps) + 1)  # where the append goes among the references
        for step in steps[:order]:
            step()
        start = time.perf_counter()
        await client.append(name, events)
        appends.append(time.perf_counter() - start)
        for step in steps[order:]:
            step()
    a = statistics.median(appends)
    medians = {way: statistics.median(times) for way, times in counts.items()}
    fastest = min(medians, key=medians.__getitem__)
    reference = medians[fastest] + statistics.median(inserts)
    others = "; ".join(f"{way} {fmt(t)}" for way, t in medians.items() if way != fastest)
    return (
        f"priced append of {BATCH:,}-event batches ({tokenizer}) ≥ 0.8x reference",
        f"{fmt(a)} per batch = {reference / a:.2f}x",
        f"the raw tokenizer's fastest count of the same texts ({fastest}) {fmt(medians[fastest])}"
        f" + raw SQLite insert of the rows {fmt(statistics.median(inserts))}; slower raw ways:"
        f" {others}; compactd's own count of the texts {fmt(statistics.median(owns))}",
    )


def _add(times: list[float], call: Callable[[Any], object], argument: object) -> None:
    times.append(_timed(lambda: call(argument)))


# ---- 2. another session's checks beside 1,000-event batches ---------------------------------


async def checks_beside_batches(
    near: Client, addresses: tuple[str, str], rounds: int, checks: int
) -> Row:
    """B's checks on ``addresses[0]``, A idle, A appending there, A appending to the other."""
    b = await near.session(ROUTES["cl100k_base"])
    await near.append(b, near.batch(b, 200))
    take = near.channel.unary_unary(
        "/bench.Lag/Take", request_serializer=identity, response_deserializer=identity
    )
    phases: dict[str, list[float]] = {"idle": [], "same": [], "other": []}
    loop: dict[str, tuple[float, float]] = dict.fromkeys(phases, (0.0, 0.0))  # pause, slice
    for round_ in range(rounds):
        names = list(phases)
        for phase in names[round_ % 3 :] + names[: round_ % 3]:
            await take(b"")
            if phase == "idle":
                phases[phase] += await _checks(near, b, checks)
            else:
                phases[phase] += await _beside_appender(near, b, addresses, phase, round_, checks)
            pause, cpu = (float(x) for x in (await take(b"")).split())
            loop[phase] = (max(loop[phase][0], pause), max(loop[phase][1], cpu))
            if phase != "idle":
                await asyncio.sleep(SETTLE_S)  # A's last batch's background work, done
    idle, same, other = (_pct(phases[p], 0.99) for p in ("idle", "same", "other"))
    return (
        "CheckPressure p99 on B while A appends 1,000-event batches to B's server ≤ 1.3x the "
        "isolation floor",
        f"{fmt(same)} = {same / other:.2f}x the floor ({same / idle:.2f}x idle); B's server's "
        f"event loop paused at most {fmt(loop['same'][0])}, its longest slice of CPU "
        f"{fmt(loop['same'][1])}",
        f"the floor, B's p99 while A's batches go to another compactd process on the same "
        f"machine: {fmt(other)} ({other / idle:.2f}x idle; B's server's loop paused at most "
        f"{fmt(loop['other'][0])}, slice {fmt(loop['other'][1])}); B's p99 while A is idle "
        f"{fmt(idle)} (pause {fmt(loop['idle'][0])}, slice {fmt(loop['idle'][1])}); {rounds} "
        f"rounds of {checks} checks a phase, phases in rotating order",
    )


async def _beside_appender(
    near: Client, b: str, addresses: tuple[str, str], phase: str, round_: int, checks: int
) -> list[float]:
    """B's checks while A appends to B's server (``same``) or to the other one."""
    target = addresses[0] if phase == "same" else addresses[1]
    appender = await _appender(target, f"a{round_}{phase}-")
    assert appender.stdout is not None
    assert appender.stdin is not None
    if await appender.stdout.readline() != b"appending\n":  # its first batch is sent
        raise RuntimeError(f"session A's appender stopped: exit {await appender.wait()}")
    samples = await _checks(near, b, checks)
    appender.stdin.close()
    await appender.wait()
    return samples


async def _checks(client: Client, name: str, times: int) -> list[float]:
    samples = []
    for _ in range(times):
        start = time.perf_counter()
        await client.check(name)
        samples.append(time.perf_counter() - start)
    return samples


async def _appender(address: str, prefix: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.bench_batches", "--append-to", address, "--prefix", prefix,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip


async def append_until_stdin_closes(address: str, prefix: str) -> None:
    """Session A (a child process): appends 1,000-event batches until stdin closes; prints a
    line once its first batch is on its way. Its batches (a fresh session every three, before
    the surface reaches its byte limit) are built and serialized before the first is sent."""
    async with grpc.aio.insecure_channel(address) as channel:
        client = Client(channel, prefix)
        send = channel.unary_unary(
            "/compactd.v1.SessionService/AppendEvents",
            request_serializer=None,  # already serialized
            response_deserializer=session_service_pb2.AppendEventsResponse.FromString,
        )
        batches = await _built_batches(client, sessions=4)
        closed = asyncio.ensure_future(asyncio.to_thread(sys.stdin.read))
        for index, data in enumerate(itertools.cycle(batches)):
            if closed.done():
                break
            if index == len(batches):  # a long phase: more sessions
                batches += await _built_batches(client, sessions=4)
            sent = asyncio.ensure_future(send(data))
            if index == 0:
                await asyncio.sleep(0.05)
                print("appending", flush=True)
            await sent


async def _built_batches(client: Client, sessions: int) -> list[bytes]:
    batches = []
    for _ in range(sessions):
        name = await client.session(ROUTES["cl100k_base"])
        for _ in range(3):
            request = session_service_pb2.AppendEventsRequest(
                session_id=name, events=client.batch(name, BATCH)
            )
            batches.append(request.SerializeToString())
    return batches


# ---- running ----------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="bench-batches-") as folder:
        async with (
            served("bench.bench_batches", 1, f"{folder}/near.db") as (near,),
            served("bench.bench_batches", 1, f"{folder}/other.db") as (other,),
            grpc.aio.insecure_channel(near) as channel,
        ):
            client = Client(channel)
            rows = [
                await priced_batches(client, Path(folder), args.rounds, tokenizer)
                for tokenizer in ROUTES
            ]
            rows.append(
                await checks_beside_batches(client, (near, other), args.rounds, args.checks)
            )
            return rows


async def serve(path: str) -> None:
    """A benchmarked server (a child process): prints its address, serves until stdin closes;
    ``bench.Lag/Take`` answers its event loop's longest pause and slice of CPU since asked
    (``bench_neighbours.serve``)."""
    await bench_neighbours.serve(
        path,
        max_batch_events=4 * BATCH,  # a batch of BATCH events with its step brackets
        max_resident_sessions=0,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--checks", type=int, default=300, help="checks per phase")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # a server child: its SQLite file
    parser.add_argument("--append-to", help=argparse.SUPPRESS)  # session A's child: the address
    parser.add_argument("--prefix", default="a", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def readme_rows() -> list[Row]:
    """This benchmark's rows of docs/benchmarks.md, (goal, measured, reference), at its defaults."""
    return asyncio.run(run(parse_args([])))


def main() -> None:
    arguments = parse_args()
    if arguments.serve:
        asyncio.run(serve(arguments.serve))
    elif arguments.append_to:
        asyncio.run(append_until_stdin_closes(arguments.append_to, arguments.prefix))
    else:
        print(f"machine: {os.cpu_count()} cores")
        for goal, measured, reference in asyncio.run(run(arguments)):
            print(f"{goal}\n    measured: {measured}\n    reference (same run): {reference}")


if __name__ == "__main__":
    main()

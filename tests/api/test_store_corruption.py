"""A damaged SQLite file over a real server: the damaged session answers DATA_LOSS with reason
``STORE_CORRUPT`` (never INTERNAL), and the other sessions keep working."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest

from compactd.testing.openai_server import OpenAICompatServer
from tests.api.rpc import details
from tests.builders import user
from tests.compaction_fixtures import started

MARK = b"DAMAGED-SESSION-ROW"


def corrupt_page_holding(path: Path, marker: bytes) -> int:
    """Overwrite the page that holds the middle occurrence of ``marker`` with garbage; its
    number. The store must be closed (its WAL checkpointed into the file)."""
    raw = bytearray(path.read_bytes())
    page_size = int.from_bytes(raw[16:18], "big") or 65536
    hits, at = [], raw.find(marker)
    while at >= 0:
        hits.append(at)
        at = raw.find(marker, at + 1)
    page = hits[len(hits) // 2] // page_size
    raw[page * page_size : (page + 1) * page_size] = b"\xa5" * page_size
    path.write_bytes(bytes(raw))
    return page


async def test_a_damaged_session_answers_data_loss_and_the_others_keep_working(
    tmp_path: Path, loop: OpenAICompatServer, caplog: pytest.LogCaptureFixture
) -> None:
    async with started(tmp_path, loop) as h:
        await h.create(*(user(f"healthy {i}") for i in range(50)))
        damaged = dataclasses.replace(h, session_id="damaged")
        await damaged.create(*(user(f"{MARK.decode()} {i} " + "x" * 200) for i in range(400)))
    assert not (tmp_path / "compactd.db-wal").exists()  # checkpointed at close: one file
    corrupt_page_holding(tmp_path / "compactd.db", MARK)

    async with started(tmp_path, loop) as h:
        damaged = dataclasses.replace(h, session_id="damaged")
        calls = (damaged.events, damaged.surface, damaged.build, lambda: damaged.append(user("+")))
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call()
            got = details(caught.value)
            assert (got.code, got.reason) == (grpc.StatusCode.DATA_LOSS, "STORE_CORRUPT"), got
        log = await h.events()
        assert [e.user_message.content[0].text.text for e in log[:50]] == [
            f"healthy {i}" for i in range(50)
        ]
        assert await h.append(user("still writable")) == [len(log)]

    tracebacks = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert tracebacks == []

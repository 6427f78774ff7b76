"""A TCP relay to a real server that can turn into a black hole: it keeps accepting and keeps
every connection open, but no byte passes either way (a partitioned or frozen database host,
seen from a client: no reset, no answer)."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from types import TracebackType


class BlackHoleRelay:
    """Relays ``127.0.0.1:<port>`` to ``host:port`` until ``swallow`` is called.

    Use as ``async with BlackHoleRelay(host, port) as relay``; ``relay.url(url)`` rewrites a
    libpq URL to go through it."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.swallowing = False
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    def url(self, url: str) -> str:
        """``url`` with its host and port replaced by the relay's."""
        parts = urllib.parse.urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@127.0.0.1:{self.port}" if userinfo else f"127.0.0.1:{self.port}"
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))

    def swallow(self) -> None:
        """From now on nothing passes, on open connections and on new ones."""
        self.swallowing = True

    async def __aenter__(self) -> BlackHoleRelay:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        for pipe in self._pipes:
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        if self.swallowing:
            return  # accepted and left open: the client waits for an answer that never comes
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers.add(up_writer)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            pipe = asyncio.ensure_future(self._pipe(source, sink))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await source.read(65536):
                if self.swallowing:
                    continue  # read and dropped: TCP stays healthy, no answer arrives
                sink.write(data)
                await sink.drain()

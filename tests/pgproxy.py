"""A small real TCP proxy in front of PostgreSQL that loses the acknowledgements of commits, for the tests.

It relays bytes both ways and reads the client's side of the wire protocol (the untyped start-up messages, then
typed messages: a type byte and a length). While it is told to, it acts on a simple-query ``COMMIT`` (asyncpg ends a
transaction with ``COMMIT;`` on the simple query protocol):

- ``lose``: the COMMIT goes to the server, which commits; the server's reply is read and thrown away, and both
  connections are cut. The client sees its connection lost with the commit's outcome unknown — it was made.
- ``cut``: the connection is cut before the COMMIT reaches the server, which rolls the transaction back.

``lose_every(n)`` acts on every n-th COMMIT until told otherwise; ``lose_next(k)`` on the next k.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from dataclasses import dataclass

SSL_REQUEST, GSS_REQUEST = 80877103, 80877104


@dataclass
class Plan:
    mode: str = "lose"
    every: int = 0  # act on every n-th COMMIT (0: not by count)
    next: int = 0  # act on the next n COMMITs


class CommitProxy:
    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.plan = Plan()
        self.commits = 0  # COMMITs seen
        self.acted = 0  # COMMITs whose reply was lost (or that were cut)
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    def start(self) -> "CommitProxy":
        self._thread.start()
        self._ready.wait(10)
        return self

    def url(self, database_url: str) -> str:
        """``database_url`` (a PostgreSQL URL on the target) through this proxy."""
        return database_url.replace(f":{self.target[1]}/", f":{self.port}/")

    def lose_every(self, n: int, mode: str = "lose") -> None:
        with self._lock:
            self.plan = Plan(mode, every=n)

    def lose_next(self, k: int = 1, mode: str = "lose") -> None:
        with self._lock:
            self.plan = Plan(mode, next=k)

    def stop_losing(self) -> None:
        with self._lock:
            self.plan = Plan()

    def close(self) -> None:
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _act(self) -> str | None:
        """Whether (and how) to act on the COMMIT just seen."""
        with self._lock:
            self.commits += 1
            plan = self.plan
            if plan.next > 0:
                plan.next -= 1
            elif not (plan.every and self.commits % plan.every == 0):
                return None
            self.acted += 1
            return plan.mode

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        self.port = listener.getsockname()[1]
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, sock=listener))
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        back = asyncio.ensure_future(_pipe(server_r, client_w))
        try:
            await self._forward(client_r, server_w, server_r, back)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            back.cancel()
            for writer in (client_w, server_w):
                writer.close()

    async def _forward(self, reader: asyncio.StreamReader, server: asyncio.StreamWriter,
                       server_r: asyncio.StreamReader, back: asyncio.Future[None]) -> None:
        """Relay the client's messages, acting on a COMMIT as planned."""
        while True:  # start-up: untyped messages (an SSL or GSS request first, then the start-up message)
            head = await reader.readexactly(8)
            length, code = struct.unpack("!ii", head)
            server.write(head + await reader.readexactly(length - 8))
            await server.drain()
            if code not in (SSL_REQUEST, GSS_REQUEST):
                break
        while True:
            head = await reader.readexactly(5)
            kind, length = head[:1], struct.unpack("!i", head[1:])[0]
            body = await reader.readexactly(length - 4)
            mode = self._act() if kind == b"Q" and body.lstrip().upper().startswith(b"COMMIT") else None
            if mode == "cut":
                return
            if mode == "lose":  # the reply will not be relayed: the client's side is cut first
                back.cancel()
                await asyncio.gather(back, return_exceptions=True)
            server.write(head + body)
            await server.drain()
            if mode == "lose":  # the server commits and answers: its reply is read here and thrown away
                await asyncio.wait_for(server_r.read(1), 10)
                return


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.CancelledError):
        pass
    finally:
        writer.close()

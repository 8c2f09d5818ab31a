"""Injection target: the main thread waits in an event loop's system call (epoll_wait, poll, select)
with the GIL released, and nothing wakes it up until a client connects.

``inject_event_loop.py MODE``:

* ``asyncio-sleep``: ``asyncio.run(main())`` where ``main`` awaits ``asyncio.sleep(3600)`` (an idle actor);
* ``asyncio-server``: an asyncio echo server that no client has reached yet;
* ``asyncio-pipeline``: three tasks joined by queues (read, work, write back) waiting for their first line;
* ``selector-default``, ``selector-poll``, ``selector-select``: a hand-written loop over
  ``selectors.DefaultSelector`` / ``PollSelector`` / ``SelectSelector`` with no timeout.

Every mode but ``asyncio-sleep`` listens on 127.0.0.1 (``PORT <port>`` before ``READY <pid>``) and answers
a line sent to it with that line, so a test can see that the loop still works after an injection.
"""

import asyncio
import os
import selectors
import socket
import sys


def _ready(port: int) -> None:
    print("PORT", port, flush=True)
    print("READY", os.getpid(), flush=True)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(await reader.readline())
    await writer.drain()
    writer.close()


async def asyncio_sleep() -> None:
    _ready(0)
    await asyncio.sleep(3600)


async def asyncio_server() -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    _ready(server.sockets[0].getsockname()[1])
    async with server:
        await server.serve_forever()


async def asyncio_pipeline() -> None:
    lines: "asyncio.Queue[tuple]" = asyncio.Queue(maxsize=8)
    done: "asyncio.Queue[tuple]" = asyncio.Queue(maxsize=8)

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await lines.put((await reader.readline(), writer))

    async def work() -> None:
        while True:
            line, writer = await lines.get()
            sum(i * i for i in range(10000))  # a step of CPU work per item
            await done.put((line, writer))

    async def write_back() -> None:
        while True:
            line, writer = await done.get()
            writer.write(line)
            await writer.drain()
            writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    _ready(server.sockets[0].getsockname()[1])
    await asyncio.gather(work(), write_back(), server.serve_forever())


def selector_loop(kind: str) -> None:
    selector = {"default": selectors.DefaultSelector, "poll": selectors.PollSelector,
                "select": selectors.SelectSelector}[kind]()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ)
    _ready(listener.getsockname()[1])
    while True:
        for key, _ in selector.select():  # no timeout: waits in the system call until a client comes
            if key.fileobj is listener:
                conn, _ = listener.accept()
                conn.setblocking(True)
                conn.sendall(conn.makefile("rb").readline())
                conn.close()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode.startswith("selector-"):
        selector_loop(mode[len("selector-"):])
    else:
        asyncio.run({"asyncio-sleep": asyncio_sleep, "asyncio-server": asyncio_server,
                     "asyncio-pipeline": asyncio_pipeline}[mode]())

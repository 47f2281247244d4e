"""A lean keep-alive HTTP/1.1 client for load tests on loopback.

httpx costs about 5 ms of CPU per request here, a third of this 2-core machine at the loads
we measure; this client costs a fraction of that, so the server gets the CPU it would have
with its clients on other machines.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self.reader = reader
        self.writer = writer
        self.host = host

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, host)

    async def post_json(self, path: str, body: Any) -> tuple[int, bytes]:
        return await self.post(path, orjson.dumps(body))

    async def post(self, path: str, payload: bytes) -> tuple[int, bytes]:
        """Send a JSON body as it is; the status and the body of the answer."""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        self.writer.write(head.encode("ascii") + payload)
        status_line = await self.reader.readuntil(b"\r\n")
        status = int(status_line.split()[1])
        length = 0
        while (line := await self.reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()

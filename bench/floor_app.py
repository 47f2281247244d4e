"""The floor of a Python front end for POST /embed: a raw ASGI app (no framework) under uvicorn
with uvloop and httptools, doing only the work no Python server can skip per request: read
the body, parse it with orjson, tokenize its `inputs` string once, and write a fixed vector
with orjson. GET /health answers 200, so that it is started and awaited like the server.
bench/serving_cost.py measures the server's CPU per request against this one's.
Usage: python -m bench.floor_app --tokenizer TOKENIZER_JSON --port N
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
import uvicorn
from tokenizers import Tokenizer

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Message, Receive, Send], Awaitable[None]]

# The tiny model's dimension, with nine digits as orjson writes the server's float32 values
# (0.102201805), so that the floor's responses are as long as the server's.
VECTOR = [round(0.3 * math.sin(index + 1), 9) for index in range(32)]


async def read_body(receive: Receive) -> bytes:
    """The request body, which the ASGI server may hand over in several messages."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def respond(send: Send, status: int, body: bytes) -> None:
    # A Content-Length, as the server's responses carry: without one uvicorn would chunk.
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def make_app(tokenizer: Tokenizer) -> App:
    async def app(scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # uvicorn runs it with lifespan off: only HTTP comes
            return
        if scope["method"] == "POST" and scope["path"] == "/embed":
            payload = orjson.loads(await read_body(receive))
            tokenizer.encode(payload["inputs"])
            await respond(send, 200, orjson.dumps([VECTOR]))
        elif scope["path"] == "/health":
            await respond(send, 200, b"{}")
        else:
            await respond(send, 404, b'{"error": "not found"}')

    return app


def load_tokenizer(path: str) -> Tokenizer:
    tokenizer = Tokenizer.from_file(path)
    # The default model's tokenizer.json pads every text to 128 tokens; the server turns
    # padding off (model/tokenizer.py), and so must the floor, or it would do more work.
    tokenizer.no_padding()
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(
        make_app(load_tokenizer(args.tokenizer)),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()

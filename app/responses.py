"""JSON rendering straight from numpy arrays (no Python float per value), and base64 arrays.

Large bodies (per-token vectors, attention maps) are rendered in a worker thread, so that
the event loop keeps answering /live and small requests meanwhile.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import orjson
from starlette.responses import JSONResponse as StarletteJSONResponse
from starlette.responses import Response

from app.params import EncodeOptions
from app.schemas import VectorEncoding
from app.service import ChunkedResult, EmbeddingService, EncodeResult
from model import FloatArray
from model.quantization import CodeArray

Encoding = Literal["float", "base64"]
# Numbers past which a body is rendered off the event loop: rendering one that large would
# hold up every other request on the loop for longer than the thread hop costs.
OFF_LOOP_VALUES = 100_000


class JSONResponse(StarletteJSONResponse):
    """Starlette's JSONResponse rendered by orjson. A subclass of it, not of Response, so
    that FastAPI documents each route's response_model rather than a string."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


async def render(
    build: Callable[[], Any], *, values: int, headers: Mapping[str, str] | None = None
) -> Response:
    """A JSON response from `build()`; `values` (how many numbers the body holds) decides
    whether building and rendering run on the event loop or in a worker thread."""
    if values <= OFF_LOOP_VALUES:
        return JSONResponse(build(), headers=headers)

    def dumps() -> bytes:
        return orjson.dumps(build(), option=orjson.OPT_SERIALIZE_NUMPY)

    body = await asyncio.to_thread(dumps)
    return Response(body, media_type=JSONResponse.media_type, headers=headers)


def base64_floats(array: FloatArray) -> str:
    return base64.b64encode(array.astype("<f4", copy=False).tobytes()).decode("ascii")


def encoded_vectors(
    vectors: FloatArray,
    encoding: VectorEncoding,
    service: EmbeddingService,
    options: EncodeOptions,
) -> FloatArray | CodeArray | list[str]:
    """Finished vectors, one per row, as `encoding` asks: the floats; each vector's
    little-endian float32 bytes in base64, as OpenAI gives them; or compact codes on the
    model's calibration ranges for vectors finished as `options` finishes them."""
    if encoding == "float":
        return vectors
    if encoding == "base64":
        return [base64_floats(vector) for vector in vectors]
    return service.quantized(vectors, encoding, options)


def array_payload(array: FloatArray, encoding: Encoding) -> Any:
    """A C-contiguous float32 array for orjson, or {dtype, shape, data} in base64."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if encoding == "float":
        return array
    return {"dtype": "float32", "shape": list(array.shape), "data": base64_floats(array)}


def usage_payload(result: EncodeResult | ChunkedResult) -> dict[str, int]:
    """OpenAI's usage block; embeddings have no completion, so both counts are the input's."""
    return {"prompt_tokens": result.token_count, "total_tokens": result.token_count}


def timing_headers(result: EncodeResult | ChunkedResult) -> dict[str, str]:
    """Per-request figures in the headers text-embeddings-inference uses (milliseconds)."""
    timings = result.timings
    total = f"{(time.perf_counter() - timings.started) * 1000:.2f}"
    return {
        "x-compute-type": result.model.device.split(":")[0],
        "x-compute-characters": str(result.char_count),
        "x-compute-tokens": str(result.token_count),
        "x-compute-time": total,
        "x-total-time": total,
        "x-tokenization-time": f"{timings.tokenization * 1000:.2f}",
        "x-queue-time": f"{timings.queue * 1000:.2f}",
        "x-inference-time": f"{timings.inference * 1000:.2f}",
    }

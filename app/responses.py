"""JSON rendering straight from numpy arrays (no Python float per value) and base64 arrays."""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
import orjson
import torch
from starlette.responses import Response

from app.batcher import FloatArray
from app.service import EncodeResult
from model import finalize

Encoding = Literal["float", "base64"]


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def base64_floats(array: FloatArray) -> str:
    return base64.b64encode(array.astype("<f4", copy=False).tobytes()).decode("ascii")


def array_payload(array: FloatArray, encoding: Encoding) -> Any:
    """A C-contiguous float32 array for orjson, or {dtype, shape, data} in base64."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if encoding == "float":
        return array
    return {"dtype": "float32", "shape": list(array.shape), "data": base64_floats(array)}


def pooled_vectors(result: EncodeResult, normalize: bool, dimensions: int | None) -> FloatArray:
    """(N, D') float32: truncated to `dimensions`, then normalised if asked."""
    stacked = torch.from_numpy(np.stack([item.pooled for item in result.items]))
    # orjson serialises only C-contiguous arrays; a cut without normalising is a view.
    return np.ascontiguousarray(finalize(stacked, normalize, dimensions).numpy())


def usage_payload(result: EncodeResult) -> dict[str, int]:
    """OpenAI's usage block; embeddings have no completion, so both counts are the input's."""
    return {"prompt_tokens": result.token_count, "total_tokens": result.token_count}


def timing_headers(result: EncodeResult) -> dict[str, str]:
    """Per-request figures in the headers text-embeddings-inference uses (milliseconds)."""
    timings = result.timings
    return {
        "x-compute-tokens": str(result.token_count),
        "x-tokenization-time": f"{timings.tokenization * 1000:.2f}",
        "x-queue-time": f"{timings.queue * 1000:.2f}",
        "x-inference-time": f"{timings.inference * 1000:.2f}",
    }

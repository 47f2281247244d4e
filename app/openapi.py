"""The OpenAPI schema with what depends on the loaded model and the settings.

The request models mark such values with `x-bound` (app/schemas.py): token ids below the
vocabulary size, dimensions up to the model's, layer and head indices, prompt names, inputs
(texts, pairs, sentences) per request and characters per input. Once the model has loaded,
the schema states them, so that a request the schema allows is one the service accepts;
before that it carries the markers alone (the service answers nothing but 503 then). With an
API key set, the routes that need it declare HTTP bearer authentication.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from fastapi import FastAPI

from app.schemas import BOUND
from app.settings import Settings
from model import ModelInfo

OpenAPI = dict[str, Any]
SECURITY_SCHEME = "apiKey"


def bounds(info: ModelInfo, settings: Settings) -> dict[str, dict[str, Any]]:
    return {
        "token_id": {"maximum": info.vocab_size - 1},
        "dimensions": {"maximum": info.dimensions},
        "layer": {"minimum": -info.num_layers, "maximum": info.num_layers - 1},
        "head": {"minimum": -info.num_heads, "maximum": info.num_heads - 1},
        # "" asks for no prompt at all.
        "prompt_name": {"enum": [*info.prompts, ""]},
        "input_chars": {"maxLength": settings.max_input_chars},
        "inputs": {"maxItems": settings.max_inputs_per_request},
        "request_tokens": {"maxItems": settings.max_request_tokens},
        # /similarity's sentences, with the source sentence one input more.
        "sentences": {"maxItems": settings.max_inputs_per_request - 1},
    }


def fill_bounds(node: Any, values: Mapping[str, Mapping[str, Any]]) -> None:
    """Replace each marker in the schema, in place, with the bound it names."""
    if isinstance(node, dict):
        name = node.pop(BOUND, None)
        if name is not None:
            node.update(values[name])
        for child in node.values():
            fill_bounds(child, values)
    elif isinstance(node, list):
        for child in node:
            fill_bounds(child, values)


def declare_api_key(schema: OpenAPI, protected: Collection[tuple[str, str]]) -> None:
    schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes[SECURITY_SCHEME] = {
        "type": "http",
        "scheme": "bearer",
        "description": "The server's API key (--api-key), as 'Authorization: Bearer <key>'.",
    }
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if (method.upper(), path) in protected:
                operation["security"] = [{SECURITY_SCHEME: []}]


def bounded_openapi(
    app: FastAPI,
    model: Callable[[], ModelInfo | None],
    settings: Settings,
    protected: Collection[tuple[str, str]],
) -> Callable[[], OpenAPI]:
    """A replacement for `app.openapi`: FastAPI's schema (built once and cached), with the
    API key declared on the `protected` (method, path) pairs when one is set, and the bounds
    filled in the first time it is asked for after the model has loaded."""
    filled = False

    def openapi() -> OpenAPI:
        nonlocal filled
        built = app.openapi_schema is not None
        schema = FastAPI.openapi(app)
        if not built and settings.api_key is not None:
            declare_api_key(schema, protected)
        info = model()
        if not filled and info is not None:
            fill_bounds(schema, bounds(info, settings))
            filled = True
        return schema

    return openapi

"""Request and response bodies: TEI-compatible, OpenAI-compatible, and this project's /encode.

Each request turns itself into internal parameters with `inputs_list()` / `options()`.
Responses are documented here but rendered by orjson straight from numpy arrays.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from app.service import EncodeOptions, RawInput
from model import Direction

Inputs = StrictStr | list[StrictInt] | list[StrictStr | list[StrictInt]]
INPUTS_DESCRIPTION = (
    "A string, a list of token ids, or a list mixing strings and lists of token ids."
)


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


def as_list(inputs: Inputs) -> list[RawInput]:
    """One input (a string or one id list) or many, always as a list of inputs."""
    if isinstance(inputs, str):
        return [inputs]
    if inputs and all(isinstance(item, int) for item in inputs):
        return [[item for item in inputs if isinstance(item, int)]]
    return [item for item in inputs if not isinstance(item, int)]


class TruncatingRequest(Request):
    inputs: Inputs = Field(description=INPUTS_DESCRIPTION)
    truncate: StrictBool | None = Field(
        None, description="Cut inputs longer than the model's limit; null: the server default."
    )
    truncation_direction: Literal["right", "left", "Right", "Left"] = Field(
        "right", description="Which end of a long input is cut."
    )
    prompt_name: StrictStr | None = Field(
        None, description="A prompt from the model's sentence-transformers config, prepended."
    )

    def inputs_list(self) -> list[RawInput]:
        return as_list(self.inputs)

    @property
    def direction(self) -> Direction:
        return "left" if self.truncation_direction.lower() == "left" else "right"

    def options(self) -> EncodeOptions:
        return EncodeOptions(self.truncate, self.direction, self.prompt_name)


# TEI ------------------------------------------------------------------------------------
class EmbedRequest(TruncatingRequest):
    normalize: StrictBool = Field(True, description="L2-normalise each vector.")
    dimensions: StrictInt | None = Field(
        None, description="Keep the first N dimensions (Matryoshka), then normalise."
    )


class EmbedAllRequest(TruncatingRequest):
    def options(self) -> EncodeOptions:
        return EncodeOptions(self.truncate, self.direction, self.prompt_name, token_embeddings=True)


class TokenizeRequest(TruncatingRequest):
    add_special_tokens: StrictBool = Field(True, description="Add [CLS], [SEP] and the like.")


class SimpleToken(BaseModel):
    id: int
    text: str = Field(description="The input's characters for this token, or a special token.")
    special: bool
    start: int | None = Field(description="Start character offset; null for special tokens.")
    stop: int | None = Field(description="End character offset (exclusive).")


# OpenAI ---------------------------------------------------------------------------------
class OpenAIEmbeddingRequest(Request):
    input: Inputs = Field(description=INPUTS_DESCRIPTION)
    model: StrictStr | None = Field(
        None, description="Accepted for compatibility; the served model answers."
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: little-endian float32 bytes."
    )
    dimensions: StrictInt | None = Field(None, description="Keep the first N dimensions.")
    user: StrictStr | None = Field(None, description="Accepted and ignored.")

    def inputs_list(self) -> list[RawInput]:
        return as_list(self.input)


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: Usage


# /encode --------------------------------------------------------------------------------
class AttentionRequest(Request):
    layers: list[StrictInt] | None = Field(
        None, description="Layer indices (negative counts from the end); null: every layer."
    )
    heads: list[StrictInt] | None = Field(None, description="Head indices; null: every head.")
    reduce: Literal["none", "mean"] = Field("none", description="mean: average over the heads.")


class EncodeRequest(TruncatingRequest):
    pooled: StrictBool = Field(True, description="Return the pooled vector.")
    token_embeddings: StrictBool = Field(False, description="Return per-token vectors.")
    tokens: StrictBool = Field(True, description="Return the tokens with ids and offsets.")
    attention: AttentionRequest | None = Field(None, description="Return attention maps.")
    normalize: StrictBool = Field(True, description="L2-normalise the pooled vector.")
    dimensions: StrictInt | None = Field(None, description="Keep the first N pooled dimensions.")
    encoding: Literal["float", "base64"] = Field(
        "float", description="Arrays as JSON floats, or base64 little-endian float32 with a shape."
    )


class Base64Array(BaseModel):
    dtype: Literal["float32"] = "float32"
    shape: list[int]
    data: str = Field(description="base64 of the little-endian float32 bytes, row-major.")


Array = list[float] | list[list[float]] | list[list[list[float]]] | Base64Array


class TokenInfo(BaseModel):
    id: int
    text: str = Field(description="The token as the vocabulary spells it.")
    start: int | None = Field(description="Start character offset; null for token-id input.")
    end: int | None = Field(description="End character offset (exclusive).")
    special: bool


class AttentionMap(BaseModel):
    layer: int
    heads: list[int] | None = Field(description="Heads kept, in order; null when averaged.")
    values: Array = Field(description="(heads, T, T), or (T, T) for a mean over heads.")


class EncodedInput(BaseModel):
    index: int
    truncated: bool
    embedding: Array | None = None
    token_embeddings: Array | None = None
    tokens: list[TokenInfo] | None = None
    attention: list[AttentionMap] | None = None


class EncodeResponse(BaseModel):
    model: str
    data: list[EncodedInput]
    usage: Usage


# Operations -----------------------------------------------------------------------------
class Limits(BaseModel):
    max_batch_tokens: int
    max_batch_inputs: int
    max_inputs_per_request: int
    max_queued_inputs: int
    max_attention_values: int
    payload_limit: int
    request_timeout: float


class InfoResponse(BaseModel):
    model_id: str
    model_type: str
    dimensions: int
    max_input_tokens: int
    pooling: str
    normalize: bool = Field(description="Whether the model's own modules normalise.")
    dtype: str
    device: str
    num_layers: int
    num_heads: int
    prompts: dict[str, str]
    auto_truncate: bool
    limits: Limits
    version: str


class StatusResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ErrorResponse(BaseModel):
    error: str
    error_type: str


class OpenAIErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorResponse(BaseModel):
    error: OpenAIErrorBody

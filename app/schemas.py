"""Request and response bodies: TEI-compatible, OpenAI-compatible, and this project's /encode.

Each request turns itself into internal parameters with `inputs_list()` / `options()`.
Responses are documented here but rendered by orjson straight from numpy arrays.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app.params import (
    AttentionQuery,
    ChunkMode,
    ChunkOptions,
    EncodeOptions,
    RawInput,
    TextPair,
)
from app.parsing import EMPTY_INPUT, NOT_UNICODE
from model.info import Task
from model.quantization import Precision
from model.tokenizer import Direction


def _integral(value: object) -> object:
    """JSON Schema counts 2.0 as an integer, so clients may send it; 2.5 stays an error."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Where a bound depends on the loaded model or on the settings, the schema carries this key
# naming it; app/openapi.py puts the value in once the model has loaded.
BOUND = "x-bound"


def bound(name: str) -> dict[str, str]:
    return {BOUND: name}


Value = TypeVar("Value", bound=Sized)


def _not_empty(value: Value) -> Value:
    """An empty string or list where inputs go: a 400, as OpenAI and text-embeddings-inference
    answer it, rather than a 422 (app/parsing.py). The schema says minLength/minItems 1."""
    if len(value) == 0:
        raise PydanticCustomError(EMPTY_INPUT, "an input is empty")
    return value


def expecting(what: str) -> WrapValidator:
    """For a union field: pydantic reports one error per branch, none of which says what
    would fit; this says it, unless an input is empty or not Unicode, which is said as such."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            errors = exc.errors()
        if any(e["type"] == EMPTY_INPUT for e in errors):
            raise PydanticCustomError(EMPTY_INPUT, "an input is empty")
        for e in errors:
            if e["type"] == NOT_UNICODE:
                where = "".join(f"[{part}]" for part in e["loc"] if isinstance(part, int))
                raise PydanticCustomError(NOT_UNICODE, "not valid Unicode", {"where": where})
        raise PydanticCustomError("expected", "expected {what}", {"what": what})

    return WrapValidator(validate)


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


# Integers are strict (no "3" for 3, no true for 1) but take integral floats, as the schema
# says. The bound comes before the validator: after it, pydantic writes "ge", not "minimum".
LayerIndex = Annotated[
    StrictInt, Field(json_schema_extra=bound("layer")), BeforeValidator(_integral)
]
HeadIndex = Annotated[StrictInt, Field(json_schema_extra=bound("head")), BeforeValidator(_integral)]


def _unicode(text: str) -> str:
    """A lone surrogate ("\\ud800" is valid JSON) is not text: pydantic's JSON parser refuses
    it, but `json.loads`, which app/parsing.py falls back on to say so, takes it."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise PydanticCustomError(NOT_UNICODE, "not valid Unicode") from None
    return text


# Empty strings and id lists are answered with 400 (Empty), as OpenAI does.
Text = Annotated[
    StrictStr,
    AfterValidator(_not_empty),
    AfterValidator(_unicode),
    Field(json_schema_extra={"minLength": 1, **bound("input_chars")}),
]
TokenId = Annotated[
    StrictInt, Field(ge=0, json_schema_extra=bound("token_id")), BeforeValidator(_integral)
]
TokenIds = Annotated[
    list[TokenId], AfterValidator(_not_empty), Field(json_schema_extra={"minItems": 1})
]
INPUTS_DESCRIPTION = (
    "A string, a list of token ids, or a list mixing strings and lists of token ids."
)
IDS_DESCRIPTION = (
    "One list of token ids (integers from 0), or a list of such lists; none of them empty."
)
Inputs = Annotated[
    Text
    | TokenIds
    | Annotated[
        list[Text | TokenIds],
        AfterValidator(_not_empty),
        Field(json_schema_extra={"minItems": 1, **bound("inputs")}),
    ],
    expecting(_lower_first(INPUTS_DESCRIPTION)),
]
Dimensions = Annotated[
    StrictInt, Field(ge=1, json_schema_extra=bound("dimensions")), BeforeValidator(_integral)
]
PromptName = Annotated[StrictStr, Field(json_schema_extra=bound("prompt_name"))]
# Vectors as floats, base64 float32, or compact codes (model/quantization.py).
# One Literal (nested ones flatten), so that a wrong value's error names every choice.
VectorEncoding = Literal["float", "base64", Precision]
ENCODING_DESCRIPTION = (
    "float; base64 (each vector's little-endian float32 bytes, as OpenAI's encoding_format "
    "gives them); or compact codes, after normalisation and dimensions: int8 or uint8 (each "
    "dimension's range, in /info's quantization, mapped onto 256 steps), binary (sign bits "
    "packed 8 to a byte, shifted by -128 into int8) or ubinary (the same bytes unshifted), as "
    "sentence-transformers' quantize_embeddings gives them."
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


TruncationDirection = Literal["right", "left", "Right", "Left"]
TRUNCATE_DESCRIPTION = "Cut inputs longer than the model's limit; null: the server default."
DIRECTION_DESCRIPTION = (
    "Which end of a long input is cut; null: the model's own side (its tokenizer config's "
    "truncation_side, right unless the folder says otherwise)."
)
PROMPT_DESCRIPTION = (
    "A prompt from the model's sentence-transformers config, prepended; null: the model's "
    "default prompt, if it has one; an empty string: no prompt."
)


def direction_of(value: TruncationDirection | None) -> Direction | None:
    if value is None:
        return None  # the model's own side
    return "left" if value.lower() == "left" else "right"


class Truncation(Request):
    """The options of every request whose texts are tokenized, declared once."""

    truncate: StrictBool | None = Field(None, description=TRUNCATE_DESCRIPTION)
    truncation_direction: TruncationDirection | None = Field(
        None, description=DIRECTION_DESCRIPTION
    )

    @property
    def direction(self) -> Direction | None:
        return direction_of(self.truncation_direction)

    def options(self) -> EncodeOptions:
        """No prompt: a cross-encoder's texts are scored as they are."""
        return EncodeOptions(self.truncate, self.direction, prompt_name="")


class Prompted(Truncation):
    prompt_name: PromptName | None = Field(None, description=PROMPT_DESCRIPTION)

    def options(self) -> EncodeOptions:
        return EncodeOptions(self.truncate, self.direction, self.prompt_name)


class TruncatingRequest(Prompted):
    inputs: Inputs = Field(description=INPUTS_DESCRIPTION)

    def inputs_list(self) -> list[RawInput]:
        return as_list(self.inputs)


# TEI ------------------------------------------------------------------------------------
class EmbedRequest(TruncatingRequest):
    normalize: StrictBool = Field(True, description="L2-normalise each vector.")
    dimensions: Dimensions | None = Field(
        None, description="Keep the first N dimensions (Matryoshka), then normalise."
    )
    encoding: VectorEncoding = Field("float", description=ENCODING_DESCRIPTION)

    def options(self) -> EncodeOptions:
        # Built whole: dataclasses.replace costs as much as the rest of a request's parsing.
        return EncodeOptions(
            self.truncate,
            self.direction,
            self.prompt_name,
            normalize=self.normalize,
            dimensions=self.dimensions,
        )


class EmbedAllRequest(TruncatingRequest):
    def options(self) -> EncodeOptions:
        return EncodeOptions(
            self.truncate, self.direction, self.prompt_name, pooled=False, token_embeddings=True
        )


class TokenizeRequest(TruncatingRequest):
    add_special_tokens: StrictBool = Field(True, description="Add [CLS], [SEP] and the like.")


class SimilarityInput(Request):
    source_sentence: Text = Field(description="The sentence the others are compared with.")
    sentences: Annotated[
        list[Text],
        AfterValidator(_not_empty),
        Field(json_schema_extra={"minItems": 1, **bound("sentences")}),
    ] = Field(description="Sentences to compare with the source sentence.")


class SimilarityParameters(Prompted):
    pass


class SimilarityRequest(Request):
    """What huggingface_hub's `InferenceClient.sentence_similarity` sends."""

    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None

    def options(self) -> EncodeOptions:
        return (self.parameters or SimilarityParameters()).options()


# One list of token ids to decode: at most the tokens one request may hold (their sum over a
# request's lists is checked too: app/limits.py).
IdList = Annotated[list[TokenId], Field(min_length=1, json_schema_extra=bound("request_tokens"))]


class DecodeRequest(Request):
    ids: Annotated[
        IdList | Annotated[list[IdList], Field(min_length=1, json_schema_extra=bound("inputs"))],
        expecting(_lower_first(IDS_DESCRIPTION)),
    ] = Field(description=IDS_DESCRIPTION)
    skip_special_tokens: StrictBool = Field(
        True, description="Leave [CLS], [SEP] and the like out."
    )

    def ids_list(self) -> list[list[int]]:
        if self.ids and all(isinstance(item, int) for item in self.ids):
            return [[item for item in self.ids if isinstance(item, int)]]
        return [item for item in self.ids if isinstance(item, list)]


class EmbedSparseRequest(TruncatingRequest):
    pass


class SparseValue(BaseModel):
    index: int = Field(description="A vocabulary id.")
    value: float = Field(description="Its weight (only ids with a weight are listed).")


# Cross-encoders ---------------------------------------------------------------------------
SingleOrPair = Annotated[
    list[Text], AfterValidator(_not_empty), Field(max_length=2, json_schema_extra={"minItems": 1})
]


# A batch holds at least one list ([text] or [text, text]); a flat list is one input.
Batch = Annotated[
    list[Text | SingleOrPair],
    AfterValidator(_not_empty),
    Field(json_schema_extra={"minItems": 1, **bound("inputs"), "contains": {"type": "array"}}),
]
PREDICT_INPUTS_DESCRIPTION = (
    "A text, a pair of texts [text, text], or a batch of texts and pairs: "
    "[[text], [text, text], ...]."
)


class PredictRequest(Truncation):
    inputs: Annotated[
        Text | SingleOrPair | Batch, expecting(_lower_first(PREDICT_INPUTS_DESCRIPTION))
    ] = Field(description=PREDICT_INPUTS_DESCRIPTION)
    raw_scores: StrictBool = Field(
        False, description="Logits as they are; else a softmax over the labels (a sigmoid for one)."
    )

    @model_validator(mode="after")
    def _flat_list_is_one_input(self) -> PredictRequest:
        if isinstance(self.inputs, list) and not self.is_batch() and len(self.inputs) > 2:
            raise ValueError(
                "inputs: a flat list is one text or one pair; send a batch as a list of lists"
            )
        return self

    def is_batch(self) -> bool:
        return isinstance(self.inputs, list) and any(isinstance(i, list) for i in self.inputs)

    def inputs_list(self) -> list[RawInput | TextPair]:
        """One input per text or pair; a flat list of two texts is one pair."""
        if isinstance(self.inputs, str):
            return [self.inputs]
        if not self.is_batch():
            return [as_input([item for item in self.inputs if isinstance(item, str)])]
        return [as_input(item if isinstance(item, list) else [item]) for item in self.inputs]


def as_input(texts: list[str]) -> RawInput | TextPair:
    """[text] is a text, [first, second] a pair (the validator allows no longer list)."""
    return texts[0] if len(texts) == 1 else (texts[0], texts[1])


class Prediction(BaseModel):
    score: float
    label: str


class RerankRequest(Truncation):
    query: Text = Field(description="What the texts are ranked against.")
    texts: Annotated[
        list[Text],
        AfterValidator(_not_empty),
        Field(json_schema_extra={"minItems": 1, **bound("inputs")}),
    ] = Field(description="Texts to rank.")
    raw_scores: StrictBool = Field(False, description="The logit as it is; else its sigmoid.")
    return_text: StrictBool = Field(False, description="Return each text with its score.")

    def pairs(self) -> list[RawInput | TextPair]:
        return [(self.query, text) for text in self.texts]


class Rank(BaseModel):
    index: int = Field(description="The text's position in the request.")
    score: float
    text: str | None = Field(None, description="The text, when return_text is true.")


class SimpleToken(BaseModel):
    id: int
    text: str = Field(description="The input's characters for this token, or a special token.")
    special: bool
    start: int | None = Field(description="Start character offset; null for special tokens.")
    stop: int | None = Field(description="End character offset (exclusive).")


# OpenAI ---------------------------------------------------------------------------------
MODEL_DESCRIPTION = (
    "Which served model answers, where the server serves several (GET /v1/models lists "
    "them; an unknown name is a 404); with one, any name is accepted and that model answers."
)


class OpenAIEmbeddingRequest(Request):
    input: Inputs = Field(description=INPUTS_DESCRIPTION)
    model: StrictStr | None = Field(None, description=MODEL_DESCRIPTION)
    encoding_format: VectorEncoding = Field("float", description=ENCODING_DESCRIPTION)
    dimensions: Dimensions | None = Field(None, description="Keep the first N dimensions.")
    user: StrictStr | None = Field(None, description="Accepted and ignored.")

    def inputs_list(self) -> list[RawInput]:
        return as_list(self.input)

    def options(self) -> EncodeOptions:
        """OpenAI's vectors are always normalised; the model's default prompt applies."""
        return EncodeOptions(dimensions=self.dimensions)


# Cohere ---------------------------------------------------------------------------------
CohereInputType = Literal["search_document", "search_query", "classification", "clustering"]


class CohereEmbedRequest(Request):
    """Cohere's v2 embed request, for texts; `images`, `inputs` and `max_tokens` are refused."""

    texts: Annotated[
        list[Text],
        AfterValidator(_not_empty),
        Field(json_schema_extra={"minItems": 1, **bound("inputs")}),
    ] = Field(description="The texts to embed.")
    model: StrictStr | None = Field(None, description=MODEL_DESCRIPTION)
    input_type: CohereInputType | None = Field(
        None,
        description=(
            "The folder's prompt of that name (search_query: `search_query` or `query`; "
            "search_document: `search_document`, `document` or `passage`; or `classification`, "
            "`clustering`), else the model's default prompt."
        ),
    )
    embedding_types: Annotated[list[VectorEncoding], Field(min_length=1)] = Field(
        ["float"], description="Each type asked for is returned under its name."
    )
    output_dimension: Dimensions | None = Field(None, description="Keep the first N dimensions.")
    truncate: Literal["NONE", "START", "END"] = Field(
        "END", description="END cuts the end of a long input, START its start, NONE refuses it."
    )
    priority: StrictInt | None = Field(None, description="Accepted and ignored.")

    def options(self, prompt_name: str | None) -> EncodeOptions:
        """Cohere's vectors are normalised, as its models give them."""
        return EncodeOptions(
            self.truncate != "NONE",
            "left" if self.truncate == "START" else "right",
            prompt_name,
            dimensions=self.output_dimension,
        )


class CohereEmbeddings(BaseModel):
    float_: list[list[float]] | None = Field(None, alias="float")
    base64: list[str] | None = None
    int8: list[list[int]] | None = None
    uint8: list[list[int]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None


class CohereBilledUnits(BaseModel):
    input_tokens: int


class CohereMeta(BaseModel):
    api_version: dict[str, str]
    billed_units: CohereBilledUnits


class CohereEmbedResponse(BaseModel):
    id: str = Field(description="A UUID for the response, as Cohere gives one.")
    response_type: Literal["embeddings_by_type"]
    embeddings: CohereEmbeddings
    texts: list[str]
    meta: CohereMeta


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="When this server loaded the model (Unix seconds).")
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | list[int] | str


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
    # At least one index when given: no heads would average zero maps into NaN.
    layers: Annotated[list[LayerIndex], Field(min_length=1)] | None = Field(
        None, description="Layer indices (negative counts from the end); null: every layer."
    )
    heads: Annotated[list[HeadIndex], Field(min_length=1)] | None = Field(
        None, description="Head indices; null: every head."
    )
    reduce: Literal["none", "mean"] = Field("none", description="mean: average over the heads.")

    def query(self) -> AttentionQuery:
        return AttentionQuery(
            tuple(self.layers) if self.layers is not None else None,
            tuple(self.heads) if self.heads is not None else None,
            self.reduce == "mean",
        )


CHUNKING_DESCRIPTION = (
    "Cut each text into chunks of `size` tokens (ending at a sentence's end where one falls "
    "in a chunk's second half), overlapping by `overlap` tokens, and return one vector per "
    "chunk with its character offsets. `late`: the whole text runs through the encoder once "
    "(in overlapping windows past the model's limit) and each chunk's token vectors are "
    "pooled, so each chunk's vector has seen its context; `independent`: each chunk's text "
    "is embedded alone, as /embed would."
)


class Chunking(Request):
    mode: ChunkMode = Field("late", description="`late` or `independent`.")
    size: Annotated[StrictInt, Field(ge=1), BeforeValidator(_integral)] | None = Field(
        None,
        description=(
            "Most tokens per chunk, and never more than the model takes beside its special "
            "tokens and the prompt (so that a chunk can be embedded alone); null: 256."
        ),
    )
    overlap: Annotated[StrictInt, Field(ge=0), BeforeValidator(_integral)] = Field(
        0,
        description=(
            "Tokens each chunk repeats from the end of the one before; below `size` (and "
            "below the chunk size the model allows)."
        ),
    )

    def options(self) -> ChunkOptions:
        return ChunkOptions(self.mode, self.size, self.overlap)


class ChunkRequest(Request):
    """POST /embed_chunks: texts in, vectors with offsets out."""

    inputs: Annotated[
        Text
        | Annotated[
            list[Text],
            AfterValidator(_not_empty),
            Field(json_schema_extra={"minItems": 1, **bound("inputs")}),
        ],
        expecting("a text or a list of texts"),
    ] = Field(description="A text or a list of texts.")
    chunking: Chunking = Field(default_factory=Chunking, description=CHUNKING_DESCRIPTION)
    prompt_name: PromptName | None = Field(None, description=PROMPT_DESCRIPTION)
    normalize: StrictBool = Field(True, description="L2-normalise each vector.")
    dimensions: Dimensions | None = Field(
        None, description="Keep the first N dimensions (Matryoshka), then normalise."
    )
    encoding: VectorEncoding = Field("float", description=ENCODING_DESCRIPTION)

    def inputs_list(self) -> list[RawInput]:
        return [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)

    def options(self) -> EncodeOptions:
        return EncodeOptions(
            prompt_name=self.prompt_name, normalize=self.normalize, dimensions=self.dimensions
        )


class ChunkVector(BaseModel):
    start: int = Field(description="The chunk's first character in the text as sent.")
    end: int = Field(description="One past its last character.")
    tokens: int = Field(description="The text's tokens in the chunk.")
    embedding: list[float] | list[int] | str


class EncodeRequest(TruncatingRequest):
    pooled: StrictBool = Field(True, description="Return the pooled vector.")
    token_embeddings: StrictBool = Field(False, description="Return per-token vectors.")
    tokens: StrictBool = Field(True, description="Return the tokens with ids and offsets.")
    attention: AttentionRequest | None = Field(None, description="Return attention maps.")
    normalize: StrictBool = Field(True, description="L2-normalise the pooled vector.")
    dimensions: Dimensions | None = Field(None, description="Keep the first N pooled dimensions.")
    encoding: Literal["float", "base64"] = Field(
        "float", description="Arrays as JSON floats, or base64 little-endian float32 with a shape."
    )
    chunking: Chunking | None = Field(
        None,
        description=(
            f"{CHUNKING_DESCRIPTION} Each input's `chunks` then replace its `embedding`; "
            "texts only, and neither per-token vectors nor attention maps."
        ),
    )
    quantize: Precision | None = Field(
        None,
        description=(
            "The pooled vector as compact codes, a JSON list of integers (null: floats, as "
            "`encoding` says), as /embed's `encoding` gives them: int8 or uint8 on /info's "
            "ranges, binary or ubinary sign bits. Without a pooled vector there is nothing to "
            "code, and it is ignored."
        ),
    )

    def options(self) -> EncodeOptions:
        return EncodeOptions(
            self.truncate,
            self.direction,
            self.prompt_name,
            normalize=self.normalize,
            dimensions=self.dimensions,
            pooled=self.pooled,
            token_embeddings=self.token_embeddings,
            attention=self.attention.query() if self.attention else None,
            token_details=self.tokens,
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


class EncodedChunk(BaseModel):
    start: int
    end: int
    tokens: int
    embedding: Array | list[int]


class EncodedInput(BaseModel):
    index: int
    truncated: bool
    embedding: Array | None = None
    chunks: list[EncodedChunk] | None = None
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
    max_input_chars: int
    max_request_tokens: int
    max_token_values: int
    max_attention_values: int
    max_chunks_per_input: int
    max_chunks_per_request: int
    payload_limit: int
    request_timeout: float
    max_queue_wait: float
    body_timeout: float


class QuantizationRanges(BaseModel):
    calibration_texts: int = Field(description="How many texts the ranges come from.")
    min: list[float]
    max: list[float]


class InfoResponse(BaseModel):
    model_id: str
    task: Task = Field(
        description="What the model serves: /embed, /predict and /rerank, or /embed_sparse."
    )
    labels: list[str] = Field(description="A classifier's labels, in the order of its logits.")
    architecture: str = Field(
        description="config.json's model_type (bert, roberta, ...); jina_bert for a bert "
        "config with ALiBi positions."
    )
    positions: str = Field(description="The position scheme: learned, rotary, alibi, ...")
    dimensions: int = Field(description="Size of the pooled vectors (after any Dense layer).")
    hidden_size: int = Field(description="Size of the per-token vectors.")
    max_input_tokens: int
    pooling: list[str] = Field(description="Pooling modes, concatenated in this order.")
    include_prompt: bool = Field(description="Whether prompt tokens are pooled.")
    dense: list[str] = Field(description="Dense layers after the pooling: 'in -> out, act'.")
    normalize: bool = Field(description="Whether the model's own modules normalise.")
    dtype: str
    dtype_reason: str = Field(description="Why this dtype: asked for, or what auto found.")
    device: str
    num_layers: int
    num_heads: int
    prompts: dict[str, str]
    default_prompt_name: str | None
    do_lower_case: bool
    similarity_fn_name: str
    quantization: QuantizationRanges | None = Field(
        description=(
            "An embedding model's ranges for int8 and uint8 codes, per dimension, of "
            "normalised vectors at full size, from its calibration texts: code = "
            "floor((value - min) / ((max - min) / 255)), clipped to 0..255, less 128 for int8."
        )
    )
    auto_truncate: bool
    limits: Limits
    version: str
    # text-embeddings-inference's names for the same facts, for clients that read them.
    model_sha: str | None = None
    model_dtype: str
    model_type: dict[str, dict[str, object]] = Field(
        description='text-embeddings-inference\'s: {"embedding": {"pooling": "mean"}} and the like.'
    )
    max_concurrent_requests: int
    max_input_length: int
    max_client_batch_size: int
    max_batch_requests: int | None
    tokenization_workers: int
    sha: str | None = None
    docker_label: str | None = None


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

"""The per-request limits, checked before any work is queued; each error states its limit.

Cheap checks come first (input count and characters, before tokenizing), then those that need
the tokens (tokens per request, per-token and attention values).
"""

from __future__ import annotations

from collections.abc import Sequence

from app.errors import EmptyInputError, PayloadTooLargeError, ValidationFailedError
from app.params import AttentionQuery, EncodeOptions, RawInput, TextPair
from app.settings import Settings
from model import AttentionSpec, Encoded, ModelInfo

# The chunk size a request that names none gets, where the model takes that many tokens.
DEFAULT_CHUNK_TOKENS = 256


class Limits:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def check_inputs(self, inputs: Sequence[RawInput | TextPair]) -> None:
        """400 for no input or an empty one; 413 for too many inputs or characters."""
        if not inputs:
            raise EmptyInputError("the request holds no input")
        limit = self.settings.max_inputs_per_request
        if len(inputs) > limit:
            raise PayloadTooLargeError(
                f"the request holds {len(inputs)} inputs, more than the limit of {limit}"
            )
        chars = self.settings.max_input_chars
        for index, item in enumerate(inputs):
            texts = item if isinstance(item, tuple) else [item]
            if any(len(text) == 0 for text in texts):
                raise EmptyInputError(f"input {index} is empty")
            for text in texts:
                if isinstance(text, str) and len(text) > chars:
                    raise PayloadTooLargeError(
                        f"input {index} has {len(text)} characters, more than the limit of {chars}"
                    )

    def check_dimensions(self, dimensions: int | None, info: ModelInfo) -> None:
        if dimensions is not None and not 1 <= dimensions <= info.dimensions:
            raise ValidationFailedError(
                f"dimensions must be between 1 and {info.dimensions}, got {dimensions}",
                param="dimensions",
            )

    def resolve_attention(
        self, query: AttentionQuery | None, info: ModelInfo
    ) -> AttentionSpec | None:
        if query is None:
            return None
        return AttentionSpec(
            tuple(sorted(resolve_indices(query.layers, info.num_layers, "layer"))),
            tuple(resolve_indices(query.heads, info.num_heads, "head")),
            query.mean,
        )

    def check_token_count(self, tokens: int) -> None:
        """413 for more tokens than a request may hold."""
        limit = self.settings.max_request_tokens
        if tokens > limit:
            raise PayloadTooLargeError(
                f"the request holds {tokens} tokens, more than the limit of {limit}; "
                "send fewer or shorter inputs"
            )

    def check_tokens(
        self,
        encoded: Sequence[Encoded],
        options: EncodeOptions,
        attention: AttentionSpec | None,
        info: ModelInfo,
    ) -> int:
        """413 for too many tokens in the request; 422 for too many per-token or attention
        values in the response. Returns the request's token count."""
        tokens = sum(len(e.ids) for e in encoded)
        self.check_token_count(tokens)
        if options.token_embeddings:
            values = tokens * info.hidden_size
            limit = self.settings.max_token_values
            if values > limit:
                raise ValidationFailedError(
                    f"the per-token embeddings asked for hold {values} values (tokens x "
                    f"{info.hidden_size}), over the limit of {limit}; send fewer or shorter "
                    "inputs",
                    param="input",
                )
        if attention is not None:
            # Every head asked for is computed, also for a mean over them.
            per_pair = len(attention.layers) * len(attention.heads)
            values = sum(per_pair * len(e.ids) ** 2 for e in encoded)
            limit = self.settings.max_attention_values
            if values > limit:
                raise ValidationFailedError(
                    f"the attention maps asked for take {values} values to compute (layers x "
                    f"heads x tokens^2), over the limit of {limit}; ask for fewer layers or "
                    "heads, or shorter inputs",
                    param="attention",
                )
        return tokens


def chunk_size(asked: int | None, overlap: int, room: int) -> tuple[int, int]:
    """Tokens per chunk and of overlap. A chunk holds at most what the model takes beside
    its special tokens and the prompt (`room`), so that each chunk can be embedded alone, and
    by default DEFAULT_CHUNK_TOKENS; where the size asked is cut to that, the overlap keeps
    its share of the chunk. 422 for an overlap not below the size asked."""
    wanted = asked or DEFAULT_CHUNK_TOKENS
    if overlap >= wanted:
        raise ValidationFailedError(
            f"chunking.overlap {overlap} must be below the chunk size {wanted}",
            param="chunking.overlap",
        )
    size = min(wanted, room)
    return size, overlap * size // wanted


def resolve_indices(asked: Sequence[int] | None, count: int, what: str) -> list[int]:
    """None means all; negative indices count from the end, as in Python."""
    if asked is None:
        return list(range(count))
    resolved = []
    for index in asked:
        if not -count <= index < count:
            raise ValidationFailedError(
                f"{what} {index} is outside [-{count}, {count})", param=f"attention.{what}s"
            )
        resolved.append(index % count)
    return list(dict.fromkeys(resolved))

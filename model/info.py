"""What the service knows of a loaded model, without torch: the front end imports it too."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class Task(enum.StrEnum):
    """What the loaded model computes: vectors, label logits, or sparse vocabulary weights."""

    EMBED = "embed"
    CLASSIFY = "classify"
    SPARSE = "sparse"


@dataclass(frozen=True)
class ModelInfo:
    """What the service reports about the loaded model."""

    model_id: str
    model_type: str
    positions: str  # the position scheme (model/architectures/)
    # Of the outputs: the pipeline's vectors (after any Dense layer, cut to the folder's
    # truncate_dim; a request may ask for fewer); for classify the labels; for sparse the
    # vocabulary.
    dimensions: int
    hidden_size: int  # of the per-token vectors
    max_input_tokens: int
    pooling: tuple[str, ...]
    include_prompt: bool
    dense: tuple[str, ...]  # "in -> out, Activation" per Dense layer
    normalize: bool
    dtype: str
    dtype_reason: str
    device: str
    num_layers: int
    num_heads: int
    vocab_size: int
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    do_lower_case: bool = False
    similarity_fn_name: str = "cosine"
    task: Task = Task.EMBED
    # Classify: the label of each logit, in index order.
    labels: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """The attention maps an input asks for, resolved against the model (0-based indices)."""

    layers: tuple[int, ...]
    heads: tuple[int, ...]
    mean: bool = False

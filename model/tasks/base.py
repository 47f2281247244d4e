"""What a model task is on the model's side: how a folder declares it, what its modules and
files say, what runs after the encoder, and how /info names its pooling.

The serving side of the same tasks (routes, finishing outputs) is app/tasks/.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from model.architectures import Encoder, EncoderConfig
from model.architectures.base import ConfigReader
from model.folder import FolderSpec, Metadata, TransformerOutputs
from model.heads import Head
from model.info import Task
from model.pipeline import EmbeddingPipeline


@dataclass(frozen=True)
class Modules:
    """A sentence-transformers folder's modules.json: each module's class name and folder."""

    source: Path
    kinds: list[str]
    paths: list[Path]

    def describe(self) -> str:
        return " + ".join(self.kinds)


class Loaded(NamedTuple):
    network: Encoder
    head: EmbeddingPipeline | Head
    dimensions: int  # of the outputs
    labels: tuple[str, ...]  # a classifier's, in the order of its logits


# The FolderSpec fields a task reads from its folder.
Fields = dict[str, Any]


@dataclass(frozen=True)
class ModelTask:
    task: Task
    # config_sentence_transformers.json's `model_type` for it.
    folder_type: str
    # What its Transformer module computes.
    outputs: TransformerOutputs
    # sentence-transformers' default similarity function for its outputs.
    default_similarity: str
    # Whether its sentence-transformers class reads `truncate_dim` and a default prompt.
    reads_truncate_dim: bool
    takes_default_prompt: bool
    # Whether its inputs may be pairs of texts, whose passes take segment ids.
    reads_pairs: bool
    # Whether a folder saved before `model_type` was written is this task's, by its modules.
    declared_by_modules: Callable[[Modules, Mapping[str, Any]], bool]
    # The fields its modules give (beside the Transformer's), refusing what it cannot run.
    read_modules: Callable[[Modules, Metadata], Fields]
    # The fields a plain Hugging Face folder gives: its config.json's path and keys.
    read_plain: Callable[[Path, Mapping[str, Any], Metadata], Fields]
    # The encoder and what runs after it, from the folder.
    load: Callable[[EncoderConfig, ConfigReader, FolderSpec, torch.device, torch.dtype], Loaded]
    # /info's `pooling`.
    pooling_names: Callable[[FolderSpec], tuple[str, ...]]

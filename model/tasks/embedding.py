"""Embedding: a SentenceTransformer folder (Transformer, Pooling, then Dense and Normalize
modules), or a plain encoder embedded by mean pooling; the sentence-transformers pipeline runs
after the encoder."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model.architectures import EncoderConfig
from model.architectures.base import ConfigReader
from model.checkpoint import load_weights
from model.errors import ConfigError
from model.folder import (
    DenseModule,
    FolderSpec,
    Metadata,
    NormalizeModule,
    TransformerOutputs,
    read_dense,
    read_normalize,
    read_pooling,
)
from model.info import Task
from model.networks import load_network, on_meta, shapes
from model.pipeline import Dense, EmbeddingPipeline, Normalize
from model.tasks.base import Fields, Loaded, ModelTask, Modules


def read_modules(modules: Modules, metadata: Metadata) -> Fields:
    """Transformer, Pooling, then Dense and Normalize modules."""
    kinds, paths = modules.kinds, modules.paths
    if kinds[0] != "Transformer":
        raise ConfigError(
            f"{modules.source}: the first module must be a Transformer, not {kinds[0]}"
        )
    if kinds[1:2] != ["Pooling"]:
        raise ConfigError(f"{modules.source}: the Transformer must be followed by a Pooling module")
    pooling_file = paths[1] / "config.json"
    pooling, pooling_dimension = read_pooling(pooling_file)
    steps: list[DenseModule | NormalizeModule] = []
    for kind, path in zip(kinds[2:], paths[2:], strict=True):
        if kind == "Dense":
            steps.append(DenseModule(read_dense(path / "config.json"), path))
        elif kind == "Normalize":
            read_normalize(path / "config.json")
            steps.append(NormalizeModule())
        else:
            raise ConfigError(
                f"{modules.source}: a {kind} module after the Pooling is not supported"
            )
    return {
        "pooling": pooling,
        "pooling_dimension": pooling_dimension,
        "pooling_file": pooling_file,
        "steps": tuple(steps),
    }


def read_plain(config_file: Path, config: Mapping[str, Any], metadata: Metadata) -> Fields:
    return {}  # mean pooling, no norm: FolderSpec's defaults


def load(
    config: EncoderConfig,
    raw: ConfigReader,
    spec: FolderSpec,
    device: torch.device,
    dtype: torch.dtype,
) -> Loaded:
    network = load_network(config, spec.transformer_dir, device, dtype)
    pipeline = load_pipeline(spec, config.hidden_size).to(device)
    return Loaded(network, pipeline, pipeline.dimensions(config.hidden_size), ())


def load_pipeline(spec: FolderSpec, hidden_size: int) -> EmbeddingPipeline:
    """Pooling, then each Dense (its weights checked against the size it receives) or
    Normalize; Dense layers stay in float32 whatever the encoder's dtype."""
    if spec.pooling_dimension not in (None, hidden_size):
        raise ConfigError(
            f"{spec.pooling_file}: embedding dimension {spec.pooling_dimension} does not match the "
            f"encoder's hidden_size {hidden_size}"
        )
    size = hidden_size * len(spec.pooling.modes)
    steps: list[nn.Module] = []
    for index, step in enumerate(spec.steps):
        if isinstance(step, DenseModule):
            if step.spec.in_features != size:
                raise ConfigError(
                    f"{step.folder / 'config.json'}: in_features {step.spec.in_features} does "
                    f"not match the {size} features it receives"
                )
            with on_meta():
                dense = Dense(step.spec)
            weights = load_weights(step.folder, shapes(dense))
            dense.load_state_dict(weights, strict=True, assign=True)
            steps.append(dense.float().eval().requires_grad_(False))
            size = step.spec.out_features
        elif index < len(spec.steps) - 1:
            steps.append(Normalize())
    trailing_norm = bool(spec.steps) and not isinstance(spec.steps[-1], DenseModule)
    return EmbeddingPipeline(
        spec.pooling, steps, normalize=trailing_norm, truncate_dim=spec.truncate_dim
    )


EMBEDDING = ModelTask(
    task=Task.EMBED,
    folder_type="SentenceTransformer",
    outputs=TransformerOutputs("feature-extraction", "token_embeddings", "last_hidden_state"),
    default_similarity="cosine",
    reads_truncate_dim=True,
    takes_default_prompt=True,
    reads_pairs=False,
    declared_by_modules=lambda modules, settings: True,  # what no other task claims
    read_modules=read_modules,
    read_plain=read_plain,
    load=load,
    pooling_names=lambda spec: tuple(str(mode) for mode in spec.pooling.modes),
)

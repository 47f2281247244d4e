"""Sparse (SPLADE): a SparseEncoder folder (Transformer or MLMTransformer, then SpladePooling),
or a plain `*ForMaskedLM` checkpoint asked to serve it; a masked-language-model head and the
SPLADE pooling run after the encoder."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from model.architectures import EncoderConfig
from model.architectures.base import ConfigReader
from model.checkpoint import read_json_object
from model.errors import ConfigError
from model.folder import DIMENSION_KEYS, FolderSpec, Metadata, TransformerOutputs, refuse_unknown
from model.heads import Splade, masked_lm_head
from model.info import Task
from model.networks import load_network_with_head, on_meta
from model.tasks.base import Fields, Loaded, ModelTask, Modules

# SpladePooling's settings and the values implemented.
SPLADE_KEYS = {
    "pooling_strategy": ("max", "sum"),
    "activation_function": ("relu", "log1p_relu"),
}


def read_modules(modules: Modules, metadata: Metadata) -> Fields:
    """A SPLADE SparseEncoder: Transformer (fill-mask) or MLMTransformer, then SpladePooling."""
    kinds = modules.kinds
    if kinds[0] not in ("Transformer", "MLMTransformer") or kinds[1:] != ["SpladePooling"]:
        raise ConfigError(
            f"{modules.source}: a SparseEncoder here is a Transformer (or MLMTransformer) and a "
            f"SpladePooling module, not {modules.describe()}"
        )
    pooling_file = modules.paths[1] / "config.json"
    splade, dimension = read_splade(pooling_file)
    return {"pooling_dimension": dimension, "pooling_file": pooling_file, "splade": splade}


def read_splade(path: Path) -> tuple[Splade, int | None]:
    """SpladePooling's config: its settings, and the output size it was saved for."""
    raw = read_json_object(path, required=False)
    # `chunk_size` only bounds memory (and is never saved by sentence-transformers).
    refuse_unknown(path, raw, {*SPLADE_KEYS, *DIMENSION_KEYS, "chunk_size"})
    for key, supported in SPLADE_KEYS.items():
        if raw.get(key, supported[0]) not in supported:
            raise ConfigError(
                f"{path}: unsupported {key} {raw[key]!r} (supported: {', '.join(supported)})"
            )
    splade = Splade(
        pooling_strategy=raw.get("pooling_strategy", "max"),
        activation_function=raw.get("activation_function", "relu"),
    )
    dimension = next((raw[key] for key in DIMENSION_KEYS if raw.get(key) is not None), None)
    return splade, dimension


def read_plain(config_file: Path, config: Mapping[str, Any], metadata: Metadata) -> Fields:
    return {"splade": Splade()}


def load(
    config: EncoderConfig,
    raw: ConfigReader,
    spec: FolderSpec,
    device: torch.device,
    dtype: torch.dtype,
) -> Loaded:
    if spec.pooling_dimension not in (None, config.vocab_size):
        raise ConfigError(
            f"{spec.pooling_file}: embedding dimension {spec.pooling_dimension} does not "
            f"match the vocabulary size {config.vocab_size}"
        )
    with on_meta():
        head = masked_lm_head(config, raw, spec.splade or Splade())
    network, loaded = load_network_with_head(config, raw, spec, head, device, dtype)
    return Loaded(network, loaded, config.vocab_size, ())


def pooling_names(spec: FolderSpec) -> tuple[str, ...]:
    strategy = (spec.splade or Splade()).pooling_strategy
    return (f"splade_{strategy}",)


SPARSE = ModelTask(
    task=Task.SPARSE,
    folder_type="SparseEncoder",
    outputs=TransformerOutputs("fill-mask", "token_embeddings", "logits"),
    # sentence-transformers' default for sparse vectors.
    default_similarity="dot",
    reads_truncate_dim=False,
    takes_default_prompt=True,
    reads_pairs=False,
    declared_by_modules=lambda modules, settings: (
        modules.kinds[0] == "MLMTransformer" or "SpladePooling" in modules.kinds
    ),
    read_modules=read_modules,
    read_plain=read_plain,
    load=load,
    pooling_names=pooling_names,
)

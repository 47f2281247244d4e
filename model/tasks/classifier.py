"""Classification (cross-encoders, rerankers): a CrossEncoder folder (one sequence-classification
Transformer), or a plain `*ForSequenceClassification` checkpoint; a classification head runs
after the encoder, and its score activation is the folder's."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from model.architectures import EncoderConfig
from model.architectures.base import ConfigReader
from model.errors import ConfigError
from model.folder import FolderSpec, Metadata, ScoreActivation, TransformerOutputs, score_activation
from model.heads import classification_head
from model.info import Task
from model.networks import load_network_with_head, on_meta
from model.tasks.base import Fields, Loaded, ModelTask, Modules

OUTPUTS = TransformerOutputs("sequence-classification", "scores", "logits")


def read_modules(modules: Modules, metadata: Metadata) -> Fields:
    """A CrossEncoder (sentence-transformers 5.4 and later): one sequence-classification
    Transformer."""
    if modules.kinds != ["Transformer"]:
        raise ConfigError(
            f"{modules.source}: a CrossEncoder here is one Transformer module, "
            f"not {modules.describe()}"
        )
    return {"score_activation": metadata.score_activation}


def read_plain(config_file: Path, config: Mapping[str, Any], metadata: Metadata) -> Fields:
    activation = metadata.score_activation or _config_score_activation(config_file, config)
    return {"score_activation": activation}


def _config_score_activation(path: Path, config: Mapping[str, Any]) -> ScoreActivation | None:
    """Where CrossEncoders saved by sentence-transformers up to 5.3 keep their activation:
    config.json's `sentence_transformers.activation_fn` (from 4.0), or
    `sbert_ce_default_activation_function` (before); for a plain transformers classifier, its
    `problem_type`: multi-label scores each label by its own sigmoid (transformers' pipeline)."""
    settings = config.get("sentence_transformers")
    if isinstance(settings, dict) and settings.get("activation_fn") is not None:
        source = f"{path}: key 'sentence_transformers.activation_fn'"
        return score_activation(source, settings["activation_fn"])
    if config.get("sbert_ce_default_activation_function") is not None:
        source = f"{path}: key 'sbert_ce_default_activation_function'"
        return score_activation(source, config["sbert_ce_default_activation_function"])
    if config.get("problem_type") == "multi_label_classification":
        source = f"{path}: key 'problem_type' (multi_label_classification)"
        return ScoreActivation("Sigmoid", source)
    return None


def load(
    config: EncoderConfig,
    raw: ConfigReader,
    spec: FolderSpec,
    device: torch.device,
    dtype: torch.dtype,
) -> Loaded:
    with on_meta():
        head, labels = classification_head(config, raw)
    _check_score_activation(spec.score_activation, labels)
    network, head = load_network_with_head(config, raw, spec, head, device, dtype)
    return Loaded(network, head, len(labels), labels)


def _check_score_activation(activation: ScoreActivation | None, labels: tuple[str, ...]) -> None:
    """Several labels are scored by softmax (one by sigmoid): a folder that scores each of
    several labels by its own sigmoid (multi-label) would be served wrong."""
    if activation is not None and activation.name == "Sigmoid" and len(labels) > 1:
        raise ConfigError(
            f"{activation.source}: Sigmoid over {len(labels)} labels (independent multi-label "
            "scores) is not supported; several labels are scored by softmax"
        )


CLASSIFIER = ModelTask(
    task=Task.CLASSIFY,
    folder_type="CrossEncoder",
    outputs=OUTPUTS,
    default_similarity="cosine",
    reads_truncate_dim=False,
    # Pairs are tokenized without prompts, so a default one could not be honoured.
    takes_default_prompt=False,
    reads_pairs=True,
    declared_by_modules=lambda modules, settings: (
        settings.get("transformer_task") == OUTPUTS.transformer_task
    ),
    read_modules=read_modules,
    read_plain=read_plain,
    load=load,
    pooling_names=lambda spec: ("cls",),  # every classification head reads the first token
)

"""One place per model task on the model's side (embedding, classifier, sparse), and which
task a folder serves.

- A sentence-transformers folder says it: `model_type` in config_sentence_transformers.json
  (each task's `folder_type`), or, in folders saved before that was written, its modules (each
  task's `declared_by_modules`: SpladePooling is sparse, a sequence-classification Transformer
  a classifier, anything else an embedding).
- A CrossEncoder saved by sentence-transformers up to 5.3 is a plain folder (its settings sit
  in config.json), and so is any other Hugging Face checkpoint: `architectures`
  `*ForSequenceClassification` is a classifier; `*ForMaskedLM` could be SPLADE or an encoder
  for mean pooling, so the caller must choose; anything else is embedded by mean pooling.

Each task then reads its own modules and files, loads what runs after the encoder and names
its pooling (model/tasks/embedding.py, classifier.py, sparse.py); the serving side of the same
tasks is app/tasks/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model.checkpoint import read_json, read_json_object
from model.errors import ConfigError
from model.folder import (
    FolderSpec,
    Metadata,
    module_kind,
    read_metadata,
    read_transformer_config,
    transformer_settings,
)
from model.info import Task
from model.similarity import check_similarity_fn
from model.tasks.base import ModelTask, Modules
from model.tasks.classifier import CLASSIFIER
from model.tasks.embedding import EMBEDDING
from model.tasks.sparse import SPARSE

MODEL_TASKS: dict[Task, ModelTask] = {spec.task: spec for spec in (EMBEDDING, CLASSIFIER, SPARSE)}
# config_sentence_transformers.json's model_type -> the task it declares.
FOLDER_TYPES = {spec.folder_type: spec.task for spec in MODEL_TASKS.values()}
# The order in which a folder without a model_type is told by its modules: the first that
# claims it (the embedding task claims whatever the others do not).
BY_MODULES = (SPARSE, CLASSIFIER, EMBEDDING)


def read_folder(folder: Path, task: Task | None = None) -> FolderSpec:
    """A sentence-transformers folder, or a plain Hugging Face one (embedded by mean pooling,
    without a norm).

    With `task` None the folder's declaration decides (see the module docstring). A task
    asked for must be one the folder can serve: a sentence-transformers folder serves the
    one its modules declare only; a plain folder any, as long as its weights hold the head
    (checked when they are loaded).
    """
    modules_file = folder / "modules.json"
    entries = read_json(modules_file, required=False)
    metadata = read_metadata(folder / "config_sentence_transformers.json", FOLDER_TYPES)
    if entries is None:
        return _plain_folder(folder, metadata, task)
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{modules_file}: expected a non-empty JSON list of modules")
    modules = Modules(
        modules_file,
        [module_kind(modules_file, entry) for entry in entries],
        [folder / str(entry.get("path", "")) for entry in entries],
    )
    declared = _declared_task(metadata, modules)
    if task is not None and task is not declared.task:
        raise ConfigError(
            f"{modules_file}: this sentence-transformers folder "
            f"({metadata.model_type or 'SentenceTransformer'}) serves task "
            f"{declared.task.value!r} only, not {task.value!r}"
        )
    return _spec(
        modules.paths[0],
        declared,
        metadata,
        declared.read_modules(modules, metadata),
        modules.kinds[0],
    )


def _declared_task(metadata: Metadata, modules: Modules) -> ModelTask:
    """The folder's `model_type`; folders saved before it was written are told by modules."""
    if metadata.model_type is not None:
        return MODEL_TASKS[FOLDER_TYPES[metadata.model_type]]
    _, settings = read_transformer_config(modules.paths[0])
    return next(spec for spec in BY_MODULES if spec.declared_by_modules(modules, settings))


def _plain_folder(folder: Path, metadata: Metadata, task: Task | None) -> FolderSpec:
    """A folder without modules.json: a Hugging Face checkpoint, or a CrossEncoder saved by
    sentence-transformers up to 5.3."""
    config_file = folder / "config.json"
    config = read_json_object(config_file)
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ConfigError(f"{config_file}: key 'architectures' must be a list of class names")
    if task is None:
        if metadata.model_type is not None:
            task = FOLDER_TYPES[metadata.model_type]
        elif any(name.endswith("ForSequenceClassification") for name in architectures):
            task = Task.CLASSIFY
        elif any(name.endswith("ForMaskedLM") for name in architectures):
            raise ConfigError(
                f"{config_file}: architectures {', '.join(architectures)} is a masked-language "
                "model, which can give sparse embeddings (SPLADE) or dense ones (mean pooling); "
                "choose the task: task=sparse for SPLADE, or task=embed for mean pooling"
            )
        else:
            task = Task.EMBED
    spec = MODEL_TASKS[task]
    return _spec(folder, spec, metadata, spec.read_plain(config_file, config, metadata))


def _spec(
    transformer_dir: Path,
    task: ModelTask,
    metadata: Metadata,
    fields: dict[str, Any],
    kind: str = "Transformer",
) -> FolderSpec:
    """The task's own fields, the Transformer's settings and the metadata's, as one spec."""
    return FolderSpec(
        transformer_dir=transformer_dir,
        task=task.task,
        **fields,
        **transformer_settings(transformer_dir, task.task, task.outputs, kind),
        **_metadata_settings(metadata, task),
    )


def _metadata_settings(metadata: Metadata, task: ModelTask) -> dict[str, Any]:
    """The FolderSpec fields the metadata gives, for the task served."""
    if not task.takes_default_prompt and metadata.default_prompt_name:
        raise ConfigError(
            f"{metadata.source}: unsupported default_prompt_name "
            f"{metadata.default_prompt_name!r} for a {task.folder_type}"
        )
    similarity = metadata.similarity_fn_name or task.default_similarity
    check_similarity_fn(similarity, str(metadata.source))
    return {
        "prompts": metadata.prompts,
        "default_prompt_name": metadata.default_prompt_name,
        "similarity_fn_name": similarity,
        "truncate_dim": metadata.truncate_dim if task.reads_truncate_dim else None,
    }


__all__ = ["FOLDER_TYPES", "MODEL_TASKS", "ModelTask", "read_folder"]

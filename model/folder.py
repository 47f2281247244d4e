"""Reading a model folder: the sentence-transformers files around `config.json` and the weights.

Everything in the folder that changes the outputs is honoured, or refused here at start-up
with an error naming the file and the key: serving vectors that differ from the ones the
model was trained to give would silently poison a search index. Both file formats are read:
sentence-transformers up to 5.3 (`pooling_mode_*_token` flags, `sentence_transformers.models.X`
and `sentence_transformers.sparse_encoder.models.X` module types) and 5.4 and later
(`pooling_mode`, `sentence_transformers.base.modules...X`, `transformer_task`).

The folder also says which task it serves (model/heads.py):
- a sentence-transformers folder by its own declaration: `model_type` in
  config_sentence_transformers.json (SentenceTransformer, CrossEncoder, SparseEncoder) and
  its modules (Transformer + Pooling..., a Transformer whose `transformer_task` is
  sequence-classification, or Transformer/MLMTransformer + SpladePooling);
- a CrossEncoder saved by sentence-transformers up to 5.3 is a plain folder (its settings sit
  in config.json), and so is any other Hugging Face checkpoint: `architectures`
  `*ForSequenceClassification` is a classifier; `*ForMaskedLM` could be SPLADE or an encoder
  for mean pooling, so the caller must choose; anything else is embedded by mean pooling.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.checkpoint import read_json, read_json_object
from model.errors import ConfigError
from model.heads import Splade
from model.info import Task
from model.pipeline import ACTIVATIONS, DenseSpec, Pooling, PoolingMode
from model.similarity import check_similarity_fn
from model.tokenizer import Direction

log = logging.getLogger(__name__)

# The flag format's keys, in the order sentence-transformers concatenates the modes.
POOLING_FLAGS = {
    "pooling_mode_cls_token": PoolingMode.CLS,
    "pooling_mode_max_tokens": PoolingMode.MAX,
    "pooling_mode_mean_tokens": PoolingMode.MEAN,
    "pooling_mode_mean_sqrt_len_tokens": PoolingMode.MEAN_SQRT_LEN,
    "pooling_mode_weightedmean_tokens": PoolingMode.WEIGHTED_MEAN,
    "pooling_mode_lasttoken": PoolingMode.LAST_TOKEN,
}
_DIMENSION_KEYS = ("word_embedding_dimension", "embedding_dimension")
# The Transformer's settings file, under the names sentence-transformers tries in this order
# (its first versions named it after the architecture); the first that holds a key counts.
_TRANSFORMER_CONFIG_FILES = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
# Keys of the Transformer's settings that cannot change the vectors.
_INERT_TRANSFORMER_KEYS = ("unpad_inputs",)
_TRANSFORMER_DEFAULTS: dict[str, Any] = {
    "processing_kwargs": None,
    "query_length": None,
    "document_length": None,
    "query_expansion": None,
}
# What the Transformer module computes for each task: `transformer_task`, the
# `module_output_name` it fills, and the model output its `modality_config` reads.
_TRANSFORMER_OUTPUTS = {
    Task.EMBED: ("feature-extraction", "token_embeddings", "last_hidden_state"),
    Task.CLASSIFY: ("sequence-classification", "scores", "logits"),
    Task.SPARSE: ("fill-mask", "token_embeddings", "logits"),
}
_SENTENCE_EMBEDDING = "sentence_embedding"
# config_sentence_transformers.json's model_type -> the task it serves.
MODEL_TYPES = {
    "SentenceTransformer": Task.EMBED,
    "CrossEncoder": Task.CLASSIFY,
    "SparseEncoder": Task.SPARSE,
}
_METADATA_KEYS = (
    "__version__",
    "prompts",
    "default_prompt_name",
    "similarity_fn_name",
    "model_type",
    "activation_fn",
    "max_active_dims",
    "truncate_dim",
    # Which modules stay in float32 under a half-precision dtype: precision, not the outputs.
    "keep_in_fp32_modules",
)
# The score activations sentence-transformers' CrossEncoder writes by default (Sigmoid for
# one label, Identity for several): the caller applies sigmoid to one logit and offers raw
# scores, so both are served as the model means them. Anything else is refused.
SCORE_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "Identity",
    "torch.nn.modules.activation.Sigmoid": "Sigmoid",
}
_SPLADE_KEYS = {
    "pooling_strategy": ("max", "sum"),
    "activation_function": ("relu", "log1p_relu"),
}


@dataclass(frozen=True)
class DenseModule:
    spec: DenseSpec
    folder: Path


@dataclass(frozen=True)
class NormalizeModule:
    pass


@dataclass(frozen=True)
class ScoreActivation:
    """The activation a CrossEncoder folder declares for its scores, and where it says so."""

    name: str  # a SCORE_ACTIVATIONS value
    source: str  # "file: key"


@dataclass(frozen=True)
class FolderSpec:
    """What a model folder asks of the encoder's inputs and of the steps after it."""

    transformer_dir: Path
    task: Task = Task.EMBED
    pooling: Pooling = field(default_factory=Pooling)
    # The size the pooling config was saved for: the token embeddings' (checked against the
    # encoder), or for SPLADE the vocabulary's.
    pooling_dimension: int | None = None
    pooling_file: Path | None = None  # where pooling_dimension was read, for errors
    # Dense and Normalize modules after the pooling, in order.
    steps: tuple[DenseModule | NormalizeModule, ...] = ()
    # Sparse: SpladePooling's settings.
    splade: Splade | None = None
    # Classify: the declared score activation; None when the folder leaves the default.
    score_activation: ScoreActivation | None = None
    max_seq_length: int | None = None
    do_lower_case: bool = False
    # tokenizer_config.json's truncation_side; None: what tokenizer.json saved, else the right.
    truncation_side: Direction | None = None
    # tokenizer_config.json's keys, read once here: its tokenizer class (segment ids, and
    # what tokenizer.json must agree with) is checked where the tokenizer is built.
    tokenizer_settings: Mapping[str, Any] = field(default_factory=dict)
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity_fn_name: str = "cosine"
    # Embed: every vector is cut to its first `truncate_dim` features after the modules, as
    # sentence-transformers cuts them (a Matryoshka model saved for a smaller size).
    truncate_dim: int | None = None


@dataclass(frozen=True)
class _Metadata:
    """config_sentence_transformers.json."""

    source: Path
    model_type: str | None = None
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity_fn_name: str | None = None
    score_activation: ScoreActivation | None = None
    truncate_dim: int | None = None


def read_folder(folder: Path, task: Task | None = None) -> FolderSpec:
    """A sentence-transformers folder, or a plain Hugging Face one (embedded by mean pooling,
    without a norm).

    With `task` None the folder's declaration decides (see the module docstring). A task
    asked for must be one the folder can serve: a sentence-transformers folder serves the
    one its modules declare only; a plain folder any, as long as its weights hold the head
    (checked when they are loaded).
    """
    modules_file = folder / "modules.json"
    modules = read_json(modules_file, required=False)
    metadata = _read_metadata(folder / "config_sentence_transformers.json")
    if modules is None:
        return _plain_folder(folder, metadata, task)
    if not isinstance(modules, list) or not modules:
        raise ConfigError(f"{modules_file}: expected a non-empty JSON list of modules")
    kinds = [_module_kind(modules_file, entry) for entry in modules]
    paths = [folder / str(entry.get("path", "")) for entry in modules]
    declared = _declared_task(metadata, kinds, paths[0])
    if task is not None and task is not declared:
        raise ConfigError(
            f"{modules_file}: this sentence-transformers folder "
            f"({metadata.model_type or 'SentenceTransformer'}) serves task {declared.value!r} "
            f"only, not {task.value!r}"
        )
    if declared is Task.CLASSIFY:
        return _classifier_modules(modules_file, kinds, paths, metadata)
    if declared is Task.SPARSE:
        return _sparse_modules(modules_file, kinds, paths, metadata)
    return _embedding_modules(modules_file, kinds, paths, metadata)


def _declared_task(metadata: _Metadata, kinds: list[str], transformer_dir: Path) -> Task:
    """The folder's `model_type`; folders saved before it was written are told by modules."""
    if metadata.model_type is not None:
        return MODEL_TYPES[metadata.model_type]
    if kinds[0] == "MLMTransformer" or "SpladePooling" in kinds:
        return Task.SPARSE
    _, settings = _read_transformer_config(transformer_dir)
    if settings.get("transformer_task") == _TRANSFORMER_OUTPUTS[Task.CLASSIFY][0]:
        return Task.CLASSIFY
    return Task.EMBED


def _embedding_modules(
    modules_file: Path, kinds: list[str], paths: list[Path], metadata: _Metadata
) -> FolderSpec:
    """Transformer, Pooling, then Dense and Normalize modules."""
    if kinds[0] != "Transformer":
        raise ConfigError(f"{modules_file}: the first module must be a Transformer, not {kinds[0]}")
    if kinds[1:2] != ["Pooling"]:
        raise ConfigError(f"{modules_file}: the Transformer must be followed by a Pooling module")
    pooling_file = paths[1] / "config.json"
    pooling, pooling_dimension = _read_pooling(pooling_file)
    steps: list[DenseModule | NormalizeModule] = []
    for kind, path in zip(kinds[2:], paths[2:], strict=True):
        if kind == "Dense":
            steps.append(DenseModule(_read_dense(path / "config.json"), path))
        elif kind == "Normalize":
            _read_normalize(path / "config.json")
            steps.append(NormalizeModule())
        else:
            raise ConfigError(f"{modules_file}: a {kind} module after the Pooling is not supported")
    return FolderSpec(
        transformer_dir=paths[0],
        pooling=pooling,
        pooling_dimension=pooling_dimension,
        pooling_file=pooling_file,
        steps=tuple(steps),
        **_transformer_settings(paths[0], Task.EMBED, kinds[0]),
        **_metadata_settings(metadata, Task.EMBED),
    )


def _classifier_modules(
    modules_file: Path, kinds: list[str], paths: list[Path], metadata: _Metadata
) -> FolderSpec:
    """A CrossEncoder (sentence-transformers 5.4 and later): one sequence-classification
    Transformer."""
    if kinds != ["Transformer"]:
        raise ConfigError(
            f"{modules_file}: a CrossEncoder here is one Transformer module, "
            f"not {' + '.join(kinds)}"
        )
    return FolderSpec(
        transformer_dir=paths[0],
        task=Task.CLASSIFY,
        score_activation=metadata.score_activation,
        **_transformer_settings(paths[0], Task.CLASSIFY, kinds[0]),
        **_metadata_settings(metadata, Task.CLASSIFY),
    )


def _sparse_modules(
    modules_file: Path, kinds: list[str], paths: list[Path], metadata: _Metadata
) -> FolderSpec:
    """A SPLADE SparseEncoder: Transformer (fill-mask) or MLMTransformer, then SpladePooling."""
    if kinds[0] not in ("Transformer", "MLMTransformer") or kinds[1:] != ["SpladePooling"]:
        raise ConfigError(
            f"{modules_file}: a SparseEncoder here is a Transformer (or MLMTransformer) and a "
            f"SpladePooling module, not {' + '.join(kinds)}"
        )
    pooling_file = paths[1] / "config.json"
    splade, dimension = _read_splade(pooling_file)
    return FolderSpec(
        transformer_dir=paths[0],
        task=Task.SPARSE,
        pooling_dimension=dimension,
        pooling_file=pooling_file,
        splade=splade,
        **_transformer_settings(paths[0], Task.SPARSE, kinds[0]),
        **_metadata_settings(metadata, Task.SPARSE),
    )


def _plain_folder(folder: Path, metadata: _Metadata, task: Task | None) -> FolderSpec:
    """A folder without modules.json: a Hugging Face checkpoint, or a CrossEncoder saved by
    sentence-transformers up to 5.3."""
    config_file = folder / "config.json"
    config = read_json_object(config_file)
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ConfigError(f"{config_file}: key 'architectures' must be a list of class names")
    if task is None:
        if metadata.model_type is not None:
            task = MODEL_TYPES[metadata.model_type]
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
    activation = None
    if task is Task.CLASSIFY:
        activation = metadata.score_activation or _config_score_activation(config_file, config)
    return FolderSpec(
        transformer_dir=folder,
        task=task,
        splade=Splade() if task is Task.SPARSE else None,
        score_activation=activation,
        **_transformer_settings(folder, task),
        **_metadata_settings(metadata, task),
    )


def _module_kind(source: Path, entry: Any) -> str:
    """The class name of a module entry; anything but sentence-transformers' own is refused."""
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
        raise ConfigError(f"{source}: each module needs a 'type' string, got {entry!r}")
    module_type: str = entry["type"]
    package, _, kind = module_type.rpartition(".")
    supported = ("Transformer", "MLMTransformer", "Pooling", "Dense", "Normalize", "SpladePooling")
    # sentence-transformers' own package only: `sentence_transformers_x.Dense` is someone's code.
    own = package == "sentence_transformers" or package.startswith("sentence_transformers.")
    if not own or kind not in supported:
        raise ConfigError(
            f"{source}: module {entry.get('name', entry.get('idx'))!r} has type {module_type!r}, "
            f"which this server does not implement (supported: {', '.join(supported)})"
        )
    return kind


def _read_pooling(path: Path) -> tuple[Pooling, int | None]:
    raw = read_json_object(path)
    _refuse_unknown(path, raw, {*POOLING_FLAGS, *_DIMENSION_KEYS, "pooling_mode", "include_prompt"})
    include_prompt = raw.get("include_prompt", True)
    if not isinstance(include_prompt, bool):
        raise ConfigError(f"{path}: key 'include_prompt' must be true or false")
    if "pooling_mode" in raw:  # sentence-transformers 6 and later
        named = raw["pooling_mode"]
        names = [named] if isinstance(named, str) else named
        if not isinstance(names, list) or not names:
            raise ConfigError(f"{path}: key 'pooling_mode' must be a mode or a list of modes")
        try:
            modes = tuple(PoolingMode(name) for name in names)
        except ValueError as exc:
            raise ConfigError(
                f"{path}: unknown pooling_mode {named!r} "
                f"(supported: {', '.join(mode.value for mode in PoolingMode)})"
            ) from exc
    else:  # the flag format; sentence-transformers pools by mean when no flag is set
        modes = tuple(mode for flag, mode in POOLING_FLAGS.items() if raw.get(flag)) or (
            PoolingMode.MEAN,
        )
    dimension = next((raw[key] for key in _DIMENSION_KEYS if key in raw), None)
    return Pooling(modes, include_prompt), dimension


def _read_dense(path: Path) -> DenseSpec:
    raw = read_json_object(path)
    _refuse_unknown(
        path,
        raw,
        {
            "in_features",
            "out_features",
            "bias",
            "activation_function",
            "use_residual",
            "module_input_name",
            "module_output_name",
        },
    )
    _expect_sentence_embedding(path, raw)
    activation = raw.get("activation_function", "torch.nn.modules.activation.Tanh")
    package, _, name = str(activation).rpartition(".")
    if not package.startswith("torch.nn") or name not in ACTIVATIONS:
        raise ConfigError(
            f"{path}: unsupported activation_function {activation!r} "
            f"(supported: torch.nn {', '.join(ACTIVATIONS)})"
        )
    for key in ("in_features", "out_features"):
        if not isinstance(raw.get(key), int) or raw[key] <= 0:
            raise ConfigError(f"{path}: key {key!r} must be a positive integer")
    return DenseSpec(
        in_features=raw["in_features"],
        out_features=raw["out_features"],
        bias=bool(raw.get("bias", True)),
        activation=name,
        use_residual=bool(raw.get("use_residual", False)),
    )


def _read_normalize(path: Path) -> None:
    raw = read_json_object(path, required=False)
    _refuse_unknown(path, raw, {"module_input_name", "module_output_name"})
    _expect_sentence_embedding(path, raw)


def _expect_sentence_embedding(path: Path, raw: Mapping[str, Any]) -> None:
    """Modules that work on the token embeddings instead (multi-vector models) are refused."""
    for key in ("module_input_name", "module_output_name"):
        if raw.get(key) not in (None, _SENTENCE_EMBEDDING):
            raise ConfigError(
                f"{path}: unsupported {key} {raw[key]!r} (only {_SENTENCE_EMBEDDING!r})"
            )


def _transformer_settings(folder: Path, task: Task, kind: str = "Transformer") -> dict[str, Any]:
    """`max_seq_length` and `do_lower_case`; every other key must be inert, at its default, or
    say that the Transformer computes what `task` reads."""
    path, raw = _read_transformer_config(folder)
    _refuse_unknown(
        path,
        raw,
        {
            "max_seq_length",
            "do_lower_case",
            "modality_config",
            "transformer_task",
            "module_output_name",
            *_TRANSFORMER_DEFAULTS,
        }
        | set(_INERT_TRANSFORMER_KEYS),
    )
    for key, default in _TRANSFORMER_DEFAULTS.items():
        if raw.get(key, default) not in (default, {}):
            raise ConfigError(f"{path}: unsupported {key} {raw[key]!r} (only {default!r})")
    transformer_task, output_name, model_output = _TRANSFORMER_OUTPUTS[task]
    # Files written before `transformer_task` existed leave it out: sentence-transformers
    # 5.0-5.3's MLMTransformer always ran the fill-mask head, its Transformer never a head.
    default_task = "fill-mask" if kind == "MLMTransformer" else None
    declared_task = raw.get("transformer_task", default_task)
    if declared_task not in (None, transformer_task):
        raise ConfigError(
            f"{path}: transformer_task {declared_task!r} does not give what task "
            f"{task.value!r} reads (only {transformer_task!r})"
        )
    if raw.get("module_output_name", output_name) != output_name:
        raise ConfigError(
            f"{path}: unsupported module_output_name {raw['module_output_name']!r} "
            f"(only {output_name!r})"
        )
    modality = raw.get("modality_config")
    if modality not in (
        None,
        {"text": {"method": "forward", "method_output_name": model_output}},
    ):
        raise ConfigError(
            f"{path}: unsupported modality_config {modality!r} (text only, from {model_output!r})"
        )
    tokenizer_path = folder / "tokenizer_config.json"
    tokenizer_config = read_json_object(tokenizer_path, required=False)
    max_seq_length = raw.get("max_seq_length")
    if max_seq_length is None:
        max_seq_length = _tokenizer_max_length(tokenizer_config)
    elif not isinstance(max_seq_length, int) or max_seq_length <= 0:
        raise ConfigError(f"{path}: key 'max_seq_length' must be a positive integer")
    do_lower_case = raw.get("do_lower_case", False)
    if not isinstance(do_lower_case, bool):
        raise ConfigError(f"{path}: key 'do_lower_case' must be true or false")
    return {
        "max_seq_length": max_seq_length,
        "do_lower_case": do_lower_case,
        "truncation_side": _truncation_side(tokenizer_path, tokenizer_config),
        "tokenizer_settings": tokenizer_config,
    }


def _read_transformer_config(folder: Path) -> tuple[Path, dict[str, Any]]:
    """The Transformer's settings file and its keys ({} when there is none)."""
    for name in _TRANSFORMER_CONFIG_FILES:
        raw = read_json_object(folder / name, required=False)
        if raw:
            return folder / name, raw
    return folder / _TRANSFORMER_CONFIG_FILES[0], {}


def _read_splade(path: Path) -> tuple[Splade, int | None]:
    """SpladePooling's config: its settings, and the output size it was saved for."""
    raw = read_json_object(path, required=False)
    # `chunk_size` only bounds memory (and is never saved by sentence-transformers).
    _refuse_unknown(path, raw, {*_SPLADE_KEYS, *_DIMENSION_KEYS, "chunk_size"})
    for key, supported in _SPLADE_KEYS.items():
        if raw.get(key, supported[0]) not in supported:
            raise ConfigError(
                f"{path}: unsupported {key} {raw[key]!r} (supported: {', '.join(supported)})"
            )
    splade = Splade(
        pooling_strategy=raw.get("pooling_strategy", "max"),
        activation_function=raw.get("activation_function", "relu"),
    )
    dimension = next((raw[key] for key in _DIMENSION_KEYS if raw.get(key) is not None), None)
    return splade, dimension


def _tokenizer_max_length(tokenizer_config: Mapping[str, Any]) -> int | None:
    """sentence-transformers 6 keeps max_seq_length as the tokenizer's `model_max_length`."""
    value = tokenizer_config.get("model_max_length")
    # transformers writes a huge sentinel (1e30) when the limit is unset.
    if isinstance(value, int) and 0 < value < 1_000_000:
        return value
    return None


def _truncation_side(path: Path, tokenizer_config: Mapping[str, Any]) -> Direction | None:
    """The side transformers (which sentence-transformers calls) cuts on when a call names
    none, if tokenizer_config.json says it."""
    side = tokenizer_config.get("truncation_side")
    if side not in (None, "right", "left"):
        raise ConfigError(f"{path}: unsupported truncation_side {side!r} (right or left)")
    return side


def _read_metadata(path: Path) -> _Metadata:
    """The model type, prompts, the default prompt, the similarity function and, for a
    CrossEncoder, its score activation."""
    raw = read_json_object(path, required=False)
    unknown = sorted(set(raw) - set(_METADATA_KEYS))
    if unknown:
        log.warning("%s: ignoring keys that do not change vectors: %s", path, ", ".join(unknown))
    kind = raw.get("model_type")
    if kind is not None and kind not in MODEL_TYPES:
        raise ConfigError(
            f"{path}: unsupported model_type {kind!r} (supported: {', '.join(MODEL_TYPES)})"
        )
    if raw.get("max_active_dims") is not None:
        raise ConfigError(
            f"{path}: unsupported max_active_dims {raw['max_active_dims']!r}: this server "
            "returns every non-zero weight"
        )
    prompts = raw.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise ConfigError(f"{path}: key 'prompts' must map names to strings")
    default = raw.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ConfigError(f"{path}: default_prompt_name {default!r} is not one of the prompts")
    activation = None
    if raw.get("activation_fn") is not None:
        activation = _score_activation(f"{path}: key 'activation_fn'", raw["activation_fn"])
    truncate_dim = raw.get("truncate_dim")
    if truncate_dim is not None and (
        not isinstance(truncate_dim, int) or isinstance(truncate_dim, bool) or truncate_dim <= 0
    ):
        raise ConfigError(f"{path}: key 'truncate_dim' must be a positive integer or null")
    return _Metadata(
        source=path,
        model_type=kind,
        prompts=prompts,
        default_prompt_name=default,
        similarity_fn_name=raw.get("similarity_fn_name") or None,
        score_activation=activation,
        truncate_dim=truncate_dim,
    )


def _metadata_settings(metadata: _Metadata, task: Task) -> dict[str, Any]:
    """The FolderSpec fields the metadata gives, for the task served."""
    if task is Task.CLASSIFY and metadata.default_prompt_name:
        # Pairs are tokenized without prompts, so a default one could not be honoured.
        raise ConfigError(
            f"{metadata.source}: unsupported default_prompt_name "
            f"{metadata.default_prompt_name!r} for a classifier"
        )
    # sentence-transformers' default: cosine for vectors, dot product for sparse ones.
    similarity = metadata.similarity_fn_name or ("dot" if task is Task.SPARSE else "cosine")
    check_similarity_fn(similarity, str(metadata.source))
    return {
        "prompts": metadata.prompts,
        "default_prompt_name": metadata.default_prompt_name,
        "similarity_fn_name": similarity,
        # Only SentenceTransformer reads it; CrossEncoder and SparseEncoder leave it unread.
        "truncate_dim": metadata.truncate_dim if task is Task.EMBED else None,
    }


def _config_score_activation(path: Path, config: Mapping[str, Any]) -> ScoreActivation | None:
    """Where CrossEncoders saved by sentence-transformers up to 5.3 keep their activation:
    config.json's `sentence_transformers.activation_fn` (from 4.0), or
    `sbert_ce_default_activation_function` (before); for a plain transformers classifier, its
    `problem_type`: multi-label scores each label by its own sigmoid (transformers' pipeline)."""
    settings = config.get("sentence_transformers")
    if isinstance(settings, dict) and settings.get("activation_fn") is not None:
        source = f"{path}: key 'sentence_transformers.activation_fn'"
        return _score_activation(source, settings["activation_fn"])
    if config.get("sbert_ce_default_activation_function") is not None:
        source = f"{path}: key 'sbert_ce_default_activation_function'"
        return _score_activation(source, config["sbert_ce_default_activation_function"])
    if config.get("problem_type") == "multi_label_classification":
        source = f"{path}: key 'problem_type' (multi_label_classification)"
        return ScoreActivation("Sigmoid", source)
    return None


def _score_activation(source: str, value: Any) -> ScoreActivation:
    if value not in SCORE_ACTIVATIONS:
        raise ConfigError(
            f"{source}: unsupported score activation {value!r} "
            f"(supported: {', '.join(SCORE_ACTIVATIONS)})"
        )
    return ScoreActivation(SCORE_ACTIVATIONS[value], source)


def _refuse_unknown(path: Path, raw: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(
            f"{path}: unsupported key {unknown[0]!r}: this server does not implement it, and "
            "serving without it could give vectors that differ from the model's own"
        )

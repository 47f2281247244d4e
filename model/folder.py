"""Reading a model folder's files: the sentence-transformers files around `config.json`.

Everything in the folder that changes the outputs is honoured, or refused here at start-up
with an error naming the file and the key: serving vectors that differ from the ones the
model was trained to give would silently poison a search index. Both file formats are read:
sentence-transformers up to 5.3 (`pooling_mode_*_token` flags, `sentence_transformers.models.X`
and `sentence_transformers.sparse_encoder.models.X` module types) and 5.4 and later
(`pooling_mode`, `sentence_transformers.base.modules...X`, `transformer_task`).

Which task a folder serves, and what each task reads of it (its modules, its head), is
model/tasks/'s, one module per task; this module reads the files they share.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from model.checkpoint import read_json_object
from model.errors import ConfigError
from model.heads import Splade
from model.info import Task
from model.pipeline import ACTIVATIONS, DenseSpec, Pooling, PoolingMode
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
DIMENSION_KEYS = ("word_embedding_dimension", "embedding_dimension")
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
_SENTENCE_EMBEDDING = "sentence_embedding"
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


class TransformerOutputs(NamedTuple):
    """What the Transformer module computes for a task: its `transformer_task`, the
    `module_output_name` it fills, and the model output its `modality_config` reads."""

    transformer_task: str
    output_name: str
    model_output: str


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
class Metadata:
    """config_sentence_transformers.json."""

    source: Path
    model_type: str | None = None
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity_fn_name: str | None = None
    score_activation: ScoreActivation | None = None
    truncate_dim: int | None = None


def module_kind(source: Path, entry: Any) -> str:
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


def read_pooling(path: Path) -> tuple[Pooling, int | None]:
    raw = read_json_object(path)
    refuse_unknown(path, raw, {*POOLING_FLAGS, *DIMENSION_KEYS, "pooling_mode", "include_prompt"})
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
    dimension = next((raw[key] for key in DIMENSION_KEYS if key in raw), None)
    return Pooling(modes, include_prompt), dimension


def read_dense(path: Path) -> DenseSpec:
    raw = read_json_object(path)
    refuse_unknown(
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


def read_normalize(path: Path) -> None:
    raw = read_json_object(path, required=False)
    refuse_unknown(path, raw, {"module_input_name", "module_output_name"})
    _expect_sentence_embedding(path, raw)


def _expect_sentence_embedding(path: Path, raw: Mapping[str, Any]) -> None:
    """Modules that work on the token embeddings instead (multi-vector models) are refused."""
    for key in ("module_input_name", "module_output_name"):
        if raw.get(key) not in (None, _SENTENCE_EMBEDDING):
            raise ConfigError(
                f"{path}: unsupported {key} {raw[key]!r} (only {_SENTENCE_EMBEDDING!r})"
            )


def transformer_settings(
    folder: Path, task: Task, outputs: TransformerOutputs, kind: str = "Transformer"
) -> dict[str, Any]:
    """`max_seq_length` and `do_lower_case`; every other key must be inert, at its default, or
    say that the Transformer computes what `task` reads (`outputs`)."""
    path, raw = read_transformer_config(folder)
    refuse_unknown(
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
    transformer_task, output_name, model_output = outputs
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


def read_transformer_config(folder: Path) -> tuple[Path, dict[str, Any]]:
    """The Transformer's settings file and its keys ({} when there is none)."""
    for name in _TRANSFORMER_CONFIG_FILES:
        raw = read_json_object(folder / name, required=False)
        if raw:
            return folder / name, raw
    return folder / _TRANSFORMER_CONFIG_FILES[0], {}


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


def read_metadata(path: Path, folder_types: Collection[str]) -> Metadata:
    """The model type, prompts, the default prompt, the similarity function and, for a
    CrossEncoder, its score activation."""
    raw = read_json_object(path, required=False)
    unknown = sorted(set(raw) - set(_METADATA_KEYS))
    if unknown:
        log.warning("%s: ignoring keys that do not change vectors: %s", path, ", ".join(unknown))
    kind = raw.get("model_type")
    if kind is not None and kind not in folder_types:
        raise ConfigError(
            f"{path}: unsupported model_type {kind!r} (supported: {', '.join(folder_types)})"
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
        activation = score_activation(f"{path}: key 'activation_fn'", raw["activation_fn"])
    truncate_dim = raw.get("truncate_dim")
    if truncate_dim is not None and (
        not isinstance(truncate_dim, int) or isinstance(truncate_dim, bool) or truncate_dim <= 0
    ):
        raise ConfigError(f"{path}: key 'truncate_dim' must be a positive integer or null")
    return Metadata(
        source=path,
        model_type=kind,
        prompts=prompts,
        default_prompt_name=default,
        similarity_fn_name=raw.get("similarity_fn_name") or None,
        score_activation=activation,
        truncate_dim=truncate_dim,
    )


def score_activation(source: str, value: Any) -> ScoreActivation:
    if value not in SCORE_ACTIVATIONS:
        raise ConfigError(
            f"{source}: unsupported score activation {value!r} "
            f"(supported: {', '.join(SCORE_ACTIVATIONS)})"
        )
    return ScoreActivation(SCORE_ACTIVATIONS[value], source)


def refuse_unknown(path: Path, raw: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(
            f"{path}: unsupported key {unknown[0]!r}: this server does not implement it, and "
            "serving without it could give vectors that differ from the model's own"
        )

"""Reading a model folder: the sentence-transformers files around `config.json` and the weights.

Everything in the folder that changes the vectors is honoured, or refused here at start-up
with an error naming the file and the key: serving vectors that differ from the ones the
model was trained to give would silently poison a search index. Both file formats are read:
sentence-transformers up to 5 (`pooling_mode_*_token` flags, `sentence_transformers.models.X`
module types) and 6 and later (`pooling_mode`, `sentence_transformers.base.modules...X`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.checkpoint import read_json, read_json_object
from model.errors import ConfigError
from model.pipeline import ACTIVATIONS, DenseSpec, Pooling, PoolingMode
from model.similarity import check_similarity_fn

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
# Keys of sentence_bert_config.json that cannot change the vectors.
_INERT_TRANSFORMER_KEYS = ("unpad_inputs",)
_TRANSFORMER_DEFAULTS: dict[str, Any] = {
    "transformer_task": "feature-extraction",
    "module_output_name": "token_embeddings",
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
)


@dataclass(frozen=True)
class DenseModule:
    spec: DenseSpec
    folder: Path


@dataclass(frozen=True)
class NormalizeModule:
    pass


@dataclass(frozen=True)
class FolderSpec:
    """What a model folder asks of the encoder's inputs and of the steps after it."""

    transformer_dir: Path
    pooling: Pooling = field(default_factory=Pooling)
    # The token-embedding size the Pooling config was saved for (checked against the encoder).
    pooling_dimension: int | None = None
    # Dense and Normalize modules after the pooling, in order.
    steps: tuple[DenseModule | NormalizeModule, ...] = ()
    max_seq_length: int | None = None
    do_lower_case: bool = False
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity_fn_name: str = "cosine"


def read_folder(folder: Path) -> FolderSpec:
    """A sentence-transformers folder, or a plain Hugging Face one (mean pooling, no norm)."""
    modules_file = folder / "modules.json"
    modules = read_json(modules_file, required=False)
    metadata = _read_metadata(folder / "config_sentence_transformers.json")
    if modules is None:
        return FolderSpec(transformer_dir=folder, **_transformer_settings(folder), **metadata)
    if not isinstance(modules, list) or not modules:
        raise ConfigError(f"{modules_file}: expected a non-empty JSON list of modules")
    kinds = [_module_kind(modules_file, entry) for entry in modules]
    paths = [folder / str(entry.get("path", "")) for entry in modules]
    if kinds[0] != "Transformer":
        raise ConfigError(f"{modules_file}: the first module must be a Transformer, not {kinds[0]}")
    if kinds[1:2] != ["Pooling"]:
        raise ConfigError(f"{modules_file}: the Transformer must be followed by a Pooling module")
    hidden_dir = paths[0]
    pooling, pooling_dimension = _read_pooling(paths[1] / "config.json")
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
        transformer_dir=hidden_dir,
        pooling=pooling,
        pooling_dimension=pooling_dimension,
        steps=tuple(steps),
        **_transformer_settings(hidden_dir),
        **metadata,
    )


def _module_kind(source: Path, entry: Any) -> str:
    """The class name of a module entry; anything but sentence-transformers' own is refused."""
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
        raise ConfigError(f"{source}: each module needs a 'type' string, got {entry!r}")
    module_type: str = entry["type"]
    package, _, kind = module_type.rpartition(".")
    if not package.startswith("sentence_transformers") or kind not in (
        "Transformer",
        "Pooling",
        "Dense",
        "Normalize",
    ):
        raise ConfigError(
            f"{source}: module {entry.get('name', entry.get('idx'))!r} has type {module_type!r}, "
            "which this server does not implement (supported: Transformer, Pooling, Dense, "
            "Normalize)"
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


def _transformer_settings(folder: Path) -> dict[str, Any]:
    """`max_seq_length` and `do_lower_case`; every other key must be inert or at its default."""
    path = folder / "sentence_bert_config.json"
    raw = read_json_object(path, required=False)
    _refuse_unknown(
        path,
        raw,
        {"max_seq_length", "do_lower_case", "modality_config", *_TRANSFORMER_DEFAULTS}
        | set(_INERT_TRANSFORMER_KEYS),
    )
    for key, default in _TRANSFORMER_DEFAULTS.items():
        if raw.get(key, default) not in (default, {}):
            raise ConfigError(f"{path}: unsupported {key} {raw[key]!r} (only {default!r})")
    modality = raw.get("modality_config")
    if modality not in (
        None,
        {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
    ):
        raise ConfigError(f"{path}: unsupported modality_config {modality!r} (text only)")
    max_seq_length = raw.get("max_seq_length")
    if max_seq_length is None:
        max_seq_length = _tokenizer_max_length(folder / "tokenizer_config.json")
    elif not isinstance(max_seq_length, int) or max_seq_length <= 0:
        raise ConfigError(f"{path}: key 'max_seq_length' must be a positive integer")
    do_lower_case = raw.get("do_lower_case", False)
    if not isinstance(do_lower_case, bool):
        raise ConfigError(f"{path}: key 'do_lower_case' must be true or false")
    return {"max_seq_length": max_seq_length, "do_lower_case": do_lower_case}


def _tokenizer_max_length(path: Path) -> int | None:
    """sentence-transformers 6 keeps max_seq_length as the tokenizer's `model_max_length`."""
    value = read_json_object(path, required=False).get("model_max_length")
    # transformers writes a huge sentinel (1e30) when the limit is unset.
    if isinstance(value, int) and 0 < value < 1_000_000:
        return value
    return None


def _read_metadata(path: Path) -> dict[str, Any]:
    """Prompts, the default prompt and the similarity function."""
    raw = read_json_object(path, required=False)
    unknown = sorted(set(raw) - set(_METADATA_KEYS))
    if unknown:
        log.warning("%s: ignoring keys that do not change vectors: %s", path, ", ".join(unknown))
    kind = raw.get("model_type", "SentenceTransformer")
    if kind != "SentenceTransformer":
        raise ConfigError(f"{path}: unsupported model_type {kind!r} (only 'SentenceTransformer')")
    prompts = raw.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise ConfigError(f"{path}: key 'prompts' must map names to strings")
    default = raw.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ConfigError(f"{path}: default_prompt_name {default!r} is not one of the prompts")
    similarity = raw.get("similarity_fn_name") or "cosine"
    check_similarity_fn(similarity, str(path))
    return {"prompts": prompts, "default_prompt_name": default, "similarity_fn_name": similarity}


def _refuse_unknown(path: Path, raw: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(
            f"{path}: unsupported key {unknown[0]!r}: this server does not implement it, and "
            "serving without it could give vectors that differ from the model's own"
        )

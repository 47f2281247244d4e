"""Loading a model folder: the encoder, what runs after it for the task, the tokenizer, and what
the service reports about it.

Networks are built on the meta device: no random init, and the loaded tensors become the
parameters (assign=True) instead of being copied into a second set of them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch
from torch import nn

from model.architectures import Encoder, EncoderConfig, config_from_hf
from model.architectures.base import ConfigReader
from model.architectures.bert import TransformerEncoder
from model.checkpoint import load_weights, read_json_object, weight_file, weight_keys
from model.device import DtypeChoice
from model.errors import CheckpointError, ConfigError
from model.folder import DenseModule, FolderSpec, ScoreActivation, read_folder
from model.heads import Head, MaskedLMHead, build_head
from model.info import ModelInfo, Task
from model.pipeline import Dense, EmbeddingPipeline, Normalize
from model.tokenizer import TextTokenizer
from model.tokenizer_class import check_tokenizer_class, checks_tokenizer_json, uses_token_types

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    network: Encoder
    # Embed: the sentence-transformers pipeline; classify and sparse: the task's head.
    head: EmbeddingPipeline | Head
    tokenizer: TextTokenizer
    info: ModelInfo


def parse_task(task: str) -> Task | None:
    """None for "auto" (the folder decides)."""
    if task == "auto":
        return None
    try:
        return Task(task)
    except ValueError:
        choices = ", ".join(["auto", *Task])
        raise ConfigError(f"unknown task {task!r} (choose one of {choices})") from None


def load_model(
    folder: Path,
    device: torch.device,
    choice: DtypeChoice,
    *,
    task: str = "auto",
    model_id: str | None = None,
    max_input_tokens: int | None = None,
) -> LoadedModel:
    """`max_input_tokens` can only lower the model's own limit."""
    spec = read_folder(folder, parse_task(task))
    source = spec.transformer_dir / "config.json"
    raw = read_json_object(source)
    config = config_from_hf(raw, str(source))
    head: EmbeddingPipeline | Head
    labels: tuple[str, ...] = ()
    if spec.task is Task.EMBED:
        network = load_network(config, spec.transformer_dir, device, choice.dtype)
        head = load_pipeline(spec, config.hidden_size).to(device)
        dimensions = head.dimensions(config.hidden_size)
    else:
        reader = ConfigReader(raw, str(source))
        network, head, labels = load_network_with_head(config, reader, spec, device, choice.dtype)
        dimensions = len(labels) if spec.task is Task.CLASSIFY else config.vocab_size
    ceiling = config.max_positions
    max_tokens = min(spec.max_seq_length or ceiling, max_input_tokens or ceiling, ceiling)
    tokenizer_file = spec.transformer_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(f"{tokenizer_file}: file not found")
    tokenizer_json = tokenizer_file.read_text(encoding="utf-8")
    if checks_tokenizer_json(spec.tokenizer_settings, config.model_type):
        settings_path = spec.transformer_dir / "tokenizer_config.json"
        check_tokenizer_class(orjson.loads(tokenizer_json), spec.tokenizer_settings, settings_path)
    tokenizer = TextTokenizer(
        tokenizer_json,
        max_tokens,
        config.vocab_size,
        lowercase=spec.do_lower_case,
        truncation_side=spec.truncation_side,
        token_types=uses_token_types(spec.tokenizer_settings),
    )
    if tokenizer.truncation_side == "left" and any(spec.prompts.values()):
        # sentence-transformers cuts a long prompted text's start, prompt included (and
        # pooling without the prompt then leaves out text); this server keeps the prompt.
        raise ConfigError(
            f"{spec.transformer_dir}: a left truncation side with prompts is not supported "
            "(sentence-transformers cuts the prompt away from long inputs; this server keeps "
            "it): cut on the right, or ask for a left cut per request"
        )
    info = ModelInfo(
        model_id=model_id or str(folder),
        model_type=config.model_type,
        positions=config.positions,
        dimensions=dimensions,
        hidden_size=config.hidden_size,
        max_input_tokens=max_tokens,
        pooling=_pooling_names(spec),
        include_prompt=spec.pooling.include_prompt,
        dense=tuple(
            f"{s.spec.in_features} -> {s.spec.out_features}, {s.spec.activation}"
            for s in spec.steps
            if isinstance(s, DenseModule)
        ),
        normalize=isinstance(head, EmbeddingPipeline) and head.normalize,
        dtype=choice.name,
        dtype_reason=choice.reason,
        device=str(device),
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        vocab_size=config.vocab_size,
        prompts=dict(spec.prompts),
        default_prompt_name=spec.default_prompt_name,
        do_lower_case=spec.do_lower_case,
        similarity_fn_name=spec.similarity_fn_name,
        task=spec.task,
        labels=labels,
    )
    log.info(
        "loaded %s from %s for task %s on %s as %s (%s)",
        info.model_id,
        folder,
        info.task,
        device,
        info.dtype,
        info.dtype_reason,
    )
    return LoadedModel(network, head, tokenizer, info)


def _pooling_names(spec: FolderSpec) -> tuple[str, ...]:
    if spec.task is Task.CLASSIFY:
        return ("cls",)  # every classification head reads the first token
    if spec.splade is not None:
        return (f"splade_{spec.splade.pooling_strategy}",)
    return tuple(str(mode) for mode in spec.pooling.modes)


def load_network(
    config: EncoderConfig, folder: Path, device: torch.device, dtype: torch.dtype
) -> Encoder:
    with torch.device("meta"):
        network = config.build()
    weights = load_weights(folder, _shapes(network), config.checkpoint_prefixes)
    return _finish_network(network, weights, device, dtype)


def load_network_with_head(
    config: EncoderConfig,
    raw: ConfigReader,
    spec: FolderSpec,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Encoder, Head, tuple[str, ...]]:
    """The encoder and the task's head from one checkpoint, and the head's labels."""
    with torch.device("meta"):
        network = config.build()
        head, labels = build_head(spec.task, config, raw, spec.splade)
    _check_score_activation(spec.score_activation, labels)
    if spec.task is Task.SPARSE and spec.pooling_dimension not in (None, config.vocab_size):
        raise ConfigError(
            f"{spec.pooling_file}: embedding dimension {spec.pooling_dimension} does not "
            f"match the vocabulary size {config.vocab_size}"
        )
    head_shapes = _shapes(head)
    under_prefix = {k: v for k, v in head_shapes.items() if k.startswith(head.encoder_side)}
    own = {k: v for k, v in head_shapes.items() if k not in under_prefix}
    _check_head_weights(spec, raw, head, own)
    weights = load_weights(
        spec.transformer_dir,
        {**_shapes(network), **under_prefix},
        config.checkpoint_prefixes,
        extra=own,
    )
    head_weights = {key: weights.pop(key) for key in head_shapes}
    network = _finish_network(network, weights, device, dtype)
    head.load_state_dict(head_weights, strict=True, assign=True)
    # A classification head is small and runs in float32, like Dense layers. A masked-LM
    # head's vocabulary matrix is as large as the word embeddings (it may be them): it stays
    # in the encoder's dtype, and only its outputs are taken to float32.
    head_dtype = dtype if isinstance(head, MaskedLMHead) else torch.float32
    head = head.to(device=device, dtype=head_dtype).eval().requires_grad_(False)
    if isinstance(head, MaskedLMHead) and head.tied:
        # Heads exist for BERT-family encoders only (build_head).
        assert isinstance(network, TransformerEncoder)
        head.tie(network.embeddings.word_embeddings)
    return network, head, labels


def _finish_network(
    network: Encoder, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> Encoder:
    network.load_state_dict(weights, strict=True, assign=True)
    network.reset_buffers()
    return network.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _shapes(module: nn.Module) -> dict[str, torch.Size]:
    return {key: value.shape for key, value in module.state_dict().items()}


def _check_head_weights(
    spec: FolderSpec, raw: ConfigReader, head: Head, own: Mapping[str, torch.Size]
) -> None:
    """A checkpoint without the task's head is refused by what it lacks, not as corrupt."""
    missing = sorted(set(own) - weight_keys(spec.transformer_dir))
    if missing:
        architectures = ", ".join(map(str, raw.raw.get("architectures") or ["not given"]))
        raise CheckpointError(
            f"{weight_file(spec.transformer_dir)}: task {spec.task.value!r} needs "
            f"{head.description}, and key {missing[0]!r} is missing ({len(missing)} of the "
            f"head's keys missing; {raw.source} architectures: {architectures})"
        )


def _check_score_activation(activation: ScoreActivation | None, labels: tuple[str, ...]) -> None:
    """Several labels are scored by softmax (one by sigmoid): a folder that scores each of
    several labels by its own sigmoid (multi-label) would be served wrong."""
    if activation is not None and activation.name == "Sigmoid" and len(labels) > 1:
        raise ConfigError(
            f"{activation.source}: Sigmoid over {len(labels)} labels (independent multi-label "
            "scores) is not supported; several labels are scored by softmax"
        )


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
            with torch.device("meta"):
                dense = Dense(step.spec)
            weights = load_weights(step.folder, _shapes(dense))
            dense.load_state_dict(weights, strict=True, assign=True)
            steps.append(dense.float().eval().requires_grad_(False))
            size = step.spec.out_features
        elif index < len(spec.steps) - 1:
            steps.append(Normalize())
    trailing_norm = bool(spec.steps) and not isinstance(spec.steps[-1], DenseModule)
    return EmbeddingPipeline(
        spec.pooling, steps, normalize=trailing_norm, truncate_dim=spec.truncate_dim
    )

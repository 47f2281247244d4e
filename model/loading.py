"""Loading a model folder: the encoder and what runs after it for the task (model/tasks/), the
tokenizer, and what the service reports about it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch

from model.architectures import Encoder, config_from_hf
from model.architectures.base import ConfigReader
from model.checkpoint import read_json_object
from model.device import DtypeChoice
from model.errors import ConfigError
from model.folder import DenseModule
from model.heads import Head
from model.info import ModelInfo, Task
from model.pipeline import EmbeddingPipeline
from model.tasks import MODEL_TASKS, read_folder
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
    model_task = MODEL_TASKS[spec.task]
    network, head, dimensions, labels = model_task.load(
        config, ConfigReader(raw, str(source)), spec, device, choice.dtype
    )
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
        pooling=model_task.pooling_names(spec),
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

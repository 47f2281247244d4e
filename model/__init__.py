"""A from-scratch BERT-family encoder that loads trained checkpoints; no web code here."""

from model.architectures import EncoderConfig
from model.embedder import AttentionSpec, BatchOutput, Embedder, ModelInfo
from model.errors import (
    CheckpointError,
    ConfigError,
    InputError,
    InputTooLongError,
    ModelError,
    ModelNotFoundError,
    PromptError,
    TokenIdError,
)
from model.heads import Task
from model.pipeline import FloatArray, PoolingMode, finish
from model.resolve import DEFAULT_MODEL_ID
from model.tokenizer import Direction, Encoded

__all__ = [
    "DEFAULT_MODEL_ID",
    "AttentionSpec",
    "BatchOutput",
    "CheckpointError",
    "ConfigError",
    "Direction",
    "Embedder",
    "Encoded",
    "EncoderConfig",
    "FloatArray",
    "InputError",
    "InputTooLongError",
    "ModelError",
    "ModelInfo",
    "ModelNotFoundError",
    "PoolingMode",
    "PromptError",
    "Task",
    "TokenIdError",
    "finish",
]

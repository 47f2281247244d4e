"""A from-scratch BERT-family encoder that loads trained checkpoints; no web code here."""

from model.config import EncoderConfig
from model.embedder import BatchOutput, Embedder, ModelInfo
from model.errors import (
    CheckpointError,
    ConfigError,
    InputError,
    InputTooLongError,
    ModelError,
    ModelNotFoundError,
    TokenIdError,
)
from model.pooling import Pooling, finalize
from model.resolve import DEFAULT_MODEL_ID
from model.tokenizer import Direction, Encoded

__all__ = [
    "DEFAULT_MODEL_ID",
    "BatchOutput",
    "CheckpointError",
    "ConfigError",
    "Direction",
    "Embedder",
    "Encoded",
    "EncoderConfig",
    "InputError",
    "InputTooLongError",
    "ModelError",
    "ModelInfo",
    "ModelNotFoundError",
    "Pooling",
    "TokenIdError",
    "finalize",
]

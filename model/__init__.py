"""A from-scratch BERT-family encoder that loads trained checkpoints; no web code here.

The names that need torch are imported on first use: the supervisor and the front ends use
the settings, the model's description and its tokenizer (model/info.py, model/codec.py) and
never run a model, and importing torch would cost each of them over a hundred MiB.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

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
from model.resolve import DEFAULT_MODEL_ID

if TYPE_CHECKING:
    from model.architectures import EncoderConfig
    from model.codec import ModelCard, TextCodec
    from model.embedder import BatchOutput, Embedder, PendingOutput
    from model.info import AttentionSpec, ModelInfo, Task
    from model.pipeline import PoolingMode
    from model.tokenizer import Direction, Encoded
    from model.vectors import FloatArray, finish

# Each name imported on first use, from its module. Those of model.info, model.vectors,
# model.codec and model.tokenizer need no torch: a front end uses them.
_LAZY = {
    "EncoderConfig": "model.architectures",
    "AttentionSpec": "model.info",
    "BatchOutput": "model.embedder",
    "Embedder": "model.embedder",
    "PendingOutput": "model.embedder",
    "ModelCard": "model.codec",
    "ModelInfo": "model.info",
    "Task": "model.info",
    "TextCodec": "model.codec",
    "FloatArray": "model.vectors",
    "PoolingMode": "model.pipeline",
    "finish": "model.vectors",
    "Direction": "model.tokenizer",
    "Encoded": "model.tokenizer",
}


if not TYPE_CHECKING:  # type checkers see the imports above, and flag misspelt names

    def __getattr__(name: str) -> object:
        if name not in _LAZY:
            raise AttributeError(f"module 'model' has no attribute {name!r}")
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value  # once imported, an ordinary attribute
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "ModelCard",
    "ModelError",
    "ModelInfo",
    "ModelNotFoundError",
    "PendingOutput",
    "PoolingMode",
    "PromptError",
    "Task",
    "TextCodec",
    "TokenIdError",
    "finish",
]

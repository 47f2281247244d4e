"""Every encoder architecture this service runs, found by the `model_type` in `config.json`.

To add one: a module here with its config (derived from `EncoderConfig`, with `from_hf` and
`build`) and its `Encoder`, one line in `ARCHITECTURES`, and a parity test against
`transformers` in tests/model/.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.architectures.base import ConfigReader, Encoder, EncoderConfig, EncoderOutput
from model.architectures.bert import BertConfig
from model.architectures.distilbert import DistilBertConfig
from model.architectures.modernbert import ModernBertConfig
from model.architectures.mpnet import MPNetConfig
from model.errors import ConfigError

ARCHITECTURES: dict[str, type[EncoderConfig]] = {
    "bert": BertConfig,
    "roberta": BertConfig,
    "xlm-roberta": BertConfig,
    "distilbert": DistilBertConfig,
    "mpnet": MPNetConfig,
    "modernbert": ModernBertConfig,
}


def config_from_hf(raw: Mapping[str, Any], source: str = "config.json") -> EncoderConfig:
    """The architecture's own config, from a Hugging Face `config.json`."""
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: missing key 'model_type'")
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"{source}: unsupported model_type {model_type!r} "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return ARCHITECTURES[model_type].from_hf(ConfigReader(raw, source))


__all__ = [
    "ARCHITECTURES",
    "BertConfig",
    "DistilBertConfig",
    "Encoder",
    "EncoderConfig",
    "EncoderOutput",
    "MPNetConfig",
    "ModernBertConfig",
    "config_from_hf",
]

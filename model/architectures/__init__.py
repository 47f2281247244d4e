"""Every encoder architecture this service runs, found by the `model_type` in `config.json`.

To add one: a module here with its config (derived from `EncoderConfig`, with `from_hf` and
`build`) and its `Encoder`, one line in `ARCHITECTURES`, and a parity test in tests/model/:
against `transformers`, or, for a model whose code lives only with its weights, against numbers
its authors' code produced (tests/model/fixtures/, each naming its source).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model.architectures.base import ConfigReader, Encoder, EncoderConfig, EncoderOutput
from model.architectures.bert import BertConfig
from model.architectures.distilbert import DistilBertConfig
from model.architectures.gemma3 import Gemma3Config
from model.architectures.gte import GteConfig
from model.architectures.jina_bert import JinaBertConfig
from model.architectures.modernbert import ModernBertConfig
from model.architectures.mpnet import MPNetConfig
from model.architectures.nomic_bert import NomicBertConfig
from model.architectures.qwen3 import Qwen3Config
from model.errors import ConfigError

ARCHITECTURES: dict[str, type[EncoderConfig]] = {
    "bert": BertConfig,
    "roberta": BertConfig,
    "xlm-roberta": BertConfig,
    "distilbert": DistilBertConfig,
    "mpnet": MPNetConfig,
    "modernbert": ModernBertConfig,
    "nomic_bert": NomicBertConfig,
    # Chosen by config_from_hf: JinaBERT's config.json says model_type "bert".
    "jina_bert": JinaBertConfig,
    "new": GteConfig,
    "gte": GteConfig,
    "gemma3_text": Gemma3Config,
    "qwen3": Qwen3Config,
}


def config_from_hf(raw: Mapping[str, Any], source: str = "config.json") -> EncoderConfig:
    """The architecture's own config, from a Hugging Face `config.json`."""
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: missing key 'model_type'")
    if model_type == "bert" and raw.get("position_embedding_type") == "alibi":
        model_type = "jina_bert"
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

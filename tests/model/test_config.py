from __future__ import annotations

from typing import Any

import pytest

from model import ConfigError
from model.architectures import BertConfig, config_from_hf
from tests.helpers import TINY_CONFIG


def test_bert_and_roberta_configs() -> None:
    bert = config_from_hf(TINY_CONFIG)
    assert isinstance(bert, BertConfig)
    assert (bert.position_offset, bert.max_positions, bert.norm_first) == (0, 64, False)
    roberta = config_from_hf(
        {**TINY_CONFIG, "model_type": "roberta", "pad_token_id": 1, "max_position_embeddings": 66}
    )
    assert isinstance(roberta, BertConfig)
    assert (roberta.position_offset, roberta.max_positions) == (2, 64)
    xlmr = {k: v for k, v in TINY_CONFIG.items() if k != "pad_token_id"} | {
        "model_type": "xlm-roberta"
    }
    xlmr_config = config_from_hf(xlmr)
    assert isinstance(xlmr_config, BertConfig)
    assert xlmr_config.position_offset == 2  # default pad_token_id 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
        ({"model_type": None}, "missing key 'model_type'"),
        ({"hidden_size": None}, "missing key 'hidden_size'"),
        ({"num_hidden_layers": "six"}, "'num_hidden_layers' must be a positive integer"),
        ({"hidden_act": "swish"}, "unsupported hidden_act 'swish'"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"is_decoder": True}, "unsupported is_decoder True"),
        ({"num_attention_heads": 5}, "not divisible"),
    ],
)
def test_bad_config_names_the_key(change: dict[str, Any], message: str) -> None:
    raw = {k: v for k, v in {**TINY_CONFIG, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        config_from_hf(raw, "config.json")


def test_config_is_frozen() -> None:
    config = config_from_hf(TINY_CONFIG)
    with pytest.raises(AttributeError):
        config.hidden_size = 3  # type: ignore[misc]


def test_seed_variant() -> None:
    config = BertConfig.seed_variant(
        vocab_size=10, d_model=8, num_heads=2, num_layers=1, d_ff=16, max_len=12
    )
    assert config.position_kind == "sinusoidal" and config.scale_embeddings and config.norm_first
    assert config.type_vocab_size == 0 and not config.embedding_layer_norm

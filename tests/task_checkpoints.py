"""Tiny cross-encoder and masked-LM checkpoints, saved by `transformers` into temporary folders.

Every parameter is perturbed after init (LayerNorms and heads too), so that a misplaced norm
or a head left at its init cannot hide. Tokenizers have a pair template: BERT's with token
types, or RoBERTa's (`<s> A </s></s> B </s>`, spelled with this vocabulary's [CLS] and [SEP]).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, processors

from model.heads import Splade
from tests.helpers import TINY_CONFIG, TINY_VOCAB, tiny_tokenizer

# model_type -> (config class, its values beyond TINY_CONFIG)
CONFIGS: dict[str, tuple[Any, dict[str, Any]]] = {
    "bert": (transformers.BertConfig, {}),
    "roberta": (
        transformers.RobertaConfig,
        {"pad_token_id": 1, "type_vocab_size": 1, "max_position_embeddings": 66},
    ),
    "xlm-roberta": (
        transformers.XLMRobertaConfig,
        {"pad_token_id": 1, "type_vocab_size": 1, "max_position_embeddings": 66},
    ),
}
CLASSIFIERS = {
    "bert": transformers.BertForSequenceClassification,
    "roberta": transformers.RobertaForSequenceClassification,
    "xlm-roberta": transformers.XLMRobertaForSequenceClassification,
}
MASKED_LMS = {
    "bert": transformers.BertForMaskedLM,
    "roberta": transformers.RobertaForMaskedLM,
    "xlm-roberta": transformers.XLMRobertaForMaskedLM,
}


def pair_tokenizer(model_type: str = "bert") -> Tokenizer:
    """The tiny WordPiece tokenizer with the architecture's pair template."""
    tokenizer = tiny_tokenizer()
    ids = [("[CLS]", TINY_VOCAB.index("[CLS]")), ("[SEP]", TINY_VOCAB.index("[SEP]"))]
    if model_type == "bert":
        pair = "[CLS] $A [SEP] $B:1 [SEP]:1"
    else:
        pair = "[CLS] $A [SEP] [SEP] $B [SEP]"
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair=pair, special_tokens=ids
    )
    return tokenizer


def hf_config(model_type: str, **extra: Any) -> Any:
    config_class, overrides = CONFIGS[model_type]
    values = {k: v for k, v in TINY_CONFIG.items() if k != "model_type"}
    return config_class(**{**values, **overrides, **extra}, attn_implementation="eager")


def labelled(num_labels: int) -> dict[str, Any]:
    """Config values for `num_labels` named labels (transformers numbers them LABEL_i for 1)."""
    if num_labels == 1:
        return {"num_labels": 1}
    names = ["contradiction", "entailment", "neutral", "other"][:num_labels]
    return {
        "id2label": dict(enumerate(names)),
        "label2id": {name: i for i, name in enumerate(names)},
    }


def save_task_model(
    folder: Path, model_class: Any, model_type: str, *, max_length: int = 40, **extra: Any
) -> Any:
    """A perturbed random task model and its tokenizer, saved as `transformers` saves them;
    `max_length` is the tokenizer's `model_max_length`, which the folder's limit comes from."""
    torch.manual_seed(0)
    reference = model_class(hf_config(model_type, **extra)).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    reference.save_pretrained(folder)
    # BERT's tokenizers return token types, RoBERTa's do not (their models have one type).
    inputs = ["input_ids", "attention_mask"]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=pair_tokenizer(model_type),
        model_max_length=max_length,
        model_input_names=[*inputs, "token_type_ids"] if model_type == "bert" else inputs,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
    )
    fast.save_pretrained(folder)
    return reference


def write_splade_folder(folder: Path, splade: Splade) -> None:
    """The files sentence-transformers 5.4 and later saves around a fill-mask Transformer."""
    (folder / "1_SpladePooling").mkdir()
    pooling = {
        "pooling_strategy": splade.pooling_strategy,
        "activation_function": splade.activation_function,
        "embedding_dimension": None,
    }
    (folder / "1_SpladePooling" / "config.json").write_text(json.dumps(pooling))
    modules = [
        {
            "idx": 0,
            "name": "0",
            "path": "",
            "type": "sentence_transformers.base.modules.transformer.Transformer",
        },
        {
            "idx": 1,
            "name": "1",
            "path": "1_SpladePooling",
            "type": "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling",
        },
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"transformer_task": "fill-mask"}))


def splade_difference(got: torch.Tensor, expected: torch.Tensor, strategy: str) -> float:
    """The largest difference between SPLADE weights; for sum pooling relative to the weight
    where it is over 1. Sums of up to 40 weights reach about 30, where float32 values are
    3.8e-6 apart: a bound of 1e-5 there is 1e-5 relative, as for the float32 logits."""
    scale = expected.abs().clamp(min=1) if strategy == "sum" else torch.ones_like(expected)
    return float(((got - expected).abs() / scale).max())

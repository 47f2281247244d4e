"""Parity with sentence-transformers' CrossEncoder and SparseEncoder on tiny folders.

Folders in the current format are saved by sentence-transformers itself; folders in the format
that 5.0-5.3 saved (a CrossEncoder's settings in config.json, `sparse_encoder.models` module
types) are written here as files, since the installed library saves only the current one, and
loaded by both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from sentence_transformers import CrossEncoder, SparseEncoder
from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

from model import Embedder, Task
from tests.task_checkpoints import (
    CLASSIFIERS,
    MASKED_LMS,
    labelled,
    save_task_model,
    splade_difference,
)

TOLERANCE = 1e-5
CPU = torch.device("cpu")
PAIRS = [
    ("hello world", "the quick brown fox jumps over the lazy dog"),
    ("fox", "dog"),
    ("the lazy dog, the lazy dog!", "hello"),
    (" ".join(["the quick brown fox"] * 5), " ".join(["jumps over the lazy"] * 5)),
    ("é?", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2),
    ("", "hello"),
]
TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "é",
    "",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2,  # over the 40-token limit
]


def load(folder: Path) -> Embedder:
    return Embedder.from_folder(folder, CPU, torch.float32)


def scores(ours: Embedder) -> torch.Tensor:
    return ours.forward(ours.tokenize_pairs(PAIRS)).pooled


def check_cross_encoder(folder: Path, num_labels: int) -> float:
    """The raw logits, and what the service derives from them (sigmoid of one logit, softmax
    of several), against CrossEncoder.predict; the largest difference."""
    reference = CrossEncoder(str(folder), device="cpu")
    ours = load(folder)
    assert ours.info.task is Task.CLASSIFY and ours.info.dimensions == num_labels
    logits = scores(ours)
    raw = torch.as_tensor(reference.predict(PAIRS, activation_fn=torch.nn.Identity()))
    differences = [(logits - raw.reshape(logits.shape)).abs().max()]
    if num_labels == 1:
        default = torch.as_tensor(reference.predict(PAIRS))  # the folder's own activation
        if isinstance(reference.activation_fn, torch.nn.Sigmoid):
            differences.append((torch.sigmoid(logits[:, 0]) - default).abs().max())
    else:
        softmax = torch.as_tensor(reference.predict(PAIRS, apply_softmax=True))
        differences.append((torch.softmax(logits, dim=-1) - softmax).abs().max())
    worst = float(max(differences))
    assert worst <= TOLERANCE, f"scores differ by {worst}"
    return worst


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
@pytest.mark.parametrize("num_labels", [1, 3])
def test_cross_encoder_saved_by_sentence_transformers(
    tmp_path: Path, model_type: str, num_labels: int
) -> None:
    save_task_model(tmp_path / "hf", CLASSIFIERS[model_type], model_type, **labelled(num_labels))
    CrossEncoder(str(tmp_path / "hf"), device="cpu").save_pretrained(str(tmp_path / "ce"))
    modules = json.loads((tmp_path / "ce" / "modules.json").read_text())
    assert [m["type"].rpartition(".")[2] for m in modules] == ["Transformer"]
    check_cross_encoder(tmp_path / "ce", num_labels)


@pytest.mark.parametrize(
    ("settings", "num_labels"),
    [
        # 4.0-5.3: under "sentence_transformers" in config.json.
        (
            {
                "sentence_transformers": {
                    "activation_fn": "torch.nn.modules.activation.Sigmoid",
                    "version": "5.1.0",
                }
            },
            1,
        ),
        (
            {
                "sentence_transformers": {
                    "activation_fn": "torch.nn.modules.linear.Identity",
                    "version": "5.1.0",
                }
            },
            3,
        ),
        # Before 4.0 (ms-marco cross-encoders on the Hub still have this).
        ({"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}, 1),
    ],
)
def test_cross_encoder_in_the_older_format(
    tmp_path: Path, settings: dict[str, Any], num_labels: int
) -> None:
    save_task_model(tmp_path, CLASSIFIERS["bert"], "bert", **labelled(num_labels))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | settings))
    check_cross_encoder(tmp_path, num_labels)


def check_sparse_encoder(folder: Path) -> float:
    reference = SparseEncoder(str(folder), device="cpu")
    ours = load(folder)
    assert ours.info.task is Task.SPARSE and ours.info.dimensions == ours.info.vocab_size
    expected = reference.encode(TEXTS, convert_to_tensor=True, convert_to_sparse_tensor=False)
    got = ours.forward(ours.tokenize(TEXTS)).pooled
    strategy = json.loads((folder / "1_SpladePooling" / "config.json").read_text())
    difference = splade_difference(got, expected.to_dense(), strategy["pooling_strategy"])
    assert difference <= TOLERANCE, f"sparse vectors differ by {difference}"
    assert ours.info.similarity_fn_name == "dot"
    return difference


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_sparse_encoder_saved_by_sentence_transformers(tmp_path: Path, model_type: str) -> None:
    save_task_model(tmp_path / "hf", MASKED_LMS[model_type], model_type)
    SparseEncoder(str(tmp_path / "hf"), device="cpu").save_pretrained(str(tmp_path / "se"))
    modules = json.loads((tmp_path / "se" / "modules.json").read_text())
    assert [m["type"].rpartition(".")[2] for m in modules] == ["Transformer", "SpladePooling"]
    check_sparse_encoder(tmp_path / "se")


@pytest.mark.parametrize(
    ("strategy", "activation"), [("sum", "relu"), ("max", "log1p_relu"), ("sum", "log1p_relu")]
)
def test_sparse_encoder_pooling_settings(tmp_path: Path, strategy: str, activation: str) -> None:
    """Built from the (deprecated) MLMTransformer module, which 6.x still saves by its name."""
    save_task_model(tmp_path / "hf", MASKED_LMS["bert"], "bert")
    modules = [
        MLMTransformer(str(tmp_path / "hf")),
        SpladePooling(pooling_strategy=strategy, activation_function=activation),
    ]
    SparseEncoder(modules=modules, device="cpu").save_pretrained(str(tmp_path / "se"))
    saved = json.loads((tmp_path / "se" / "modules.json").read_text())
    assert saved[0]["type"].endswith("MLMTransformer")
    check_sparse_encoder(tmp_path / "se")


def test_sparse_encoder_in_the_older_format(tmp_path: Path) -> None:
    """The files sentence-transformers 5.0-5.3 saved for a SPLADE model."""
    reference = save_task_model(tmp_path, transformers.BertForMaskedLM, "bert")
    files: dict[str, Any] = {
        "modules.json": [
            {
                "idx": 0,
                "name": "0",
                "path": "",
                "type": "sentence_transformers.sparse_encoder.models.MLMTransformer",
            },
            {
                "idx": 1,
                "name": "1",
                "path": "1_SpladePooling",
                "type": "sentence_transformers.sparse_encoder.models.SpladePooling",
            },
        ],
        "sentence_bert_config.json": {"max_seq_length": 40, "do_lower_case": False},
        "1_SpladePooling/config.json": {
            "pooling_strategy": "max",
            "activation_function": "relu",
            "word_embedding_dimension": reference.config.vocab_size,
        },
        "config_sentence_transformers.json": {
            "model_type": "SparseEncoder",
            "__version__": {
                "sentence_transformers": "5.1.0",
                "transformers": "4.55.0",
                "pytorch": "2.7.1",
            },
            "prompts": {"query": "", "document": ""},
            "default_prompt_name": None,
            "similarity_fn_name": "dot",
        },
    }
    (tmp_path / "1_SpladePooling").mkdir()
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    check_sparse_encoder(tmp_path)


def test_cross_encoder_whose_tokenizer_gives_no_segment_ids(tmp_path: Path) -> None:
    """model_input_names without token_type_ids: transformers hands the model no segment ids,
    so the second text of a pair is segment 0 as well (the scores change: the trained
    segment embeddings differ)."""
    save_task_model(tmp_path / "hf", CLASSIFIERS["bert"], "bert", **labelled(1))
    CrossEncoder(str(tmp_path / "hf"), device="cpu").save_pretrained(str(tmp_path / "ce"))
    settings_path = tmp_path / "ce" / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text())
    settings["model_input_names"] = ["input_ids", "attention_mask"]
    settings_path.write_text(json.dumps(settings))
    check_cross_encoder(tmp_path / "ce", 1)
    with_segments = load(tmp_path / "hf")
    assert (scores(with_segments) - scores(load(tmp_path / "ce"))).abs().max() > 1e-3

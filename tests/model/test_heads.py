"""Classification and SPLADE heads: parity with `transformers` on tiny random checkpoints.

Inputs are padded batches of mixed lengths, pairs (with their token types, some truncated)
beside single texts, tokenized by `transformers` and by this code (which must agree).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from model import Embedder, Encoded, Task, packing
from model import heads as heads_module
from model.heads import Splade
from tests.helpers import every_map
from tests.task_checkpoints import (
    CLASSIFIERS,
    MASKED_LMS,
    labelled,
    save_task_model,
    splade_difference,
    write_splade_folder,
)

TOLERANCE = 1e-5
CPU = torch.device("cpu")
PAIRS = [
    ("hello world", "the quick brown fox jumps over the lazy dog"),
    ("fox", "dog"),
    ("the lazy dog, the lazy dog!", "hello"),
    # 6 + 2 x 20 tokens: cut longest-first to the limit of 40.
    (" ".join(["the quick brown fox"] * 5), " ".join(["jumps over the lazy"] * 5)),
    ("é?", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2),
]
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "é", "a b c"]


def load(folder: Path, task: str = "auto") -> Embedder:
    return Embedder.from_folder(folder, CPU, torch.float32, task=task)


def reference_inputs(folder: Path, pairs: bool) -> dict[str, torch.Tensor]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if pairs:
        firsts, seconds = zip(*PAIRS, strict=True)
        encoded = tokenizer(list(firsts), list(seconds), truncation=True, padding=True)
    else:
        encoded = tokenizer(TEXTS, truncation=True, padding=True)
    return {key: torch.tensor(value) for key, value in encoded.items()}


def ours_inputs(ours: Embedder) -> tuple[list[Encoded], list[Encoded]]:
    return ours.tokenize_pairs(PAIRS), ours.tokenize(TEXTS)


def check_same_tokens(expected: dict[str, torch.Tensor], got: list[Encoded]) -> None:
    for row, item in enumerate(got):
        n = len(item.ids)
        assert expected["attention_mask"][row].sum() == n
        assert expected["input_ids"][row, :n].tolist() == item.ids
        if "token_type_ids" in expected and item.type_ids is not None:
            assert expected["token_type_ids"][row, :n].tolist() == item.type_ids


@pytest.mark.parametrize("model_type", list(CLASSIFIERS))
@pytest.mark.parametrize("num_labels", [1, 3])
def test_classifier_logits_match_transformers(
    tmp_path: Path, model_type: str, num_labels: int
) -> None:
    reference = save_task_model(
        tmp_path, CLASSIFIERS[model_type], model_type, **labelled(num_labels)
    )
    ours = load(tmp_path)
    assert ours.info.task is Task.CLASSIFY and ours.info.dimensions == num_labels
    assert ours.info.labels == tuple(reference.config.id2label[i] for i in range(num_labels))
    pairs, singles = ours_inputs(ours)
    assert any(item.truncated for item in pairs)
    got = ours.forward([*pairs, *singles], token_embeddings=True)
    assert got.pooled.dtype == torch.float32 and got.pooled.shape == (9, num_labels)
    assert got.token_embeddings is not None
    for rows, batch, is_pairs in ((slice(0, 5), pairs, True), (slice(5, 9), singles, False)):
        inputs = reference_inputs(tmp_path, is_pairs)
        check_same_tokens(inputs, batch)
        with torch.no_grad():
            expected = reference(**inputs, output_hidden_states=True)
        difference = (got.pooled[rows] - expected.logits).abs().max()
        assert difference <= TOLERANCE, f"logits differ by {difference}"
        for item, tokens, states in zip(
            batch, got.token_embeddings[rows], expected.hidden_states[-1], strict=True
        ):
            assert (tokens - states[: len(item.ids)]).abs().max() <= TOLERANCE


def splade_reference(logits: torch.Tensor, mask: torch.Tensor, splade: Splade) -> torch.Tensor:
    """sentence-transformers' SpladePooling, written out."""
    values = torch.log1p(torch.relu(logits * mask.unsqueeze(-1)))
    if splade.activation_function == "log1p_relu":
        values = torch.log1p(values)
    if splade.pooling_strategy == "max":
        return values.max(dim=1).values
    return values.sum(dim=1)


MASKED_LM_CASES = [
    ("bert", {}),
    ("bert", {"hidden_act": "relu"}),
    ("bert", {"tie_word_embeddings": False}),
    ("roberta", {}),
    ("xlm-roberta", {"tie_word_embeddings": False}),
]


@pytest.mark.parametrize(("model_type", "extra"), MASKED_LM_CASES)
@pytest.mark.parametrize("splade", [Splade(), Splade("sum"), Splade("max", "log1p_relu")])
def test_splade_matches_transformers_and_the_formula(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model_type: str,
    extra: dict[str, Any],
    splade: Splade,
) -> None:
    # Several chunks of tokens per batch, so that the pooling across chunks is exercised.
    monkeypatch.setattr(heads_module, "SPARSE_CHUNK_VALUES", 7 * 83)
    reference = save_task_model(tmp_path, MASKED_LMS[model_type], model_type, **extra)
    if splade != Splade():
        write_splade_folder(tmp_path, splade)
    ours = load(tmp_path, "sparse")
    assert ours.info.task is Task.SPARSE and ours.info.dimensions == ours.info.vocab_size
    if not reference.config.tie_word_embeddings:
        decoder = reference.get_output_embeddings().weight
        assert not torch.equal(decoder, reference.get_input_embeddings().weight)
    pairs, singles = ours_inputs(ours)
    got = ours.forward([*singles, *pairs]).pooled
    for rows, is_pairs in ((slice(0, 4), False), (slice(4, 9), True)):
        inputs = reference_inputs(tmp_path, is_pairs)
        with torch.no_grad():
            logits = reference(**inputs).logits
        expected = splade_reference(logits, inputs["attention_mask"], splade)
        difference = splade_difference(got[rows], expected, splade.pooling_strategy)
        assert difference <= TOLERANCE, f"SPLADE weights differ by {difference}"
    assert (got >= 0).all() and (got == 0).any()


LAYOUTS = pytest.mark.parametrize("threshold", [1.1, 0.0], ids=["grid", "packed"])


@LAYOUTS
@pytest.mark.parametrize(
    ("model_class", "model_type", "task"),
    [
        (transformers.BertForSequenceClassification, "bert", "auto"),
        (transformers.XLMRobertaForSequenceClassification, "xlm-roberta", "auto"),
        (transformers.BertForMaskedLM, "bert", "sparse"),
        (transformers.RobertaForMaskedLM, "roberta", "sparse"),
    ],
)
def test_batched_equals_alone(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    threshold: float,
    model_class: Any,
    model_type: str,
    task: str,
) -> None:
    monkeypatch.setattr(packing, "PACKING_MIN_PADDING", threshold)
    monkeypatch.setattr(heads_module, "SPARSE_CHUNK_VALUES", 5 * 83)
    save_task_model(tmp_path, model_class, model_type, **labelled(3))
    ours = load(tmp_path, task)
    pairs, singles = ours_inputs(ours)
    batch: list[Encoded | list[int]] = [*pairs, *singles, []]  # an empty input: a padded row
    maps = every_map(ours)
    together = ours.forward(batch, token_embeddings=True, attention=maps)
    assert together.token_embeddings is not None and together.attentions is not None
    assert torch.isfinite(together.pooled).all()
    for row, item in enumerate(batch[:-1]):
        alone = ours.forward([item], token_embeddings=True, attention=maps)
        assert alone.token_embeddings is not None and alone.attentions is not None
        assert (alone.pooled[0] - together.pooled[row]).abs().max() <= TOLERANCE
        tokens = alone.token_embeddings[0] - together.token_embeddings[row]
        assert tokens.abs().max() <= TOLERANCE
        for layer in maps.layers:
            probs = alone.attentions[0][layer] - together.attentions[row][layer]
            assert probs.abs().max() <= TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_heads_in_half_precision_give_float32(tmp_path: Path, dtype: torch.dtype) -> None:
    """The MLM head runs in the encoder's dtype, the classifier in float32; outputs are float32
    and close to the float32 model's."""
    for model_class, task in (
        (transformers.BertForSequenceClassification, "classify"),
        (transformers.BertForMaskedLM, "sparse"),
    ):
        folder = tmp_path / task
        save_task_model(folder, model_class, "bert", **labelled(3))
        full = load(folder, task)
        half = Embedder.from_folder(folder, CPU, dtype, task=task)
        pairs, singles = ours_inputs(half)
        got = half.forward([*pairs, *singles]).pooled
        want = full.forward([*pairs, *singles]).pooled
        assert got.dtype == torch.float32
        assert (got - want).abs().max() <= 0.1 * want.abs().max()

"""Parity with `transformers` on tiny random BERT and RoBERTa checkpoints (float32, eager)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from model import Embedder
from tests.helpers import TINY_CONFIG, every_map, write_sentence_transformers_files

TOLERANCE = 1e-5
ARCHITECTURES = {
    "bert": (transformers.BertConfig, transformers.BertModel, {}),
    "roberta": (
        transformers.RobertaConfig,
        transformers.RobertaModel,
        {"pad_token_id": 1, "type_vocab_size": 1, "max_position_embeddings": 66},
    ),
    "xlm-roberta": (
        transformers.XLMRobertaConfig,
        transformers.XLMRobertaModel,
        {"pad_token_id": 1, "type_vocab_size": 1, "max_position_embeddings": 66},
    ),
}


def save_reference(folder: Path, model_type: str, **extra: Any) -> Any:
    config_class, model_class, overrides = ARCHITECTURES[model_type]
    values = {k: v for k, v in TINY_CONFIG.items() if k != "model_type"}
    config = config_class(**{**values, **overrides, **extra}, attn_implementation="eager")
    torch.manual_seed(0)
    reference = model_class(config, add_pooling_layer=False).eval()
    with torch.no_grad():  # random LayerNorms too, so that a misplaced norm cannot hide
        for param in reference.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    reference.save_pretrained(folder)
    write_sentence_transformers_files(folder, max_seq_length=60)
    return reference


def padded_batch(pad_id: int) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    lengths = [7, 19, 3, 12]
    vocab = TINY_CONFIG["vocab_size"]
    batch = [torch.randint(5, vocab, (n,), generator=generator).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.full((len(batch), width), pad_id)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, seq in enumerate(batch):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return batch, ids, mask


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
@pytest.mark.parametrize("hidden_act", ["gelu", "relu", "gelu_new"])
def test_hidden_states_and_attention_match_transformers(
    tmp_path: Path, model_type: str, hidden_act: str
) -> None:
    reference = save_reference(tmp_path, model_type, hidden_act=hidden_act)
    ours = Embedder.from_folder(tmp_path, torch.device("cpu"), torch.float32)
    batch, ids, mask = padded_batch(reference.config.pad_token_id)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, output_attentions=True)
    maps = every_map(ours)
    got = ours.forward(batch, token_embeddings=True, attention=maps)
    assert got.token_embeddings is not None and got.attentions is not None
    for row, seq in enumerate(batch):
        n = len(seq)
        diff = (got.token_embeddings[row] - expected.last_hidden_state[row, :n]).abs().max()
        assert diff <= TOLERANCE, f"hidden states differ by {diff}"
        for layer in maps.layers:
            want = expected.attentions[layer][row, :, :n, :n]
            diff = (got.attentions[row][layer] - want).abs().max()
            assert diff <= TOLERANCE, f"layer {layer} attention differs by {diff}"


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_fast_path_matches_explicit_path(tmp_path: Path, model_type: str) -> None:
    save_reference(tmp_path, model_type)
    ours = Embedder.from_folder(tmp_path, torch.device("cpu"), torch.float32)
    batch, _, _ = padded_batch(ours.network.config.pad_token_id)
    fast = ours.forward(batch, token_embeddings=True)
    explicit = ours.forward(batch, token_embeddings=True, attention=every_map(ours))
    assert fast.token_embeddings is not None and explicit.token_embeddings is not None
    for a, b in zip(fast.token_embeddings, explicit.token_embeddings, strict=True):
        assert (a - b).abs().max() <= TOLERANCE


def test_task_model_prefix_is_read(tmp_path: Path) -> None:
    """A checkpoint saved from BertForMaskedLM stores `bert.`-prefixed keys and a head."""
    config = transformers.BertConfig(
        **{k: v for k, v in TINY_CONFIG.items() if k != "model_type"}, attn_implementation="eager"
    )
    torch.manual_seed(0)
    masked_lm = transformers.BertForMaskedLM(config).eval()
    masked_lm.save_pretrained(tmp_path)
    write_sentence_transformers_files(tmp_path)
    ours = Embedder.from_folder(tmp_path, torch.device("cpu"), torch.float32)
    batch, ids, mask = padded_batch(0)
    with torch.no_grad():
        expected = masked_lm.bert(input_ids=ids, attention_mask=mask).last_hidden_state
    got = ours.forward(batch[:1], token_embeddings=True).token_embeddings
    assert got is not None
    assert (got[0] - expected[0, : len(batch[0])]).abs().max() <= TOLERANCE

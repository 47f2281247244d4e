"""Workers holding one copy of the weights (model/shared_weights.py): the same vectors, the
tensors read from one read-only mapping of the store's file, ties kept, other weights refused."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import Tensor

from model import Embedder
from model.device import resolve_dtype
from model.heads import MaskedLMHead
from model.int8 import INT8, int8_unavailable
from model.shared_weights import WeightStore
from tests.task_checkpoints import MASKED_LMS, save_task_model

CPU = torch.device("cpu")
TEXTS = ["a short sentence", "another, somewhat longer, sentence to embed", "x"]


def load(folder: Path, dtype: torch.dtype = torch.float32) -> Embedder:
    return Embedder.from_folder(folder, CPU, dtype)


def mapped_ranges(path: Path) -> list[tuple[int, int, str]]:
    """This process's mappings of `path`: start, end, permissions."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            ranges.append((start, end, fields[1]))
    return ranges


def in_store(tensor: Tensor, store: WeightStore) -> bool:
    address = tensor.data_ptr()
    return any(start <= address < end for start, end, _ in mapped_ranges(store.data))


def weights_of(embedder: Embedder) -> list[Tensor]:
    modules = (embedder.network, embedder.head)
    return [t for m in modules for t in (*m.parameters(), *m.buffers()) if t.numel()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_embedders_share_one_read_only_copy_and_give_the_same_vectors(
    tiny_checkpoint: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    reference = load(tiny_checkpoint, dtype).embed(TEXTS)
    store = WeightStore(tmp_path)
    first, second = load(tiny_checkpoint, dtype), load(tiny_checkpoint, dtype)
    assert first.share_weights(store) and second.share_weights(store)
    for embedder in (first, second):
        assert all(in_store(tensor, store) for tensor in weights_of(embedder))
        assert torch.equal(embedder.embed(TEXTS), reference)  # max abs difference 0
    assert {permissions for _, _, permissions in mapped_ranges(store.data)} == {"r--s"}
    # One file holds every tensor once (a tensor starts on a 64-byte boundary).
    size = sum(t.numel() * t.element_size() for t in weights_of(first))
    assert size <= store.data.stat().st_size < size + 64 * len(weights_of(first))


@pytest.mark.skipif(int8_unavailable(CPU) is not None, reason="no int8 here")
def test_a_compiled_int8_models_rowwise_weights_are_shared_too(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """Its int8 weights and their scales are plain parameters (model/int8.py): one copy in
    the store for every engine, the vectors unchanged (before any graph is compiled, which
    freezes the weights it was traced with: `share_weights` comes first)."""
    int8 = resolve_dtype(INT8, CPU)
    reference = Embedder.from_folder(tiny_checkpoint, CPU, int8, compile=True).embed(TEXTS)
    store = WeightStore(tmp_path)
    first, second = (
        Embedder.from_folder(tiny_checkpoint, CPU, int8, compile=True) for _ in range(2)
    )
    assert first.share_weights(store) and second.share_weights(store)
    for embedder in (first, second):
        weights = weights_of(embedder)
        assert any(tensor.dtype == torch.int8 for tensor in weights)
        assert all(in_store(tensor, store) for tensor in weights)
        assert torch.equal(embedder.embed(TEXTS), reference)


def test_a_tied_vocabulary_matrix_follows_the_shared_word_embeddings(tmp_path: Path) -> None:
    folder = tmp_path / "mlm"
    save_task_model(folder, MASKED_LMS["bert"], "bert")
    reference = Embedder.from_folder(folder, CPU, torch.float32, task="sparse")
    embedder = Embedder.from_folder(folder, CPU, torch.float32, task="sparse")
    store = WeightStore(tmp_path)
    assert embedder.share_weights(store)
    head = embedder.head
    assert isinstance(head, MaskedLMHead) and head.tied
    assert in_store(head.decoder_weight(), store)
    ids = [embedder.tokenize(TEXTS)[1]]
    assert torch.equal(embedder.forward(ids).pooled, reference.forward(ids).pooled)


def test_a_store_holding_other_weights_leaves_them_private(
    tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = WeightStore(tmp_path)
    assert load(tiny_checkpoint, torch.bfloat16).share_weights(store)
    other = load(tiny_checkpoint)  # float32: the same names, other dtypes
    reference = other.embed(TEXTS)
    with caplog.at_level(logging.WARNING, logger="model.shared_weights"):
        assert not other.share_weights(store)
    assert "another model's weights" in caplog.text
    assert not any(in_store(tensor, store) for tensor in weights_of(other))
    assert torch.equal(other.embed(TEXTS), reference)


def test_other_values_under_the_same_names_leave_them_private(
    tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = WeightStore(tmp_path)
    assert load(tiny_checkpoint).share_weights(store)
    other = load(tiny_checkpoint)
    with torch.no_grad():
        next(other.network.parameters()).add_(1.0)
    reference = other.embed(TEXTS)
    with caplog.at_level(logging.WARNING, logger="model.shared_weights"):
        assert not other.share_weights(store)
    assert "other values" in caplog.text
    assert torch.equal(other.embed(TEXTS), reference)


def test_a_store_that_cannot_be_written_leaves_them_private(
    tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    embedder = load(tiny_checkpoint)
    reference = embedder.embed(TEXTS)
    with caplog.at_level(logging.WARNING, logger="model.shared_weights"):
        assert not embedder.share_weights(WeightStore(tmp_path / "absent"))
    assert "weights not shared, this worker keeps its own" in caplog.text
    assert torch.equal(embedder.embed(TEXTS), reference)

"""The encoder's linear layers on weights prepacked for oneDNN (model/prepacked.py): the same
vectors as torch's own `F.linear` on the checkpoint layout, and only where oneDNN runs them."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from torch import nn

from model import AttentionSpec, Embedder
from model.prepacked import PrepackedLinear, can_prepack
from model.resolve import DEFAULT_MODEL_ID, resolve_model_dir

CPU = torch.device("cpu")
TEXTS = [
    "a short sentence",
    "The cat sits outside while the dog plays in the garden.",
    "Größe 東京 🚀 " * 20,
]
# float32: oneDNN's products against MKL's differ only by rounding (2e-7 seen); bfloat16:
# oneDNN runs both, so the same bits are expected, with a bfloat16 step of slack.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-3}


def linears(embedder: Embedder) -> tuple[int, int]:
    modules = list(embedder.network.modules())
    return (
        sum(type(m) is nn.Linear for m in modules),
        sum(isinstance(m, PrepackedLinear) for m in modules),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_real_model_gives_the_vectors_of_f_linear(dtype: torch.dtype) -> None:
    if not can_prepack(CPU, dtype):
        pytest.skip(f"oneDNN does not run {dtype} on this CPU")  # bfloat16 without AVX-512
    folder = resolve_model_dir(DEFAULT_MODEL_ID)
    packed = Embedder.from_folder(folder, CPU, dtype)
    plain = Embedder.from_folder(folder, CPU, dtype, prepack=False)
    # all-MiniLM-L6-v2: joined QKV, output, and the two feed-forward layers, in 6 layers.
    assert packed.prepacked == 24
    assert linears(packed) == (0, 24)
    assert plain.prepacked == 0
    assert linears(plain) == (24, 0)
    ours, theirs = packed.embed(TEXTS), plain.embed(TEXTS)
    assert (ours - theirs).abs().max().item() <= TOLERANCE[dtype]
    assert torch.nn.functional.cosine_similarity(ours, theirs).min().item() >= 0.99999


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_token_embeddings_and_attention_maps(
    tiny_checkpoint: Path, dtype: torch.dtype
) -> None:
    """The other outputs read the same layers: per-token vectors and the attention maps."""
    if not can_prepack(CPU, dtype):
        pytest.skip(f"oneDNN does not run {dtype} on this CPU")
    packed = Embedder.from_folder(tiny_checkpoint, CPU, dtype)
    plain = Embedder.from_folder(tiny_checkpoint, CPU, dtype, prepack=False)
    assert packed.prepacked > 0
    spec = AttentionSpec(layers=(0, 1), heads=(0, 1))
    batch = packed.tokenize(TEXTS)
    ours = packed.forward(batch, token_embeddings=True, attention=spec)
    theirs = plain.forward(batch, token_embeddings=True, attention=spec)
    assert ours.token_embeddings is not None and theirs.token_embeddings is not None
    # Per-token vectors are not normalised: bfloat16's step is relative to their size.
    for mine, reference in zip(ours.token_embeddings, theirs.token_embeddings, strict=True):
        scale = reference.abs().max().item()
        assert (mine - reference).abs().max().item() <= TOLERANCE[dtype] * max(scale, 1.0)
    assert ours.attentions is not None and theirs.attentions is not None
    for mine_maps, reference_maps in zip(ours.attentions, theirs.attentions, strict=True):
        for layer, maps in mine_maps.items():
            assert (maps - reference_maps[layer]).abs().max().item() <= TOLERANCE[dtype]


def test_a_prepacked_layer_refuses_to_be_moved_or_saved(tiny_checkpoint: Path) -> None:
    """Its opaque weight would be skipped by .to() and state_dict(): it says so instead."""
    network = Embedder.from_folder(tiny_checkpoint, CPU, torch.float32).network
    with pytest.raises(RuntimeError, match="cannot be moved or converted: build the model"):
        network.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot be saved: build the model with prepack"):
        network.state_dict()


def test_prepacking_only_where_onednn_runs_the_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    if platform.machine() == "x86_64":  # CI's machines: float32 is always prepacked there
        assert can_prepack(CPU, torch.float32)
    assert not can_prepack(CPU, torch.float16)
    assert not can_prepack(torch.device("cuda"), torch.float32)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # oneDNN off: F.linear
    assert not can_prepack(CPU, torch.float32)

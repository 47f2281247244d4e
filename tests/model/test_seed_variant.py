"""The seeds' variant (pre- or post-norm, ReLU) equals torch.nn.TransformerEncoder."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model.architectures.bert import (
    BertConfig,
    EncoderBlock,
    EncoderStack,
    TransformerEncoder,
    sinusoidal_table,
)
from tests.helpers import map_request

D_MODEL, HEADS, LAYERS, D_FF = 32, 4, 3, 64


def copy_into_torch(ours: EncoderStack, theirs: nn.TransformerEncoder) -> None:
    with torch.no_grad():
        for block, layer in zip(ours.layer, theirs.layers, strict=True):
            assert isinstance(block, EncoderBlock)
            attention = block.attention.self
            layer.self_attn.in_proj_weight.copy_(attention.qkv.weight)
            layer.self_attn.in_proj_bias.copy_(attention.qkv.bias)
            layer.self_attn.out_proj.weight.copy_(block.attention.output.dense.weight)
            layer.self_attn.out_proj.bias.copy_(block.attention.output.dense.bias)
            layer.linear1.load_state_dict(block.intermediate.dense.state_dict())
            layer.linear2.load_state_dict(block.output.dense.state_dict())
            layer.norm1.load_state_dict(block.attention.output.LayerNorm.state_dict())
            layer.norm2.load_state_dict(block.output.LayerNorm.state_dict())
        if theirs.norm is not None:
            theirs.norm.load_state_dict(ours.norm.state_dict())


@pytest.mark.parametrize("norm_first", [True, False])
def test_stack_matches_torch_transformer_encoder(norm_first: bool) -> None:
    config = BertConfig.seed_variant(
        vocab_size=50,
        d_model=D_MODEL,
        num_heads=HEADS,
        num_layers=LAYERS,
        d_ff=D_FF,
        max_len=40,
        norm_first=norm_first,
    )
    torch.manual_seed(0)
    ours = TransformerEncoder(config).eval()
    with torch.no_grad():
        for param in ours.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    layer = nn.TransformerEncoderLayer(
        D_MODEL,
        HEADS,
        D_FF,
        dropout=0.0,
        activation="relu",
        batch_first=True,
        norm_first=norm_first,
        layer_norm_eps=config.layer_norm_eps,
    )
    final_norm = nn.LayerNorm(D_MODEL, eps=config.layer_norm_eps) if norm_first else None
    theirs = nn.TransformerEncoder(layer, LAYERS, norm=final_norm, enable_nested_tensor=False)
    theirs.eval()
    copy_into_torch(ours.encoder, theirs)

    x = torch.randn(3, 11, D_MODEL)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 2:] = 0
    with torch.no_grad():
        got, _ = ours.encoder(x, mask)
        expected = theirs(x, src_key_padding_mask=mask == 0)
        explicit, maps = ours.encoder(x, mask, map_request({0, 1, 2}, HEADS))
    real = mask.bool()
    assert (got - expected)[real].abs().max() <= 1e-5
    assert (explicit - expected)[real].abs().max() <= 1e-5
    assert set(maps) == {0, 1, 2}


def test_seed_embeddings_are_scaled_and_sinusoidal() -> None:
    config = BertConfig.seed_variant(
        vocab_size=50, d_model=D_MODEL, num_heads=HEADS, num_layers=1, d_ff=D_FF, max_len=40
    )
    ours = TransformerEncoder(config).eval()
    ids = torch.tensor([[3, 7, 9]])
    got = ours.embeddings(ids, torch.ones_like(ids), None)
    expected = (
        ours.embeddings.word_embeddings(ids) * D_MODEL**0.5 + sinusoidal_table(40, D_MODEL)[:3]
    )
    assert torch.allclose(got, expected, atol=1e-6)
    # Seed 000's loop formula, position 1, feature 0 (sin) and 1 (cos) at i = 0.
    table = sinusoidal_table(4, D_MODEL)
    assert table[1, 0] == pytest.approx(torch.sin(torch.tensor(1.0)).item())
    assert table[1, 1] == pytest.approx(torch.cos(torch.tensor(1.0)).item())

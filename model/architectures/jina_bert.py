"""JinaBERT (jina-embeddings-v2-small-en, -base-en): BERT with ALiBi and a gated feed-forward.

Jina's config.json says `model_type: "bert"`; `position_embedding_type: "alibi"` sends it here
(`config_from_hf`). Against BERT: no position embeddings; instead each head adds
-slope x |query - key| to its scores (ALiBi, symmetric for an encoder), with the authors'
per-head slopes. The feed-forward is GEGLU: `mlp.gated_layers` (no bias) makes twice
`intermediate_size` features, GELU of the first half times the second half goes through
`mlp.wo`, then the residual and `mlp.layernorm`. LayerNorms come after each sub-layer, as in
BERT. Attribute names follow the checkpoint keys of the authors' code
(jinaai/jina-bert-implementation: `encoder.layer.0.mlp.gated_layers.weight`, ...), so weights
load without a renaming table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.architectures.base import ConfigReader, Encoder, EncoderConfig, EncoderOutput, run_layers
from model.attention import NO_MAPS, MapRequest, attend
from model.packing import TokenLayout, in_row_chunks

# `emb_pooler` steers only the authors' own `encode()`, which mean-pools whatever it says;
# here the folder's Pooling module pools, and a plain folder is mean-pooled too.
EMB_POOLERS = {None: None, "mean": "mean"}
# `attn_implementation`: None runs the authors' eager attention, "torch" their SDPA call;
# both compute the same softmax.
ATTENTION_IMPLEMENTATIONS = {None: None, "torch": "torch"}


@dataclass(frozen=True, kw_only=True)
class JinaBertConfig(EncoderConfig):
    # Checkpoints saved from the authors' task models (JinaBertForMaskedLM, ...).
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("bert.",)

    intermediate_size: int
    max_position_embeddings: int
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 2

    @property
    def max_positions(self) -> int:
        """ALiBi's bias numbers any length, and this encoder computes it for any width. The
        limit is the length the config declares the model for (8,192 for jina-embeddings-v2,
        as its sentence-transformers and tokenizer settings say too): past it the authors'
        code warns before extending its bias, and attention's cost grows with the square of
        the length. `max_input_tokens` can lower it."""
        return self.max_position_embeddings

    @property
    def positions(self) -> str:
        return "alibi"

    @classmethod
    def from_hf(cls, config: ConfigReader) -> JinaBertConfig:
        config.expect("position_embedding_type", "alibi", "absolute")
        # "reglu" and "original" (BERT's ungated intermediate and output layers) exist in the
        # authors' code but in no released model.
        config.expect("feed_forward_type", "geglu", "original")
        # A decoder would attend causally; this encoder attends both ways.
        config.expect("is_decoder", False, False)
        config.choice("emb_pooler", EMB_POOLERS, None)
        config.choice("attn_implementation", ATTENTION_IMPLEMENTATIONS, None)
        # `hidden_act` is not read: the authors' GEGLU layer always applies exact GELU, and
        # hidden_act feeds only their ungated feed-forward and masked-LM head.
        return cls(
            model_type="jina_bert",
            vocab_size=config.positive_int("vocab_size"),
            hidden_size=config.positive_int("hidden_size"),
            num_hidden_layers=config.positive_int("num_hidden_layers"),
            num_attention_heads=config.positive_int("num_attention_heads"),
            pad_token_id=config.integer("pad_token_id", 0),
            intermediate_size=config.positive_int("intermediate_size"),
            max_position_embeddings=config.positive_int("max_position_embeddings"),
            layer_norm_eps=config.number("layer_norm_eps", 1e-12),
            type_vocab_size=config.positive_int("type_vocab_size", 2),
        )

    def build(self) -> JinaBertEncoder:
        return JinaBertEncoder(self)


def alibi_slopes(num_heads: int, device: torch.device) -> Tensor:
    """(H,) float32 slopes, as the authors compute them. For n heads, n a power of two, head
    i (from 0) has 2^(-8(i+1)/n). Otherwise the largest power of two below, p, gives the first
    p heads theirs, and the rest take every other slope of 2p heads: 2^(-4(2k+1)/p).

    The exponents are exact in float64, and the powers are taken on the device, so that no
    host-to-device copy enters a captured CUDA graph.
    """
    closest = 2 ** math.floor(math.log2(num_heads))
    exponents = torch.arange(1, closest + 1, device=device, dtype=torch.float64) * (8 / closest)
    remaining = num_heads - closest
    if remaining:
        odd = torch.arange(1, 2 * remaining, 2, device=device, dtype=torch.float64)
        exponents = torch.cat([exponents, odd * (4 / closest)])
    return torch.exp2(-exponents).float()


def alibi_bias(num_heads: int, width: int, device: torch.device) -> Tensor:
    """(1, H, T, T) float32 score bias: -slope x |key position - query position|. Positions
    on the grid are token positions, because every row starts at 0 (right padding)."""
    position = torch.arange(width, device=device)
    distance = (position[None, :] - position[:, None]).abs().float()  # (T, T)
    slopes = alibi_slopes(num_heads, device)
    return (-slopes[:, None, None] * distance).unsqueeze(0)


class Embeddings(nn.Module):
    """Token + token type embeddings, then LayerNorm; positions enter inside attention."""

    def __init__(self, config: JinaBertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        x: Tensor = self.word_embeddings(input_ids)  # (B, T, D)
        if token_type_ids is None:  # one segment: every token has type 0
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        out: Tensor = self.LayerNorm(x)
        return out


class SelfAttention(nn.Module):
    def __init__(self, config: JinaBertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        size = config.hidden_size
        self.query = nn.Linear(size, size)
        self.key = nn.Linear(size, size)
        self.value = nn.Linear(size, size)

    def forward(
        self, h: Tensor, layout: TokenLayout, bias: Tensor, map_heads: tuple[int, ...] | None
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens -> (N, D) context, and (B, h, T, T) probabilities if asked;
        `bias` is the (1, H, T, T) ALiBi bias."""
        q, k, v = (
            layout.heads(projection(h), self.num_heads)
            for projection in (self.query, self.key, self.value)
        )  # (B, H, T, hd) each
        context, probs = attend(q, k, v, layout.key_mask, bias=bias, map_heads=map_heads)
        return layout.merge_heads(context), probs


class SelfOutput(nn.Module):
    """The attention's output projection and the LayerNorm after its residual."""

    def __init__(self, config: JinaBertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class AttentionSublayer(nn.Module):
    def __init__(self, config: JinaBertConfig) -> None:
        super().__init__()
        self.self = SelfAttention(config)
        self.output = SelfOutput(config)

    def forward(
        self, x: Tensor, layout: TokenLayout, bias: Tensor, map_heads: tuple[int, ...] | None
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens in and out."""
        context, probs = self.self(x, layout, bias, map_heads)
        out: Tensor = self.output.LayerNorm(x + self.output.dense(context))
        return out, probs


class GatedFeedForward(nn.Module):
    """GEGLU: GELU of the first half of `gated_layers` times its second half, through `wo`;
    then the residual and `layernorm`."""

    def __init__(self, config: JinaBertConfig) -> None:
        super().__init__()
        size, inner = config.hidden_size, config.intermediate_size
        self.gated_layers = nn.Linear(size, 2 * inner, bias=False)
        self.wo = nn.Linear(inner, size)
        self.layernorm = nn.LayerNorm(size, eps=config.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        """(N, D) tokens in and out."""
        gated, linear = self.gated_layers(x).chunk(2, dim=-1)  # (N, inner) each
        out: Tensor = self.layernorm(x + self.wo(F.gelu(gated) * linear))
        return out


class Layer(nn.Module):
    def __init__(self, config: JinaBertConfig) -> None:
        super().__init__()
        self.attention = AttentionSublayer(config)
        self.mlp = GatedFeedForward(config)

    def forward(
        self, x: Tensor, layout: TokenLayout, bias: Tensor, map_heads: tuple[int, ...] | None
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens in and out."""
        x, probs = self.attention(x, layout, bias, map_heads)
        return in_row_chunks(self.mlp, x), probs


class Stack(nn.Module):
    def __init__(self, config: JinaBertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))


class JinaBertEncoder(Encoder):
    """Embeddings, then the layers, all sharing one ALiBi bias computed for the batch's width."""

    config: JinaBertConfig

    def __init__(self, config: JinaBertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Stack(config)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        maps: MapRequest | None = None,
    ) -> EncoderOutput:
        maps = maps or NO_MAPS
        layout = TokenLayout.from_mask(attention_mask)
        h = layout.pack(self.embeddings(input_ids, token_type_ids))  # (N, D)
        bias = alibi_bias(self.config.num_attention_heads, input_ids.shape[1], input_ids.device)
        h, kept = run_layers(self.encoder.layer, h, layout, maps, lambda index: (bias,))
        return EncoderOutput(layout.unpack(h), kept)

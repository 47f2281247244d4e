"""DistilBERT: BERT's post-norm blocks with learned positions and no token types.

Attribute names follow the Hugging Face checkpoint keys
(`transformer.layer.0.attention.q_lin.weight`, ...), so weights load without a renaming table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor, nn

from model.activations import ACTIVATIONS, Activation, activate
from model.architectures.base import ConfigReader, Encoder, EncoderConfig, EncoderOutput, run_layers
from model.attention import NO_MAPS, MapRequest, attend
from model.packing import TokenLayout, in_row_chunks

# DistilBERT's LayerNorms take no epsilon from the config.
LAYER_NORM_EPS = 1e-12


@dataclass(frozen=True, kw_only=True)
class DistilBertConfig(EncoderConfig):
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("distilbert.",)

    intermediate_size: int
    max_position_embeddings: int
    activation: Activation = "gelu"

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    @property
    def positions(self) -> str:
        return "learned"  # a sinusoidal table is saved with the weights: learned to this code

    @classmethod
    def from_hf(cls, config: ConfigReader) -> DistilBertConfig:
        # `sinusoidal_pos_embds` needs nothing here: transformers writes the fixed table into
        # `position_embeddings.weight` and saves it with the weights, so a checkpoint holds
        # its position table whichever kind it is.
        return cls(
            model_type="distilbert",
            vocab_size=config.positive_int("vocab_size"),
            hidden_size=config.positive_int("dim"),
            num_hidden_layers=config.positive_int("n_layers"),
            num_attention_heads=config.positive_int("n_heads"),
            pad_token_id=config.integer("pad_token_id", 0),
            intermediate_size=config.positive_int("hidden_dim"),
            max_position_embeddings=config.positive_int("max_position_embeddings"),
            activation=config.choice("activation", ACTIVATIONS, "gelu"),
        )

    def build(self) -> DistilBertEncoder:
        return DistilBertEncoder(self)


class Embeddings(nn.Module):
    """Token + position embeddings, then LayerNorm."""

    def __init__(self, config: DistilBertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)

    def forward(self, input_ids: Tensor) -> Tensor:
        x: Tensor = self.word_embeddings(input_ids)  # (B, T, D)
        x = x + self.position_embeddings.weight[: input_ids.shape[1]]
        out: Tensor = self.LayerNorm(x)
        return out


class SelfAttention(nn.Module):
    """Multi-head self-attention with its output projection."""

    def __init__(self, config: DistilBertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        size = config.hidden_size
        self.q_lin = nn.Linear(size, size)
        self.k_lin = nn.Linear(size, size)
        self.v_lin = nn.Linear(size, size)
        self.out_lin = nn.Linear(size, size)

    def forward(
        self, h: Tensor, layout: TokenLayout, map_heads: tuple[int, ...] | None
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens -> (N, D) projected context, and (B, h, T, T) if asked."""
        q, k, v = (
            layout.heads(projection(h), self.num_heads)
            for projection in (self.q_lin, self.k_lin, self.v_lin)
        )  # (B, H, T, hd) each
        context, probs = attend(q, k, v, layout.key_mask, map_heads=map_heads)
        out: Tensor = self.out_lin(layout.merge_heads(context))
        return out, probs


class FeedForward(nn.Module):
    def __init__(self, config: DistilBertConfig) -> None:
        super().__init__()
        self.lin1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.lin2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.activation = config.activation

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.lin2(activate(self.lin1(x), self.activation))
        return out


class TransformerBlock(nn.Module):
    """Self-attention and feed-forward, each followed by residual and LayerNorm (post-norm)."""

    def __init__(self, config: DistilBertConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(config)
        self.sa_layer_norm = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.ffn = FeedForward(config)
        self.output_layer_norm = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)

    def forward(
        self, x: Tensor, layout: TokenLayout, map_heads: tuple[int, ...] | None
    ) -> tuple[Tensor, Tensor | None]:
        """(N, D) packed tokens in and out."""
        context, probs = self.attention(x, layout, map_heads)
        x = self.sa_layer_norm(x + context)
        return in_row_chunks(self.feed_forward, x), probs

    def feed_forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.output_layer_norm(x + self.ffn(x))
        return out


class Transformer(nn.Module):
    def __init__(self, config: DistilBertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            TransformerBlock(config) for _ in range(config.num_hidden_layers)
        )


class DistilBertEncoder(Encoder):
    """Embeddings followed by the stacked blocks; token types, if given, are ignored."""

    config: DistilBertConfig

    def __init__(self, config: DistilBertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.transformer = Transformer(config)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        maps: MapRequest | None = None,
    ) -> EncoderOutput:
        maps = maps or NO_MAPS
        layout = TokenLayout.from_mask(attention_mask)
        h = layout.pack(self.embeddings(input_ids))  # (N, D)
        h, kept = run_layers(self.transformer.layer, h, layout, maps)
        return EncoderOutput(layout.unpack(h), kept)

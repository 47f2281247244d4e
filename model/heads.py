"""The tasks a checkpoint serves besides embeddings, and the heads that run after the encoder.

- classify: a sequence-classification head on the first token gives one raw logit per label
  (the caller applies sigmoid or softmax): BERT's pooler then `classifier`, or RoBERTa's and
  XLM-R's two-layer `classifier`.
- sparse: a masked-language-model head gives logits over the vocabulary for every real token,
  which SPLADE turns into one weight per vocabulary entry: log(1 + relu(logits)), max- or
  sum-pooled over the tokens.

Attribute names follow the checkpoint keys (`classifier.out_proj.weight`,
`cls.predictions.transform.dense.weight`), so weights load strictly without a renaming table.
Keys a task model stores under its encoder's prefix (BERT's `bert.pooler.*`) are named by
`Head.encoder_side`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.activations import Activation, activate
from model.architectures import BertConfig, EncoderConfig
from model.architectures.base import ConfigReader
from model.errors import ConfigError
from model.info import Task

SpladePoolingStrategy = Literal["max", "sum"]
SpladeActivation = Literal["relu", "log1p_relu"]


@dataclass(frozen=True)
class Splade:
    """sentence-transformers' SpladePooling: how token logits become one weight per entry."""

    pooling_strategy: SpladePoolingStrategy = "max"
    # "log1p_relu" applies log1p once more (OpenSearch's models): log(1 + log(1 + relu(x))).
    activation_function: SpladeActivation = "relu"


# Logits computed at once by a sparse head (tokens x vocabulary, in float32): bounds the
# memory a long batch needs to about 128 MiB instead of B x T x vocabulary values.
SPARSE_CHUNK_VALUES = 1 << 25


class Head(nn.Module):
    """Runs on the encoder's (B, T, D) states and (B, T) mask; gives (B, outputs) float32."""

    # State-dict key prefixes that task checkpoints store under the encoder's own prefix.
    encoder_side: ClassVar[tuple[str, ...]] = ()
    # What the head is, for errors: "BERT's sequence-classification head".
    description: ClassVar[str]

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        raise NotImplementedError


class _Pooler(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(size, size)


class BertClassificationHead(Head):
    """BertForSequenceClassification: tanh(pooler.dense(first token)), then `classifier`."""

    encoder_side = ("pooler.",)
    description = "BERT's sequence-classification head (pooler and classifier)"

    def __init__(self, config: BertConfig, num_labels: int) -> None:
        super().__init__()
        self.pooler = _Pooler(config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, num_labels)

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        pooled = torch.tanh(self.pooler.dense(hidden[:, 0].float()))
        logits: Tensor = self.classifier(pooled)
        return logits


class _TwoLayerClassifier(nn.Module):
    def __init__(self, size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(size, size)
        self.out_proj = nn.Linear(size, num_labels)


class RobertaClassificationHead(Head):
    """RoBERTa's and XLM-R's: out_proj(tanh(dense(first token))), no pooler."""

    description = "RoBERTa's sequence-classification head (classifier.dense, classifier.out_proj)"

    def __init__(self, config: BertConfig, num_labels: int) -> None:
        super().__init__()
        self.classifier = _TwoLayerClassifier(config.hidden_size, num_labels)

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        head = self.classifier
        logits: Tensor = head.out_proj(torch.tanh(head.dense(hidden[:, 0].float())))
        return logits


class MaskedLMHead(Head):
    """A masked-language-model head followed by SPLADE pooling over the real tokens.

    The vocabulary projection is the word-embedding matrix when the config ties them
    (`tie_word_embeddings`, true by default, and then the checkpoint omits it): `tie` shares
    the encoder's tensor after loading, so it is not held twice. It runs in the encoder's
    dtype; the activation and the pooling run in float32.
    """

    def __init__(self, config: BertConfig, splade: Splade, *, tied: bool) -> None:
        super().__init__()
        self.splade = splade
        self.tied = tied
        self.vocab_size = config.vocab_size
        self._tied_to: nn.Embedding | None = None

    def transform(self, tokens: Tensor) -> Tensor:
        """(N, D) token states -> (N, D) before the vocabulary projection."""
        raise NotImplementedError

    def projection(self) -> tuple[Tensor, Tensor]:
        """The (V, D) vocabulary matrix and the (V,) bias in use."""
        raise NotImplementedError

    def tie(self, word_embeddings: nn.Embedding) -> None:
        """Use the encoder's word embeddings as the vocabulary matrix (tied configs only).

        The head reads the embedding's weight at each call and does not hold it: it neither
        loads nor moves it, and follows it when the weights move to a shared store
        (model/shared_weights.py). Kept out of `__setattr__`, which would make the encoder's
        embedding a submodule of the head.
        """
        object.__setattr__(self, "_tied_to", word_embeddings)

    def decoder_weight(self) -> Tensor:
        assert self._tied_to is not None, "tie() is called after loading"
        return self._tied_to.weight

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, T, D) states -> (B, V) float32 weights, from the real tokens only, a chunk of
        tokens at a time (tokens x vocabulary logits are the large tensor here)."""
        rows, positions = attention_mask.nonzero(as_tuple=True)  # row-major: (N,) each
        tokens = hidden[rows, positions]  # (N, D)
        weight, bias = self.projection()
        # Every weight is >= 0, so zeros are a neutral start for the max as for the sum, and
        # a row without tokens stays all zeros.
        pooled = torch.zeros(hidden.shape[0], self.vocab_size, device=hidden.device)
        reduce = "amax" if self.splade.pooling_strategy == "max" else "sum"
        step = max(1, SPARSE_CHUNK_VALUES // self.vocab_size)
        for start in range(0, tokens.shape[0], step):
            logits = F.linear(self.transform(tokens[start : start + step]), weight, bias)
            values = torch.log1p(torch.relu(logits.float()))
            if self.splade.activation_function == "log1p_relu":
                values = torch.log1p(values)
            index = rows[start : start + step].unsqueeze(1).expand_as(values)
            pooled.scatter_reduce_(0, index, values, reduce)
        return pooled


class _PredictionTransform(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class _Predictions(nn.Module):
    def __init__(self, config: BertConfig, *, tied: bool) -> None:
        super().__init__()
        self.transform = _PredictionTransform(config)
        if tied:
            # The decoder's bias is tied to this one (transformers' `_tied_weights_keys`).
            self.bias = nn.Parameter(torch.empty(config.vocab_size))
        else:
            self.decoder = nn.Linear(config.hidden_size, config.vocab_size)


class _OnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig, *, tied: bool) -> None:
        super().__init__()
        self.predictions = _Predictions(config, tied=tied)


class BertMaskedLMHead(MaskedLMHead):
    """BertForMaskedLM's `cls.predictions`: dense, the config's activation, LayerNorm."""

    description = "BERT's masked-language-model head (cls.predictions)"

    def __init__(self, config: BertConfig, splade: Splade, *, tied: bool) -> None:
        super().__init__(config, splade, tied=tied)
        self.activation: Activation = config.hidden_act
        self.cls = _OnlyMLMHead(config, tied=tied)

    def transform(self, tokens: Tensor) -> Tensor:
        transform = self.cls.predictions.transform
        out: Tensor = transform.LayerNorm(activate(transform.dense(tokens), self.activation))
        return out

    def projection(self) -> tuple[Tensor, Tensor]:
        predictions = self.cls.predictions
        if self.tied:
            return self.decoder_weight(), predictions.bias
        return predictions.decoder.weight, predictions.decoder.bias


class _RobertaLMHead(nn.Module):
    def __init__(self, config: BertConfig, *, tied: bool) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if tied:
            self.bias = nn.Parameter(torch.empty(config.vocab_size))
        else:
            self.decoder = nn.Linear(config.hidden_size, config.vocab_size)


class RobertaMaskedLMHead(MaskedLMHead):
    """RobertaForMaskedLM's (and XLM-R's) `lm_head`: dense, exact GELU, layer_norm."""

    description = "RoBERTa's masked-language-model head (lm_head)"

    def __init__(self, config: BertConfig, splade: Splade, *, tied: bool) -> None:
        super().__init__(config, splade, tied=tied)
        self.lm_head = _RobertaLMHead(config, tied=tied)

    def transform(self, tokens: Tensor) -> Tensor:
        head = self.lm_head
        out: Tensor = head.layer_norm(F.gelu(head.dense(tokens)))
        return out

    def projection(self) -> tuple[Tensor, Tensor]:
        if self.tied:
            return self.decoder_weight(), self.lm_head.bias
        return self.lm_head.decoder.weight, self.lm_head.decoder.bias


CLASSIFICATION_HEADS: dict[str, Callable[[BertConfig, int], Head]] = {
    "bert": BertClassificationHead,
    "roberta": RobertaClassificationHead,
    "xlm-roberta": RobertaClassificationHead,
}
MASKED_LM_HEADS: dict[str, type[MaskedLMHead]] = {
    "bert": BertMaskedLMHead,
    "roberta": RobertaMaskedLMHead,
    "xlm-roberta": RobertaMaskedLMHead,
}


def classification_head(config: EncoderConfig, raw: ConfigReader) -> tuple[Head, tuple[str, ...]]:
    """A sequence-classification head for this architecture (uninitialised: build it on the
    meta device), and the label of each of its logits."""
    bert = _bert_family(config, raw, CLASSIFICATION_HEADS, Task.CLASSIFY, "sequence-classification")
    labels = read_labels(raw)
    return CLASSIFICATION_HEADS[config.model_type](bert, len(labels)), labels


def masked_lm_head(config: EncoderConfig, raw: ConfigReader, splade: Splade) -> MaskedLMHead:
    """A masked-language-model head for this architecture, pooled by `splade`."""
    bert = _bert_family(config, raw, MASKED_LM_HEADS, Task.SPARSE, "masked-language-model")
    tied = raw.raw.get("tie_word_embeddings", True)
    if not isinstance(tied, bool):
        raise raw.error("key 'tie_word_embeddings' must be true or false")
    return MASKED_LM_HEADS[config.model_type](bert, splade, tied=tied)


def _bert_family(
    config: EncoderConfig, raw: ConfigReader, heads: Mapping[str, object], task: Task, kind: str
) -> BertConfig:
    if config.model_type not in heads or not isinstance(config, BertConfig):
        raise ConfigError(
            f"{raw.source}: task {task.value!r} needs a {kind} head, which this server "
            f"implements for {', '.join(heads)}, not for model_type {config.model_type!r}"
        )
    return config


def read_labels(config: ConfigReader) -> tuple[str, ...]:
    """The label of each logit, in index order, from `id2label` (as transformers saves it);
    without it, transformers' `num_labels` (default 2) and its LABEL_i names."""
    id2label = config.raw.get("id2label")
    if id2label is None:
        return tuple(f"LABEL_{i}" for i in range(config.positive_int("num_labels", 2)))
    if not isinstance(id2label, dict) or not id2label:
        raise config.error("key 'id2label' must map label indices to names")
    indices = {str(i) for i in range(len(id2label))}
    if set(map(str, id2label)) != indices or not all(isinstance(v, str) for v in id2label.values()):
        raise config.error(
            f"key 'id2label' must name each index from 0 to {len(id2label) - 1} once, "
            f"got {id2label!r}"
        )
    by_index = {str(key): value for key, value in id2label.items()}
    return tuple(by_index[str(i)] for i in range(len(id2label)))

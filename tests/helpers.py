"""Tiny checkpoints written to temporary folders, so tests need no model hub."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from model.architectures import config_from_hf
from model.attention import MapRequest
from model.embedder import AttentionSpec, Embedder
from model.int8 import int8_unavailable

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "é"]
TINY_VOCAB = (
    SPECIALS
    + list(string.ascii_lowercase)
    + ["##" + c for c in string.ascii_lowercase]
    + list(string.digits)
    + list(".,!?'")
    + WORDS
)
TINY_CONFIG: dict[str, Any] = {
    "model_type": "bert",
    "vocab_size": len(TINY_VOCAB),
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "max_position_embeddings": 64,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
    "type_vocab_size": 2,
    "pad_token_id": 0,
}


def tiny_tokenizer() -> Tokenizer:
    """A BERT-style WordPiece tokenizer over TINY_VOCAB."""
    vocab = {token: index for index, token in enumerate(TINY_VOCAB)}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def write_sentence_transformers_files(
    folder: Path, *, pooling: str = "mean", normalize: bool = True, max_seq_length: int = 48
) -> None:
    """modules.json, 1_Pooling/config.json, sentence_bert_config.json and tokenizer.json."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    flags = {
        "mean": "pooling_mode_mean_tokens",
        "cls": "pooling_mode_cls_token",
        "max": "pooling_mode_max_tokens",
        "last_token": "pooling_mode_lasttoken",
    }
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, flags[pooling]: True})
    )
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length})
    )
    tiny_tokenizer().save(str(folder / "tokenizer.json"))


def make_random_checkpoint(
    folder: Path, seed: int = 0, **config_overrides: Any
) -> dict[str, torch.Tensor]:
    """A BERT-layout checkpoint with random weights (LayerNorms included) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    raw = {**TINY_CONFIG, **config_overrides}
    torch.manual_seed(seed)
    network = config_from_hf(raw).build()
    state = {key: torch.randn_like(value) * 0.5 for key, value in network.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    write_sentence_transformers_files(folder)
    return state


def every_map(embedder: Embedder, layers: list[int] | None = None) -> AttentionSpec:
    """Attention maps of every head of `layers` (default: every layer)."""
    chosen = range(embedder.info.num_layers) if layers is None else layers
    return AttentionSpec(tuple(chosen), tuple(range(embedder.info.num_heads)))


def map_request(layers: set[int], num_heads: int) -> MapRequest:
    return MapRequest(frozenset(layers), tuple(range(num_heads)))


# int8 against float32 on a tiny model: the bounds the int8 issue sets for the default model.
INT8_MIN_MEAN_COSINE = 0.96
INT8_MIN_COSINE = 0.88


def check_int8_close_to_float32(
    folder: Path, texts: list[str], prompt_name: str | None = None
) -> None:
    """`dtype int8`'s vectors against float32's for the model in `folder`."""
    if int8_unavailable(torch.device("cpu")) is not None:
        pytest.skip("no int8 kernels on this CPU")
    exact = Embedder.load(str(folder), device="cpu", dtype="float32")
    approx = Embedder.load(str(folder), device="cpu", dtype="int8")
    assert approx.quantized > 0
    cosines = torch.nn.functional.cosine_similarity(
        exact.embed(texts, prompt_name=prompt_name), approx.embed(texts, prompt_name=prompt_name)
    )
    assert cosines.mean() >= INT8_MIN_MEAN_COSINE, f"mean cosine {cosines.mean().item():.4f}"
    assert cosines.min() >= INT8_MIN_COSINE, f"min cosine {cosines.min().item():.4f}"


def check_cuda_float16(folder: Path, texts: list[str]) -> None:
    """The model in `folder` on CUDA in float16, with its CUDA graphs captured: cosine to the
    CPU's float32 >= 0.999 (as tests/model/test_gpu.py asks of the default model)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    exact = Embedder.load(str(folder), device="cpu", dtype="float32").embed(texts)
    half = Embedder.load(str(folder), device="cuda", dtype="float16")
    half.capture_graphs()
    cosines = torch.nn.functional.cosine_similarity(exact, half.embed(texts).cpu().float())
    assert cosines.min() >= 0.999, f"min cosine {cosines.min().item():.6f}"


def graph_runs(embedder: Embedder, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, one entry per pass that runs on a compiled graph."""
    assert embedder.compiled is not None
    runs: list[int] = []
    on_graphs = embedder.compiled._compiled

    def counted(*inputs: torch.Tensor | None) -> object:
        runs.append(1)
        return on_graphs(*inputs)

    monkeypatch.setattr(embedder.compiled, "_compiled", counted)
    return runs

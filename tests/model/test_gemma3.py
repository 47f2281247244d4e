"""EmbeddingGemma (`gemma3_text`, bidirectional) against transformers and sentence-transformers.

The checkpoint is a tiny random Gemma3TextModel saved by transformers (float32, eager attention
so that it returns its probabilities), every weight perturbed, norms included. Its sliding
window (6: 3 tokens on each side) is far shorter than the longer inputs, so sliding layers see
less than full ones; its head_dim (16) is not hidden_size / heads (8), its
query_pre_attn_scalar (12) not head_dim, and its two rotary bases are far apart, so that
mixing any of them up shows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from sentence_transformers import SentenceTransformer

from model import ConfigError, Embedder, packing
from model.architectures import config_from_hf
from model.architectures.gemma3 import Gemma3Config, Gemma3Encoder
from tests.helpers import (
    TINY_VOCAB,
    check_cuda_float16,
    check_int8_close_to_float32,
    every_map,
    tiny_tokenizer,
)

TOLERANCE = 1e-5
MIN_COSINE = 0.99999
BFLOAT16_MIN_COSINE = 0.999
HIDDEN = 32
MAX_SEQ_LENGTH = 60
# Mixed lengths; 40 tokens span many sliding windows.
LENGTHS = [9, 40, 3, 17, 1]
CONFIG: dict[str, Any] = {
    "vocab_size": len(TINY_VOCAB),
    "hidden_size": HIDDEN,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 12,
    "sliding_window": 6,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rope_theta": 1000.0,
    "rope_local_base_freq": 50.0,
    "max_position_embeddings": 64,
    "use_bidirectional_attention": True,
    # Special tokens inside the tiny vocabulary.
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 3,
}
LAYOUTS = pytest.mark.parametrize("threshold", [0.0, 1.1], ids=["packed", "grid"])
PROMPTS = {
    "query": "task: search result | query: ",
    "document": "title: none | text: ",
    "Clustering": "task: clustering | query: ",
}
TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog, the quick brown fox jumps again",
    "",
    "é",
    "a b c d e f g h i j k l m n o p q r s t",
]


def hf_config(**extra: Any) -> Any:
    return transformers.Gemma3TextConfig(**{**CONFIG, **extra}, attn_implementation="eager")


def save_reference(folder: Path, **extra: Any) -> Any:
    """A random Gemma3TextModel saved in `folder`, with a tokenizer AutoTokenizer reads as is."""
    torch.manual_seed(0)
    reference = transformers.Gemma3TextModel(hf_config(**extra)).eval()
    with torch.no_grad():  # random norms too, so that a misplaced norm cannot hide
        for param in reference.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    reference.save_pretrained(folder)
    write_tokenizer(folder)
    return reference


def write_tokenizer(folder: Path) -> None:
    """Without a class named, AutoTokenizer would rebuild the tiny tokenizer as Gemma's."""
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False})
    )


def write_embeddinggemma_modules(folder: Path) -> None:
    """EmbeddingGemma's modules around the Transformer in `folder`: mean Pooling, Dense up to
    4 x hidden and back (no bias, identity activation), Normalize, and its prompts."""
    names = ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    paths = ["", "1_Pooling", "2_Dense", "3_Dense", "4_Normalize"]
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{name}"}
        for i, (name, path) in enumerate(zip(names, paths, strict=True))
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    for path in paths[1:]:
        (folder / path).mkdir()
    pooling = {
        "word_embedding_dimension": HIDDEN,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    generator = torch.Generator().manual_seed(2)
    for path, (size_in, size_out) in zip(
        paths[2:4], [(HIDDEN, 4 * HIDDEN), (4 * HIDDEN, HIDDEN)], strict=True
    ):
        dense = {
            "in_features": size_in,
            "out_features": size_out,
            "bias": False,
            "activation_function": "torch.nn.modules.linear.Identity",
        }
        (folder / path / "config.json").write_text(json.dumps(dense))
        weight = torch.randn(size_out, size_in, generator=generator) / size_in**0.5
        save_file({"linear.weight": weight}, str(folder / path / "model.safetensors"))
    metadata = {
        "model_type": "SentenceTransformer",
        "prompts": PROMPTS,
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    }
    (folder / "config_sentence_transformers.json").write_text(json.dumps(metadata))


def load(folder: Path, dtype: torch.dtype = torch.float32) -> Embedder:
    return Embedder.from_folder(folder, torch.device("cpu"), dtype)


def padded_batch() -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Random non-special ids per row, and the same right-padded as (B, T) ids and mask."""
    generator = torch.Generator().manual_seed(1)
    batch = [torch.randint(5, len(TINY_VOCAB), (n,), generator=generator).tolist() for n in LENGTHS]
    ids = torch.full((len(batch), max(LENGTHS)), CONFIG["pad_token_id"])
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(batch):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    return batch, ids, mask


@LAYOUTS
@pytest.mark.parametrize(
    "extra",
    [{}, {"attention_bias": True, "num_key_value_heads": 1, "sliding_window": 7}],
    ids=["embeddinggemma", "bias-one-kv-head-odd-window"],
)
def test_hidden_states_and_attention_match_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any], threshold: float
) -> None:
    monkeypatch.setattr(packing, "PACKING_MIN_PADDING", threshold)
    reference = save_reference(tmp_path, **extra)
    ours = load(tmp_path)
    batch, ids, mask = padded_batch()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, output_attentions=True)
    # The window is in force: the longest row's first token sees 3 tokens on its right in
    # a sliding layer, all of them in a full one.
    longest = LENGTHS.index(max(LENGTHS))
    assert (expected.attentions[0][longest, :, 0, 4:] == 0).all()
    assert (expected.attentions[1][longest, :, 0, 4:] > 0).all()
    maps = every_map(ours)
    got = ours.forward(batch, token_embeddings=True, attention=maps)
    assert got.token_embeddings is not None and got.attentions is not None
    for row, n in enumerate(LENGTHS):
        hidden = (got.token_embeddings[row] - expected.last_hidden_state[row, :n]).abs().max()
        assert hidden <= TOLERANCE, f"row {row}: hidden states differ by {hidden}"
        for layer in maps.layers:
            want = expected.attentions[layer][row, :, :n, :n]
            difference = (got.attentions[row][layer] - want).abs().max()
            assert difference <= TOLERANCE, f"row {row} layer {layer}: {difference}"


def test_causal_lm_checkpoint_is_read_under_its_prefix(tmp_path: Path) -> None:
    """Gemma3ForCausalLM keeps the text model under `model.`."""
    torch.manual_seed(0)
    task = transformers.Gemma3ForCausalLM(hf_config()).eval()
    task.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    batch, ids, mask = padded_batch()
    with torch.no_grad():
        expected = task.model(input_ids=ids, attention_mask=mask).last_hidden_state
    got = load(tmp_path).forward(batch, token_embeddings=True).token_embeddings
    assert got is not None
    for row, n in enumerate(LENGTHS):
        assert (got[row] - expected[row, :n]).abs().max() <= TOLERANCE


@pytest.fixture
def embeddinggemma_folder(tmp_path: Path) -> Path:
    save_reference(tmp_path)
    write_embeddinggemma_modules(tmp_path)
    return tmp_path


def test_folder_matches_sentence_transformers(embeddinggemma_folder: Path) -> None:
    ours = load(embeddinggemma_folder)
    assert (ours.info.model_type, ours.info.positions) == ("gemma3_text", "rotary")
    assert ours.info.dimensions == HIDDEN and ours.info.normalize
    assert ours.info.prompts == PROMPTS
    reference = SentenceTransformer(str(embeddinggemma_folder), device="cpu")
    for prompt_name in ("query", "document", None):
        expected = reference.encode(TEXTS, prompt_name=prompt_name, convert_to_tensor=True)
        got = ours.embed(TEXTS, prompt_name=prompt_name)
        cosine = F.cosine_similarity(got, expected)
        assert cosine.min() >= MIN_COSINE, f"prompt {prompt_name}: cosine {cosine.min()}"


@LAYOUTS
def test_batched_equals_alone(
    embeddinggemma_folder: Path, monkeypatch: pytest.MonkeyPatch, threshold: float
) -> None:
    monkeypatch.setattr(packing, "PACKING_MIN_PADDING", threshold)
    ours = load(embeddinggemma_folder)
    encoded = ours.tokenize(TEXTS, prompt_name="query")
    maps = every_map(ours)
    together = ours.forward(encoded, token_embeddings=True, attention=maps)
    assert together.token_embeddings is not None and together.attentions is not None
    for row, item in enumerate(encoded):
        alone = ours.forward([item], token_embeddings=True, attention=maps)
        assert alone.token_embeddings is not None and alone.attentions is not None
        assert (alone.pooled[0] - together.pooled[row]).abs().max() <= TOLERANCE
        tokens = alone.token_embeddings[0] - together.token_embeddings[row]
        assert tokens.abs().max() <= TOLERANCE
        for layer in maps.layers:
            probs = alone.attentions[0][layer] - together.attentions[row][layer]
            assert probs.abs().max() <= TOLERANCE


def test_bfloat16_stays_close_to_float32(embeddinggemma_folder: Path) -> None:
    full = load(embeddinggemma_folder).embed(TEXTS, prompt_name="query")
    half = load(embeddinggemma_folder, torch.bfloat16)
    assert half.info.dtype == "bfloat16"
    cosine = F.cosine_similarity(full, half.embed(TEXTS, prompt_name="query"))
    assert cosine.min() >= BFLOAT16_MIN_COSINE, f"min cosine {cosine.min():.6f}"


def test_int8_stays_close_to_float32(embeddinggemma_folder: Path) -> None:
    check_int8_close_to_float32(embeddinggemma_folder, TEXTS, prompt_name="query")


@pytest.mark.gpu
def test_float16_on_cuda_stays_close_to_float32(embeddinggemma_folder: Path) -> None:
    check_cuda_float16(embeddinggemma_folder, TEXTS)


def test_bfloat16_embeddings_are_scaled_as_transformers_scales_them(tmp_path: Path) -> None:
    """sqrt(hidden_size) is rounded to bfloat16 (5.65625, not 5.65685) before the product."""
    reference = save_reference(tmp_path).to(torch.bfloat16)
    ours = load(tmp_path, torch.bfloat16).network
    assert isinstance(ours, Gemma3Encoder)
    _, ids, _ = padded_batch()
    with torch.no_grad():
        expected = reference.embed_tokens(ids)
        got = ours.embed_tokens(ids)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_older_config_reads_the_same() -> None:
    """Configs on the Hub give flat rotary bases and `sliding_window_pattern`, not
    `rope_parameters` and `layer_types`; the window is the saved one, not the halved one
    transformers holds in memory."""
    current = hf_config().to_dict()
    older = {k: v for k, v in current.items() if k not in ("layer_types", "rope_parameters")}
    older |= {"rope_theta": 1000.0, "rope_local_base_freq": 50.0, "sliding_window_pattern": 2}
    config = config_from_hf(older)
    assert config == config_from_hf(current)
    assert isinstance(config, Gemma3Config)
    assert config.full_layers == (False, True, False)
    assert (config.full_rope_theta, config.sliding_rope_theta) == (1000.0, 50.0)
    assert (config.head_dim, config.local_window) == (16, 3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_bidirectional_attention": False}, "unsupported use_bidirectional_attention False"),
        ({"attn_logit_softcapping": 50.0}, "unsupported attn_logit_softcapping 50.0"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "unsupported rope_scaling"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 2.0}}},
            "rope_parameters.sliding_attention: unsupported rope_type 'yarn'",
        ),
        ({"hidden_activation": "silu"}, "unsupported hidden_activation 'silu'"),
        ({"attention_bias": "yes"}, "unsupported attention_bias 'yes'"),
        (
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
            "unsupported layer_types entry 'chunked_attention'",
        ),
        ({"layer_types": ["full_attention"]}, "one type for each of 3 layers"),
        ({"num_key_value_heads": 3}, "not divisible by num_key_value_heads 3"),
        ({"head_dim": 15}, "even head_dim"),
        ({"sliding_window": None}, "missing key 'sliding_window'"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be positive"),
    ],
)
def test_unsupported_value_is_refused_by_name(change: dict[str, Any], message: str) -> None:
    raw = hf_config().to_dict() | change
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_hf(raw, "config.json")

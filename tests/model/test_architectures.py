"""Encoders beyond the BERT family against `transformers`, on tiny random checkpoints.

Each checkpoint is made and saved by transformers (float32, eager attention so that it returns
its probabilities) and loaded here by `Embedder.from_folder`, in both token layouts: the
position-wise layers on packed real tokens, and on the padded grid.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from model import ConfigError, Embedder, packing
from model.architectures import ModernBertConfig, config_from_hf
from tests.helpers import TINY_VOCAB, every_map, write_sentence_transformers_files

TOLERANCE = 1e-5
# Mixed lengths; 130 tokens reach MPNet's farthest (clamped) buckets and span many of
# ModernBERT's local windows (local_attention 8: 4 tokens each side).
LENGTHS = [9, 130, 3, 41, 1]
MAX_SEQ_LENGTH = 150
SHARED: dict[str, Any] = {"vocab_size": len(TINY_VOCAB), "max_position_embeddings": 160}
# model_type -> (config class, encoder class, a task model on it, tiny config values)
ARCHITECTURES: dict[str, tuple[Any, Any, Any, dict[str, Any]]] = {
    "distilbert": (
        transformers.DistilBertConfig,
        transformers.DistilBertModel,
        transformers.DistilBertForMaskedLM,
        {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 48, "pad_token_id": 0},
    ),
    "mpnet": (
        transformers.MPNetConfig,
        transformers.MPNetModel,
        transformers.MPNetForMaskedLM,
        {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 48,
            "pad_token_id": 1,
        },
    ),
    "modernbert": (
        transformers.ModernBertConfig,
        transformers.ModernBertModel,
        transformers.ModernBertForMaskedLM,
        {
            "hidden_size": 32,
            "num_hidden_layers": 3,  # global, local, global
            "num_attention_heads": 4,
            "intermediate_size": 48,
            "local_attention": 8,
            "global_attn_every_n_layers": 2,
            # Far from the defaults and from each other, so that swapping them shows.
            "global_rope_theta": 1000.0,
            "local_rope_theta": 50.0,
            # Special tokens inside the tiny vocabulary.
            "pad_token_id": 0,
            "bos_token_id": 2,
            "cls_token_id": 2,
            "eos_token_id": 3,
            "sep_token_id": 3,
        },
    ),
}
CASES = [
    ("distilbert", {}),
    ("distilbert", {"activation": "relu"}),
    ("distilbert", {"sinusoidal_pos_embds": True}),
    ("mpnet", {}),
    ("mpnet", {"hidden_act": "relu"}),
    ("modernbert", {}),
    ("modernbert", {"attention_bias": True, "mlp_bias": True, "norm_bias": True}),
]
LAYOUTS = pytest.mark.parametrize("threshold", [0.0, 1.1], ids=["packed", "grid"])


def hf_config(model_type: str, **extra: Any) -> Any:
    config_class, _, _, values = ARCHITECTURES[model_type]
    return config_class(**{**SHARED, **values, **extra}, attn_implementation="eager")


def save_reference(folder: Path, model_type: str, **extra: Any) -> Any:
    """A random encoder saved in `folder` with the sentence-transformers files."""
    torch.manual_seed(0)
    reference = ARCHITECTURES[model_type][1](hf_config(model_type, **extra)).eval()
    with torch.no_grad():  # random LayerNorms too, so that a misplaced norm cannot hide
        for param in reference.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    reference.save_pretrained(folder)
    write_sentence_transformers_files(folder, max_seq_length=MAX_SEQ_LENGTH)
    return reference


def load(folder: Path) -> Embedder:
    return Embedder.from_folder(folder, torch.device("cpu"), torch.float32)


def padded_batch(pad_id: int) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Random non-special ids per row, and the same right-padded as (B, T) ids and mask."""
    generator = torch.Generator().manual_seed(1)
    batch = [torch.randint(5, len(TINY_VOCAB), (n,), generator=generator).tolist() for n in LENGTHS]
    ids = torch.full((len(batch), max(LENGTHS)), pad_id)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(batch):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    return batch, ids, mask


def differences(ours: Embedder, reference: Any) -> tuple[float, float]:
    """Largest differences of the last hidden states and of every attention probability."""
    batch, ids, mask = padded_batch(reference.config.pad_token_id)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, output_attentions=True)
    maps = every_map(ours)
    got = ours.forward(batch, token_embeddings=True, attention=maps)
    assert got.token_embeddings is not None and got.attentions is not None
    hidden = attention = 0.0
    for row, n in enumerate(LENGTHS):
        want = expected.last_hidden_state[row, :n]
        hidden = max(hidden, float((got.token_embeddings[row] - want).abs().max()))
        for layer in maps.layers:
            want = expected.attentions[layer][row, :, :n, :n]
            attention = max(attention, float((got.attentions[row][layer] - want).abs().max()))
    return hidden, attention


@LAYOUTS
@pytest.mark.parametrize(("model_type", "extra"), CASES)
def test_hidden_states_and_attention_match_transformers(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model_type: str,
    extra: dict[str, Any],
    threshold: float,
) -> None:
    monkeypatch.setattr(packing, "PACKING_MIN_PADDING", threshold)
    reference = save_reference(tmp_path, model_type, **extra)
    hidden, attention = differences(load(tmp_path), reference)
    assert hidden <= TOLERANCE, f"hidden states differ by {hidden}"
    assert attention <= TOLERANCE, f"attention probabilities differ by {attention}"


@LAYOUTS
@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_batched_equals_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_type: str, threshold: float
) -> None:
    monkeypatch.setattr(packing, "PACKING_MIN_PADDING", threshold)
    save_reference(tmp_path, model_type)
    ours = load(tmp_path)
    batch = [*padded_batch(0)[0], []]  # an empty input pads a whole row
    maps = every_map(ours)
    together = ours.forward(batch, token_embeddings=True, attention=maps)
    assert together.token_embeddings is not None and together.attentions is not None
    assert torch.isfinite(together.pooled).all()
    assert together.token_embeddings[-1].shape == (0, ours.info.hidden_size)
    for row, sequence in enumerate(batch[:-1]):
        alone = ours.forward([sequence], token_embeddings=True, attention=maps)
        assert alone.token_embeddings is not None and alone.attentions is not None
        assert (alone.pooled[0] - together.pooled[row]).abs().max() <= TOLERANCE
        tokens = alone.token_embeddings[0] - together.token_embeddings[row]
        assert tokens.abs().max() <= TOLERANCE
        for layer in maps.layers:
            probs = alone.attentions[0][layer] - together.attentions[row][layer]
            assert probs.abs().max() <= TOLERANCE


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_task_model_prefix_is_read(tmp_path: Path, model_type: str) -> None:
    """A checkpoint saved from a task model keeps the encoder under a prefix, beside a head."""
    torch.manual_seed(0)
    task = ARCHITECTURES[model_type][2](hf_config(model_type)).eval()
    task.save_pretrained(tmp_path)
    write_sentence_transformers_files(tmp_path, max_seq_length=MAX_SEQ_LENGTH)
    hidden, attention = differences(load(tmp_path), getattr(task, task.base_model_prefix))
    assert max(hidden, attention) <= TOLERANCE


def test_modernbert_older_config_reads_the_same() -> None:
    """Configs on the Hub predate `layer_types` and `rope_parameters`."""
    current = hf_config("modernbert").to_dict()
    older = {k: v for k, v in current.items() if k not in ("layer_types", "rope_parameters")}
    older |= {"global_rope_theta": 1000.0, "local_rope_theta": 50.0}
    config = config_from_hf(older)
    assert config == config_from_hf(current)
    assert isinstance(config, ModernBertConfig)
    assert config.global_layers == (True, False, True)
    assert (config.global_rope_theta, config.local_rope_theta, config.local_window) == (1e3, 50, 4)


@pytest.mark.parametrize(
    ("model_type", "change", "message"),
    [
        ("distilbert", {"activation": "swish"}, "unsupported activation 'swish'"),
        ("mpnet", {"hidden_act": "tanh"}, "unsupported hidden_act 'tanh'"),
        (
            "mpnet",
            {"relative_attention_num_buckets": 64},
            "unsupported relative_attention_num_buckets 64",
        ),
        ("modernbert", {"hidden_activation": "silu"}, "unsupported hidden_activation 'silu'"),
        ("modernbert", {"norm_bias": "yes"}, "unsupported norm_bias 'yes'"),
        ("modernbert", {"rope_scaling": {"rope_type": "yarn"}}, "unsupported rope_scaling"),
        (
            "modernbert",
            {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}}},
            "rope_parameters.full_attention: unsupported rope_type 'linear'",
        ),
        (
            "modernbert",
            {"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
            "unsupported layer_types entry 'chunked_attention'",
        ),
        ("modernbert", {"layer_types": ["full_attention"]}, "one type for each of 3 layers"),
        ("modernbert", {"hidden_size": 24, "num_attention_heads": 8}, "even head dimension"),
    ],
)
def test_unsupported_value_is_refused_by_name(
    model_type: str, change: dict[str, Any], message: str
) -> None:
    raw = hf_config(model_type).to_dict() | change
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_hf(raw, "config.json")


def test_unsupported_model_type_lists_every_architecture() -> None:
    with pytest.raises(ConfigError, match="unsupported model_type 'gpt2'") as error:
        config_from_hf({"model_type": "gpt2"}, "config.json")
    for model_type in ("bert", "roberta", "xlm-roberta", *ARCHITECTURES):
        assert model_type in str(error.value)

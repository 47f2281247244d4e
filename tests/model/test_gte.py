"""GTE v1.5 / mGTE (`new`) and arctic-embed-m-v2.0 (`gte`) against their authors' code.

transformers has no class for this model: its code lives with the weights (Alibaba-NLP/new-impl).
The reference hidden states in fixtures/gte.json came from that code as vendored in
xuhaike/SparseCL at commit 03dd0e1c38f438c0c3cd61c02a67df31feb20313 (gte/modeling.py and
gte/configuration.py; its `NewModel`, run in float32 with eager attention under transformers
4.44.2), on weights made by tests/seeded_weights.py from the fixture's seed. Here the same rule
makes the same weights from this encoder's own keys, which must be the authors' keys; they are
saved as a model folder and loaded as any other.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from model import ConfigError, Embedder, packing
from model.architectures import config_from_hf
from model.architectures.gte import GteConfig
from tests.helpers import (
    TINY_VOCAB,
    WORDS,
    check_cuda_float16,
    check_int8_close_to_float32,
    tiny_tokenizer,
    write_sentence_transformers_files,
)
from tests.model.test_batch_invariance import TEXTS, check_invariance
from tests.seeded_weights import seeded_weights

FIXTURE = Path(__file__).parent / "fixtures" / "gte.json"
TOLERANCE = 1e-5
MIN_BFLOAT16_COSINE = 0.999
LAYOUTS = pytest.mark.parametrize("threshold", [0.0, 1.1], ids=["packed", "grid"])
AUTO_MAP = {
    "AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig",
    "AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel",
    "AutoModelForMaskedLM": "Alibaba-NLP/new-impl--modeling.NewForMaskedLM",
    "AutoModelForMultipleChoice": "Alibaba-NLP/new-impl--modeling.NewForMultipleChoice",
    "AutoModelForQuestionAnswering": "Alibaba-NLP/new-impl--modeling.NewForQuestionAnswering",
    "AutoModelForSequenceClassification": (
        "Alibaba-NLP/new-impl--modeling.NewForSequenceClassification"
    ),
    "AutoModelForTokenClassification": "Alibaba-NLP/new-impl--modeling.NewForTokenClassification",
}
# The released models' config.json, keys as they ship them, at tiny sizes.
TINY_SIZES = {
    "vocab_size": len(TINY_VOCAB),
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}
SHIPPED = {
    "gte-multilingual-base": {
        "architectures": ["NewModel", "NewForTokenClassification"],
        "attention_probs_dropout_prob": 0.0,
        "auto_map": AUTO_MAP,
        "classifier_dropout": 0.0,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "layer_norm_type": "layer_norm",
        "logn_attention_clip1": False,
        "logn_attention_scale": False,
        "model_type": "new",
        "num_labels": 1,
        "pack_qkv": True,
        "position_embedding_type": "rope",
        "rope_scaling": {"factor": 8.0, "type": "ntk"},
        "rope_theta": 20000,
        "torch_dtype": "float16",
        "transformers_version": "4.39.1",
        "type_vocab_size": 1,
        "unpad_inputs": False,
        "use_memory_efficient_attention": False,
    },
    "gte-base-en-v1.5": {
        "architectures": ["NewModel"],
        "attention_probs_dropout_prob": 0.0,
        "auto_map": AUTO_MAP,
        "classifier_dropout": None,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "layer_norm_type": "layer_norm",
        "logn_attention_clip1": False,
        "logn_attention_scale": False,
        "model_type": "new",
        "pack_qkv": True,
        "position_embedding_type": "rope",
        "rope_scaling": {"factor": 2.0, "type": "ntk"},
        "rope_theta": 500000,
        "torch_dtype": "float32",
        "transformers_version": "4.39.1",
        "type_vocab_size": 0,
        "unpad_inputs": False,
        "use_memory_efficient_attention": False,
    },
    # Snowflake's copy of the code under its own names, unscaled, with the xformers switches on.
    "snowflake-arctic-embed-m-v2.0": {
        "architectures": ["GteModel"],
        "attention_probs_dropout_prob": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_hf_alibaba_nlp_gte.GteConfig",
            "AutoModel": "modeling_hf_alibaba_nlp_gte.GteModel",
        },
        "classifier_dropout": 0.1,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "layer_norm_type": "layer_norm",
        "logn_attention_clip1": False,
        "logn_attention_scale": False,
        "matryoshka_dimensions": [256],
        "model_type": "gte",
        "pack_qkv": True,
        "position_embedding_type": "rope",
        "rope_scaling": None,
        "rope_theta": 160000,
        "torch_dtype": "float32",
        "type_vocab_size": 1,
        "unpad_inputs": True,
        "use_memory_efficient_attention": True,
    },
}
POSITIONS = {
    "gte-multilingual-base": "rotary (NTK-scaled)",
    "gte-base-en-v1.5": "rotary (NTK-scaled)",
    "snowflake-arctic-embed-m-v2.0": "rotary",
}


@cache
def fixture() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(FIXTURE.read_text(encoding="utf-8"))
    return loaded


def reference_model(name: str) -> dict[str, Any]:
    return next(model for model in fixture()["models"] if model["name"] == name)


def decode(encoded: dict[str, Any]) -> torch.Tensor:
    raw = base64.b64decode(encoded["float32_le_base64"])
    array = np.frombuffer(raw, dtype="<f4").reshape(encoded["shape"])
    return torch.from_numpy(array.copy())


def shapes_of(config: GteConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        network = config.build()
    return {key: tuple(value.shape) for key, value in network.state_dict().items()}


def write_weights(folder: Path, raw: dict[str, Any], seed: int, prefix: str = "") -> None:
    """config.json and seeded weights over this encoder's own keys (under `prefix`)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = config_from_hf(raw)
    assert isinstance(config, GteConfig)
    weights = seeded_weights(shapes_of(config), seed)
    save_file({prefix + key: value for key, value in weights.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw))


def load(folder: Path, dtype: torch.dtype = torch.float32) -> Embedder:
    return Embedder.from_folder(folder, torch.device("cpu"), dtype)


def reference_folder(folder: Path, name: str) -> Embedder:
    write_weights(folder, reference_model(name)["config"], fixture()["seed"])
    write_sentence_transformers_files(folder, pooling="cls")
    return load(folder)


def largest_difference(network: torch.nn.Module, case: dict[str, Any]) -> float:
    """Over the real tokens of the case's batch, as the reference ran it."""
    ids = torch.tensor(case["input_ids"])
    mask = torch.tensor(case["attention_mask"])
    types = torch.tensor(case["token_type_ids"]) if "token_type_ids" in case else None
    with torch.inference_mode():
        hidden = network(ids, mask, types).hidden
    want = decode(case["last_hidden_state"])
    return float(((hidden - want).abs() * mask[..., None]).max())


@pytest.mark.parametrize("name", ["ntk", "plain_rms"])
def test_keys_are_the_authors(name: str) -> None:
    model = reference_model(name)
    config = config_from_hf(model["config"])
    assert isinstance(config, GteConfig)
    assert shapes_of(config) == {key: tuple(shape) for key, shape in model["state_dict"].items()}


@LAYOUTS
@pytest.mark.parametrize("name", ["ntk", "plain_rms"])
def test_hidden_states_match_the_authors_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, threshold: float
) -> None:
    """A padded batch (with token types where the model has them), and one input longer than
    max_position_embeddings (for the NTK model, longer than it times the factor too)."""
    monkeypatch.setattr(packing, "PACKING_MIN_PADDING", threshold)
    embedder = reference_folder(tmp_path, name)
    cases = reference_model(name)["cases"]
    config = embedder.network.config
    assert len(torch.tensor(cases[-1]["input_ids"])[0]) > config.max_positions
    for case in cases:
        difference = largest_difference(embedder.network, case)
        assert difference <= TOLERANCE, f"{case['name']}: hidden states differ by {difference}"


def test_the_long_case_depends_on_ntk_scaling() -> None:
    """Unscaled rotary positions miss the reference: the fixture checks the scaling itself."""
    config = config_from_hf(reference_model("ntk")["config"])
    assert isinstance(config, GteConfig) and config.positions == "rotary (NTK-scaled)"
    unscaled = dataclasses.replace(config, ntk_factor=1.0)
    network = unscaled.build().eval()
    network.load_state_dict(seeded_weights(shapes_of(unscaled), fixture()["seed"]))
    long_case = reference_model("ntk")["cases"][-1]
    assert largest_difference(network, long_case) > 0.01


def test_task_model_prefix_is_read(tmp_path: Path) -> None:
    """The authors' task models (NewForMaskedLM, ...) keep the encoder under `new.`."""
    plain = reference_folder(tmp_path / "plain", "ntk")
    raw = reference_model("ntk")["config"]
    write_weights(tmp_path / "task", raw, fixture()["seed"], prefix="new.")
    write_sentence_transformers_files(tmp_path / "task", pooling="cls")
    task = load(tmp_path / "task")
    texts = ["hello world", "the quick brown fox"]
    assert torch.equal(task.embed(texts), plain.embed(texts))


def real_layout(folder: Path, model: str) -> Path:
    """A folder as the model ships it: config.json with its auto_map, CLS pooling, Normalize,
    the sentence-transformers settings files, a tokenizer (the tiny one)."""
    write_weights(folder, SHIPPED[model] | TINY_SIZES, seed=7)
    modules = [
        ("sentence_transformers.models.Transformer", ""),
        ("sentence_transformers.models.Pooling", "1_Pooling"),
        ("sentence_transformers.models.Normalize", "2_Normalize"),
    ]
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {"idx": index, "name": str(index), "path": path, "type": kind}
                for index, (kind, path) in enumerate(modules)
            ]
        )
    )
    (folder / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": TINY_SIZES["hidden_size"],
        "pooling_mode_cls_token": True,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "2_Normalize").mkdir()
    settings = {"max_seq_length": 8192, "do_lower_case": False}
    (folder / "sentence_bert_config.json").write_text(json.dumps(settings))
    metadata = {
        "__version__": {"sentence_transformers": "3.0.1", "transformers": "4.39.1"},
        "prompts": {"query": "query: "} if SHIPPED[model]["model_type"] == "gte" else {},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    }
    (folder / "config_sentence_transformers.json").write_text(json.dumps(metadata))
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    # XLM-R's class reads tokenizer.json as saved; BERT's (gte-base-en-v1.5's) would rebuild
    # the tiny tokenizer's pair template, so that folder names no class.
    tokenizer_config: dict[str, Any] = {"model_max_length": 8192}
    if model != "gte-base-en-v1.5":
        tokenizer_config["tokenizer_class"] = "XLMRobertaTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


@pytest.mark.parametrize("model", list(SHIPPED))
def test_real_layout_loads_and_embeds_the_cls_token(tmp_path: Path, model: str) -> None:
    embedder = load(real_layout(tmp_path, model))
    info = embedder.info
    assert (info.model_type, info.positions) == (SHIPPED[model]["model_type"], POSITIONS[model])
    assert info.pooling == ("cls",) and info.normalize
    assert info.max_input_tokens == TINY_SIZES["max_position_embeddings"]
    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "é"]
    out = embedder.forward(embedder.tokenize(texts), token_embeddings=True)
    assert out.token_embeddings is not None
    first = torch.stack([tokens[0] for tokens in out.token_embeddings])
    assert (out.pooled - first).abs().max() <= 1e-6
    expected = torch.nn.functional.normalize(first, dim=-1)
    assert (embedder.embed(texts) - expected).abs().max() <= 1e-6


@LAYOUTS
def test_batch_invariance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threshold: float
) -> None:
    monkeypatch.setattr(packing, "PACKING_MIN_PADDING", threshold)
    embedder = load(real_layout(tmp_path, "gte-multilingual-base"))
    check_invariance(embedder, [*TEXTS, " ".join(WORDS * 8)])


def varied_sentences() -> list[str]:
    generator = np.random.default_rng(3)
    return [
        " ".join(generator.choice(WORDS, size=int(generator.integers(1, 40)))) for _ in range(60)
    ]


@pytest.mark.parametrize("model", ["gte-multilingual-base", "gte-base-en-v1.5"])
def test_bfloat16_stays_close_to_float32(tmp_path: Path, model: str) -> None:
    folder = real_layout(tmp_path, model)
    sentences = varied_sentences()
    full = load(folder).embed(sentences)
    half = load(folder, torch.bfloat16).embed(sentences)
    cosine = torch.nn.functional.cosine_similarity(full, half)
    assert cosine.min() >= MIN_BFLOAT16_COSINE, f"min cosine {cosine.min().item():.6f}"


@pytest.mark.parametrize("model", ["gte-multilingual-base", "gte-base-en-v1.5"])
def test_int8_stays_close_to_float32(tmp_path: Path, model: str) -> None:
    check_int8_close_to_float32(real_layout(tmp_path, model), varied_sentences())


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["gte-multilingual-base", "gte-base-en-v1.5"])
def test_float16_on_cuda_stays_close_to_float32(tmp_path: Path, model: str) -> None:
    check_cuda_float16(real_layout(tmp_path, model), varied_sentences())


def tiny_config(**change: Any) -> dict[str, Any]:
    return SHIPPED["gte-multilingual-base"] | TINY_SIZES | change


def test_implementation_switches_are_accepted() -> None:
    """unpad_inputs and memory-efficient attention change how the reference runs, not what
    it computes; logn_attention_clip1 acts only with logn_attention_scale."""
    switched = tiny_config(
        unpad_inputs=True, use_memory_efficient_attention=True, logn_attention_clip1=True
    )
    assert config_from_hf(switched) == config_from_hf(tiny_config())


def test_config_values_are_read() -> None:
    config = config_from_hf(tiny_config())
    assert isinstance(config, GteConfig)
    assert (config.ntk_factor, config.rope_theta, config.type_vocab_size) == (8.0, 20000, 1)
    assert config.max_positions == TINY_SIZES["max_position_embeddings"]
    unscaled = config_from_hf(tiny_config(rope_scaling=None))
    assert isinstance(unscaled, GteConfig)
    assert (unscaled.ntk_factor, unscaled.positions) == (1.0, "rotary")
    rms = config_from_hf(tiny_config(layer_norm_type="rms_norm"))
    assert isinstance(rms, GteConfig) and rms.layer_norm_type == "rms_norm"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"position_embedding_type": "absolute"}, "unsupported position_embedding_type"),
        ({"pack_qkv": False}, "unsupported pack_qkv False"),
        ({"logn_attention_scale": True}, "unsupported logn_attention_scale True"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling: unsupported type"),
        ({"rope_scaling": {"factor": 2.0}}, "rope_scaling: unsupported type None"),
        ({"rope_scaling": {"type": "ntk"}}, "rope_scaling: missing key 'factor'"),
        (
            {"rope_scaling": {"type": "ntk", "factor": 2.0, "mixed_b": 0.5}},
            "rope_scaling: unsupported mixed_b 0.5",
        ),
        ({"rope_scaling": {"type": "ntk", "factor": 0.5}}, "'factor' must be at least 1"),
        (
            {"rope_scaling": {"type": "ntk", "factor": 2.0, "original_max_position_embeddings": 8}},
            "unsupported rope_scaling key 'original_max_position_embeddings'",
        ),
        ({"rope_scaling": "ntk"}, "key 'rope_scaling' must be an object or null"),
        ({"layer_norm_type": "batch_norm"}, "unsupported layer_norm_type 'batch_norm'"),
        ({"hidden_act": "silu"}, "unsupported hidden_act 'silu'"),
        ({"type_vocab_size": -1}, "key 'type_vocab_size' must not be negative"),
        ({"hidden_size": 36, "num_attention_heads": 12}, "even head dimension"),
    ],
)
def test_unsupported_value_is_refused_by_name(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_hf(tiny_config(**change), "config.json")

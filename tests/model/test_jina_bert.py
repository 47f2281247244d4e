"""JinaBERT (model/architectures/jina_bert.py) against its authors' code, through folder loading.

transformers has no class for JinaBERT; its code lives with the weights
(jinaai/jina-bert-implementation on the Hugging Face Hub). The reference numbers in
fixtures/jina_bert.json came from a vendored copy of that code: repository
veya2ztn/sci-bert-finetune, commit e39c6b94c6c3d90f7c3ce29c3411b3b015822e58,
models/jinabert/modeling_bert.py (JinaBertModel, transformers 4.44.2, float32), run outside this
project on weights made by tests/seeded_weights.py for its keys. The tests make the same
weights for this encoder's keys, which are the same keys, write them to a model folder, load it
as the service does, and compare last hidden states within 1e-5: a padded batch, inputs longer
than the config's max_position_embeddings (where the authors' code extends its ALiBi tensor),
and a pair's token types.
"""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import processors

from model import ConfigError, Embedder, packing
from model.architectures import BertConfig, config_from_hf
from model.architectures.jina_bert import JinaBertConfig, alibi_slopes
from tests.helpers import (
    TINY_VOCAB,
    WORDS,
    check_cuda_float16,
    check_int8_close_to_float32,
    tiny_tokenizer,
)
from tests.model.test_batch_invariance import TEXTS, check_invariance
from tests.seeded_weights import seeded_weights

TOLERANCE = 1e-5
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "jina_bert.json").read_text())
LAYOUTS = pytest.mark.parametrize("threshold", [0.0, 1.1], ids=["packed", "grid"])
REMOTE_CODE = "jinaai/jina-bert-implementation"
# Keys of jina-embeddings-v2's config.json that the fixture's tiny config leaves out.
RELEASED_KEYS: dict[str, Any] = {
    "_name_or_path": REMOTE_CODE,
    "model_max_length": 8192,
    "attention_probs_dropout_prob": 0.0,
    "auto_map": {
        "AutoConfig": f"{REMOTE_CODE}--configuration_bert.JinaBertConfig",
        "AutoModelForMaskedLM": f"{REMOTE_CODE}--modeling_bert.JinaBertForMaskedLM",
        "AutoModel": f"{REMOTE_CODE}--modeling_bert.JinaBertModel",
        "AutoModelForSequenceClassification": (
            f"{REMOTE_CODE}--modeling_bert.JinaBertForSequenceClassification"
        ),
    },
    "classifier_dropout": None,
    "gradient_checkpointing": False,
    "hidden_dropout_prob": 0.1,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
    "transformers_version": "4.26.0",
    "use_cache": True,
    "emb_pooler": "mean",
}


def decode(encoded: dict[str, Any]) -> torch.Tensor:
    data = np.frombuffer(base64.b64decode(encoded["base64_float32_le"]), dtype="<f4")
    return torch.from_numpy(data.copy()).reshape(encoded["shape"])


def write_folder(
    folder: Path, config: dict[str, Any], *, prefix: str = "", extra: bool = False
) -> None:
    """A sentence-transformers folder (Transformer, mean Pooling) around the fixture's seeded
    weights, made for this encoder's keys; `prefix` as a task model saves them, `extra` adds
    the pooler that JinaBertModel saves beside the encoder."""
    folder.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        network = config_from_hf(config).build()
    shapes = {key: tuple(value.shape) for key, value in network.state_dict().items()}
    state = seeded_weights(shapes, FIXTURE["seed"])
    if extra:
        size = config["hidden_size"]
        state |= {
            "pooler.dense.weight": torch.zeros(size, size),
            "pooler.dense.bias": torch.zeros(size),
        }
    save_file(
        {prefix + key: value for key, value in state.items()}, str(folder / "model.safetensors")
    )
    (folder / "config.json").write_text(json.dumps(config))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling = {
        "word_embedding_dimension": config["hidden_size"],
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    settings = {"max_seq_length": 8192, "do_lower_case": False}
    (folder / "sentence_bert_config.json").write_text(json.dumps(settings))
    # A BertTokenizer, as the released folders name it; its pair template is BERT's.
    tokenizer = tiny_tokenizer()
    tokenizer.post_processor = processors.BertProcessing(
        ("[SEP]", TINY_VOCAB.index("[SEP]")), ("[CLS]", TINY_VOCAB.index("[CLS]"))
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_settings = {"tokenizer_class": "BertTokenizer", "do_lower_case": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_settings))


def load(folder: Path, dtype: torch.dtype = torch.float32) -> Embedder:
    return Embedder.from_folder(folder, torch.device("cpu"), dtype)


@pytest.fixture
def fixture_folder(tmp_path: Path) -> Path:
    write_folder(tmp_path / "jina", FIXTURE["config"])
    return tmp_path / "jina"


@pytest.fixture
def released_folder(tmp_path: Path) -> Path:
    """The fixture's model in the layout the released models ship: config.json with their
    extra keys, bare keys with the pooler beside them."""
    write_folder(tmp_path / "released", FIXTURE["config"] | RELEASED_KEYS, extra=True)
    return tmp_path / "released"


def hidden_differences(ours: Embedder) -> dict[str, float]:
    """Each fixture case's largest difference from the reference, over real tokens."""
    found = {}
    for name, case in FIXTURE["cases"].items():
        mask = torch.tensor(case["attention_mask"])
        want = decode(case["last_hidden_state"])
        lengths = mask.sum(dim=1).tolist()
        if case["token_type_ids"] is None:  # the service's own path, from id lists
            rows = [ids[:n] for ids, n in zip(case["input_ids"], lengths, strict=True)]
            got = ours.forward(rows, token_embeddings=True).token_embeddings
            assert got is not None
        else:
            ids, types = torch.tensor(case["input_ids"]), torch.tensor(case["token_type_ids"])
            with torch.inference_mode():
                hidden = ours.network(ids, mask, types).hidden
            got = [hidden[row, :n] for row, n in enumerate(lengths)]
        found[name] = max(
            float((got[row] - want[row, :n]).abs().max()) for row, n in enumerate(lengths)
        )
    return found


def test_keys_are_the_authors() -> None:
    with torch.device("meta"):
        network = config_from_hf(FIXTURE["config"]).build()
    assert sorted(network.state_dict()) == FIXTURE["state_dict_keys"]


@LAYOUTS
def test_hidden_states_match_the_authors_code(
    fixture_folder: Path, monkeypatch: pytest.MonkeyPatch, threshold: float
) -> None:
    monkeypatch.setattr(packing, "PACKING_MIN_PADDING", threshold)
    ours = load(fixture_folder)
    longest = max(len(ids) for ids in FIXTURE["cases"]["past_max_positions"]["input_ids"])
    assert longest > FIXTURE["config"]["max_position_embeddings"]
    for name, difference in hidden_differences(ours).items():
        assert difference <= TOLERANCE, f"{name}: hidden states differ by {difference}"


@pytest.mark.parametrize("prefix", ["", "bert."])
def test_released_layout_loads_and_embeds(tmp_path: Path, prefix: str) -> None:
    """The released config.json (auto_map, emb_pooler, ...) and weights beside a pooler, or
    under a task model's prefix, give the reference's numbers; vectors are the mean of them."""
    folder = tmp_path / "released"
    write_folder(folder, FIXTURE["config"] | RELEASED_KEYS, prefix=prefix, extra=True)
    ours = load(folder)
    assert (ours.info.model_type, ours.info.positions) == ("jina_bert", "alibi")
    assert ours.info.pooling == ("mean",) and not ours.info.normalize
    # max_seq_length (8192) is above what the config declares, which then bounds inputs.
    assert ours.info.max_input_tokens == FIXTURE["config"]["max_position_embeddings"]
    assert max(hidden_differences(ours).values()) <= TOLERANCE
    texts = ["hello world", "the quick brown fox jumps over the lazy dog"]
    vectors = ours.embed(texts)
    tokens = ours.forward(ours.tokenize(texts), token_embeddings=True).token_embeddings
    assert tokens is not None and vectors.shape == (2, FIXTURE["config"]["hidden_size"])
    for vector, states in zip(vectors, tokens, strict=True):
        assert (vector - states.mean(dim=0)).abs().max() <= TOLERANCE


@LAYOUTS
def test_batch_invariance(
    released_folder: Path, monkeypatch: pytest.MonkeyPatch, threshold: float
) -> None:
    monkeypatch.setattr(packing, "PACKING_MIN_PADDING", threshold)
    check_invariance(load(released_folder), TEXTS)


def test_bfloat16_stays_close_to_float32(released_folder: Path) -> None:
    rng = np.random.default_rng(3)
    sentences = [" ".join(rng.choice(WORDS, size=n)) for n in (1, 3, 6, 10, 14) for _ in range(4)]
    full = load(released_folder).embed(sentences)
    half = load(released_folder, torch.bfloat16).embed(sentences)
    cosine = torch.nn.functional.cosine_similarity(full, half)
    assert cosine.min() >= 0.999, f"min cosine {cosine.min().item():.6f}"


def test_int8_stays_close_to_float32(released_folder: Path) -> None:
    rng = np.random.default_rng(3)
    sentences = [" ".join(rng.choice(WORDS, size=n)) for n in (1, 3, 6, 10, 14) for _ in range(4)]
    check_int8_close_to_float32(released_folder, sentences)


@pytest.mark.gpu
def test_float16_on_cuda_stays_close_to_float32(released_folder: Path) -> None:
    check_cuda_float16(released_folder, ["the lazy dog", "hello world " * 6, "fox"])


def test_slopes_are_the_authors() -> None:
    """Powers of two from 2^(-8/n); for 12 heads (base-en), 8 of them then every other of 16."""
    cpu = torch.device("cpu")
    eight = [2.0**-k for k in range(1, 9)]
    assert alibi_slopes(8, cpu).tolist() == eight
    halves = [math.ldexp(math.sqrt(0.5), -k) for k in range(4)]  # 2^-0.5, 2^-1.5, ...
    assert alibi_slopes(12, cpu).tolist() == pytest.approx(eight + halves, rel=1e-7)
    assert alibi_slopes(6, cpu).tolist() == [2.0**-k for k in (2, 4, 6, 8, 1, 3)]


def test_only_alibi_bert_configs_come_here() -> None:
    jina = config_from_hf(FIXTURE["config"] | RELEASED_KEYS)
    assert isinstance(jina, JinaBertConfig)
    assert jina.max_positions == FIXTURE["config"]["max_position_embeddings"]
    plain = {k: v for k, v in FIXTURE["config"].items() if k != "position_embedding_type"}
    assert isinstance(config_from_hf(plain), BertConfig)
    relative = FIXTURE["config"] | {"position_embedding_type": "relative_key"}
    message = "unsupported position_embedding_type 'relative_key'"
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_hf(relative, "config.json")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"feed_forward_type": "reglu"}, "unsupported feed_forward_type 'reglu'"),
        ({"feed_forward_type": None}, "unsupported feed_forward_type None"),
        ({"emb_pooler": "cls"}, "unsupported emb_pooler 'cls'"),
        ({"attn_implementation": "flashV2"}, "unsupported attn_implementation 'flashV2'"),
        ({"is_decoder": True}, "unsupported is_decoder True"),
        ({"type_vocab_size": 0}, "key 'type_vocab_size' must be a positive integer"),
    ],
)
def test_unsupported_value_is_refused_by_name(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_hf(FIXTURE["config"] | RELEASED_KEYS | change, "config.json")

"""NomicBERT (nomic-embed-text-v1/v1.5) against its authors' code, on tiny seeded checkpoints.

transformers has no class for this model; its code lives with the weights. The reference
numbers in fixtures/nomic_bert.json come from `NomicBertModel` in nomic-ai/contrastors at
commit 613ddfd37309e538cceadb05b1e6423e7b09f603
(src/contrastors/models/huggingface/modeling_hf_nomic_bert.py), run outside this project in
float32 with transformers 4.57.1; the copy of that file published with nomic-ai/nomic-bert-2048
(aahrong/nomic-embed-text-v1.5 at 3185eb0cda4624b21ca40e3909242b1240f34a99) gave the same
numbers. Both sides made their weights with `tests.seeded_weights.seeded_weights` from the
fixture's seed and their own state_dict's keys, which are the same keys. The fixture names the
configs as given to that code, the cases' ids, masks and token types, and the last hidden
states (float32, little-endian, base64). Hidden states must agree within 1e-5.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import processors

from model import ConfigError, Embedder, packing
from model.architectures import config_from_hf
from model.architectures.nomic_bert import NomicBertConfig
from tests.helpers import (
    check_cuda_float16,
    check_int8_close_to_float32,
    tiny_tokenizer,
    write_sentence_transformers_files,
)
from tests.model.test_batch_invariance import TEXTS, check_invariance
from tests.seeded_weights import seeded_weights

TOLERANCE = 1e-5
FIXTURE: dict[str, Any] = json.loads(
    (Path(__file__).parent / "fixtures" / "nomic_bert.json").read_text()
)
CONFIGS: dict[str, dict[str, Any]] = FIXTURE["configs"]
NTK = "swiglu_partial_rotary_ntk"
V1_5 = "v1_5_layout"
LAYOUTS = pytest.mark.parametrize("threshold", [0.0, 1.1], ids=["packed", "grid"])
# The keys nomic-embed-text-v1.5's config.json has beside the architecture's.
REAL_KEYS: dict[str, Any] = {
    "_name_or_path": "nomic-ai/nomic-bert-2048",
    "auto_map": {
        "AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
        "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel",
        "AutoModelForMaskedLM": (
            "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertForPreTraining"
        ),
    },
    "transformers_version": "4.37.2",
    "n_positions": 8192,
}
PROMPTS = {
    "search_query": "search_query: ",
    "search_document": "search_document: ",
    "classification": "classification: ",
    "clustering": "clustering: ",
}


def reference(case: dict[str, Any]) -> torch.Tensor:
    """The authors' (B, T, D) last hidden states of a case."""
    stored = case["last_hidden_state"]
    values = np.frombuffer(base64.b64decode(stored["float32_base64"]), dtype="<f4")
    return torch.from_numpy(values.copy()).view(stored["shape"])


def write_checkpoint(folder: Path, raw: dict[str, Any], prefix: str = "") -> None:
    """config.json and the seeded weights under this encoder's keys (the authors' keys)."""
    folder.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        network = config_from_hf(raw).build()
    shapes = {key: value.shape for key, value in network.state_dict().items()}
    weights = seeded_weights(shapes, FIXTURE["seed"])
    save_file({prefix + key: value for key, value in weights.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw))


def tiny_folder(folder: Path, name: str, prefix: str = "") -> Path:
    write_checkpoint(folder, CONFIGS[name]["config"], prefix)
    write_sentence_transformers_files(folder)
    return folder


def load(folder: Path, dtype: torch.dtype = torch.float32) -> Embedder:
    return Embedder.from_folder(folder, torch.device("cpu"), dtype)


def rows(name: str) -> list[tuple[list[int], torch.Tensor]]:
    """Every case's rows without token types: real ids, and the authors' hidden states."""
    found = []
    for case in CONFIGS[name]["cases"]:
        if "token_type_ids" in case:
            continue
        hidden = reference(case)
        for row, (ids, mask) in enumerate(
            zip(case["input_ids"], case["attention_mask"], strict=True)
        ):
            n = sum(mask)
            found.append((ids[:n], hidden[row, :n]))
    return found


@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_dict_keys_are_the_authors(name: str) -> None:
    """The authors' NomicBertModel's keys and shapes, as the released checkpoints name them."""
    with torch.device("meta"):
        network = config_from_hf(CONFIGS[name]["config"]).build()
    shapes = {key: list(value.shape) for key, value in network.state_dict().items()}
    assert shapes == CONFIGS[name]["state_dict_keys"]


@LAYOUTS
@pytest.mark.parametrize("name", list(CONFIGS))
def test_hidden_states_match_the_authors_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, threshold: float
) -> None:
    """Each case's padded batch as the authors ran it (token types included), then every row
    in one batch of mixed lengths. The authors ran the long inputs alone: where the rotary base
    is stretched for a row's length (past max_trained_positions) and where an input goes past
    n_positions."""
    monkeypatch.setattr(packing, "PACKING_MIN_PADDING", threshold)
    ours = load(tiny_folder(tmp_path, name))
    for case in CONFIGS[name]["cases"]:
        mask = torch.tensor(case["attention_mask"])
        types = case.get("token_type_ids")
        with torch.inference_mode():
            hidden = ours.network(
                torch.tensor(case["input_ids"]),
                mask,
                None if types is None else torch.tensor(types),
            ).hidden
        difference = ((hidden - reference(case)).abs() * mask[..., None]).max()
        assert difference <= TOLERANCE, f"{case['name']}: hidden states differ by {difference}"
    together = rows(name)
    out = ours.forward([ids for ids, _ in together], token_embeddings=True)
    assert out.token_embeddings is not None
    for (ids, want), got in zip(together, out.token_embeddings, strict=True):
        difference = (got - want).abs().max()
        assert difference <= TOLERANCE, f"{len(ids)} tokens in a batch: differ by {difference}"


def test_a_checkpoint_saved_from_the_pretraining_model_is_read(tmp_path: Path) -> None:
    """NomicBertForPreTraining (nomic-bert-2048) keeps the encoder under `bert.`."""
    ours = load(tiny_folder(tmp_path, V1_5, prefix="bert."))
    (ids, want), *_ = rows(V1_5)
    got = ours.forward([ids], token_embeddings=True).token_embeddings
    assert got is not None
    assert (got[0] - want).abs().max() <= TOLERANCE


def test_inputs_are_cut_at_n_positions(tmp_path: Path) -> None:
    """The network runs any length (the case past n_positions above); the service takes
    n_positions tokens, here below sentence_bert_config's max_seq_length (48)."""
    ours = load(tiny_folder(tmp_path, V1_5))
    assert ours.info.positions == "rotary"
    assert ours.info.max_input_tokens == CONFIGS[V1_5]["config"]["n_positions"] == 32
    assert len(ours.tokenize(["a " * 100])[0].ids) == 32


def write_real_layout(folder: Path) -> None:
    """A folder laid out as nomic-embed-text-v1.5 ships: remote-code config.json, Transformer
    and mean Pooling (no Normalize module), prompts, and a BERT tokenizer with its config."""
    write_checkpoint(folder, CONFIGS[V1_5]["config"] | REAL_KEYS)
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
    (folder / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": 32,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 8192, "do_lower_case": False})
    )
    metadata = {
        "__version__": {"sentence_transformers": "2.4.0.dev0", "transformers": "4.37.2"},
        "prompts": PROMPTS,
        "default_prompt_name": None,
    }
    (folder / "config_sentence_transformers.json").write_text(json.dumps(metadata))
    tokenizer = tiny_tokenizer()
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": True,
        "model_max_length": 8192,
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "mask_token": "[MASK]",
        "unk_token": "[UNK]",
        "strip_accents": None,
        "tokenize_chinese_chars": True,
        "clean_up_tokenization_spaces": True,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


def test_real_layout_folder_loads_and_embeds(tmp_path: Path) -> None:
    write_real_layout(tmp_path)
    ours = load(tmp_path)
    info = ours.info
    assert (info.model_type, info.positions, info.max_input_tokens) == (
        "nomic_bert",
        "rotary",
        8192,
    )
    assert (info.pooling, info.normalize, info.dimensions) == (("mean",), False, 32)
    assert info.prompts == PROMPTS
    # The keys around the architecture change nothing: the authors' numbers still hold.
    for ids, want in rows(V1_5):
        got = ours.forward([ids], token_embeddings=True).token_embeddings
        assert got is not None and (got[0] - want).abs().max() <= TOLERANCE
    # A prompted text: the prompt's tokens lead, and the vector is the mean of every token's.
    texts = ["the quick brown fox", "hello world"]
    encoded = ours.tokenize(texts, prompt_name="search_query")
    plain = ours.tokenize(texts)
    assert all(
        e.prompt_length > 0 and len(e.ids) > len(p.ids) for e, p in zip(encoded, plain, strict=True)
    )
    out = ours.forward(encoded, token_embeddings=True)
    assert out.token_embeddings is not None
    means = torch.stack([tokens.mean(dim=0) for tokens in out.token_embeddings])
    assert (out.pooled - means).abs().max() <= TOLERANCE
    vectors = ours.embed(texts, prompt_name="search_query")
    assert (vectors - out.pooled).abs().max() <= TOLERANCE


@LAYOUTS
@pytest.mark.parametrize("name", [NTK, V1_5])
def test_batch_invariance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, threshold: float
) -> None:
    """Two of the texts run past the NTK config's max_trained_positions (16)."""
    monkeypatch.setattr(packing, "PACKING_MIN_PADDING", threshold)
    ours = load(tiny_folder(tmp_path, name))
    lengths = [len(encoded.ids) for encoded in ours.tokenize(TEXTS)]
    assert sum(n > CONFIGS[NTK]["config"]["max_trained_positions"] for n in lengths) == 2
    check_invariance(ours, TEXTS)


@pytest.mark.parametrize("name", [NTK, V1_5])
def test_bfloat16_stays_close_to_float32(tmp_path: Path, name: str) -> None:
    folder = tiny_folder(tmp_path, name)
    texts = [*TEXTS, "the lazy dog " * 12]
    full, half = load(folder), load(folder, torch.bfloat16)
    assert half.info.dtype == "bfloat16"
    cosine = torch.nn.functional.cosine_similarity(full.embed(texts), half.embed(texts))
    assert cosine.min() >= 0.999, f"min cosine {cosine.min().item():.6f}"


@pytest.mark.parametrize("name", [NTK, V1_5])
def test_int8_stays_close_to_float32(tmp_path: Path, name: str) -> None:
    check_int8_close_to_float32(tiny_folder(tmp_path, name), [*TEXTS, "the lazy dog " * 12])


@pytest.mark.gpu
@pytest.mark.parametrize("name", [NTK, V1_5])
def test_float16_on_cuda_stays_close_to_float32(tmp_path: Path, name: str) -> None:
    check_cuda_float16(tiny_folder(tmp_path, name), [*TEXTS, "the lazy dog " * 12])


def test_gpt2_spellings_and_defaults() -> None:
    """Absent keys take the defaults of the authors' config (GPT-2's beneath it)."""
    config = config_from_hf(
        {"model_type": "nomic_bert", "attn_pdrop": 0.0, "rotary_emb_fraction": 1}
    )
    assert isinstance(config, NomicBertConfig)
    shape = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads)
    assert shape == (768, 12, 12)
    assert (config.vocab_size, config.n_positions, config.intermediate_size) == (50257, 1024, 3072)
    assert (config.feed_forward, config.layer_norm_epsilon, config.rotary_emb_base) == (
        "gelu",  # gelu_new, run as exact GELU by the authors' code
        1e-5,
        10_000.0,
    )
    assert (config.type_vocab_size, config.qkv_proj_bias, config.mlp_fc2_bias) == (2, True, True)
    assert config.rotary_scaling_factor is None
    base = CONFIGS[V1_5]["config"]
    without = {k: v for k, v in base.items() if k != "n_positions"}
    assert config_from_hf(without | {"max_position_embeddings": 2048}).max_positions == 2048
    # Both: n_positions, which the models publish as their length (the rotary reads neither).
    both = base | {"n_positions": 8192, "max_position_embeddings": 2048}
    assert config_from_hf(both).max_positions == 8192
    assert config_from_hf(base | {"rotary_scaling_factor": 0}) == config_from_hf(base)
    # Gated widths are rounded up to a multiple of 256, and the vocabulary to its multiple.
    widened = config_from_hf(base | {"n_inner": 300, "vocab_size": 130})
    assert isinstance(widened, NomicBertConfig)
    assert (widened.intermediate_size, widened.vocab_size) == (512, 192)
    # GPT-2 configs save an unset n_inner as null: 8/3 of n_embd (rounded) when gated.
    unset = config_from_hf(base | {"n_inner": None, "n_embd": 128})
    assert isinstance(unset, NomicBertConfig) and unset.intermediate_size == 512


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prenorm": True}, "unsupported prenorm True"),
        ({"causal": True}, "unsupported causal True"),
        ({"parallel_block": True}, "unsupported parallel_block True"),
        ({"use_rms_norm": True}, "unsupported use_rms_norm True"),
        ({"norm_mlp": True}, "unsupported norm_mlp True"),
        ({"moe_every_n_layers": 2}, "unsupported moe_every_n_layers 2"),
        ({"rotary_emb_interleaved": True}, "unsupported rotary_emb_interleaved True"),
        ({"rotary_emb_scale_base": 512}, "unsupported rotary_emb_scale_base 512"),
        ({"rotary_head_dim": True}, "unsupported rotary_head_dim True"),
        ({"attn_pdrop": 0.1}, "unsupported attn_pdrop 0.1"),
        ({"attn_pdrop": None}, "unsupported attn_pdrop None"),
        ({"num_heads_kv": 2}, "unsupported num_heads_kv 2"),
        ({"activation_function": "relu"}, "unsupported activation_function 'relu'"),
        ({"qkv_proj_bias": "no"}, "unsupported qkv_proj_bias 'no'"),
        ({"rotary_emb_fraction": 0.0}, "rotary_emb_fraction 0.0: positions without rotary"),
        ({"rotary_emb_fraction": 0.3}, "must turn an even number of its features"),
        ({"rotary_scaling_factor": -2.0}, "'rotary_scaling_factor' must not be negative"),
        (
            {"rotary_scaling_factor": 2.0, "rotary_emb_fraction": 0.25},
            "rotary_scaling_factor needs more than 2 rotary features",
        ),
        ({"type_vocab_size": -1}, "'type_vocab_size' must be 0 or more"),
    ],
)
def test_unsupported_value_is_refused_by_name(change: dict[str, Any], message: str) -> None:
    raw = CONFIGS[V1_5]["config"] | change
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_hf(raw, "config.json")


@pytest.mark.parametrize("key", ["attn_pdrop", "rotary_emb_fraction"])
def test_absent_key_whose_default_is_not_implemented_is_refused(key: str) -> None:
    """GPT-2's attention dropout (0.1), which the authors' code applies in inference too, and
    the authors' default of no rotary positions."""
    raw = {k: v for k, v in CONFIGS[V1_5]["config"].items() if k != key}
    with pytest.raises(ConfigError, match=key):
        config_from_hf(raw, "config.json")

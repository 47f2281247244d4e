"""Qwen3 (Qwen3-Embedding) against transformers' Qwen3Model and sentence-transformers.

A tiny random Qwen3Model (float32, eager attention, random RMSNorm weights too) is saved by
transformers in a folder laid out as Qwen3-Embedding's: last-token Pooling and Normalize, a
query prompt, a byte-level BPE tokenizer.json whose post-processor appends <|endoftext|>, and
a tokenizer_config.json asking for left padding. Its head_dim (16) times its 4 query heads is
not its hidden_size (48), and 2 key and value heads serve the 4 query heads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from sentence_transformers import SentenceTransformer
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from model import ConfigError, Embedder, packing
from model.architectures import config_from_hf
from tests.helpers import check_cuda_float16, check_int8_close_to_float32, every_map

TOLERANCE = 1e-5
MIN_COSINE = 0.99999
MIN_BFLOAT16_COSINE = 0.999
MAX_POSITIONS = 160
END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = [END_OF_TEXT, "<|im_start|>", "<|im_end|>"]
QUERY_PROMPT = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
)
HIDDEN = 48
CONFIG: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": MAX_POSITIONS,
    # Far from the default 10,000, so that a base read wrong shows.
    "rope_theta": 1000.0,
}
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is the capital of france? paris is the capital of france.",
    "embedding models turn passages into vectors for search",
    "Größe und Übermaß, café crème brûlée",
    "東京は日本の首都です",
    "instruct: given a web search query, retrieve relevant passages",
]
TEXTS = [
    "What is the capital of France?",
    "Paris is the capital of France.",
    "ok",
    "",
    "Größe und Übermaß 東京 🚀",
    # Past max_seq_length (160 tokens): truncated, <|endoftext|> kept at the end.
    " ".join(["embedding models turn passages into vectors"] * 40),
]


def qwen_tokenizer() -> Tokenizer:
    """A byte-level BPE with the normalizer and pre-tokenizer transformers' Qwen2Tokenizer
    builds (it keeps tokenizer.json's post-processor only), appending <|endoftext|>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    end = tokenizer.token_to_id(END_OF_TEXT)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {END_OF_TEXT}:0",
        pair=f"$A:0 {END_OF_TEXT}:0 $B:1 {END_OF_TEXT}:1",
        special_tokens=[(END_OF_TEXT, end)],
    )
    return tokenizer


def reference_model(vocab_size: int, *, causal_lm: bool = False) -> Any:
    """A random Qwen3Model (or Qwen3ForCausalLM) with every weight, norms included, moved off
    its initial value."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=vocab_size, **CONFIG, attn_implementation="eager")
    model_class = transformers.Qwen3ForCausalLM if causal_lm else transformers.Qwen3Model
    model = model_class(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def write_embedding_folder(folder: Path, model: Any, tokenizer: Tokenizer) -> None:
    """The files of a Qwen3-Embedding folder around `model`."""
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    files: dict[str, Any] = {
        "modules.json": [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            },
        ],
        "1_Pooling/config.json": {
            "word_embedding_dimension": HIDDEN,
            "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": False,
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": True,
            "include_prompt": True,
        },
        "2_Normalize/config.json": {},
        "sentence_bert_config.json": {"max_seq_length": MAX_POSITIONS, "do_lower_case": False},
        "config_sentence_transformers.json": {
            "prompts": {"query": QUERY_PROMPT, "document": ""},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
        "tokenizer_config.json": {
            "tokenizer_class": "Qwen2Tokenizer",
            "padding_side": "left",
            "eos_token": "<|im_end|>",
            "pad_token": END_OF_TEXT,
            "unk_token": None,
            "bos_token": None,
            "add_prefix_space": False,
            "model_max_length": 131072,
        },
    }
    for name, content in files.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(json.dumps(content))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return qwen_tokenizer()


@pytest.fixture(scope="module")
def reference(tokenizer: Tokenizer) -> Any:
    return reference_model(tokenizer.get_vocab_size())


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer, reference: Any) -> Path:
    path = tmp_path_factory.mktemp("qwen3-embedding")
    write_embedding_folder(path, reference, tokenizer)
    return path


@pytest.fixture(params=[0.0, 1.1], ids=["packed", "grid"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Position-wise layers on the packed real tokens, or on the padded grid."""
    monkeypatch.setattr(packing, "PACKING_MIN_PADDING", request.param)


def load(folder: Path, dtype: torch.dtype = torch.float32) -> Embedder:
    return Embedder.from_folder(folder, torch.device("cpu"), dtype)


def padded(rows: list[list[int]], *, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and 1/0 mask, padded on the right (or the left) with id 0."""
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[index, span] = torch.tensor(row)
        mask[index, span] = 1
    return ids, mask


def reference_states(reference: Any, rows: list[list[int]]) -> list[torch.Tensor]:
    """transformers' last hidden states of each row's real tokens, in a right-padded batch."""
    ids, mask = padded(rows)
    with torch.no_grad():
        states = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    return [states[index, : len(row)] for index, row in enumerate(rows)]


def largest_difference(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(got, expected, strict=True) if a.numel())


def test_config_is_read_as_transformers_reads_it(reference: Any) -> None:
    config = config_from_hf(reference.config.to_dict())
    assert config.head_dim == 16 and config.num_attention_heads * config.head_dim != HIDDEN
    assert (config.max_positions, config.positions, config.type_vocab_size) == (160, "rotary", 0)
    # Configs on the Hub (transformers 4) name the base flat, beside a null rope_scaling.
    current = reference.config.to_dict()
    older = {k: v for k, v in current.items() if k not in ("rope_parameters", "layer_types")}
    assert config_from_hf(older | {"rope_theta": 1000.0, "rope_scaling": None}) == config


@pytest.mark.usefixtures("layout")
def test_hidden_states_and_attention_match_transformers(folder: Path, reference: Any) -> None:
    """A padded batch of mixed lengths: every real token's state and attention probability."""
    ours = load(folder)
    rows = [encoded.ids for encoded in ours.tokenize(TEXTS)]
    ids, mask = padded(rows)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, output_attentions=True)
    maps = every_map(ours)
    got = ours.forward(rows, token_embeddings=True, attention=maps)
    assert got.token_embeddings is not None and got.attentions is not None
    want = [expected.last_hidden_state[index, : len(row)] for index, row in enumerate(rows)]
    assert largest_difference(got.token_embeddings, want) <= TOLERANCE
    for layer in maps.layers:
        probs = [got.attentions[index][layer] for index in range(len(rows))]
        want = [
            expected.attentions[layer][index, :, :n, :n] for index, n in enumerate(map(len, rows))
        ]
        assert largest_difference(probs, want) <= TOLERANCE


def test_causal_lm_checkpoint_is_read_under_its_prefix(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    """Qwen3ForCausalLM keeps the encoder under `model.`, beside its `lm_head`."""
    task = reference_model(tokenizer.get_vocab_size(), causal_lm=True)
    write_embedding_folder(tmp_path, task, tokenizer)
    ours = load(tmp_path)
    rows = [encoded.ids for encoded in ours.tokenize(TEXTS)]
    got = ours.forward(rows, token_embeddings=True).token_embeddings
    assert got is not None
    assert largest_difference(got, reference_states(task.model, rows)) <= TOLERANCE


@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_vectors_match_sentence_transformers(folder: Path, prompt_name: str | None) -> None:
    """sentence-transformers pads on the left, as the folder asks; this server on the right."""
    reference = SentenceTransformer(str(folder), device="cpu")
    assert reference.tokenizer.padding_side == "left"
    ours = load(folder)
    assert ours.info.dimensions == reference.get_embedding_dimension()
    assert ours.info.max_input_tokens == reference.max_seq_length
    encoded = ours.tokenize(TEXTS, prompt_name=prompt_name)
    assert any(e.truncated for e in encoded)
    assert all(e.tokens[-1] == END_OF_TEXT for e in encoded)
    expected = reference.encode(TEXTS, prompt_name=prompt_name, convert_to_tensor=True)
    cosine = torch.nn.functional.cosine_similarity(
        ours.embed(TEXTS, prompt_name=prompt_name), expected
    )
    assert cosine.min() >= MIN_COSINE, f"{TEXTS[int(cosine.argmin())][:40]!r}: {cosine.min()}"


def test_right_padding_gives_the_left_padded_last_token(folder: Path, reference: Any) -> None:
    """The left-padded batch the folder asks for, through transformers: its last column holds
    every input's last token, which this server's right-padded batch pools to the same vector."""
    ours = load(folder)
    rows = [encoded.ids for encoded in ours.tokenize(TEXTS, prompt_name="query")]
    ids, mask = padded(rows, left=True)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
    got = ours.forward(rows).pooled
    assert float((got - expected).abs().max()) <= TOLERANCE


@pytest.mark.usefixtures("layout")
def test_last_token_vector_does_not_depend_on_the_batch(folder: Path) -> None:
    ours = load(folder)
    rows = [*(encoded.ids for encoded in ours.tokenize(TEXTS)), []]  # an empty row: all padding
    together = ours.forward(rows).pooled
    assert torch.isfinite(together).all()
    for index, row in enumerate(rows[:-1]):
        alone = ours.forward([row]).pooled[0]
        assert float((alone - together[index]).abs().max()) <= TOLERANCE


def test_input_up_to_max_position_embeddings_matches_transformers(
    folder: Path, reference: Any
) -> None:
    ours = load(folder)
    [long] = ours.tokenize([TEXTS[-1]])
    assert len(long.ids) == MAX_POSITIONS and long.truncated
    rows = [long.ids, long.ids[:7]]
    got = ours.forward(rows, token_embeddings=True).token_embeddings
    assert got is not None
    assert largest_difference(got, reference_states(reference, rows)) <= TOLERANCE


def test_bfloat16_stays_close_to_float32(folder: Path) -> None:
    full, half = load(folder), load(folder, torch.bfloat16)
    for prompt_name in (None, "query"):
        cosine = torch.nn.functional.cosine_similarity(
            full.embed(TEXTS, prompt_name=prompt_name), half.embed(TEXTS, prompt_name=prompt_name)
        )
        assert cosine.min() >= MIN_BFLOAT16_COSINE, f"min cosine {cosine.min().item():.6f}"


def test_int8_stays_close_to_float32(folder: Path) -> None:
    check_int8_close_to_float32(folder, TEXTS, prompt_name="query")


@pytest.mark.gpu
def test_float16_on_cuda_stays_close_to_float32(folder: Path) -> None:
    check_cuda_float16(folder, TEXTS)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_sliding_window": True}, "unsupported use_sliding_window True"),
        (
            {"layer_types": ["full_attention", "sliding_attention"]},
            "unsupported layer_types entry 'sliding_attention'",
        ),
        ({"layer_types": ["full_attention"]}, "one type for each of 2 layers"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling"),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "rope_parameters: unsupported rope_type 'linear'",
        ),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"attention_bias": "yes"}, "unsupported attention_bias 'yes'"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
        ({"head_dim": 15}, "even head_dim"),
    ],
)
def test_unsupported_value_is_refused_by_name(
    reference: Any, change: dict[str, Any], message: str
) -> None:
    raw = reference.config.to_dict() | change
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_hf(raw, "config.json")

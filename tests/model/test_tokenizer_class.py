"""tokenizer.json against what the tokenizer class builds (model/tokenizer_class.py).

Every folder here is all-MiniLM-L6-v2 (tokenizer_class BertTokenizer) with one setting changed;
each is refused with an error that names the setting, since transformers 4 and 5 (which
sentence-transformers tokenizes with) follow tokenizer_config.json over tokenizer.json in
different ways. The unchanged folder, and the Lowercase that sentence-transformers 6 saves in
front of the normalizer, load (tests/model/test_folders.py compares their vectors).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from model import ConfigError, Embedder
from model.resolve import DEFAULT_MODEL_ID, resolve_model_dir
from model.tokenizer_class import (
    check_tokenizer_class,
    checks_tokenizer_json,
    uses_token_types,
)

MINILM = resolve_model_dir(DEFAULT_MODEL_ID)
Edit = Callable[[dict[str, Any]], None]


def minilm_with(folder: Path, tokenizer: Edit | None = None, settings: Edit | None = None) -> Path:
    """The default model's folder, tokenizer.json and tokenizer_config.json edited."""
    folder.mkdir(parents=True)
    for item in MINILM.iterdir():
        if item.name not in ("tokenizer.json", "tokenizer_config.json"):
            (folder / item.name).symlink_to(item)
    for name, edit in (("tokenizer.json", tokenizer), ("tokenizer_config.json", settings)):
        content = json.loads((MINILM / name).read_text(encoding="utf-8"))
        if edit is not None:
            edit(content)
        (folder / name).write_text(json.dumps(content), encoding="utf-8")
    return folder


def load(folder: Path) -> Embedder:
    return Embedder.from_folder(folder, torch.device("cpu"), torch.float32)


def setting(key: str, value: object) -> Edit:
    return lambda content: content.__setitem__(key, value)


def cased_normalizer(tokenizer: dict[str, Any]) -> None:
    tokenizer["normalizer"]["lowercase"] = False


def custom_normalizer(tokenizer: dict[str, Any]) -> None:
    replace = {"type": "Replace", "pattern": {"String": "Fox"}, "content": "dog"}
    tokenizer["normalizer"] = {
        "type": "Sequence",
        "normalizers": [replace, tokenizer["normalizer"]],
    }


def no_sep_template(tokenizer: dict[str, Any]) -> None:
    post = tokenizer["post_processor"]
    post["single"] = [
        piece
        for piece in post["single"]
        if "Sequence" in piece or piece["SpecialToken"]["id"] == "[CLS]"
    ]


def pair_in_one_segment(tokenizer: dict[str, Any]) -> None:
    for piece in tokenizer["post_processor"]["pair"]:
        next(iter(piece.values()))["type_id"] = 0


def whitespace_pre_tokenizer(tokenizer: dict[str, Any]) -> None:
    tokenizer["pre_tokenizer"] = {"type": "Whitespace"}


@pytest.mark.parametrize(
    ("tokenizer", "settings", "message"),
    [
        # The class lower-cases, tokenizer.json not (and the other way round).
        (None, setting("do_lower_case", False), "lowercase is True, but do_lower_case"),
        (cased_normalizer, None, "lowercase is False, but do_lower_case"),
        # A cased tokenizer.json with the key left out: the class's default lower-cases.
        (cased_normalizer, lambda s: s.pop("do_lower_case"), "lowercase is False"),
        (None, setting("strip_accents", False), "strip_accents is True, but strip_accents"),
        (None, setting("tokenize_chinese_chars", False), "handle_chinese_chars is True"),
        (custom_normalizer, None, "the normalizer is 'Sequence', not a BertNormalizer"),
        (whitespace_pre_tokenizer, None, "the pre-tokenizer is 'Whitespace'"),
        (no_sep_template, None, "a single text becomes '\\[CLS\\] \\$A', not"),
        (None, setting("sep_token", "[END]"), "not '\\[CLS\\] \\$A \\[END\\]'"),
        (pair_in_one_segment, None, "a pair becomes .*, not '.* \\$B:1 \\[SEP\\]:1'"),
    ],
)
def test_a_tokenizer_the_class_would_rebuild_otherwise_is_refused(
    tmp_path: Path, tokenizer: Edit | None, settings: Edit | None, message: str
) -> None:
    folder = minilm_with(tmp_path / "model", tokenizer, settings)
    with pytest.raises(ConfigError, match=message) as refused:
        load(folder)
    assert "tokenizer.json" in str(refused.value) and "BertTokenizer" in str(refused.value)


def test_what_the_class_would_build_alike_loads(tmp_path: Path) -> None:
    """Written another way, the same pipeline: strip_accents unset follows lowercase, the
    class's Fast name, the older BertProcessing template, special tokens as AddedToken dicts."""

    def older_template(tokenizer: dict[str, Any]) -> None:
        tokenizer["post_processor"] = {
            "type": "BertProcessing",
            "sep": ["[SEP]", 102],
            "cls": ["[CLS]", 101],
        }

    def fast_class(settings: dict[str, Any]) -> None:
        settings.update(
            tokenizer_class="BertTokenizerFast",
            strip_accents=True,
            cls_token={"content": "[CLS]", "special": True},
        )

    reference = load(MINILM).embed(["Größe und Übermaß", "café crème"])
    same = load(minilm_with(tmp_path / "model", older_template, fast_class))
    assert torch.allclose(same.embed(["Größe und Übermaß", "café crème"]), reference, atol=1e-6)


def test_another_tokenizer_class_uses_tokenizer_json_as_saved(tmp_path: Path) -> None:
    """PreTrainedTokenizerFast builds nothing of its own: tokenizer.json is the tokenizer."""
    folder = minilm_with(
        tmp_path / "model", cased_normalizer, setting("tokenizer_class", "PreTrainedTokenizerFast")
    )
    [encoded] = load(folder).tokenize(["Quiet"])
    assert encoded.tokens[1] != "quiet"  # kept its case, so another token


def test_a_left_cut_by_default_with_prompts_is_refused(tmp_path: Path) -> None:
    """sentence-transformers cuts a long prompted text's start, prompt and all; this server
    keeps the prompt, so the folder that asks for both is refused."""
    folder = minilm_with(tmp_path / "model", None, setting("truncation_side", "left"))
    (folder / "config_sentence_transformers.json").unlink()
    prompts = {"prompts": {"query": "query: "}, "default_prompt_name": None}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(prompts))
    with pytest.raises(ConfigError, match="a left truncation side with prompts"):
        load(folder)
    # Alone it is honoured, also beside the empty prompts sentence-transformers 6 saves.
    empty = {"prompts": {"query": "", "document": ""}, "default_prompt_name": None}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(empty))
    assert load(folder).tokenizer.truncation_side == "left"


def test_modernbert_tokenizers_are_taken_as_saved() -> None:
    """transformers 5 loads a ModernBERT folder's tokenizer.json as it is, whatever class its
    tokenizer_config.json names."""
    bert_class = {"tokenizer_class": "BertTokenizerFast"}
    assert checks_tokenizer_json(bert_class, "bert")
    assert not checks_tokenizer_json(bert_class, "modernbert")
    assert not checks_tokenizer_json({"tokenizer_class": "PreTrainedTokenizerFast"}, "bert")


@pytest.mark.parametrize(
    ("settings", "segments"),
    [
        ({}, True),
        ({"tokenizer_class": "BertTokenizerFast"}, True),
        # transformers 5 saves no model_input_names: the class's default holds.
        ({"tokenizer_class": "DistilBertTokenizerFast"}, False),
        ({"tokenizer_class": "XLMRobertaTokenizer"}, False),
        ({"tokenizer_class": "BertTokenizer", "model_input_names": ["input_ids"]}, False),
        ({"tokenizer_class": "MPNetTokenizer", "model_input_names": ["token_type_ids"]}, True),
    ],
)
def test_segment_ids_follow_the_tokenizer_s_model_input_names(
    settings: dict[str, Any], segments: bool
) -> None:
    assert uses_token_types(settings) is segments


MPNET_JSON: dict[str, Any] = {
    "normalizer": {"type": "BertNormalizer", "lowercase": True, "strip_accents": None},
    "pre_tokenizer": {"type": "BertPreTokenizer"},
    # What transformers 5 saves for MPNet.
    "post_processor": {"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0]},
}


def test_mpnet_s_own_template_passes_and_bert_s_does_not(tmp_path: Path) -> None:
    settings = {"tokenizer_class": "MPNetTokenizerFast"}
    check_tokenizer_class(MPNET_JSON, settings, tmp_path / "tokenizer_config.json")
    bert_template = {"type": "BertProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0]}
    with pytest.raises(ConfigError, match="a pair becomes '<s> \\$A </s> \\$B </s>'"):
        check_tokenizer_class(
            {**MPNET_JSON, "post_processor": bert_template},
            settings,
            tmp_path / "tokenizer_config.json",
        )

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tokenizers import Encoding

from model import ConfigError, Embedder, InputTooLongError, TokenIdError
from model.tokenizer import CHARS_PER_TOKEN, CUT_MARGIN, Encoded, TokenDetails
from tests.helpers import TINY_VOCAB, tiny_tokenizer

LONG = " ".join(["hello world"] * 40)  # 80 words, over the tiny model's 48 tokens


def test_offsets_tokens_and_special_flags(tiny_embedder: Embedder) -> None:
    [encoded] = tiny_embedder.tokenize(["Hello, world"])
    assert encoded.tokens == ["[CLS]", "hello", ",", "world", "[SEP]"]
    assert encoded.offsets == [(0, 0), (0, 5), (5, 6), (7, 12), (0, 0)]
    assert encoded.special == [True, False, False, False, True]
    assert not encoded.truncated


def test_a_texts_details_are_read_off_its_encoding_once_asked_for(
    tiny_embedder: Embedder,
) -> None:
    """Routes that answer vectors never turn tokens, offsets and flags into lists."""
    expected = TokenDetails(
        ["[CLS]", "hello", ",", "world", "[SEP]"],
        [(0, 0), (0, 5), (5, 6), (7, 12), (0, 0)],
        [True, False, False, False, True],
    )
    [encoded] = tiny_embedder.tokenize(["Hello, world"])
    assert isinstance(encoded.details, Encoding)
    # Equal by what the details hold, read yet or not.
    assert encoded == Encoded(encoded.ids, False, details=expected)
    moved = TokenDetails(expected.tokens, [(0, 0)] * 5, expected.special)
    assert encoded != Encoded(encoded.ids, False, details=moved)
    [encoded] = tiny_embedder.tokenize(["Hello, world"])
    assert encoded.offsets == expected.offsets
    details: object = encoded.details  # read once asked for, and kept
    assert details == expected
    # A truncated text's are read at once: its Encoding also holds the tokens cut off.
    [long] = tiny_embedder.tokenize([LONG])
    assert long.truncated and isinstance(long.details, TokenDetails)


def test_truncation_right_and_left(tiny_embedder: Embedder) -> None:
    limit = tiny_embedder.info.max_input_tokens
    [right] = tiny_embedder.tokenize([LONG + " fox"], direction="right")
    [left] = tiny_embedder.tokenize(["fox " + LONG], direction="left")
    assert len(right.ids) == len(left.ids) == limit
    assert right.truncated and left.truncated
    assert right.tokens[-1] == left.tokens[-1] == "[SEP]"
    assert "fox" not in right.tokens and "fox" not in left.tokens
    [kept] = tiny_embedder.tokenize([LONG + " fox"], direction="left")
    assert kept.tokens[-2] == "fox"


def set_truncation(folder: Path, config: dict[str, Any], saved_side: str | None) -> None:
    """A model folder's tokenizer.json (with a truncation saved on `saved_side`) and its
    tokenizer_config.json."""
    tokenizer = tiny_tokenizer()
    if saved_side is not None:
        tokenizer.enable_truncation(8, direction=saved_side)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("config", "saved_side", "side"),
    [
        ({}, None, "right"),
        ({"truncation_side": "left"}, None, "left"),
        ({}, "left", "left"),
        ({"truncation_side": "right"}, "left", "right"),
    ],
)
def test_a_request_naming_no_side_is_cut_where_transformers_cuts(
    tiny_checkpoint: Path, config: dict[str, Any], saved_side: str | None, side: str
) -> None:
    """The folder's side (tokenizer_config.json's truncation_side, else the truncation saved
    in tokenizer.json) is the default, as in transformers, which sentence-transformers calls."""
    set_truncation(tiny_checkpoint, config, saved_side)
    ours = Embedder.from_folder(tiny_checkpoint, torch.device("cpu"), torch.float32)
    limit = ours.info.max_input_tokens
    text = "fox " + LONG + " dog"
    [default] = ours.tokenize([text])
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(tiny_checkpoint)
    assert default.ids == reference(text, truncation=True, max_length=limit)["input_ids"]
    assert ("fox" in default.tokens) == (side == "right")
    assert ("dog" in default.tokens) == (side == "left")


def test_an_unknown_truncation_side_is_refused_naming_the_key(tiny_checkpoint: Path) -> None:
    set_truncation(tiny_checkpoint, {"truncation_side": "middle"}, None)
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: unsupported truncation_side"):
        Embedder.from_folder(tiny_checkpoint, torch.device("cpu"), torch.float32)


def test_too_long_without_truncation_names_the_limit(tiny_embedder: Embedder) -> None:
    with pytest.raises(InputTooLongError) as caught:
        tiny_embedder.tokenize(["short", LONG], truncate=False)
    assert caught.value.index == 1
    assert caught.value.limit == tiny_embedder.info.max_input_tokens
    assert caught.value.length == 82
    assert "82 tokens" in str(caught.value)


def test_pre_tokenized_ids_are_validated_and_truncated(tiny_embedder: Embedder) -> None:
    ids = [2, TINY_VOCAB.index("fox"), 3]
    text, pre = tiny_embedder.tokenize(["fox", ids])
    assert pre.ids == text.ids == ids
    assert pre.tokens == ["[CLS]", "fox", "[SEP]"]
    assert pre.special == [True, False, True]
    assert pre.offsets is None
    with pytest.raises(TokenIdError, match="outside the vocabulary"):
        tiny_embedder.tokenize([[2, len(TINY_VOCAB), 3]])
    with pytest.raises(TokenIdError):
        tiny_embedder.tokenize([[2, -1]])
    long_ids = list(range(5, 65))
    [cut] = tiny_embedder.tokenize([long_ids], direction="left")
    assert cut.truncated and cut.ids == long_ids[-tiny_embedder.info.max_input_tokens :]
    with pytest.raises(InputTooLongError):
        tiny_embedder.tokenize([long_ids], truncate=False)


def test_real_tokenizer_ignores_its_training_padding(minilm: Embedder) -> None:
    """all-MiniLM's tokenizer.json pads to 128 and truncates at 128; neither may leak through."""
    short, long = minilm.tokenize(["hi", "word " * 300])
    assert len(short.ids) == 3
    assert len(long.ids) == minilm.info.max_input_tokens == 256


def test_a_long_text_cut_on_the_left_has_offsets_into_the_text_as_sent(
    tiny_embedder: Embedder,
) -> None:
    """Long enough to be cut by characters before it is tokenized (model/tokenizer.py): the
    tokens and offsets are those of the whole text, with or without a prompt in front."""
    limit = tiny_embedder.info.max_input_tokens
    text = "fox " + " ".join(["the quick brown dog"] * 200) + " jumps over"
    assert len(text) > (limit + CUT_MARGIN) * CHARS_PER_TOKEN
    reference = tiny_tokenizer()
    reference.enable_truncation(limit, direction="left")
    whole = reference.encode(text)
    [cut] = tiny_embedder.tokenize([text], direction="left")
    assert (cut.ids, cut.offsets) == (whole.ids, whole.offsets)
    prompt = "hello, "
    [prompted] = tiny_embedder.tokenizer.encode([text], direction="left", prompt=prompt)
    assert prompted.tokens[1:3] == ["hello", ","] and prompted.offsets is not None
    sent = prompt + text
    for token, (start, end), special in zip(
        prompted.tokens, prompted.offsets, prompted.special, strict=True
    ):
        assert special or sent[start:end] == token.removeprefix("##")
    assert prompted.offsets[-2] == (len(sent) - 4, len(sent))

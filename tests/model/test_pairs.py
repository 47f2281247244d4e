"""Pairs of texts: the pair template, longest-first truncation on either side, long texts cut
before tokenization giving the tokens of the whole texts, and bad input refused."""

from __future__ import annotations

import itertools

import pytest
import transformers
from tokenizers import Tokenizer

from model import Direction, InputError, InputTooLongError
from model.tokenizer import CHARS_PER_TOKEN, CUT_MARGIN, Encoded, TextTokenizer, longest_first
from tests.helpers import TINY_CONFIG
from tests.task_checkpoints import pair_tokenizer

SHORT = "hello world"
MEDIUM = " ".join(["the quick brown fox"] * 6)  # 24 tokens
# More characters than the cut keeps for a 40-token limit, by word and by letter. (Not many
# more: `tokenizers` builds every pair of overflowing pieces, which a small limit makes slow.)
LONG = " ".join(["jumps over the lazy dog"] * 80)
LETTERS = "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 40
TEXTS = ["", SHORT, MEDIUM, LONG, LETTERS, "é" * 2000]


def ours(model_type: str, max_length: int) -> TextTokenizer:
    json = pair_tokenizer(model_type).to_str()
    return TextTokenizer(json, max_length, TINY_CONFIG["vocab_size"])


def reference(model_type: str, max_length: int | None, direction: Direction) -> Tokenizer:
    tokenizer = pair_tokenizer(model_type)
    if max_length is not None:
        tokenizer.enable_truncation(max_length, strategy="longest_first", direction=direction)
    return tokenizer


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
@pytest.mark.parametrize("direction", ["right", "left"])
@pytest.mark.parametrize("max_length", [40, 41])  # an odd and an even budget for the texts
def test_pairs_are_tokenized_as_whole_texts_truncated_longest_first(
    model_type: str, direction: Direction, max_length: int
) -> None:
    limit = (max_length + CUT_MARGIN) * CHARS_PER_TOKEN
    assert min(len(LONG), len(LETTERS)) > limit  # the cut is exercised
    pairs = list(itertools.product(TEXTS, TEXTS))
    got = ours(model_type, max_length).encode_pairs(pairs, direction=direction)
    expected = reference(model_type, max_length, direction).encode_batch(pairs)
    whole = reference(model_type, None, direction).encode_batch(pairs)
    for pair, item, want, full in zip(pairs, got, expected, whole, strict=True):
        context = f"{[len(text) for text in pair]} chars"
        assert item.ids == want.ids, context
        assert item.type_ids == want.type_ids, context
        assert item.special == [bool(flag) for flag in want.special_tokens_mask], context
        assert item.offsets == want.offsets, context
        assert item.truncated == (len(full.ids) > len(want.ids)), context
        assert len(item.ids) <= max_length


def test_longest_first_keeps_what_tokenizers_keeps() -> None:
    """Every split of up to 24 + 24 one-token words, for odd and even budgets."""
    for budget in (0, 1, 7, 10, 16):
        tokenizer = reference("bert", budget + 3, "right")
        pairs = [("a " * n, "b " * m) for n in range(25) for m in range(25)]
        for (first, second), encoding in zip(pairs, tokenizer.encode_batch(pairs), strict=True):
            kept = (encoding.sequence_ids.count(0), encoding.sequence_ids.count(1))
            assert longest_first((len(first) // 2, len(second) // 2), budget) == kept


def test_type_ids_and_offsets_point_into_each_text() -> None:
    [item] = ours("bert", 40).encode_pairs([("hello fox", "lazy dog")])
    assert item.tokens == ["[CLS]", "hello", "fox", "[SEP]", "lazy", "dog", "[SEP]"]
    assert item.type_ids == [0, 0, 0, 0, 1, 1, 1]
    assert item.offsets is not None
    assert item.offsets[2] == (6, 9) and item.offsets[5] == (5, 8)
    [left] = ours("bert", 40).encode_pairs([(SHORT, LONG)], direction="left")
    assert left.offsets is not None and left.offsets[-2] == (len(LONG) - 3, len(LONG))
    assert LONG[slice(*left.offsets[-2])] == "dog"


@pytest.mark.parametrize("direction", ["right", "left"])
def test_transformers_truncates_pairs_the_same_way(direction: Direction) -> None:
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=pair_tokenizer("bert"),
        truncation_side=direction,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
    pairs = [(MEDIUM, MEDIUM + " dog"), (SHORT, MEDIUM * 2), (MEDIUM * 2, SHORT)]
    firsts, seconds = zip(*pairs, strict=True)
    expected = fast(list(firsts), list(seconds), truncation="longest_first", max_length=31)
    got = ours("bert", 31).encode_pairs(pairs, direction=direction)
    assert [item.ids for item in got] == expected["input_ids"]
    assert [item.type_ids for item in got] == expected["token_type_ids"]


def test_too_long_without_truncation_is_refused() -> None:
    tokenizer = ours("bert", 40)
    fits = tokenizer.encode_pairs([(SHORT, SHORT)], truncate=False)
    assert not fits[0].truncated
    with pytest.raises(InputTooLongError, match="input 1 has 51 tokens") as error:
        tokenizer.encode_pairs([(SHORT, SHORT), (MEDIUM, MEDIUM)], truncate=False)
    assert error.value.index == 1 and error.value.limit == 40
    with pytest.raises(InputTooLongError, match="input 0 has at least"):
        tokenizer.encode_pairs([(SHORT, LONG)], truncate=False)


@pytest.mark.parametrize("pair", [("ok\ud800", "fine"), ("fine", "\udfff")])
def test_lone_surrogates_are_refused(pair: tuple[str, str]) -> None:
    with pytest.raises(InputError, match="input 1 is not valid Unicode") as error:
        ours("bert", 40).encode_pairs([(SHORT, SHORT), pair])
    assert error.value.index == 1


def test_single_texts_keep_their_own_path() -> None:
    tokenizer = ours("bert", 40)
    [single] = tokenizer.encode([SHORT])
    [pair] = tokenizer.encode_pairs([(SHORT, "")])
    assert single.type_ids is None
    assert pair.ids == [
        *single.ids,
        tokenizer.encode(["[SEP]"], add_special_tokens=False)[0].ids[0],
    ]
    assert isinstance(pair, Encoded) and pair.type_ids == [0, 0, 0, 0, 1]

"""A BERT tokenizer's plain ASCII twin gives plain ASCII text exactly what the tokenizer does:
tokens, offsets, special flags and what truncation cuts off, alone and in pairs."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Encoding, Tokenizer

from model import Embedder
from model.plain_ascii import is_plain, plain_ascii_json
from model.tokenizer import TextTokenizer

PRINTABLE = "".join(chr(code) for code in range(0x20, 0x7F))
# Pieces that reach the tokenizer's corners: its special tokens typed as text, whitespace of
# every plain kind, a word too long for WordPiece (100 characters), contractions and runs of
# punctuation.
PIECES = ["[CLS]", "[SEP]", "[UNK]", "[MASK]", "  ", "\r\n", "\t", "x" * 120, "don't", "U.S.A."]
PLAIN_TEXT = st.lists(
    st.one_of(st.sampled_from(PRINTABLE + "\t\n\r"), st.sampled_from(PIECES)), max_size=60
).map("".join)


def bert_json(**normalizer: Any) -> str:
    return orjson.dumps(
        {"normalizer": normalizer, "pre_tokenizer": {"type": "BertPreTokenizer"}}
    ).decode()


def normalizer_of(tokenizer_json: str | None) -> object:
    assert tokenizer_json is not None
    return orjson.loads(tokenizer_json)["normalizer"]


def test_plain_is_printable_ascii_tabs_and_line_breaks() -> None:
    assert is_plain("Hello, world!\tA line\r\nand ~another~") and is_plain("")
    for text in ("café", "a\x00b", "a\x0bb", "a\x0cb", "a\x7fb", "a\x1fb", "数"):
        assert not is_plain(text), repr(text)


def test_a_bert_normalizer_becomes_its_lowercasing() -> None:
    lowercasing = bert_json(type="BertNormalizer", lowercase=True, strip_accents=None)
    assert normalizer_of(plain_ascii_json(lowercasing)) == {"type": "Lowercase"}
    cased = bert_json(type="BertNormalizer", lowercase=False, strip_accents=False)
    assert normalizer_of(plain_ascii_json(cased)) is None
    # sentence-transformers' do_lower_case in front of a cased BertNormalizer, and NFD, which
    # leaves ASCII as it is.
    steps = [
        {"type": "Lowercase"},
        {"type": "NFD"},
        {"type": "BertNormalizer", "lowercase": False},
    ]
    in_sequence = bert_json(type="Sequence", normalizers=steps)
    assert normalizer_of(plain_ascii_json(in_sequence)) == {"type": "Lowercase"}


@pytest.mark.parametrize(
    "tokenizer_json",
    [
        # Nothing to gain: no BertNormalizer.
        bert_json(type="Lowercase"),
        # A step that may change ASCII text (SentencePiece's character map, a replacement).
        bert_json(
            type="Sequence",
            normalizers=[{"type": "BertNormalizer", "lowercase": True}, {"type": "Precompiled"}],
        ),
        bert_json(type="Replace", pattern={"String": "a"}, content="b"),
        # A pre-tokenizer that may tell a line break from a space.
        orjson.dumps(
            {
                "normalizer": {"type": "BertNormalizer", "lowercase": True},
                "pre_tokenizer": {"type": "Metaspace"},
            }
        ).decode(),
    ],
)
def test_no_twin_where_its_equality_is_not_known(tokenizer_json: str) -> None:
    assert plain_ascii_json(tokenizer_json) is None


def same(one: Encoding, other: Encoding) -> bool:
    def parts(encoding: Encoding) -> tuple[object, ...]:
        return (
            encoding.ids,
            encoding.tokens,
            encoding.offsets,
            encoding.special_tokens_mask,
            encoding.type_ids,
            encoding.sequence_ids,
            encoding.word_ids,
        )

    return parts(one) == parts(other) and [parts(o) for o in one.overflowing] == [
        parts(o) for o in other.overflowing
    ]


@pytest.fixture(scope="module")
def default_and_twin(minilm: Embedder) -> tuple[Tokenizer, Tokenizer]:
    """all-MiniLM-L6-v2's tokenizer as served (no padding, truncation at 16 for overflow to
    show), and its twin."""
    tokenizer_json = minilm.tokenizer.spec.tokenizer_json
    twin_json = plain_ascii_json(tokenizer_json)
    assert twin_json is not None
    made = []
    for text in (tokenizer_json, twin_json):
        tokenizer = Tokenizer.from_str(text)
        tokenizer.no_padding()
        tokenizer.enable_truncation(16)
        made.append(tokenizer)
    return made[0], made[1]


@settings(max_examples=300, deadline=None)
@given(text=PLAIN_TEXT, other=PLAIN_TEXT, special=st.booleans())
@example(text="Hello,\tWORLD!\r\n[CLS] it's U.S.A. " + "x" * 120, other="", special=True)
def test_the_twin_tokenizes_plain_text_as_the_model_does(
    default_and_twin: tuple[Tokenizer, Tokenizer], text: str, other: str, special: bool
) -> None:
    tokenizer, twin = default_and_twin
    assert same(
        tokenizer.encode(text, add_special_tokens=special),
        twin.encode(text, add_special_tokens=special),
    )
    assert same(tokenizer.encode(text, other), twin.encode(text, other))


def test_a_front_ends_bert_tokenizer_keeps_a_twin_for_each_of_its_settings(
    minilm: Embedder,
) -> None:
    """A front end's tokenizer has twins; an engine's (the Embedder's) has none."""
    spec = minilm.tokenizer.spec
    served = spec.build()
    # Without truncation, with it on either side, and a pair's texts.
    assert len(served._plain_twins) == 4
    without = minilm.tokenizer
    assert without._plain_twins == {}
    inputs = ["Plain text, as most is.", "Not plain: café", "tab\tand line\nbreak"]
    for truncate in (True, False):
        assert served.encode(inputs, truncate=truncate) == without.encode(inputs, truncate=truncate)
    [tabbed] = served.encode(inputs[2:])
    assert tabbed.offsets == [(0, 0), (0, 3), (4, 7), (8, 12), (13, 18), (0, 0)]


def test_a_tokenizer_of_another_kind_has_no_twin(tiny_embedder: Embedder) -> None:
    """The tests' tiny tokenizer is BERT's kind; a byte-level one is not."""
    assert len(tiny_embedder.tokenizer.spec.build()._plain_twins) == 4
    spec = orjson.loads(tiny_embedder.tokenizer.spec.tokenizer_json)
    spec["pre_tokenizer"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    other = TextTokenizer(orjson.dumps(spec).decode(), 48, 100, plain_ascii_twins=True)
    assert other._plain_twins == {}


@pytest.mark.parametrize("text", ["a\x00b", "a\x0bb", "a\x7fb", "a\x01b c"])
def test_ascii_control_characters_are_not_plain_for_the_twin_would_differ(
    default_and_twin: tuple[Tokenizer, Tokenizer], text: str
) -> None:
    """BERT's normalizer drops them, gluing the words either side into one."""
    tokenizer, twin = default_and_twin
    assert not same(tokenizer.encode(text), twin.encode(text))
    assert not is_plain(text)

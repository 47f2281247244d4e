"""A BERT tokenizer's plain ASCII twin gives plain ASCII text exactly what the tokenizer does:
tokens, offsets, special flags and what truncation cuts off, alone and in pairs."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Encoding, Tokenizer

from model import Direction, Embedder, InputTooLongError
from model.plain_ascii import is_plain, plain_ascii_json
from model.tokenizer import NO_DETAILS, TextTokenizer

PRINTABLE = "".join(chr(code) for code in range(0x20, 0x7F))
# Pieces that reach the tokenizer's corners: its special tokens typed as text, whitespace of
# every plain kind, a word too long for WordPiece (100 characters), contractions and runs of
# punctuation.
PIECES = ["[CLS]", "[SEP]", "[UNK]", "[MASK]", "  ", "\r\n", "\t", "x" * 120, "don't", "U.S.A."]
PLAIN_TEXT = st.lists(
    st.one_of(st.sampled_from(PRINTABLE + "\t\n\r"), st.sampled_from(PIECES)), max_size=60
).map("".join)


def bert_spec(**normalizer: Any) -> dict[str, Any]:
    return {"normalizer": normalizer, "pre_tokenizer": {"type": "BertPreTokenizer"}}


def normalizer_of(tokenizer_json: str | None) -> object:
    assert tokenizer_json is not None
    return orjson.loads(tokenizer_json)["normalizer"]


def test_plain_is_printable_ascii_tabs_and_line_breaks() -> None:
    assert is_plain("Hello, world!\tA line\r\nand ~another~") and is_plain("")
    for text in ("café", "a\x00b", "a\x0bb", "a\x0cb", "a\x7fb", "a\x1fb", "数"):
        assert not is_plain(text), repr(text)


def test_a_bert_normalizer_becomes_its_lowercasing() -> None:
    lowercasing = bert_spec(type="BertNormalizer", lowercase=True, strip_accents=None)
    assert normalizer_of(plain_ascii_json(lowercasing)) == {"type": "Lowercase"}
    assert lowercasing == bert_spec(type="BertNormalizer", lowercase=True, strip_accents=None)
    cased = bert_spec(type="BertNormalizer", lowercase=False, strip_accents=False)
    assert normalizer_of(plain_ascii_json(cased)) is None
    # sentence-transformers' do_lower_case in front of a cased BertNormalizer, and NFD, which
    # leaves ASCII as it is.
    steps = [
        {"type": "Lowercase"},
        {"type": "NFD"},
        {"type": "BertNormalizer", "lowercase": False},
    ]
    in_sequence = bert_spec(type="Sequence", normalizers=steps)
    assert normalizer_of(plain_ascii_json(in_sequence)) == {"type": "Lowercase"}


@pytest.mark.parametrize(
    "spec",
    [
        # Nothing to gain: no BertNormalizer.
        bert_spec(type="Lowercase"),
        # A step that may change ASCII text (SentencePiece's character map, a replacement).
        bert_spec(
            type="Sequence",
            normalizers=[{"type": "BertNormalizer", "lowercase": True}, {"type": "Precompiled"}],
        ),
        bert_spec(type="Replace", pattern={"String": "a"}, content="b"),
        # A pre-tokenizer that may tell a line break from a space.
        {
            "normalizer": {"type": "BertNormalizer", "lowercase": True},
            "pre_tokenizer": {"type": "Metaspace"},
        },
    ],
)
def test_no_twin_where_its_equality_is_not_known(spec: dict[str, Any]) -> None:
    assert plain_ascii_json(spec) is None


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
    twin_json = plain_ascii_json(orjson.loads(tokenizer_json))
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


class Recording:
    """A tokenizer that counts the texts it is handed."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts = 0

    def encode(self, text: str, **options: Any) -> Encoding:
        self.texts += 1
        return self.tokenizer.encode(text, **options)

    def encode_batch(self, texts: list[str], **options: Any) -> list[Encoding]:
        self.texts += len(texts)
        return self.tokenizer.encode_batch(texts, **options)


def test_a_front_ends_tokenizer_takes_plain_text_through_the_twins(minilm: Embedder) -> None:
    """A front end's tokenizer has a twin for each setting, used for plain texts only; an
    engine's (the Embedder's) has none."""
    served = minilm.tokenizer.spec.build()
    assert minilm.tokenizer._plain_twins == {}
    # Without truncation, with it on either side, and a pair's texts.
    assert len(served._plain_twins) == 4
    recording = {tokenizer: Recording(twin) for tokenizer, twin in served._plain_twins.items()}
    served._plain_twins = recording  # type: ignore[assignment]
    served.encode(["Plain text, as most is.", "tab\tand line\nbreak"])
    served.encode_pairs([("a query", "a passage")])
    assert sum(twin.texts for twin in recording.values()) == 4
    served.encode(["Not plain: café", "plain"])  # one text that is not: all through BERT's
    served.encode_pairs([("a query", "an accented passage, naïve")])
    assert sum(twin.texts for twin in recording.values()) == 4


def bert_variant(minilm: Embedder, lowercase: bool) -> str:
    """all-MiniLM-L6-v2's tokenizer.json, its BertNormalizer lowercasing or not."""
    spec = orjson.loads(minilm.tokenizer.spec.tokenizer_json)
    spec["normalizer"]["lowercase"] = lowercase
    return orjson.dumps(spec).decode()


def outcome(call: Callable[[], object]) -> object:
    """What `call` returns, or the error it raises (type and message)."""
    try:
        return call()
    except InputTooLongError as error:
        return type(error), str(error)


@pytest.fixture(scope="module")
def served_pairs(minilm: Embedder) -> list[tuple[TextTokenizer, TextTokenizer]]:
    """(with twins, without) for an uncased tokenizer, a cased one, and a cased one served
    with do_lower_case; 16 tokens, so that truncation, and the cut of long texts, happen."""
    made = []
    for lowercase, do_lower_case in ((True, False), (False, False), (False, True)):
        tokenizer_json = bert_variant(minilm, lowercase)
        made.append(
            tuple(
                TextTokenizer(
                    tokenizer_json, 16, 30522, lowercase=do_lower_case, plain_ascii_twins=twins
                )
                for twins in (True, False)
            )
        )
    return made  # type: ignore[return-value]


@settings(max_examples=150, deadline=None)
@given(
    text=st.one_of(PLAIN_TEXT, PLAIN_TEXT.map(lambda text: text * 40)),
    other=PLAIN_TEXT,
    prompt=st.sampled_from(["", "query: "]),
    direction=st.sampled_from(["right", "left"]),
)
def test_a_tokenizer_with_twins_answers_as_one_without(
    served_pairs: list[tuple[TextTokenizer, TextTokenizer]],
    text: str,
    other: str,
    prompt: str,
    direction: Direction,
) -> None:
    """Texts long enough to be cut by characters first (40 times a generated one) too."""
    for with_twins, without in served_pairs:
        for truncate in (True, False):
            asked = (text, other, prompt, direction, truncate)
            assert answers(with_twins, *asked) == answers(without, *asked)


def answers(
    tokenizer: TextTokenizer,
    text: str,
    other: str,
    prompt: str,
    direction: Direction,
    truncate: bool,
) -> list[object]:
    """The two texts with `prompt`, the two as a pair, and the first whole."""
    return [
        outcome(
            lambda: tokenizer.encode(
                [text, other], truncate=truncate, direction=direction, prompt=prompt
            )
        ),
        outcome(
            lambda: tokenizer.encode_pairs([(text, other)], truncate=truncate, direction=direction)
        ),
        tokenizer.encode_whole(text, prompt),
    ]


@settings(max_examples=150, deadline=None)
@given(
    text=st.one_of(PLAIN_TEXT, PLAIN_TEXT.map(lambda text: text * 40), st.text(max_size=40)),
    prompt=st.sampled_from(["", "query: "]),
    direction=st.sampled_from(["right", "left"]),
    truncate=st.booleans(),
)
@example(text="word " * 400, prompt="query: ", direction="left", truncate=True)
def test_ids_without_details_are_the_ids_with_them(
    served_pairs: list[tuple[TextTokenizer, TextTokenizer]],
    text: str,
    prompt: str,
    direction: Direction,
    truncate: bool,
) -> None:
    """What the model runs on (ids, truncation, the prompt's length, segments) is the same
    without the details, for a lone text and for texts sent together (tokenized without
    tracking offsets), through the twins or not; and no details are kept, but where the left
    cut of a prompted text needs the offsets to find the prompt."""
    tokenizers = (tokenizer for pair in served_pairs for tokenizer in pair)
    for tokenizer, together in itertools.product(tokenizers, ([], ["and another text"])):
        full, bare = (
            outcome(
                partial(
                    tokenizer.encode,
                    [text, *together, [101, 7592, 102]],
                    truncate=truncate,
                    direction=direction,
                    prompt=prompt,
                    details=details,
                )
            )
            for details in (True, False)
        )
        if not isinstance(full, list):  # too long, and not to be cut
            assert bare == full
            continue
        assert isinstance(bare, list)
        for kept, alone in zip(full, bare, strict=True):
            assert (alone.ids, alone.truncated, alone.prompt_length, alone.type_ids) == (
                kept.ids,
                kept.truncated,
                kept.prompt_length,
                kept.type_ids,
            )
        keeps_prompt = bool(prompt) and truncate and direction == "left"
        assert all((e.details is NO_DETAILS) is not keeps_prompt for e in bare[:-1])
        assert bare[-1] == full[-1]  # ids sent as ids have their tokens either way


def test_no_twin_where_an_added_token_is_matched_after_normalizing(minilm: Embedder) -> None:
    """Such a token's content is normalized too: BERT's normalizer would match "Café" in
    "cafe", which lowercasing alone does not."""
    spec = orjson.loads(minilm.tokenizer.spec.tokenizer_json)
    added = {"id": 30522, "content": "Café", "single_word": False, "lstrip": False}
    spec["added_tokens"].append({**added, "rstrip": False, "normalized": True, "special": False})
    assert plain_ascii_json(spec) is None
    twinned = TextTokenizer(orjson.dumps(spec).decode(), 256, 30523, plain_ascii_twins=True)
    [encoded] = twinned.encode(["cafe"])
    assert encoded.ids[1:-1] == [30522]


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

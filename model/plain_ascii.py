"""A BERT tokenizer's twin for plain ASCII text, without the Unicode work that changes nothing
there.

BERT's normalizer (`BertNormalizer`) looks characters up in Unicode's tables: it drops
control characters and turns whitespace into spaces, puts spaces around Chinese characters,
strips accents (NFD, then combining marks dropped) and lowercases. On text made only of
printable ASCII characters, tabs and line breaks, the lowercasing is all that changes a
token: no character is dropped, none is Chinese or decomposes, and a tab or line break left
as it is splits words just as the space it would have become does (BERT's pre-tokenizer
splits on any whitespace, and the offsets point into the text as sent either way). The twin
runs only the lowercasing, where the model's normalizer lowercases, and BERT's
pre-tokenizer (whitespace, then each punctuation character apart, the latter a Unicode lookup
for every character) as a split at whitespace and at ASCII's punctuation characters: the same
tokens and offsets for less work (docs/benchmarks.md). Most text sent to an embedding server
is plain ASCII.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

# Printable ASCII, tab, line feed and carriage return, and nothing else.
_PLAIN = re.compile(r"[\t\n\r -~]*")
# BERT's pre-tokenizer on ASCII: words split at whitespace, and each punctuation character (for
# ASCII, Rust's `is_ascii_punctuation`: the 32 printable characters other than letters, digits
# and the space) a piece of its own. Told by a character class instead of a Unicode table
# lookup for every character.
_ASCII_BERT_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "WhitespaceSplit"},
        {
            "type": "Split",
            "pattern": {"Regex": "[!-/:-@\\[-`{-~]"},
            "behavior": "Isolated",
            "invert": False,
        },
    ],
}
# The normalizers known to change plain ASCII text by lowercasing it at most (the NF forms
# leave it as it is).
_KNOWN_STEPS = frozenset({"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD"})


def is_plain(text: str) -> bool:
    """Whether `text` is plain ASCII, as the twin takes it (`isascii` first: it reads a flag
    of the string, where the pattern reads the text)."""
    return text.isascii() and _PLAIN.fullmatch(text) is not None


def plain_ascii_json(spec: dict[str, Any]) -> str | None:
    """The tokenizer of `spec` (a tokenizer.json, parsed) with a normalizer and a
    pre-tokenizer that give plain ASCII text (`is_plain`) the tokens and offsets its own give
    it, with less work, as JSON; None unless it is BERT's kind (a `BertNormalizer`, alone or
    with steps known to change no ASCII text but by lowercasing it, and BERT's pre-tokenizer)
    and no added token is matched in the normalized text (`normalized`: its content is
    normalized by the same normalizer, and BERT's would match an accented or tabbed one where
    lowercasing does not)."""
    pre_tokenizer = spec.get("pre_tokenizer") or {}
    if pre_tokenizer.get("type") != "BertPreTokenizer":
        return None
    if any(token.get("normalized") for token in spec.get("added_tokens") or []):
        return None
    steps = _steps(spec.get("normalizer"))
    if steps is None or not any(step["type"] == "BertNormalizer" for step in steps):
        return None
    lowercases = any(
        step["type"] == "Lowercase" or (step["type"] == "BertNormalizer" and step["lowercase"])
        for step in steps
    )
    normalizer = {"type": "Lowercase"} if lowercases else None
    twin = {**spec, "normalizer": normalizer, "pre_tokenizer": _ASCII_BERT_PRE_TOKENIZER}
    return orjson.dumps(twin).decode()


def _steps(normalizer: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The normalizer's steps, a Sequence's flattened; None if a step could change plain
    ASCII text other than by lowercasing it."""
    if normalizer is None:
        return []
    if normalizer["type"] == "Sequence":
        steps: list[dict[str, Any]] = []
        for inner in normalizer["normalizers"]:
            if (found := _steps(inner)) is None:
                return None
            steps += found
        return steps
    if normalizer["type"] in _KNOWN_STEPS:
        return [normalizer]
    return None

"""Prompts: /tokenize slices the prompted text, left truncation keeps the prompt, and the
prompt's length is counted as sentence-transformers counts it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model import Embedder
from tests.app.conftest import Placement, make_settings, running_app
from tests.helpers import TINY_VOCAB, tiny_tokenizer

pytestmark = pytest.mark.anyio
PROMPT = "the quick "
LONG = " ".join(["hello world"] * 40) + " lazy dog"  # 82 text tokens, over the limit of 48
CLS, SEP = TINY_VOCAB.index("[CLS]"), TINY_VOCAB.index("[SEP]")


@pytest.fixture
def prompted_checkpoint(tiny_checkpoint: Path) -> Path:
    (tiny_checkpoint / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": PROMPT, "long": "fox " * 60}})
    )
    return tiny_checkpoint


@pytest.fixture
def embedder(prompted_checkpoint: Path) -> Embedder:
    return Embedder.from_folder(prompted_checkpoint, torch.device("cpu"), torch.float32)


def text_ids(text: str) -> list[int]:
    return tiny_tokenizer().encode(text, add_special_tokens=False).ids


async def test_tokenize_slices_the_prompted_text(
    placement: Placement, prompted_checkpoint: Path
) -> None:
    async with running_app(make_settings(prompted_checkpoint), placement) as (_, client):
        response = await client.post(
            "/tokenize", json={"inputs": "Fox jumps", "prompt_name": "query"}
        )
    assert response.status_code == 200
    [tokens] = response.json()
    prompted = PROMPT + "Fox jumps"
    assert [t["text"] for t in tokens] == ["[CLS]", "the", "quick", "Fox", "jumps", "[SEP]"]
    for token in tokens:
        if not token["special"]:
            assert prompted[token["start"] : token["stop"]] == token["text"]


def test_left_truncation_keeps_the_prompt(embedder: Embedder) -> None:
    [encoded] = embedder.tokenize([LONG], direction="left", prompt_name="query")
    limit = embedder.info.max_input_tokens
    prompt = text_ids(PROMPT)
    assert encoded.ids == [CLS, *prompt, *text_ids(LONG)[-(limit - 2 - len(prompt)) :], SEP]
    assert encoded.truncated and encoded.prompt_length == 1 + len(prompt)
    assert encoded.offsets is not None and encoded.offsets[1:3] == [(0, 3), (4, 9)]
    [plain] = embedder.tokenize([LONG], direction="left")
    assert plain.ids == [CLS, *text_ids(LONG)[-(limit - 2) :], SEP]


async def test_left_truncation_keeps_the_prompt_over_http(
    placement: Placement, prompted_checkpoint: Path
) -> None:
    body = {"inputs": LONG, "prompt_name": "query", "truncation_direction": "left"}
    async with running_app(make_settings(prompted_checkpoint), placement) as (_, client):
        [tokens] = (await client.post("/tokenize", json=body)).json()
    assert [t["text"] for t in tokens[:3]] == ["[CLS]", "the", "quick"]
    assert [t["text"] for t in tokens[-3:]] == ["lazy", "dog", "[SEP]"]
    assert len(tokens) == 48


def test_a_long_left_cut_keeps_the_prompt_and_its_offsets(embedder: Embedder) -> None:
    """Past the character cut's threshold the text is cut before tokenizing; the prompt and
    the offsets into the prompted text stay right."""
    text = "hello world " * 400 + "the lazy dog"
    [encoded] = embedder.tokenize([text], direction="left", prompt_name="query")
    prompted = PROMPT + text
    assert encoded.tokens[:3] == ["[CLS]", "the", "quick"]
    assert encoded.tokens[-4:] == ["the", "lazy", "dog", "[SEP]"]
    assert encoded.offsets is not None
    spans = [prompted[start:end] for (start, end) in encoded.offsets[-4:-1]]
    assert spans == ["the", "lazy", "dog"]


def test_a_prompt_that_fills_the_limit_is_cut_like_any_text(embedder: Embedder) -> None:
    [encoded] = embedder.tokenize(["hello"], direction="left", prompt_name="long")
    assert len(encoded.ids) == embedder.info.max_input_tokens and encoded.truncated
    assert encoded.ids[-3:] == [TINY_VOCAB.index("fox"), TINY_VOCAB.index("hello"), SEP]


@pytest.mark.parametrize(
    ("prompt_name", "length"),
    [
        (None, 0),  # the model has no default prompt
        ("", 0),
        ("query", 3),  # [CLS] the quick: the leading special token counts, the trailing not
    ],
)
def test_the_prompt_length_counts_its_leading_special_token(
    embedder: Embedder, prompt_name: str | None, length: int
) -> None:
    [encoded] = embedder.tokenize(["fox"], prompt_name=prompt_name)
    assert encoded.prompt_length == length
    assert encoded.tokens[:length] == ["[CLS]", "the", "quick"][:length]

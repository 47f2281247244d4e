"""Property tests: whatever a client sends, the answer is never a 5xx nor a traceback; text
of any Unicode gets its vector or a 4xx that says why; and the tokenizer's character cut
gives exactly the tokens of the whole text.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

import model.tokenizer
from app.main import create_app
from app.schemas import AttentionRequest, EncodeRequest, OpenAIEmbeddingRequest, TokenizeRequest
from model import Direction, Embedder
from tests.app.conftest import make_settings
from tests.helpers import make_random_checkpoint

# Small limits so that the generated bodies reach them: 8 inputs, 150,000 characters each.
LIMITS = {"max_inputs_per_request": 8, "max_input_chars": 150_000}
DIRECTIONS: list[Direction] = ["right", "left"]
ROUTES = ["/embed", "/embed_all", "/tokenize", "/v1/embeddings", "/encode"]
# Every field name the request models know, and then some.
FIELDS = sorted(
    {
        name
        for request in (EncodeRequest, TokenizeRequest, OpenAIEmbeddingRequest, AttentionRequest)
        for name in request.model_fields
    }
)
# Characters that have broken text services: NUL and other controls, right-to-left marks and
# overrides, a byte-order mark, zero-width joiners, a combining accent, a character outside
# the Basic Multilingual Plane, CJK; and lone surrogates (valid in JSON as "\ud800").
TRICKY = "\x00\x01\x1f\x7f\u200e\u200f\u202b\u202e\u2066\ufeff\u200b\u200d\u0301\U0001f600漢"
characters = st.characters(codec="utf-8") | st.sampled_from(TRICKY)  # no surrogates
surrogates = st.sampled_from("\ud800\udbff\udc00\udfff") | st.characters(categories=["Cs"])


def mostly(usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`usual` nine times in ten, else `odd`."""
    return st.integers(0, 9).flatmap(lambda n: odd if n == 0 else usual)


# Text, one time in ten with lone surrogates among its characters.
unicode_text = mostly(st.text(characters, max_size=40), st.text(characters | surrogates))
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # NaN and infinities too: Python's json writes and reads them
    | unicode_text,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.sampled_from(FIELDS) | unicode_text, children, max_size=5)
    ),
    max_leaves=25,
)
# The tiny vocabulary has 83 tokens: ids up to 100 are sometimes outside it.
token_ids = st.lists(st.integers(min_value=0, max_value=100), min_size=1, max_size=70)
odd_ids = st.lists(st.integers(min_value=-3, max_value=100) | st.floats(-3, 100), max_size=70)
one_input = mostly(st.text(characters, min_size=1, max_size=40) | token_ids, unicode_text | odd_ids)
inputs = one_input | st.lists(one_input, min_size=1, max_size=10) | st.lists(one_input)
flags = st.none() | st.booleans()
dimensions = st.none() | st.integers(min_value=-2, max_value=40) | st.floats(-2, 40)
indices = st.none() | st.lists(st.integers(min_value=-5, max_value=5), max_size=3)
TEI_OPTIONS = {
    "truncate": flags,
    "truncation_direction": st.sampled_from(["right", "left", "Left", "up"]),
    "prompt_name": st.none() | st.just("") | unicode_text,
}
OPTIONS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "/embed": TEI_OPTIONS | {"normalize": flags, "dimensions": dimensions},
    "/embed_all": TEI_OPTIONS,
    "/tokenize": TEI_OPTIONS | {"add_special_tokens": flags},
    "/v1/embeddings": {
        "model": st.none() | unicode_text,
        "encoding_format": st.sampled_from(["float", "base64", "hex"]),
        "dimensions": dimensions,
        "user": st.none() | unicode_text,
    },
    "/encode": TEI_OPTIONS
    | {
        "pooled": flags,
        "token_embeddings": flags,
        "tokens": flags,
        "normalize": flags,
        "dimensions": dimensions,
        "encoding": st.sampled_from(["float", "base64", "hex"]),
        "attention": st.none()
        | st.fixed_dictionaries(
            {},
            optional={
                "layers": indices,
                "heads": indices,
                "reduce": st.sampled_from(["none", "mean", "max"]),
            },
        ),
    },
}


def bodies(path: str) -> st.SearchStrategy[Any]:
    """Mostly bodies close to valid, each option now and then replaced by any JSON value, so
    that they reach the limits, the tokenizer and the model; now and then anything at all."""
    key = "input" if path.startswith("/v1/") else "inputs"
    optional = {name: mostly(values, json_values) for name, values in OPTIONS[path].items()}
    near_valid = st.fixed_dictionaries({key: inputs}, optional=optional)
    anything = st.dictionaries(st.sampled_from(FIELDS) | unicode_text, json_values, max_size=6)
    return st.one_of(near_valid, near_valid, near_valid, anything, json_values)


PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    folder = tmp_path_factory.mktemp("properties") / "tiny"
    make_random_checkpoint(folder)
    app = create_app(make_settings(folder, **LIMITS))
    with TestClient(app, raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the app never became ready"
            time.sleep(0.02)
        yield client


def post_json(client: TestClient, path: str, body: Any) -> Any:
    """Post `body` as Python's json writes it: lone surrogates escaped (ensure_ascii)."""
    response = client.post(
        path, content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert response.status_code < 500, response.text
    assert "Traceback" not in response.text and 'File "' not in response.text
    return response


def assert_error_shape(path: str, body: Any) -> None:
    if path.startswith("/v1/"):
        assert set(body) == {"error"}
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["message"]
    else:
        assert set(body) == {"error", "error_type"}
        assert body["error"] and body["error_type"]


def is_text(value: str) -> bool:
    """Whether a string is valid Unicode (holds no lone surrogate)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@PROPERTY_SETTINGS
@given(data=st.data(), path=st.sampled_from(ROUTES))
def test_no_body_gets_a_5xx_or_a_traceback(
    client: TestClient, data: st.DataObject, path: str
) -> None:
    body = data.draw(bodies(path), label="body")
    response = post_json(client, path, body)
    if response.status_code >= 400:
        assert_error_shape(path, response.json())
    elif path == "/embed":  # a NaN would have been rendered as null
        assert np.isfinite(np.array(response.json(), dtype=np.float64)).all()


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/embed", {"inputs": [[[[["deep"]]]]]}, 422),
        ("/encode", {"inputs": "a", "attention": {"heads": [], "reduce": "mean"}}, 422),
        ("/v1/embeddings", {"input": "a", "\ud800": 1}, 422),
        ("/embed", {"inputs": "a", "dimensions": math.nan}, 422),
        ("/embed", {"inputs": [math.inf, 2]}, 422),
        ("/embed", {"inputs": [2.0, 7.0, 3]}, 200),  # integral floats are integers in JSON
    ],
)
def test_bodies_found_by_the_properties(
    client: TestClient, path: str, body: Any, status: int
) -> None:
    response = post_json(client, path, body)
    assert response.status_code == status, response.text


@pytest.mark.parametrize("depth", [100, 10_000, 500_000])
def test_deep_nesting_is_refused_not_a_crash(client: TestClient, depth: int) -> None:
    """Python's JSON parser recurses: past its limit the body is malformed, never a 500."""
    content = '{"inputs": ' + "[" * depth + "]" * depth + "}"
    response = client.post("/embed", content=content, headers={"content-type": "application/json"})
    assert response.status_code in (400, 422)
    assert_error_shape("/embed", response.json())


@PROPERTY_SETTINGS
@given(texts=st.lists(unicode_text, min_size=1, max_size=LIMITS["max_inputs_per_request"]))
@example(texts=["a\ud800b"])
@example(texts=["\x00", "\u202eabc\u202c", "\ufeff", "\U0001f600\u200d\U0001f600"])
def test_any_text_gets_a_vector_or_says_why(client: TestClient, texts: list[str]) -> None:
    """Valid Unicode (NUL and direction marks included) gets a unit vector per input; a lone
    surrogate a 422 naming the input; an empty string a 400."""
    # What the server parses: an escaped high and low surrogate side by side form one
    # character again.
    sent: list[str] = json.loads(json.dumps(texts))
    response = post_json(client, "/embed", {"inputs": texts})
    body = response.json()
    if any(not text for text in sent):
        assert response.status_code == 400 and body["error_type"] == "Empty"
    elif not all(is_text(text) for text in sent):
        first = next(index for index, text in enumerate(sent) if not is_text(text))
        assert response.status_code == 422, body
        assert body["error"] == f"inputs[{first}] is not valid Unicode: it holds a lone surrogate"
    else:
        assert response.status_code == 200, body
        vectors = np.array(body, dtype=np.float32)
        assert vectors.shape == (len(sent), 32)
        assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    piece=st.text(characters, min_size=1, max_size=30),
    length=st.integers(min_value=20_000, max_value=100_000),
    path=st.sampled_from(["/embed", "/encode", "/tokenize", "/v1/embeddings"]),
)
def test_100k_character_inputs_are_cut_and_embedded(
    client: TestClient, piece: str, length: int, path: str
) -> None:
    text = (piece * math.ceil(length / len(piece)))[:length]
    key = "input" if path.startswith("/v1/") else "inputs"
    response = post_json(client, path, {key: text})
    assert response.status_code == 200, response.text
    if path == "/encode":
        [item] = response.json()["data"]
        assert len(item["tokens"]) <= 48  # the tiny model's limit
        # Offsets point into the text as sent.
        assert all(t["end"] <= length for t in item["tokens"] if not t["special"])


# The character cut ---------------------------------------------------------------------
words = st.text(characters, min_size=1, max_size=12)
separators = st.sampled_from([" ", "  ", "\n", "\t", " \u3000 ", ", ", ". ", ""])


@st.composite
def long_texts(draw: st.DrawFn, min_chars: int) -> str:
    """Text past the cut's threshold: words and separators, repeated with variations."""
    parts = draw(st.lists(st.tuples(words, separators), min_size=1, max_size=30))
    unit = "".join(word + sep for word, sep in parts)
    repeats = math.ceil(draw(st.integers(min_chars, 3 * min_chars)) / len(unit))
    middle = draw(st.text(characters, max_size=20))
    return draw(words) + unit * (repeats // 2) + middle + unit * (repeats - repeats // 2)


def tokens_without_cut(embedder: Embedder, text: str, **options: Any) -> list[Any]:
    with pytest.MonkeyPatch.context() as patch:
        # A threshold no text reaches: the whole text goes through the tokenizer.
        patch.setattr(model.tokenizer, "CHARS_PER_TOKEN", 10**12)
        return embedder.tokenize([text], **options)


def cut_threshold(embedder: Embedder) -> int:
    tokens = embedder.info.max_input_tokens + model.tokenizer.CUT_MARGIN
    return tokens * model.tokenizer.CHARS_PER_TOKEN


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Embedder:
    folder = tmp_path_factory.mktemp("cut") / "tiny"
    make_random_checkpoint(folder)
    return Embedder.from_folder(folder, torch.device("cpu"), torch.float32)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), direction=st.sampled_from(DIRECTIONS))
def test_the_cut_gives_the_whole_texts_tokens(
    tiny: Embedder, data: st.DataObject, direction: Direction
) -> None:
    text = data.draw(long_texts(cut_threshold(tiny)))
    [cut] = tiny.tokenize([text], direction=direction)
    [whole] = tokens_without_cut(tiny, text, direction=direction)
    assert cut == whole  # ids, tokens, offsets, special flags and the truncated flag


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), direction=st.sampled_from(DIRECTIONS))
def test_the_cut_gives_the_whole_texts_tokens_on_the_real_tokenizer(
    minilm: Embedder, data: st.DataObject, direction: Direction
) -> None:
    text = data.draw(long_texts(cut_threshold(minilm)))
    [cut] = minilm.tokenize([text], direction=direction)
    [whole] = tokens_without_cut(minilm, text, direction=direction)
    assert cut == whole


def test_a_long_left_cut_points_into_the_text_as_sent(tiny: Embedder) -> None:
    """Found by the property above: offsets pointed into the piece the cut kept."""
    text = "hello world " * 400 + "the quick fox"
    [encoded] = tiny.tokenize([text], direction="left")
    assert encoded.offsets is not None
    start, end = encoded.offsets[-2]
    assert text[start:end] == "fox"

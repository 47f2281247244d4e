"""The playground in Chromium: similarities, tokens and attention against the API's own answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.browser.conftest import API_KEY, MAX_ATTENTION_VALUES, RecordedPage, Server

SENTENCES = [
    "A man is playing a guitar.",
    "Größe 🚀 is relative.",  # an astral character: offsets count code points, not UTF-16
    "The stock market fell today.",
]
LONG_SENTENCE = " ".join(["attention"] * 30)  # 32 tokens: a 1024-value map
# Settled: no request in flight, and the attention map or an error is shown.
SETTLED = (
    "() => window.playground.busy === 0"
    " && (window.playground.attention !== null || window.playground.error !== null)"
)
SHOWS_MAP = """([sentence, layer, head]) => {
  const shown = window.playground.attention;
  return window.playground.busy === 0 && shown !== null && shown.sentence === sentence
    && shown.layer === layer && shown.head === head;
}"""


def compare(recorded: RecordedPage, server: Server, lines: list[str], key: str = API_KEY) -> None:
    page = recorded.page
    page.goto(f"{server.url}/playground")
    page.fill("#api-key", key)
    page.fill("#sentences", "\n".join(lines))
    page.click("#run")
    page.wait_for_function(SETTLED)


def cosine(a: list[float], b: list[float]) -> float:
    u, v = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(u @ v / np.linalg.norm(u) / np.linalg.norm(v))


def test_similarity_tokens_and_attention_match_the_api(
    server: Server, recorded: RecordedPage, tmp_path: Path
) -> None:
    page = recorded.page
    compare(recorded, server, SENTENCES)
    assert page.evaluate("() => window.playground.error") is None

    cells = page.locator("#similarity td.cell")
    assert cells.count() == 9
    positions = {
        (
            int(cells.nth(k).get_attribute("data-row") or -1),
            int(cells.nth(k).get_attribute("data-col") or -1),
        )
        for k in range(9)
    }
    assert positions == {(i, j) for i in range(3) for j in range(3)}
    with server.client() as client:
        vectors = client.post("/embed", json={"inputs": SENTENCES}).json()
        tokenized = client.post("/tokenize", json={"inputs": SENTENCES[1]}).json()[0]
        encoded = client.post(
            "/encode",
            json={"inputs": SENTENCES[1], "attention": {"layers": [2], "heads": [7]}},
        ).json()
    expected = f"{cosine(vectors[0], vectors[2]):.3f}"
    cell = page.locator("#similarity td.cell[data-row='0'][data-col='2']")
    cell.hover()
    readout = page.inner_text("#similarity-readout")
    assert readout.endswith(f"cosine {expected}")
    assert SENTENCES[0] in readout and SENTENCES[2] in readout
    assert cell.inner_text() == expected

    # The second sentence, layer 2, head 7, chosen with the page's own controls.
    page.select_option("#sentence-select", "1")
    page.select_option("#layer-select", "2")
    page.select_option("#head-select", "7")
    page.wait_for_function(SHOWS_MAP, arg=[1, 2, 7])
    shown: dict[str, Any] = page.evaluate("() => window.playground")
    tokens = [
        {key: token[key] for key in ("id", "text", "special", "start", "stop")}
        for token in shown["tokens"]
    ]
    assert tokens == tokenized
    assert page.locator("#tokens .token").count() == len(tokenized)
    assert page.locator("#tokens .token.special").count() == 2  # [CLS] and [SEP]

    values = np.asarray(shown["attention"]["values"], dtype=np.float64)
    count = len(tokenized)
    assert values.shape == (count, count)
    np.testing.assert_allclose(values.sum(axis=1), 1.0, atol=1e-3)
    np.testing.assert_allclose(values, encoded["data"][0]["attention"][0]["values"][0], atol=1e-6)
    canvas = page.locator("#attention")
    assert canvas.get_attribute("data-rows") == canvas.get_attribute("data-cols") == str(count)

    # Hovering a token marks its characters in the sentence.
    page.locator("#tokens .token").nth(4).hover()  # the emoji, [UNK] in this vocabulary
    assert page.inner_text("#sentence-text mark") == tokenized[4]["text"] == "🚀"

    # From the keyboard: the map takes focus, the arrows move, the weight is read out.
    canvas.focus()
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    assert page.inner_text("#attention-readout").endswith(f": {values[1, 2]:.4f}")

    # The model panel shows /info's facts as text.
    panel = page.inner_text("#info")
    assert "Task\nembed" in panel.replace("\t", "\n") and "bert" in panel
    assert "[object" not in panel

    page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
    assert recorded.csp_violations() == []
    assert recorded.requests_leaving_loopback() == []


def test_mean_over_heads_is_the_mean_of_the_heads(server: Server, recorded: RecordedPage) -> None:
    page = recorded.page
    short = "Hello world"  # 4 tokens: all 12 heads of a layer fit the attention cap
    compare(recorded, server, [short])
    page.select_option("#layer-select", "0")
    page.wait_for_function(SHOWS_MAP, arg=[0, 0, "mean"])
    shown = np.asarray(page.evaluate("() => window.playground.attention.values"))
    with server.client() as client:
        body = {"inputs": short, "attention": {"layers": [0]}}
        answer = client.post("/encode", json=body).json()
    heads = np.asarray(answer["data"][0]["attention"][0]["values"])
    assert heads.shape == (12, 4, 4)
    np.testing.assert_allclose(shown, heads.mean(axis=0), atol=1e-6)


def test_an_attention_map_over_the_limit_shows_the_limit(
    server: Server, recorded: RecordedPage, tmp_path: Path
) -> None:
    page = recorded.page
    compare(recorded, server, [LONG_SENTENCE, SENTENCES[0]])
    page.screenshot(path=str(tmp_path / "attention-limit.png"), full_page=True)
    error = page.inner_text("#error")
    assert "422 Validation" in error
    assert f"over the limit of {MAX_ATTENTION_VALUES}" in error
    assert page.evaluate("() => window.playground.attention") is None
    assert page.locator("#attention-block").is_hidden()
    assert page.locator("#tokens .token").count() == 32  # the tokens are shown all the same
    # The similarities came back all the same, and a short sentence still shows its map.
    assert page.locator("#similarity td.cell").count() == 4
    page.select_option("#sentence-select", "1")
    page.wait_for_function(SHOWS_MAP, arg=[1, 5, "mean"])
    assert page.locator("#error").is_hidden()


def test_without_the_api_key_the_page_asks_for_it(server: Server, recorded: RecordedPage) -> None:
    page = recorded.page
    compare(recorded, server, SENTENCES, key="")
    error = page.inner_text("#error")
    assert "401 Unauthorized" in error
    assert "API key" in error
    assert page.locator("#similarity-panel").is_hidden()


def test_a_long_text_shows_its_chunks_and_their_similarity_to_a_query(
    server: Server, recorded: RecordedPage, tmp_path: Path
) -> None:
    page = recorded.page
    text = " ".join(
        [
            "The guitar has six strings and a long neck.",
            "Players strum chords or pick single notes.",
            "Meanwhile, the stock market fell sharply today.",
            "Investors sold shares of banks and airlines.",
        ]
        * 3
    )
    query = "who plays the guitar"
    page.goto(f"{server.url}/playground")
    page.fill("#api-key", API_KEY)
    page.fill("#document", text)
    page.fill("#query", query)
    page.fill("#chunk-size", "24")
    page.click("#chunk-run")
    page.wait_for_function("() => window.playground.busy === 0 && window.playground.chunks")
    shown: list[dict[str, Any]] = page.evaluate("() => window.playground.chunks")
    with server.client() as client:
        body = {"inputs": text, "chunking": {"mode": "late", "size": 24}}
        chunks = client.post("/embed_chunks", json=body).json()[0]
        [vector] = client.post("/embed", json={"inputs": query}).json()
    assert [(c["start"], c["end"], c["tokens"]) for c in shown] == [
        (c["start"], c["end"], c["tokens"]) for c in chunks
    ]
    scores = [cosine(c["embedding"], vector) for c in chunks]
    np.testing.assert_allclose([c["score"] for c in shown], scores, atol=1e-5)
    items = page.locator("#chunks .chunk")
    assert items.count() == len(chunks) > 1
    assert items.nth(0).inner_text().endswith(text[chunks[0]["start"] : chunks[0]["end"]])
    best = int(np.argmax(scores))
    assert "best" in (items.nth(best).get_attribute("class") or "")
    page.screenshot(path=str(tmp_path / "chunks.png"), full_page=True)
    assert recorded.csp_violations() == []

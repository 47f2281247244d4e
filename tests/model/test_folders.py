"""The sentence-transformers folder, honoured in full (issue 7).

Folders are built in a temporary directory around the real all-MiniLM-L6-v2 weights, one per
feature: saved by sentence-transformers 6 itself, and written here as files in the format that
sentence-transformers up to 5 saved (`sentence_transformers.models.X` module types,
`pooling_mode_*_token` flags, `sentence_bert_config.json` settings), which 6 still loads. Every
vector must match `SentenceTransformer(folder).encode`; the weights formats must give the same
vectors; whatever this server does not implement must stop loading with an error that names
the file and the module or key.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from torch import Tensor, nn

from model import CheckpointError, ConfigError, Embedder, finish
from model.resolve import DEFAULT_MODEL_ID, resolve_model_dir

MINILM = resolve_model_dir(DEFAULT_MODEL_ID)
CPU = torch.device("cpu")
MIN_COSINE = 0.99999
MAX_ABS = 1e-5
HIDDEN = 384
QUERY = "Represent this sentence for searching relevant passages: "
SHORT = [
    "hello world",
    "A man is eating food.",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
    "Quiet Queens Quote Quickly",
    "Paris Is The Capital Of France.",
    "",
    "?",
    "Größe und Übermaß",
    "GRÖSSE UND ÜBERMASS",
    "café crème brûlée",
    "東京は日本の首都です",
    "Привет, как дела?",
    "🚀 Launch Day 🎉",
    "Ελληνικά ΓΡΆΜΜΑΤΑ",
    "SELECT * FROM t WHERE id = 1;",
]
LONG = [
    " ".join(["Embedding Service Latency"] * 40),  # past 64 tokens, within 256
    # Past every max_seq_length here (256 at most): truncated.
    " ".join(f"Token{i}" for i in range(400)),
    "Long Texts Are Cut Where The Model Stops Reading, Größe Und Übermaß. " * 60,
]
TEXTS = SHORT + LONG
# The Transformer module's files, shared by every folder written here.
TRANSFORMER_FILES = ("config.json", "model.safetensors", "vocab.txt", "special_tokens_map.json")


@pytest.fixture(scope="module")
def transformer() -> Any:
    """The all-MiniLM-L6-v2 Transformer module (max_seq_length 256), shared by the folders
    that sentence-transformers builds."""
    return SentenceTransformer(str(MINILM), device="cpu")[0]


def compare(got: Tensor, expected: Tensor) -> None:
    """Each of our vectors (for TEXTS) against sentence-transformers'."""
    assert got.shape == expected.shape
    cosine = F.cosine_similarity(got, expected)
    worst = int(cosine.argmin())
    assert cosine[worst] >= MIN_COSINE, f"{TEXTS[worst][:40]!r}: cosine {cosine[worst]:.7f}"
    assert (got - expected).abs().max() <= MAX_ABS


def encode(
    model: Any,
    prompt_name: str | None = None,
    *,
    normalize: bool = False,
    truncate_dim: int | None = None,
) -> Tensor:
    """sentence-transformers' vectors; without `normalize` as its modules give them (unit
    length only by a Normalize module). Its `prompt_name=None` is the default prompt, as ours
    is; our "" (no prompt) is its `prompt=""`."""
    prompt = {"prompt": ""} if prompt_name == "" else {"prompt_name": prompt_name}
    vectors: Tensor = model.encode(
        TEXTS,
        # Sorted by length, the long texts make one batch (the tests' time, not the vectors).
        batch_size=len(LONG),
        convert_to_tensor=True,
        normalize_embeddings=normalize,
        truncate_dim=truncate_dim,
        **prompt,
    )
    return vectors


def ours(folder: Path) -> Embedder:
    return Embedder.from_folder(folder, CPU, torch.float32)


def embed(embedder: Embedder, prompt_name: str | None = None) -> Tensor:
    """Our vectors for TEXTS (normalised as the folder's modules say), the short texts in a
    batch of their own so that they are not padded to the long ones' 256 tokens."""
    return torch.cat([embedder.embed(texts, prompt_name=prompt_name) for texts in (SHORT, LONG)])


def check_folder(folder: Path, prompt_names: Sequence[str | None] = (None,)) -> Embedder:
    """`SentenceTransformer(folder).encode` against ours, for each prompt name; our embedder
    comes back for further checks."""
    reference = SentenceTransformer(str(folder), device="cpu")
    embedder = ours(folder)
    assert embedder.info.dimensions == reference.get_embedding_dimension()
    assert embedder.info.max_input_tokens == reference.max_seq_length
    assert any(encoded.truncated for encoded in embedder.tokenize(TEXTS))
    for name in prompt_names:
        compare(embed(embedder, name), encode(reference, name))
    return embedder


# --- Folders saved by sentence-transformers 6 ----------------------------------------------


@dataclass(frozen=True)
class Saved:
    """The modules after the Transformer, and the model's settings."""

    modules: Callable[[], list[nn.Module]]
    prompts: dict[str, str] | None = None
    default_prompt_name: str | None = None
    truncate_dim: int | None = None
    prompt_names: tuple[str | None, ...] = (None,)


def save(folder: Path, transformer: Any, saved: Saved) -> Path:
    torch.manual_seed(0)  # Dense weights
    model = SentenceTransformer(
        modules=[transformer, *saved.modules()],
        prompts=saved.prompts,
        default_prompt_name=saved.default_prompt_name,
        truncate_dim=saved.truncate_dim,
        device="cpu",
    )
    model.save(str(folder))
    return folder


SAVED = {
    "dense-tanh": Saved(
        lambda: [Pooling(HIDDEN), Dense(HIDDEN, 128, activation_function=nn.Tanh()), Normalize()]
    ),
    # With a bias, then without one.
    "two-dense": Saved(
        lambda: [
            Pooling(HIDDEN),
            Dense(HIDDEN, 256, activation_function=nn.ReLU()),
            Dense(256, 128, bias=False, activation_function=nn.Identity()),
        ]
    ),
    # Residual connections: the input added as it is, then through a projection.
    "dense-residual": Saved(
        lambda: [
            Pooling(HIDDEN),
            Dense(HIDDEN, HIDDEN, activation_function=nn.Sigmoid(), use_residual=True),
            Dense(HIDDEN, 128, activation_function=nn.SiLU(), use_residual=True),
        ]
    ),
    "cls": Saved(lambda: [Pooling(HIDDEN, pooling_mode="cls")]),
    "max": Saved(lambda: [Pooling(HIDDEN, pooling_mode="max")]),
    "weightedmean": Saved(lambda: [Pooling(HIDDEN, pooling_mode="weightedmean")]),
    "mean-sqrt-len": Saved(lambda: [Pooling(HIDDEN, pooling_mode="mean_sqrt_len_tokens")]),
    "lasttoken": Saved(lambda: [Pooling(HIDDEN, pooling_mode="lasttoken")]),
    # Several modes, concatenated in the order the file lists them (mean first).
    "mean+cls": Saved(lambda: [Pooling(HIDDEN, pooling_mode=("mean", "cls")), Normalize()]),
    # The prompt's tokens left out of the pooling, by every mode that could see them.
    "include-prompt-false": Saved(
        lambda: [
            Pooling(
                HIDDEN,
                pooling_mode=("cls", "mean", "weightedmean", "lasttoken"),
                include_prompt=False,
            )
        ],
        prompts={"query": QUERY},
        prompt_names=("query", ""),
    ),
    "default-prompt": Saved(
        lambda: [Pooling(HIDDEN), Normalize()],
        prompts={"query": "query: ", "passage": "passage: "},
        default_prompt_name="query",
        prompt_names=(None, "", "passage"),
    ),
    "normalize-before-dense": Saved(
        lambda: [Pooling(HIDDEN), Normalize(), Dense(HIDDEN, 96, activation_function=nn.GELU())]
    ),
    # A Matryoshka model saved for its first 64 dimensions.
    "truncate-dim": Saved(
        lambda: [Pooling(HIDDEN), Dense(HIDDEN, 256, activation_function=nn.Tanh())],
        truncate_dim=64,
    ),
}


@pytest.mark.parametrize("name", SAVED)
def test_folder_saved_by_sentence_transformers(name: str, transformer: Any, tmp_path: Path) -> None:
    saved = SAVED[name]
    check_folder(save(tmp_path, transformer, saved), saved.prompt_names)


def test_truncate_dim_is_the_default_and_a_request_can_ask_for_fewer(
    transformer: Any, tmp_path: Path
) -> None:
    folder = save(tmp_path, transformer, SAVED["truncate-dim"])
    embedder = ours(folder)
    assert embedder.info.dimensions == 64
    pooled = torch.cat(
        [embedder.forward(embedder.tokenize(texts)).pooled for texts in (SHORT, LONG)]
    )
    assert pooled.shape == (len(TEXTS), 64)
    # What a request's `dimensions` does (model.finish), against encode's own truncate_dim.
    cut = torch.from_numpy(finish(pooled.numpy(), normalize=True, dimensions=32))
    reference = SentenceTransformer(str(folder), device="cpu")
    compare(cut, encode(reference, normalize=True, truncate_dim=32))


def test_truncate_dim_with_a_trailing_normalize_gives_unit_vectors(
    transformer: Any, tmp_path: Path
) -> None:
    """sentence-transformers cuts after its Normalize module (a shorter piece of a unit
    vector); here the cut comes first and the norm after it, as its
    `normalize_embeddings=True` gives: the same direction, at unit length."""
    saved = Saved(lambda: [Pooling(HIDDEN), Normalize()], truncate_dim=100)
    folder = save(tmp_path, transformer, saved)
    embedder = ours(folder)
    assert embedder.info.dimensions == 100 and embedder.info.normalize
    reference = SentenceTransformer(str(folder), device="cpu")
    got = embed(embedder)
    compare(got, encode(reference, normalize=True))
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)))


def cased_minilm(folder: Path, normalizer: dict[str, Any] | None = None) -> Path:
    """all-MiniLM-L6-v2 with a tokenizer that keeps case (its vocabulary is lower-case, so
    upper-case words become other tokens): what `do_lower_case` is for.

    transformers builds a BERT tokenizer's normalizer from tokenizer_config.json, so both
    files say so. With `normalizer`, tokenizer.json's own normalizer is used as it is (the
    tokenizer class is the generic one)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in TRANSFORMER_FILES:
        (folder / name).symlink_to(MINILM / name)
    tokenizer = json.loads((MINILM / "tokenizer.json").read_text(encoding="utf-8"))
    bert_normalizer = {**tokenizer["normalizer"], "lowercase": False}
    tokenizer["normalizer"] = bert_normalizer if normalizer is None else normalizer
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    settings = json.loads((MINILM / "tokenizer_config.json").read_text(encoding="utf-8"))
    settings["do_lower_case"] = False
    if normalizer is not None:
        settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder


def test_do_lower_case_saved_by_sentence_transformers(tmp_path: Path) -> None:
    """sentence-transformers 6 no longer writes `do_lower_case`: it saves the Lowercase it
    put in front of the tokenizer's normalizer into tokenizer.json, and that is what is read
    here. (Loaded back by sentence-transformers 6.2 with transformers 5, a BERT tokenizer is
    rebuilt from tokenizer_config.json and loses it, so the model as built is the reference.)"""
    cased = cased_minilm(tmp_path / "cased")
    built = SentenceTransformer(
        modules=[Transformer(str(cased), do_lower_case=True, max_seq_length=256), Pooling(HIDDEN)],
        device="cpu",
    )
    built.save(str(tmp_path / "saved"))
    embedder = ours(tmp_path / "saved")
    compare(embed(embedder), encode(built))
    lower = embedder.embed([text.lower() for text in SHORT])
    assert torch.allclose(embedder.embed(SHORT), lower, atol=1e-6)


def test_info_reports_what_the_folder_holds(transformer: Any, tmp_path: Path) -> None:
    saved = Saved(
        lambda: [
            Pooling(HIDDEN, pooling_mode=("cls", "mean"), include_prompt=False),
            Dense(2 * HIDDEN, 256, activation_function=nn.Tanh()),
            Dense(256, 128, activation_function=nn.Identity()),
            Normalize(),
        ],
        prompts={"query": "query: ", "passage": "passage: "},
        default_prompt_name="query",
    )
    embedder = check_folder(save(tmp_path, transformer, saved), (None, "", "passage"))
    info = embedder.info
    assert info.pooling == ("cls", "mean") and not info.include_prompt
    assert info.dense == ("768 -> 256, Tanh", "256 -> 128, Identity")
    assert info.normalize and info.dimensions == 128 and info.hidden_size == HIDDEN
    assert info.prompts["query"] == "query: " and info.prompts["passage"] == "passage: "
    assert info.default_prompt_name == "query"
    assert info.max_input_tokens == 256 and not info.do_lower_case
    assert info.similarity_fn_name == "cosine"


# --- Folders in the format of sentence-transformers up to 5, written as files --------------


@dataclass(frozen=True)
class Module:
    """A module after the Transformer: its kind, its config.json (an old Normalize has none)
    and, for a Dense, how its weights are saved."""

    kind: str
    config: dict[str, Any] | None = None
    # sentence-transformers 2 saved a Dense's weights as pytorch_model.bin, 3 to 5 as
    # model.safetensors.
    pickled: bool = False


def old_pooling(*flags: str, dimension: int = HIDDEN, **more: Any) -> Module:
    """The flag format as sentence-transformers wrote it: the first four flags always, the
    later ones (weightedmean, lasttoken) only when set."""
    config: dict[str, Any] = {"word_embedding_dimension": dimension}
    for name in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens"):
        config[f"pooling_mode_{name}"] = name in flags
    config.update({f"pooling_mode_{name}": True for name in flags}, **more)
    return Module("Pooling", config)


def old_dense(
    in_features: int,
    out_features: int,
    activation: str,
    *,
    bias: bool = True,
    pickled: bool = False,
) -> Module:
    config = {
        "in_features": in_features,
        "out_features": out_features,
        "bias": bias,
        "activation_function": f"torch.nn.modules.{activation}",
    }
    return Module("Dense", config, pickled)


NORMALIZE = Module("Normalize")


@dataclass(frozen=True)
class Old:
    modules: tuple[Module, ...]
    settings: dict[str, Any] = field(
        default_factory=lambda: {"max_seq_length": 256, "do_lower_case": False}
    )
    settings_file: str = "sentence_bert_config.json"
    metadata: dict[str, Any] = field(default_factory=dict)  # config_sentence_transformers.json
    transformer_path: str = ""  # "" is the folder itself
    prompt_names: tuple[str | None, ...] = (None,)


def dense_weights(module: Module, seed: int) -> dict[str, Tensor]:
    assert module.config is not None
    generator = torch.Generator().manual_seed(seed)
    shape = (module.config["out_features"], module.config["in_features"])
    weights = {"linear.weight": torch.randn(shape, generator=generator) * 0.05}
    if module.config["bias"]:
        weights["linear.bias"] = torch.randn(shape[0], generator=generator) * 0.05
    return weights


def write_old(folder: Path, old: Old, link_transformer: bool = True) -> Path:
    """The folder as sentence-transformers up to 5 saved it; the Transformer's files are the
    packaged model's own (linked) unless the caller writes them."""
    transformer_dir = folder / old.transformer_path
    transformer_dir.mkdir(parents=True, exist_ok=True)
    if link_transformer:
        for name in (*TRANSFORMER_FILES, "tokenizer.json", "tokenizer_config.json"):
            (transformer_dir / name).symlink_to(MINILM / name)
    (transformer_dir / old.settings_file).write_text(json.dumps(old.settings))
    entries = [
        {
            "idx": 0,
            "name": "0",
            "path": old.transformer_path,
            "type": "sentence_transformers.models.Transformer",
        }
    ]
    for idx, module in enumerate(old.modules, start=1):
        path = f"{idx}_{module.kind}"
        entries.append(
            {
                "idx": idx,
                "name": str(idx),
                "path": path,
                "type": f"sentence_transformers.models.{module.kind}",
            }
        )
        (folder / path).mkdir()
        if module.config is not None:
            (folder / path / "config.json").write_text(json.dumps(module.config))
        if module.kind == "Dense":
            weights = dense_weights(module, seed=idx)
            if module.pickled:
                torch.save(weights, folder / path / "pytorch_model.bin")
            else:
                save_file(weights, str(folder / path / "model.safetensors"))
    (folder / "modules.json").write_text(json.dumps(entries))
    versions = {"sentence_transformers": "3.4.1", "transformers": "4.48.0", "pytorch": "2.5.1"}
    metadata = {"__version__": versions, **old.metadata}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(metadata))
    return folder


OLD = {
    # Dense weights pickled, as sentence-transformers 2 saved them (read with weights_only).
    "dense-tanh": Old(
        (
            old_pooling("mean_tokens"),
            old_dense(HIDDEN, 128, "activation.Tanh", pickled=True),
            NORMALIZE,
        )
    ),
    "two-dense": Old(
        (
            old_pooling("mean_tokens"),
            old_dense(HIDDEN, 256, "activation.Sigmoid"),
            old_dense(256, 128, "linear.Identity", bias=False),
        )
    ),
    "cls": Old((old_pooling("cls_token"),)),
    "max": Old((old_pooling("max_tokens"),)),
    "weightedmean": Old((old_pooling("weightedmean_tokens"),)),
    "mean-sqrt-len": Old((old_pooling("mean_sqrt_len_tokens"),)),
    "lasttoken": Old((old_pooling("lasttoken"),)),
    "cls+mean": Old((old_pooling("cls_token", "mean_tokens"), NORMALIZE)),
    # No flag set: sentence-transformers pools by mean.
    "no-flag": Old((old_pooling(),)),
    "include-prompt-false": Old(
        (old_pooling("cls_token", "mean_tokens", "weightedmean_tokens", include_prompt=False),),
        metadata={"prompts": {"query": QUERY}},
        prompt_names=("query", ""),
    ),
    "default-prompt": Old(
        (old_pooling("mean_tokens"), NORMALIZE),
        metadata={
            "prompts": {"query": "query: ", "passage": "passage: "},
            "default_prompt_name": "query",
        },
        prompt_names=(None, "", "passage"),
    ),
    "normalize-before-dense": Old(
        (old_pooling("mean_tokens"), NORMALIZE, old_dense(HIDDEN, 96, "activation.ReLU"), NORMALIZE)
    ),
    # max_seq_length below the tokenizer's model_max_length (512) decides where texts are cut.
    "max-seq-length": Old((old_pooling("mean_tokens"),), settings={"max_seq_length": 64}),
    # The Transformer in a folder of its own, as sentence-transformers' first versions saved it.
    "transformer-in-a-folder": Old((old_pooling("mean_tokens"),), transformer_path="0_Transformer"),
    # The settings file under the older name that sentence-transformers still reads.
    "sentence-distilbert-config": Old(
        (old_pooling("mean_tokens"),),
        settings={"max_seq_length": 128, "do_lower_case": False},
        settings_file="sentence_distilbert_config.json",
    ),
    "truncate-dim": Old((old_pooling("mean_tokens"),), metadata={"truncate_dim": 128}),
}


@pytest.mark.parametrize("name", OLD)
def test_folder_in_the_older_format(name: str, tmp_path: Path) -> None:
    old = OLD[name]
    embedder = check_folder(write_old(tmp_path, old), old.prompt_names)
    assert embedder.info.max_input_tokens == old.settings["max_seq_length"]


def test_do_lower_case_in_the_older_format(tmp_path: Path) -> None:
    folder = cased_minilm(tmp_path)
    old = Old((old_pooling("mean_tokens"),), {"max_seq_length": 256, "do_lower_case": True})
    embedder = check_folder(write_old(folder, old, link_transformer=False))
    assert embedder.info.do_lower_case
    # Without the setting the same folder reads upper-case words as other tokens.
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    cased = ours(folder)
    assert F.cosine_similarity(cased.embed(SHORT[2:4]), embedder.embed(SHORT[2:4])).max() < 0.99


def test_do_lower_case_adds_no_lowercase_to_a_tokenizer_that_has_one(tmp_path: Path) -> None:
    """sentence-transformers puts a Lowercase in front only where the normalizer holds none;
    where one comes after a case-sensitive step, that step still sees upper case."""
    lowercasing = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Replace", "pattern": {"String": "Q"}, "content": "K"},
            {"type": "Lowercase"},
        ],
    }
    folder = cased_minilm(tmp_path, lowercasing)
    old = Old((old_pooling("mean_tokens"),), {"max_seq_length": 256, "do_lower_case": True})
    embedder = check_folder(write_old(folder, old, link_transformer=False))
    [quiet] = embedder.tokenize(["Quiet"])
    assert quiet.tokens[1] == "ku"


# --- Weights formats -----------------------------------------------------------------------


def test_transformer_weights_in_every_format_give_the_same_vectors(tmp_path: Path) -> None:
    """Sharded safetensors with an index, and pytorch_model.bin (read with weights_only)."""
    plain = embed(ours(write_old(tmp_path / "plain", OLD["dense-tanh"])))
    state = load_file(str(MINILM / "model.safetensors"))
    keys = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    for weights in ("sharded", "bin"):
        folder = tmp_path / weights
        folder.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", *TRANSFORMER_FILES):
            if name != "model.safetensors":
                (folder / name).symlink_to(MINILM / name)
        if weights == "sharded":
            for shard, names in shards.items():
                save_file({key: state[key] for key in names}, str(folder / shard))
            index = {
                "metadata": {
                    "total_size": sum(t.numel() * t.element_size() for t in state.values())
                },
                "weight_map": {key: shard for shard, names in shards.items() for key in names},
            }
            (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        else:
            torch.save(state, folder / "pytorch_model.bin")
        write_old(folder, OLD["dense-tanh"], link_transformer=False)
        got = embed(check_folder(folder))
        assert torch.equal(got, plain), weights


# --- Refusals ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """A change to a valid older-format folder, the file the error must name (relative to the
    folder), and what else it must name (the module or the key)."""

    change: Callable[[Path], None]
    file: str
    names: tuple[str, ...]


def edit_json(path: Path, edit: Callable[[Any], Any]) -> None:
    """Rewrite a JSON file; one not there reads as {} (an old Normalize has no config.json)."""
    raw = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(edit(raw)))


def set_module_type(index: int, module_type: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        def edit(modules: list[dict[str, Any]]) -> list[dict[str, Any]]:
            modules[index]["type"] = module_type
            return modules

        edit_json(folder / "modules.json", edit)

    return change


def add_module(module_type: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        (folder / "4_Extra").mkdir()

        def edit(modules: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [*modules, {"idx": 4, "name": "extra", "path": "4_Extra", "type": module_type}]

        edit_json(folder / "modules.json", edit)

    return change


def update(relative: str, **keys: Any) -> Callable[[Path], None]:
    return lambda folder: edit_json(folder / relative, lambda raw: {**raw, **keys})


def drop_module(index: int) -> Callable[[Path], None]:
    return lambda folder: edit_json(
        folder / "modules.json", lambda modules: modules[:index] + modules[index + 1 :]
    )


def swap_first_modules(folder: Path) -> None:
    edit_json(folder / "modules.json", lambda modules: [modules[1], modules[0], *modules[2:]])


def pickle_an_object(folder: Path) -> None:
    """A pickle that holds more than tensors: loading it could run code."""
    weights = {"linear.weight": torch.zeros(128, HIDDEN), "linear.bias": Module("Dense")}
    (folder / "2_Dense" / "model.safetensors").unlink()
    torch.save(weights, folder / "2_Dense" / "pytorch_model.bin")


# Transformer, Pooling, Dense, Normalize: each refusal changes one thing.
OLD_VALID = (old_pooling("mean_tokens"), old_dense(HIDDEN, 128, "activation.Tanh"), NORMALIZE)
ST6_MODULES = "sentence_transformers.sentence_transformer.modules"
REFUSALS = {
    "layer-norm": Refusal(
        add_module("sentence_transformers.models.LayerNorm"),
        "modules.json",
        ("'extra'", "LayerNorm"),
    ),
    "layer-norm-6": Refusal(
        add_module(f"{ST6_MODULES}.layer_norm.LayerNorm"), "modules.json", ("'extra'", "LayerNorm")
    ),
    "router": Refusal(
        add_module("sentence_transformers.base.modules.router.Router"), "modules.json", ("Router",)
    ),
    "word-embeddings": Refusal(
        set_module_type(0, "sentence_transformers.models.WordEmbeddings"),
        "modules.json",
        ("'0'", "WordEmbeddings"),
    ),
    "static-embedding": Refusal(
        set_module_type(0, f"{ST6_MODULES}.static_embedding.StaticEmbedding"),
        "modules.json",
        ("StaticEmbedding",),
    ),
    "custom-package": Refusal(
        set_module_type(1, "my_package.modules.Pooling"), "modules.json", ("'1'", "my_package")
    ),
    # Named like sentence-transformers, but another package: its code, not sentence-transformers'.
    "look-alike-package": Refusal(
        set_module_type(2, "sentence_transformers_extras.Dense"),
        "modules.json",
        ("'2'", "sentence_transformers_extras"),
    ),
    "transformer-not-first": Refusal(
        swap_first_modules, "modules.json", ("Pooling", "Transformer")
    ),
    "no-pooling": Refusal(drop_module(1), "modules.json", ("Pooling",)),
    "dense-activation": Refusal(
        update("2_Dense/config.json", activation_function="torch.nn.modules.activation.Softmax"),
        "2_Dense/config.json",
        ("activation_function", "Softmax"),
    ),
    "dense-custom-activation": Refusal(
        update("2_Dense/config.json", activation_function="my_package.Swish"),
        "2_Dense/config.json",
        ("activation_function", "my_package.Swish"),
    ),
    "dense-token-embeddings": Refusal(
        update("2_Dense/config.json", module_input_name="token_embeddings"),
        "2_Dense/config.json",
        ("module_input_name", "token_embeddings"),
    ),
    "dense-unknown-key": Refusal(
        update("2_Dense/config.json", dropout=0.1), "2_Dense/config.json", ("'dropout'",)
    ),
    "dense-in-features": Refusal(
        update("2_Dense/config.json", in_features=768),
        "2_Dense/config.json",
        ("in_features 768", "384"),
    ),
    "dense-pickle-with-code": Refusal(
        pickle_an_object, "2_Dense/pytorch_model.bin", ("weights-only",)
    ),
    "normalize-token-embeddings": Refusal(
        update("3_Normalize/config.json", module_input_name="token_embeddings"),
        "3_Normalize/config.json",
        ("module_input_name", "token_embeddings"),
    ),
    "pooling-unknown-key": Refusal(
        update("1_Pooling/config.json", pooling_mode_attention_tokens=True),
        "1_Pooling/config.json",
        ("'pooling_mode_attention_tokens'",),
    ),
    "pooling-unknown-mode": Refusal(
        update("1_Pooling/config.json", pooling_mode=["mean", "attention"]),
        "1_Pooling/config.json",
        ("pooling_mode", "attention"),
    ),
    "pooling-dimension": Refusal(
        update("1_Pooling/config.json", word_embedding_dimension=768),
        "1_Pooling/config.json",
        ("embedding dimension 768", "hidden_size 384"),
    ),
    # Settings of the Transformer that change its outputs.
    "tokenizer-args": Refusal(
        update("sentence_bert_config.json", tokenizer_args={"model_max_length": 64}),
        "sentence_bert_config.json",
        ("'tokenizer_args'",),
    ),
    "processing-kwargs": Refusal(
        update(
            "sentence_bert_config.json", processing_kwargs={"text": {"truncation_side": "left"}}
        ),
        "sentence_bert_config.json",
        ("processing_kwargs",),
    ),
    "transformer-task": Refusal(
        update("sentence_bert_config.json", transformer_task="fill-mask"),
        "sentence_bert_config.json",
        ("transformer_task", "fill-mask"),
    ),
    "default-prompt-unknown": Refusal(
        update(
            "config_sentence_transformers.json",
            prompts={"query": "q: "},
            default_prompt_name="passage",
        ),
        "config_sentence_transformers.json",
        ("default_prompt_name", "passage"),
    ),
    "truncate-dim": Refusal(
        update("config_sentence_transformers.json", truncate_dim="64"),
        "config_sentence_transformers.json",
        ("truncate_dim",),
    ),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_refused_naming_the_file_and_the_module_or_key(name: str, tmp_path: Path) -> None:
    refusal = REFUSALS[name]
    folder = write_old(tmp_path, Old(OLD_VALID))
    refusal.change(folder)
    with pytest.raises((ConfigError, CheckpointError)) as caught:
        ours(folder)
    message = str(caught.value)
    assert f"{folder / refusal.file}:" in message, message
    for part in refusal.names:
        assert part in message, message


def test_the_valid_folder_the_refusals_change_loads(tmp_path: Path) -> None:
    """So that each refusal above is caused by its own change."""
    embedder = ours(write_old(tmp_path, Old(OLD_VALID)))
    assert embedder.info.dense == ("384 -> 128, Tanh",) and embedder.info.normalize

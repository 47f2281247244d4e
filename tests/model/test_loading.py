"""Loading errors name the file and the key; model ids resolve as documented."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import CheckpointError, ConfigError, Embedder, ModelNotFoundError
from model import resolve as resolve_module
from model.resolve import DEFAULT_MODEL_ID, file_sha256, resolve_model_dir
from tests.helpers import write_sentence_transformers_files

CPU = torch.device("cpu")


def load(folder: Path, dtype: torch.dtype = torch.float32) -> Embedder:
    return Embedder.from_folder(folder, CPU, dtype)


def rewrite_weights(folder: Path, change: dict[str, torch.Tensor | None]) -> None:
    state = load_file(str(folder / "model.safetensors"))
    for key, value in change.items():
        if value is None:
            del state[key]
        else:
            state[key] = value
    save_file(state, str(folder / "model.safetensors"))


def test_missing_key_is_named(tiny_checkpoint: Path) -> None:
    rewrite_weights(tiny_checkpoint, {"encoder.layer.1.output.dense.bias": None})
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: missing key 'encoder.layer.1.output.dense.bias'",
    ):
        load(tiny_checkpoint)


def test_wrong_shape_is_named(tiny_checkpoint: Path) -> None:
    rewrite_weights(tiny_checkpoint, {"embeddings.word_embeddings.weight": torch.zeros(5, 32)})
    with pytest.raises(
        CheckpointError, match=r"'embeddings.word_embeddings.weight' has shape \(5, 32\)"
    ):
        load(tiny_checkpoint)


def test_unexpected_tensors_are_reported(
    tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rewrite_weights(tiny_checkpoint, {"pooler.dense.weight": torch.zeros(32, 32)})
    caplog.set_level("INFO")
    load(tiny_checkpoint)
    assert "pooler.dense.weight" in caplog.text


@pytest.mark.parametrize("cut", [0.5, 0.999])
def test_truncated_safetensors(tiny_checkpoint: Path, cut: float) -> None:
    path = tiny_checkpoint / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        load(tiny_checkpoint)


def test_garbage_safetensors(tiny_checkpoint: Path) -> None:
    (tiny_checkpoint / "model.safetensors").write_bytes(b"\x07not a safetensors file at all")
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load(tiny_checkpoint)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("model.safetensors", "no weights file found (looked for model.safetensors, "),
        ("config.json", "config.json: file not found"),
        ("tokenizer.json", "tokenizer.json: file not found"),
    ],
)
def test_missing_file_is_named(tiny_checkpoint: Path, name: str, message: str) -> None:
    (tiny_checkpoint / name).unlink()
    with pytest.raises((CheckpointError, ConfigError), match=re.escape(message)):
        load(tiny_checkpoint)


def test_bad_config_json(tiny_checkpoint: Path) -> None:
    (tiny_checkpoint / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        load(tiny_checkpoint)
    (tiny_checkpoint / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ConfigError, match="unsupported model_type 't5'"):
        load(tiny_checkpoint)


def test_pooling_and_normalize_come_from_the_folder(tiny_checkpoint: Path) -> None:
    write_sentence_transformers_files(
        tiny_checkpoint, pooling="cls", normalize=False, max_seq_length=500
    )
    embedder = load(tiny_checkpoint)
    assert embedder.info.pooling == ("cls",)
    assert not embedder.info.normalize
    assert embedder.info.max_input_tokens == 64  # capped at max_position_embeddings
    vectors = embedder.embed(["hello world"])
    assert vectors.norm() != pytest.approx(1.0)
    assert embedder.embed(["hello world"], normalize=True).norm() == pytest.approx(1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_loads_on_cpu(tiny_checkpoint: Path, dtype: torch.dtype) -> None:
    full = load(tiny_checkpoint).embed(["hello world", "the fox"])
    half = load(tiny_checkpoint, dtype)
    assert half.info.dtype == str(dtype).removeprefix("torch.")
    cosine = torch.nn.functional.cosine_similarity(full, half.embed(["hello world", "the fox"]))
    assert cosine.min() >= 0.99


def test_local_folder_and_packaged_ids_resolve(tiny_checkpoint: Path) -> None:
    assert resolve_model_dir(str(tiny_checkpoint)) == tiny_checkpoint
    packaged = resolve_model_dir(DEFAULT_MODEL_ID)
    assert (
        file_sha256(packaged / "model.safetensors")
        == resolve_module.PACKAGED_MODELS[DEFAULT_MODEL_ID][1]
    )


def test_unknown_model_id_says_how_to_get_it() -> None:
    with pytest.raises(ModelNotFoundError, match=r"not a local folder.*EMBED_ALLOW_DOWNLOAD"):
        Embedder.load("nobody/no-such-model", device="cpu")


def test_packaged_weights_with_wrong_sha256_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "fake_model_pkg"
    (package / "model").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model" / "model.safetensors").write_bytes(b"tampered")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(resolve_module.PACKAGED_MODELS, "fake/model", ("fake_model_pkg", "0" * 64))
    with pytest.raises(CheckpointError, match=r"sha256 .* does not match"):
        resolve_model_dir("fake/model")


def test_download_goes_through_huggingface_hub(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
        asked.append(repo_id)
        if repo_id == "offline/model":
            raise OSError("network unreachable")
        return str(tiny_checkpoint)

    monkeypatch.setitem(
        sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download)
    )
    assert resolve_model_dir("someone/model", allow_download=True) == tiny_checkpoint
    with pytest.raises(ModelNotFoundError, match="could not be downloaded: network unreachable"):
        resolve_model_dir("offline/model", allow_download=True)
    assert asked == ["someone/model", "offline/model"]


def test_bad_device_and_dtype_are_named() -> None:
    with pytest.raises(ConfigError, match="dtype 'float8'"):
        Embedder.load(device="cpu", dtype="float8")
    with pytest.raises(ConfigError, match="device 'tpu'"):
        Embedder.load(device="tpu")


def test_max_input_tokens_only_lowers_the_models_limit(tiny_checkpoint: Path) -> None:
    lowered = Embedder.from_folder(tiny_checkpoint, CPU, torch.float32, max_input_tokens=10)
    assert lowered.info.max_input_tokens == 10
    [cut] = lowered.tokenize(["hello world " * 20])
    assert len(cut.ids) == 10 and cut.truncated
    raised = Embedder.from_folder(tiny_checkpoint, CPU, torch.float32, max_input_tokens=10_000)
    assert raised.info.max_input_tokens == 48  # sentence_bert_config's max_seq_length


def test_loading_draws_no_random_starts(tiny_checkpoint: Path) -> None:
    """Every weight comes from the checkpoint: the modules' random starts are skipped while
    a model is built (on the meta device, the first would import torch._dynamo), and only
    then: a module built outside gets its usual start."""
    code = (
        "import sys, pathlib, torch\n"
        "from model import Embedder\n"
        f"folder = pathlib.Path({str(tiny_checkpoint)!r})\n"
        "Embedder.from_folder(folder, torch.device('cpu'), torch.float32)\n"
        "print('torch._dynamo' in sys.modules)\n"
        "print(float(torch.nn.Embedding(64, 8).weight.std()) > 0.5)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.stdout.split() == ["False", "True"], run.stderr

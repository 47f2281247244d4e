"""Which task a folder serves, what /info says about it, and the folders refused at start-up
(by the file and the key, or by what is missing)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from model import CheckpointError, ConfigError, Embedder, Task
from model.heads import Splade
from tests.helpers import write_sentence_transformers_files
from tests.task_checkpoints import (
    CLASSIFIERS,
    MASKED_LMS,
    labelled,
    save_task_model,
    write_splade_folder,
)

CPU = torch.device("cpu")


def load(folder: Path, task: str = "auto") -> Embedder:
    return Embedder.from_folder(folder, CPU, torch.float32, task=task)


def edit_json(path: Path, change: dict[str, Any]) -> None:
    current = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(current | change))


@pytest.fixture
def classifier(tmp_path: Path) -> Path:
    save_task_model(tmp_path, CLASSIFIERS["bert"], "bert", **labelled(3))
    return tmp_path


@pytest.fixture
def masked_lm(tmp_path: Path) -> Path:
    save_task_model(tmp_path, MASKED_LMS["bert"], "bert")
    return tmp_path


def test_what_each_task_reports(classifier: Path, tmp_path: Path) -> None:
    info = load(classifier).info
    assert (info.task, info.labels, info.dimensions) == (
        Task.CLASSIFY,
        ("contradiction", "entailment", "neutral"),
        3,
    )
    assert (info.pooling, info.dense, info.normalize, info.max_input_tokens) == (
        ("cls",),
        (),
        False,
        40,
    )
    save_task_model(tmp_path / "mlm", MASKED_LMS["roberta"], "roberta")
    write_splade_folder(tmp_path / "mlm", Splade("sum"))
    sparse = load(tmp_path / "mlm").info
    assert (sparse.task, sparse.labels, sparse.dimensions) == (Task.SPARSE, (), 83)
    assert (sparse.pooling, sparse.normalize, sparse.similarity_fn_name) == (
        ("splade_sum",),
        False,
        "dot",
    )
    assert load(classifier, "embed").info.task is Task.EMBED


def test_a_plain_classifier_can_still_be_embedded(classifier: Path) -> None:
    """Before classification heads, such folders were embedded by mean pooling; task=embed
    keeps that."""
    ours = load(classifier, "embed")
    assert (ours.info.task, ours.info.pooling, ours.info.dimensions) == (Task.EMBED, ("mean",), 32)
    encoded = ours.tokenize(["hello world"])
    [tokens] = ours.forward(encoded, token_embeddings=True).token_embeddings or []
    assert (ours.forward(encoded).pooled[0] - tokens.mean(dim=0)).abs().max() <= 1e-6


def test_a_labelless_config_has_transformers_default_labels(classifier: Path) -> None:
    config = json.loads((classifier / "config.json").read_text())
    del config["id2label"], config["label2id"]
    (classifier / "config.json").write_text(json.dumps(config | {"num_labels": 3}))
    assert load(classifier).info.labels == ("LABEL_0", "LABEL_1", "LABEL_2")


def test_a_plain_masked_lm_must_be_told_the_task(masked_lm: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.json: architectures BertForMaskedLM") as error:
        load(masked_lm)
    assert "task=sparse for SPLADE" in str(error.value)
    assert "task=embed for mean pooling" in str(error.value)
    assert load(masked_lm, "sparse").info.task is Task.SPARSE
    assert load(masked_lm, "embed").info.task is Task.EMBED
    write_sentence_transformers_files(masked_lm)  # its own declaration: an embedding model
    assert load(masked_lm).info.task is Task.EMBED


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("sparse", "task 'sparse' needs BERT's masked-language-model head (cls.predictions)"),
        ("classify", "task 'classify' needs BERT's sequence-classification head"),
    ],
)
def test_a_task_without_its_head_is_refused(masked_lm: Path, task: str, message: str) -> None:
    """A masked LM has no classifier, a classifier no masked-LM head; both name the key."""
    folder = masked_lm
    if task == "sparse":
        save_task_model(folder, CLASSIFIERS["bert"], "bert")
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load(folder, task)


def test_a_classifier_without_its_classifier_is_refused(classifier: Path) -> None:
    path = classifier / "model.safetensors"
    state = load_file(str(path))
    save_file({k: v for k, v in state.items() if not k.startswith("classifier.")}, str(path))
    message = "task 'classify' needs BERT's sequence-classification head (pooler and classifier)"
    with pytest.raises(CheckpointError, match=re.escape(message)) as error:
        load(classifier)
    assert "key 'classifier.bias' is missing" in str(error.value)
    assert "BertForSequenceClassification" in str(error.value)


def test_an_untied_decoder_must_be_in_the_checkpoint(masked_lm: Path) -> None:
    edit_json(masked_lm / "config.json", {"tie_word_embeddings": False})
    with pytest.raises(CheckpointError, match=r"key 'cls\.predictions\.decoder\.bias' is missing"):
        load(masked_lm, "sparse")


@pytest.mark.parametrize(
    ("model_class", "task", "kind"),
    [
        (transformers.DistilBertForSequenceClassification, "auto", "sequence-classification"),
        (transformers.DistilBertForMaskedLM, "sparse", "masked-language-model"),
        (transformers.MPNetForMaskedLM, "sparse", "masked-language-model"),
    ],
)
def test_an_architecture_without_heads_is_refused_by_name(
    tmp_path: Path, model_class: Any, task: str, kind: str
) -> None:
    config = model_class.config_class(
        vocab_size=83, dim=32, n_layers=1, n_heads=4, hidden_dim=48, hidden_size=32,
        num_hidden_layers=1, num_attention_heads=4, intermediate_size=48,
    )  # fmt: skip
    model_class(config).save_pretrained(tmp_path)
    write_sentence_transformers_files(tmp_path)
    (tmp_path / "modules.json").unlink()
    message = f"task {task if task != 'auto' else 'classify'!r} needs a {kind} head"
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        load(tmp_path, task)
    assert f"not for model_type {config.model_type!r}" in str(error.value)


def test_a_sentence_transformers_folder_serves_its_own_task(masked_lm: Path) -> None:
    write_splade_folder(masked_lm, Splade())
    with pytest.raises(ConfigError, match=r"modules\.json: .* serves task 'sparse' only"):
        load(masked_lm, "embed")
    with pytest.raises(ConfigError, match="serves task 'embed' only, not 'classify'"):
        write_sentence_transformers_files(masked_lm)
        load(masked_lm, "classify")


def test_an_unknown_task_is_refused(classifier: Path) -> None:
    with pytest.raises(ConfigError, match="unknown task 'rerank'"):
        load(classifier, "rerank")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"pooling_strategy": "mean"}, "unsupported pooling_strategy 'mean'"),
        ({"activation_function": "softplus"}, "unsupported activation_function 'softplus'"),
        ({"top_k": 64}, "unsupported key 'top_k'"),
        ({"embedding_dimension": 30522}, "embedding dimension 30522 does not match"),
    ],
)
def test_unsupported_splade_pooling_is_refused(
    masked_lm: Path, config: dict[str, Any], message: str
) -> None:
    write_splade_folder(masked_lm, Splade())
    edit_json(masked_lm / "1_SpladePooling" / "config.json", config)
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        load(masked_lm)
    if "embedding dimension" not in message:
        assert "1_SpladePooling/config.json" in str(error.value)


def cross_encoder_files(folder: Path) -> None:
    """What CrossEncoder 5.4 and later saves beside the transformers files."""
    transformer = "sentence_transformers.base.modules.transformer.Transformer"
    modules = [{"idx": 0, "name": "0", "path": "", "type": transformer}]
    (folder / "modules.json").write_text(json.dumps(modules))
    edit_json(
        folder / "sentence_bert_config.json",
        {
            "transformer_task": "sequence-classification",
            "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
            "module_output_name": "scores",
        },
    )
    edit_json(
        folder / "config_sentence_transformers.json",
        {"model_type": "CrossEncoder", "activation_fn": "torch.nn.modules.linear.Identity"},
    )


@pytest.mark.parametrize(
    ("file", "change", "message"),
    [
        (
            "config_sentence_transformers.json",
            {"activation_fn": "torch.nn.modules.activation.Tanh"},
            "key 'activation_fn': unsupported score activation",
        ),
        (
            "config_sentence_transformers.json",
            {"activation_fn": "torch.nn.modules.activation.Sigmoid"},
            "Sigmoid over 3 labels (independent multi-label scores) is not supported",
        ),
        (
            "config_sentence_transformers.json",
            {"prompts": {"query": "query: "}, "default_prompt_name": "query"},
            "unsupported default_prompt_name 'query' for a CrossEncoder",
        ),
        (
            "sentence_bert_config.json",
            {"transformer_task": "feature-extraction"},
            "transformer_task 'feature-extraction' does not give what task 'classify' reads",
        ),
        (
            "sentence_bert_config.json",
            {"module_output_name": "causal_logits"},
            "unsupported module_output_name 'causal_logits'",
        ),
        (
            "config.json",
            {"sentence_transformers": {"activation_fn": "my_module.Scaled"}},
            "key 'sentence_transformers.activation_fn': unsupported score activation",
        ),
        (
            "config.json",
            {"problem_type": "multi_label_classification"},
            "key 'problem_type' (multi_label_classification): Sigmoid over 3 labels",
        ),
    ],
)
def test_unsupported_cross_encoder_settings_are_refused(
    classifier: Path, file: str, change: dict[str, Any], message: str
) -> None:
    if file != "config.json":  # the older format keeps its settings in config.json
        cross_encoder_files(classifier)
    assert load(classifier).info.task is Task.CLASSIFY
    edit_json(classifier / file, change)
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        load(classifier)
    assert file in str(error.value)


@pytest.mark.parametrize(
    ("modules", "message"),
    [
        (["Transformer", "LogitScore"], "type 'sentence_transformers.cross_encoder.modules"),
        (["Transformer", "Pooling"], "one Transformer module, not Transformer + Pooling"),
    ],
)
def test_cross_encoder_modules_are_checked(
    classifier: Path, modules: list[str], message: str
) -> None:
    cross_encoder_files(classifier)
    types = {
        "Transformer": "sentence_transformers.base.modules.transformer.Transformer",
        "LogitScore": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore",
        "Pooling": "sentence_transformers.base.modules.pooling.Pooling",
    }
    entries = [
        {"idx": i, "name": str(i), "path": "" if i == 0 else f"{i}_{kind}", "type": types[kind]}
        for i, kind in enumerate(modules)
    ]
    (classifier / "modules.json").write_text(json.dumps(entries))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(classifier)


def test_sparse_encoder_settings_that_change_outputs_are_refused(masked_lm: Path) -> None:
    write_splade_folder(masked_lm, Splade())
    edit_json(masked_lm / "config_sentence_transformers.json", {"model_type": "SparseEncoder"})
    assert load(masked_lm).info.task is Task.SPARSE
    edit_json(masked_lm / "config_sentence_transformers.json", {"max_active_dims": 64})
    with pytest.raises(ConfigError, match="unsupported max_active_dims 64"):
        load(masked_lm)
    edit_json(masked_lm / "config_sentence_transformers.json", {"max_active_dims": None})
    autoencoder = "sentence_transformers.sparse_encoder.modules.sparse_auto_encoder."
    modules = json.loads((masked_lm / "modules.json").read_text())
    modules[1]["type"] = autoencoder + "SparseAutoEncoder"
    (masked_lm / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="SparseAutoEncoder', which this server does not"):
        load(masked_lm)

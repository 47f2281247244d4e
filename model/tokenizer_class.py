"""What transformers' tokenizer class takes from tokenizer_config.json over tokenizer.json.

sentence-transformers tokenizes with transformers' AutoTokenizer. For BERT, DistilBERT and
MPNet, the tokenizer class rebuilds parts of tokenizer.json from tokenizer_config.json: the
normalizer from `do_lower_case` (true when the file does not say), `strip_accents` and
`tokenize_chinese_chars` (transformers 4 where these differ from tokenizer.json's; transformers
5 always, with its own pre-tokenizer and single and pair templates too). This server tokenizes
with tokenizer.json as saved, so a folder whose two files disagree is refused, naming the key:
which of the two the reference follows depends on its version. And a tokenizer whose
`model_input_names` leave out `token_type_ids` gives the model no segment ids, so a pair's
second text is embedded as segment 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from model.errors import ConfigError

# The classes (without transformers' "Fast" suffix) that rebuild the pipeline: the
# post-processor each builds, and the [CLS] and [SEP] tokens it uses when tokenizer_config.json
# names none.
_REBUILDING_CLASSES = {
    "BertTokenizer": ("BertProcessing", "[CLS]", "[SEP]"),
    "DistilBertTokenizer": ("BertProcessing", "[CLS]", "[SEP]"),
    "MPNetTokenizer": ("RobertaProcessing", "<s>", "</s>"),
}
# BertNormalizer's settings and the tokenizer_config.json key each one is rebuilt from.
_NORMALIZER_KEYS = {
    "lowercase": "do_lower_case",
    "strip_accents": "strip_accents",
    "handle_chinese_chars": "tokenize_chinese_chars",
}


# Tokenizer classes whose default model_input_names leave out token_type_ids (transformers
# 5 saves no model_input_names, so the class's default holds).
_NO_SEGMENT_IDS = (
    "DistilBertTokenizer",
    "MPNetTokenizer",
    "RobertaTokenizer",
    "XLMRobertaTokenizer",
    "CamembertTokenizer",
)


def uses_token_types(tokenizer_config: Mapping[str, Any]) -> bool:
    """Whether the tokenizer hands the model segment ids: its `model_input_names`, else its
    class's default."""
    names = tokenizer_config.get("model_input_names")
    if isinstance(names, list):
        return "token_type_ids" in names
    name = tokenizer_config.get("tokenizer_class")
    return not (isinstance(name, str) and name.removesuffix("Fast") in _NO_SEGMENT_IDS)


def checks_tokenizer_json(tokenizer_config: Mapping[str, Any], model_type: str) -> bool:
    """Whether tokenizer_config.json names a class that rebuilds tokenizer.json. Not for
    ModernBERT: transformers 5 loads its tokenizer.json as saved, whatever class the file
    names (its folders on the Hub name wrong ones)."""
    name = tokenizer_config.get("tokenizer_class")
    rebuilding = isinstance(name, str) and name.removesuffix("Fast") in _REBUILDING_CLASSES
    return rebuilding and model_type != "modernbert"


def check_tokenizer_class(
    tokenizer_json: Mapping[str, Any],
    tokenizer_config: Mapping[str, Any],
    config_path: Path,
) -> None:
    """Refuse a tokenizer.json that the tokenizer class tokenizer_config.json names (one that
    `checks_tokenizer_json` accepts) would rebuild differently. Sentence-transformers folders
    name it; without, AutoTokenizer would pick one by the model type, not checked here."""
    name = str(tokenizer_config["tokenizer_class"])
    json_path = config_path.with_name("tokenizer.json")
    processing, cls_token, sep_token = _REBUILDING_CLASSES[name.removesuffix("Fast")]

    def refuse(what: str) -> ConfigError:
        return ConfigError(
            f"{json_path}: {what}, where {name} (tokenizer_class, {config_path.name}) builds "
            "its own: this server tokenizes with tokenizer.json as saved, so the two must agree"
        )

    saved_normalizer = tokenizer_json.get("normalizer") or {}
    normalizer = _bert_normalizer(saved_normalizer)
    if normalizer is None or not normalizer.get("clean_text", True):
        raise refuse(f"the normalizer is {_describe(saved_normalizer)}, not a BertNormalizer")
    rebuilt = {
        "lowercase": tokenizer_config.get("do_lower_case", True),
        "strip_accents": tokenizer_config.get("strip_accents"),
        "handle_chinese_chars": tokenizer_config.get("tokenize_chinese_chars", True),
    }
    saved = {
        "lowercase": normalizer.get("lowercase", True),
        "strip_accents": normalizer.get("strip_accents"),
        "handle_chinese_chars": normalizer.get("handle_chinese_chars", True),
    }
    for setting in (rebuilt, saved):  # unset strip_accents follows lowercase
        if setting["strip_accents"] is None:
            setting["strip_accents"] = setting["lowercase"]
    for key, config_key in _NORMALIZER_KEYS.items():
        if saved[key] != rebuilt[key]:
            raise refuse(
                f"the normalizer's {key} is {saved[key]}, but {config_key} in "
                f"{config_path.name} makes it {rebuilt[key]}"
            )
    pre_tokenizer = tokenizer_json.get("pre_tokenizer") or {}
    if pre_tokenizer.get("type") != "BertPreTokenizer":
        raise refuse(f"the pre-tokenizer is {_describe(pre_tokenizer)}, not a BertPreTokenizer")
    cls = _token(tokenizer_config.get("cls_token"), cls_token)
    sep = _token(tokenizer_config.get("sep_token"), sep_token)
    post_processor = tokenizer_json.get("post_processor") or {}
    # Segment ids matter only where the tokenizer hands them to the model (BERT's).
    segments = uses_token_types(tokenizer_config)
    for what in ("single", "pair"):
        expected = _processing_template(processing, cls, sep, what)
        template = _template(post_processor, what)
        if template is None or _shown(template, segments) != _shown(expected, segments):
            shown = _shown(template, segments) if template else "not a template"
            text = "a single text" if what == "single" else "a pair"
            raise refuse(f"{text} becomes {shown!r}, not {_shown(expected, segments)!r}")


def _bert_normalizer(normalizer: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The BertNormalizer, alone or behind the Lowercase that sentence-transformers 6 saves
    for its own `do_lower_case` (honoured as the model was built: model/folder.py)."""
    steps = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else []
    if len(steps) == 2 and steps[0].get("type") == "Lowercase":
        normalizer = steps[1]
    return normalizer if normalizer.get("type") == "BertNormalizer" else None


def _describe(component: Mapping[str, Any]) -> str:
    return repr(component.get("type")) if component else "missing"


def _token(value: object, default: str) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else default


# A template's pieces: a special token or `$A` / `$B`, and its segment id.
Piece = tuple[str, int]


def _processing_template(kind: str, cls: str, sep: str, what: str) -> list[Piece]:
    """BertProcessing's `[CLS] $A [SEP]` and `[CLS] $A [SEP] $B:1 [SEP]:1`, RobertaProcessing's
    `<s> $A </s>` and `<s> $A </s> </s> $B </s>` (what the classes build, too)."""
    single = [(cls, 0), ("$A", 0), (sep, 0)]
    if what == "single":
        return single
    if kind == "RobertaProcessing":
        return [*single, (sep, 0), ("$B", 0), (sep, 0)]
    return [*single, ("$B", 1), (sep, 1)]


def _template(post_processor: Mapping[str, Any], what: str) -> list[Piece] | None:
    """What tokenizer.json's post-processor makes of one text or of a pair."""
    kind = post_processor.get("type")
    if kind in ("BertProcessing", "RobertaProcessing"):
        cls = str((post_processor.get("cls") or [None])[0])
        sep = str((post_processor.get("sep") or [None])[0])
        return _processing_template(kind, cls, sep, what)
    if kind == "TemplateProcessing":
        pieces = []
        for piece in post_processor.get(what, []):
            if "Sequence" in piece:
                sequence = piece["Sequence"]
                pieces.append((f"${sequence.get('id')}", int(sequence.get("type_id", 0))))
            else:
                special = piece.get("SpecialToken", {})
                pieces.append((str(special.get("id")), int(special.get("type_id", 0))))
        return pieces
    return None


def _show(piece: Piece, segments: bool) -> str:
    token, segment = piece
    return f"{token}:{segment}" if segments and segment else token


def _shown(pieces: list[Piece], segments: bool) -> str:
    return " ".join(_show(piece, segments) for piece in pieces)

"""One place per model task (embedding, classifier, sparse): what the front ends and the
engine need to know of it, registered together.

A task says what it is called in errors, which routes it serves (a route of another task
answers 424 before any work), where text-embeddings-inference's `POST /` goes for it, how
/info describes it in text-embeddings-inference's terms, and how the engine finishes each
input's pooled output (cut and normalised vectors, logits, sparse weights). Reading its
model folder and loading what runs after the encoder is the model's side (model/tasks/).
No torch and no HTTP here: the engine imports it too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from app.engine.protocol import Output, Wants
from app.errors import WrongTaskError
from model.info import ModelInfo, Task
from model.vectors import FloatArray


@dataclass(frozen=True)
class TaskSpec:
    task: Task
    # "an embedding model", for the 424 a route of another task answers.
    name: str
    # The POST routes that need a model of this task.
    paths: frozenset[str]
    # Where `POST /` goes, by the model and the body.
    main_path: Callable[[ModelInfo, bytes], str]
    # text-embeddings-inference's description in /info: {"embedding": {"pooling": ...}}.
    tei_model_type: Callable[[ModelInfo], dict[str, dict[str, object]]]
    # The engine's last step: each input's output from its pooled row (None where the
    # input wants none), one call per batch.
    finish: Callable[[FloatArray, Sequence[Wants]], list[Output | None]]
    # Whether its vectors may be asked for as int8 or uint8 codes, whose ranges the engine
    # reads off the model's vectors of the calibration texts at start-up.
    codes: bool = False


def _specs() -> Mapping[Task, TaskSpec]:
    from app.tasks import classifier, embedding, sparse

    return {spec.task: spec for spec in (embedding.SPEC, classifier.SPEC, sparse.SPEC)}


TASKS: Mapping[Task, TaskSpec] = _specs()
TASK_PATHS = frozenset(path for spec in TASKS.values() for path in spec.paths)


def require_task(info: ModelInfo, path: str) -> None:
    """424 when the loaded model's task does not serve `path`."""
    if path in TASK_PATHS and path not in TASKS[info.task].paths:
        needs = next(spec for spec in TASKS.values() if path in spec.paths)
        raise WrongTaskError(
            f"this route needs {needs.name} model; the loaded model is "
            f"{TASKS[info.task].name} model ({info.model_id})"
        )

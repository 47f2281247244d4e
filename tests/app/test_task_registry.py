"""Each model task registered in one place (app/tasks/): its routes, its POST / target, its
finishing in the engine."""

from __future__ import annotations

import numpy as np
import pytest

from app.engine.protocol import ItemResult, Wants
from app.errors import WrongTaskError
from app.tasks import TASKS, embedding, require_task
from app.tasks.classifier import finish_logits
from app.tasks.embedding import finish_vectors
from app.tasks.sparse import finish_sparse
from model.info import ModelInfo, Task
from model.vectors import FloatArray, finish


def info_of(task: Task, labels: tuple[str, ...] = ()) -> ModelInfo:
    return ModelInfo(
        "m", "bert", "learned", 4, 4, 16, ("mean",), True, (), True, "float32", "asked", "cpu",
        1, 1, 10,
        task=task, labels=labels,
    )  # fmt: skip


def test_every_task_is_registered_and_owns_its_routes() -> None:
    assert set(TASKS) == set(Task)
    owners = [path for spec in TASKS.values() for path in spec.paths]
    assert len(owners) == len(set(owners))  # no route belongs to two tasks
    for spec in TASKS.values():
        main = spec.main_path(info_of(spec.task, ("yes",)), b'{"inputs": "a"}')
        assert main in spec.paths


@pytest.mark.parametrize("task", list(Task))
def test_a_route_of_another_task_is_a_424_naming_both(task: Task) -> None:
    info = info_of(task)
    for spec in TASKS.values():
        for path in spec.paths:
            if spec.task is task:
                require_task(info, path)
                continue
            with pytest.raises(WrongTaskError) as caught:
                require_task(info, path)
            assert spec.name in caught.value.message and TASKS[task].name in caught.value.message
    require_task(info, "/embed_all")  # per-token states: any model


def test_post_root_goes_where_the_task_says() -> None:
    embed = TASKS[Task.EMBED]
    assert embed.main_path(info_of(Task.EMBED), b'{"inputs": "a"}') == "/embed"
    similarity = b'{"inputs": {"source_sentence": "a", "sentences": ["b"]}}'
    assert embed.main_path(info_of(Task.EMBED), similarity) == "/similarity"
    classify = TASKS[Task.CLASSIFY]
    assert classify.main_path(info_of(Task.CLASSIFY, ("yes",)), b"") == "/rerank"
    assert classify.main_path(info_of(Task.CLASSIFY, ("a", "b")), b"") == "/predict"


def test_finishing_follows_each_inputs_wants(monkeypatch: pytest.MonkeyPatch) -> None:
    pooled = np.array([[3.0, 4.0, 0.0], [0.0, 2.0, 0.0], [1.0, 0.0, 0.0]], dtype=np.float32)
    wants = [Wants(), Wants(normalize=False, dimensions=2), Wants(pooled=False)]
    first, second, third = (ItemResult(output) for output in finish_vectors(pooled, wants))
    assert np.allclose(first.vector, [0.6, 0.8, 0.0]) and np.allclose(second.vector, [0.0, 2.0])
    assert third.output is None
    # Every row alike: one call on the pass's array itself (no copy of its rows first); the
    # rows that come back are copies, not views of the pass
    given: list[FloatArray] = []

    def seen(vectors: FloatArray, normalize: bool, dimensions: int | None) -> FloatArray:
        given.append(vectors)
        return finish(vectors, normalize, dimensions)

    monkeypatch.setattr(embedding, "finish", seen)
    alike = [
        ItemResult(output).vector for output in finish_vectors(pooled, [Wants(dimensions=2)] * 3)
    ]
    assert len(given) == 1 and given[0] is pooled
    assert np.allclose(alike, [[0.6, 0.8], [0.0, 1.0], [1.0, 0.0]])
    assert not any(np.shares_memory(vector, pooled) for vector in alike)
    first, second, third = (ItemResult(output) for output in finish_logits(pooled, wants))
    assert np.array_equal(second.vector, pooled[1]) and third.output is None
    first, _, third = (ItemResult(output) for output in finish_sparse(pooled, wants))
    ids, weights = first.sparse
    assert ids.tolist() == [0, 1] and weights.tolist() == [3.0, 4.0] and third.output is None

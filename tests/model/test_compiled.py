"""The encoder's passes compiled by inductor (`compile`): the eager pass's numbers, every graph
compiled at start-up, eager where no graph applies, refused where it cannot run.

Every test here makes a compiled pass whose graph's guards fail raise rather than run
eagerly (`CompiledNetwork.stance`), and counts the passes that ran on a graph: a pass sent
to a graph must run on it, and the passes that should be are."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tests.model.test_architectures as architectures
from model import ConfigError, Embedder, Encoded, packing
from model.compiled import (
    LARGE_BATCH_MARGIN,
    MAX_TOKENS,
    CompiledNetwork,
    checked_guards,
    compile_unavailable,
)
from model.device import resolve_dtype
from model.errors import CompileError
from model.int8 import INT8, int8_unavailable
from model.prepacked import can_prepack
from tests.helpers import (
    every_map,
    graph_runs,
    make_random_checkpoint,
    write_sentence_transformers_files,
)
from tests.task_checkpoints import CLASSIFIERS, labelled, save_task_model

TOLERANCE = 1e-5
TEXTS = ["hello", "hello world", "the quick brown fox jumps over the lazy dog", "fox"]


@pytest.fixture(scope="module", autouse=True)
def no_silent_eager_passes() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CompiledNetwork, "stance", "fail_on_recompile")
        yield


@pytest.fixture
def one_thread() -> Iterator[None]:
    """A thread count `compiled` has graphs for, whatever the machine's own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_random_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def compiled(folder: Path) -> Embedder:
    embedder = Embedder.from_folder(folder, torch.device("cpu"), torch.float32, compile=True)
    # One input, and batches, on one thread and on two.
    assert embedder.compile_passes([1, 2]) == 4
    return embedder


@pytest.fixture(scope="module")
def eager(folder: Path) -> Embedder:
    return Embedder.from_folder(folder, torch.device("cpu"), torch.float32)


def batches(embedder: Embedder) -> list[list[Encoded]]:
    """Single inputs of several lengths, a batch of equal lengths, and padded batches."""
    encoded = embedder.tokenize(TEXTS)
    alone = [[item] for item in encoded]
    return [*alone, [encoded[2], encoded[2]], encoded, encoded[:2]]


def compile_batches(embedder: Embedder, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches with padding and without run on the graphs, whatever the start-up timing
    chose on this machine."""
    assert embedder.compiled is not None
    monkeypatch.setattr(embedder.compiled, "batches", True)
    monkeypatch.setattr(embedder.compiled, "padded_batches", True)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    ("unpadded", "padded_batches"),
    [(True, True), (True, False), (False, False)],
    ids=["batches-compiled", "padded-eager", "batches-eager"],
)
def test_compiled_passes_give_the_eager_vectors_and_compile_nothing_more(
    compiled: Embedder,
    eager: Embedder,
    unpadded: bool,
    padded_batches: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each batch, of any size and token count, on the graphs compiled at start-up, with
    what a batch with padding and one without run on chosen either way; one input always
    runs compiled."""
    assert compiled.compiled is not None
    monkeypatch.setattr(compiled.compiled, "batches", unpadded)
    monkeypatch.setattr(compiled.compiled, "padded_batches", padded_batches)
    runs = graph_runs(compiled, monkeypatch)
    every = batches(eager)
    padded = [batch for batch in every if len({len(item.ids) for item in batch}) > 1]
    assert len(padded) == 2
    eager_batches = (0 if padded_batches else len(padded)) + (0 if unpadded else 1)
    for batch in every:
        got = compiled.forward(batch, token_embeddings=True)
        want = eager.forward(batch, token_embeddings=True)
        assert largest_difference(got.pooled, want.pooled) <= TOLERANCE
        assert got.token_embeddings is not None and want.token_embeddings is not None
        for mine, theirs in zip(got.token_embeddings, want.token_embeddings, strict=True):
            assert largest_difference(mine, theirs) <= TOLERANCE
    assert len(runs) == len(every) - eager_batches


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("large_batches", [False, True])
def test_passes_of_up_to_max_tokens_run_on_the_graphs_and_larger_ones_as_timed(
    compiled: Embedder, eager: Embedder, monkeypatch: pytest.MonkeyPatch, large_batches: bool
) -> None:
    """A batch of MAX_TOKENS padded tokens and one long input run compiled (no size in
    between ties a graph); a batch of more runs eagerly, its feed-forward in chunks, unless
    such a batch measured faster compiled at start-up."""
    compile_batches(compiled, monkeypatch)
    assert compiled.compiled is not None
    monkeypatch.setattr(compiled.compiled, "large_batches", large_batches)
    runs = graph_runs(compiled, monkeypatch)
    rows = MAX_TOKENS // 32
    for batch, on_graphs in (
        ([[2, *range(10, 40), 3]] * rows, True),
        ([[2, *range(10, 48), 3]], True),
        ([[2, *range(10, 40), 3]] * (rows + 1), large_batches),
    ):
        runs.clear()
        got = compiled.forward(batch).pooled
        assert largest_difference(got, eager.forward(batch).pooled) <= TOLERANCE
        assert len(runs) == on_graphs


def test_the_start_up_timings_decide_which_batches_run_compiled(
    eager: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three sample batches are timed both ways: short inputs of one length, of many lengths
    (padded), and more than MAX_TOKENS tokens within the model's positions; each decides its
    kind of batch."""
    network = CompiledNetwork(eager.network, takes_types=False)
    monkeypatch.setattr(network, "_compile", lambda batch, types: None)
    asked: list[Sequence[int]] = []
    margins: list[float] = []

    def timed(lengths: Sequence[int], batch: str, margin: float = 1.0) -> bool:
        asked.append(lengths)
        margins.append(margin)
        return len(asked) != 2  # the padded sample ran faster eagerly

    monkeypatch.setattr(network, "_runs_faster_compiled", timed)
    assert network.compile_all([1]) == 2
    assert (network.batches, network.padded_batches, network.large_batches) == (True, False, True)
    unpadded, padded, large = asked
    assert len(set(unpadded)) == 1 and len(set(padded)) > 1
    assert sum(large) > MAX_TOKENS and max(large) <= eager.network.config.max_positions
    assert min(large) < max(large)  # padded, as some large batches are
    assert margins == [1.0, 1.0, LARGE_BATCH_MARGIN] and LARGE_BATCH_MARGIN < 1


def test_a_pass_runs_on_the_graph_of_its_thread_count(
    compiled: Embedder, eager: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engines on one CPU change their thread count per pass (app/cores.py), and a graph
    holds for the count it was compiled under: each count compiled for runs its own graph,
    any other runs eagerly."""
    assert compiled.compiled is not None
    runs = graph_runs(compiled, monkeypatch)
    batch = eager.tokenize(TEXTS[2:3])
    ids = torch.tensor([batch[0].ids])
    threads = torch.get_num_threads()
    try:
        for count, fits in ((1, True), (2, True), (3, False)):
            torch.set_num_threads(count)
            assert compiled.compiled.fits(ids, None, padded=False) is fits
            runs.clear()
            got = compiled.forward(batch).pooled
            assert len(runs) == fits
            assert largest_difference(got, eager.forward(batch).pooled) <= TOLERANCE
    finally:
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_a_one_token_input_and_unexpected_segment_ids_run_eagerly(
    compiled: Embedder, eager: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph assumes two tokens or more, and an embedding model's graphs take no segment
    ids."""
    assert compiled.compiled is not None
    runs = graph_runs(compiled, monkeypatch)
    one_token = torch.tensor([[7]])
    assert not compiled.compiled.fits(one_token, None, padded=False)
    segments = torch.zeros(1, 2, dtype=torch.long)
    assert not compiled.compiled.fits(torch.tensor([[7, 8]]), segments, padded=False)
    got = compiled.forward([[7]]).pooled
    assert largest_difference(got, eager.forward([[7]]).pooled) <= TOLERANCE
    assert not runs


@pytest.mark.usefixtures("one_thread")
def test_an_embedding_models_pipeline_runs_in_its_graphs(
    compiled: Embedder, eager: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pooling and the rest of the pipeline are part of the graph: a pass on a graph calls
    no eager pipeline, and gives its vectors; a pass that keeps maps runs it eagerly."""
    calls: list[int] = []
    pipeline = compiled.head.forward

    def counted(*arguments: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return pipeline(*arguments)

    monkeypatch.setattr(compiled.head, "forward", counted)
    runs = graph_runs(compiled, monkeypatch)
    batch = eager.tokenize(TEXTS[2:3])
    got = compiled.forward(batch).pooled
    assert len(runs) == 1 and not calls
    assert largest_difference(got, eager.forward(batch).pooled) <= TOLERANCE
    with_maps = compiled.forward(batch, attention=every_map(compiled)).pooled
    assert len(runs) == 1 and len(calls) == 1
    assert largest_difference(with_maps, got) <= TOLERANCE


@pytest.mark.usefixtures("one_thread")
def test_a_single_inputs_graph_attends_with_no_mask_and_takes_no_padding(
    compiled: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Traced for one input, the mask hides nothing (no mask to make or add in each layer);
    for a batch it is the mask's to say. So a padded single row never runs on the graph."""
    assert compiled.compiled is not None
    compile_batches(compiled, monkeypatch)
    row = torch.tensor([[7, 8, 9]])
    assert compiled.compiled.fits(row, None, padded=False)
    assert not compiled.compiled.fits(row, None, padded=True)
    assert compiled.compiled.fits(torch.cat([row, row]), None, padded=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert packing.TokenLayout.from_mask(torch.ones(1, 3)).key_mask.hides_nothing
    assert not packing.TokenLayout.from_mask(torch.ones(2, 3)).key_mask.hides_nothing


@pytest.mark.usefixtures("one_thread")
def test_two_models_of_one_architecture_each_run_their_own_graphs(
    compiled: Embedder, eager: Embedder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights are frozen into a graph, and each model's graphs are its own: a second
    model like the first, with other weights, gives its own vectors on its own graphs, and
    the first still its own."""
    make_random_checkpoint(tmp_path, seed=1)
    other = Embedder.from_folder(tmp_path, torch.device("cpu"), torch.float32, compile=True)
    assert other.compile_passes([1]) == 2
    other_eager = Embedder.from_folder(tmp_path, torch.device("cpu"), torch.float32)
    batch = eager.tokenize(TEXTS[2:3])
    assert largest_difference(eager.forward(batch).pooled, other_eager.forward(batch).pooled) > 0.1
    for model, reference in ((other, other_eager), (compiled, eager), (other, other_eager)):
        runs = graph_runs(model, monkeypatch)
        got = model.forward(batch).pooled
        assert len(runs) == 1
        assert largest_difference(got, reference.forward(batch).pooled) <= TOLERANCE


def guard(name: str, kind: str, *, is_global: bool = False) -> SimpleNamespace:
    """What torch.compile hands a guard filter about one guard (the fields read)."""
    return SimpleNamespace(name=name, guard_type=kind, is_global=is_global)


def test_guards_on_the_modules_and_their_code_are_not_checked_on_every_call() -> None:
    """The pass's arguments, torch's state and objects' identities are checked; the modules'
    other attributes and the module-level code are not."""
    guards = [
        guard("input_ids", "TENSOR_MATCH"),
        guard("token_type_ids", "CONSTANT_MATCH"),
        guard("", "GLOBAL_STATE"),
        guard("", "SHAPE_ENV"),
        guard("self.embeddings.word_embeddings.weight", "ID_MATCH"),
        guard("self.encoder.layer._modules['0']._forward_hooks", "EMPTY_NN_MODULE_HOOKS_DICT"),
        guard("self.encoder.layer._modules['0'].attention.self.num_heads", "EQUALS_MATCH"),
        guard("self", "TYPE_MATCH"),
        guard("G['attend'].__code__", "ID_MATCH", is_global=True),
        guard("G['NO_MAPS'].layers", "SET_NOT_CONTAINS", is_global=True),
    ]
    kept = checked_guards(guards)  # type: ignore[arg-type]
    assert kept == [True, True, True, True, True, False, False, False, True, False]


def test_attention_maps_come_from_the_eager_pass(compiled: Embedder, eager: Embedder) -> None:
    """A graph keeps no probabilities: a pass asked for maps runs eagerly, with the same
    states and maps."""
    batch = eager.tokenize(TEXTS)
    maps = every_map(eager)
    got = compiled.forward(batch, attention=maps)
    want = eager.forward(batch, attention=maps)
    assert got.attentions is not None and want.attentions is not None
    assert largest_difference(got.pooled, want.pooled) <= TOLERANCE
    for mine, theirs in zip(got.attentions, want.attentions, strict=True):
        for layer in maps.layers:
            assert largest_difference(mine[layer], theirs[layer]) <= TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_layers_compile_on_the_checkpoints_weights(
    tmp_path: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layers large enough to be prepacked (model/prepacked.py) run packed eagerly and
    `F.linear` on the checkpoint's weight in a graph: both give the eager model's vectors."""
    cpu = torch.device("cpu")
    if not can_prepack(cpu, dtype):
        pytest.skip(f"no prepacked {dtype} layers on this CPU")
    make_random_checkpoint(tmp_path, hidden_size=256, intermediate_size=512)
    pooling = {"word_embedding_dimension": 256, "pooling_mode_mean_tokens": True}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    plain = Embedder.from_folder(tmp_path, cpu, dtype, prepack=False)
    compiled = Embedder.from_folder(tmp_path, cpu, dtype, compile=True)
    assert compiled.prepacked > 0 and compiled.compile_passes() == 2
    compile_batches(compiled, monkeypatch)
    runs = graph_runs(compiled, monkeypatch)
    texts = plain.tokenize(TEXTS)
    tolerance = TOLERANCE if dtype == torch.float32 else 0.02  # bfloat16's rounding
    for batch in ([texts[2]], texts):
        got = compiled.forward(batch).pooled
        assert largest_difference(got, plain.forward(batch).pooled) <= tolerance
        maps = every_map(plain)  # an eager pass, on the packed layers
        eager = compiled.forward(batch, attention=maps).pooled
        assert largest_difference(eager, plain.forward(batch).pooled) <= tolerance
    assert len(runs) == 2


@pytest.mark.skipif(int8_unavailable(torch.device("cpu")) is not None, reason="no int8 here")
def test_int8_passes_compile_with_rowwise_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiled int8 model's layers are the row-wise ones (model/int8.py): one input, a
    batch and a padded batch each run on a graph and give the eager pass's vectors, and an
    input's vector is the same alone as beside others, padding and all."""
    make_random_checkpoint(tmp_path, hidden_size=64, intermediate_size=128)
    pooling = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    cpu = torch.device("cpu")
    compiled = Embedder.from_folder(tmp_path, cpu, resolve_dtype(INT8, cpu), compile=True)
    assert compiled.quantized > 0 and compiled.compiled is not None
    texts = compiled.tokenize(TEXTS)
    batches = ([texts[2]], [texts[2], texts[2]], texts)  # TEXTS' lengths differ: padding
    eager = [compiled.forward(batch).pooled for batch in batches]  # before any graph
    assert compiled.compile_passes() == 2
    compile_batches(compiled, monkeypatch)
    runs = graph_runs(compiled, monkeypatch)
    got = [compiled.forward(batch).pooled for batch in batches]
    assert len(runs) == 3
    for vectors, expected in zip(got, eager, strict=True):
        assert largest_difference(vectors, expected) <= TOLERANCE
    alone = got[0][0]
    for beside in (got[1][0], got[1][1], got[2][2]):
        assert largest_difference(alone, beside) <= TOLERANCE


def test_a_pair_model_compiles_its_passes_with_segment_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cross-encoder reads pairs, whose passes take segment ids: graphs for them too,
    which a padded batch runs on too."""
    save_task_model(tmp_path, CLASSIFIERS["bert"], "bert", **labelled(3))
    eager = Embedder.from_folder(tmp_path, torch.device("cpu"), torch.float32)
    compiled = Embedder.from_folder(tmp_path, torch.device("cpu"), torch.float32, compile=True)
    assert compiled.compile_passes() == 4
    compile_batches(compiled, monkeypatch)
    runs = graph_runs(compiled, monkeypatch)
    pairs = eager.tokenize_pairs([("hello", "hello world"), ("fox", "the lazy dog")])
    for batch in ([pairs[0]], pairs):
        got = compiled.forward(batch).pooled
        assert largest_difference(got, eager.forward(batch).pooled) <= TOLERANCE
    assert len(runs) == 2


def test_masks_narrowed_by_a_sliding_window_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ModernBERT's local layers restrict the padding mask further (`Mask.narrowed`), and in
    a padded batch some of a short input's windows see padding only."""
    architectures.save_reference(tmp_path, "modernbert")
    eager = Embedder.from_folder(tmp_path, torch.device("cpu"), torch.float32)
    compiled = Embedder.from_folder(tmp_path, torch.device("cpu"), torch.float32, compile=True)
    assert compiled.compile_passes() == 2
    compile_batches(compiled, monkeypatch)
    runs = graph_runs(compiled, monkeypatch)
    batch, _, _ = architectures.padded_batch(0)
    for each in ([batch[1]], batch):
        got = compiled.forward(each, token_embeddings=True)
        want = eager.forward(each, token_embeddings=True)
        assert torch.isfinite(got.pooled).all()
        assert largest_difference(got.pooled, want.pooled) <= TOLERANCE
    assert len(runs) == 2


def test_a_pass_that_cannot_be_compiled_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One that no graph can hold whole (here its token layout made to break the graph, as
    code reading its tensors' values would) names the network and says what to do."""
    make_random_checkpoint(tmp_path)
    laying_out = packing.TokenLayout.from_mask.__func__  # type: ignore[attr-defined]

    def breaks_the_graph(cls: type[packing.TokenLayout], mask: torch.Tensor) -> object:
        torch._dynamo.graph_break()
        return laying_out(cls, mask)

    monkeypatch.setattr(packing.TokenLayout, "from_mask", classmethod(breaks_the_graph))
    embedder = Embedder.from_folder(tmp_path, torch.device("cpu"), torch.float32, compile=True)
    with pytest.raises(CompileError, match="TransformerEncoder's pass cannot be compiled"):
        embedder.compile_passes()


def test_compile_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    assert "on a GPU" in str(compile_unavailable(torch.device("cuda"), torch.float16))
    assert "not torch.float16" in str(compile_unavailable(cpu, torch.float16))
    make_random_checkpoint(tmp_path)
    write_sentence_transformers_files(tmp_path)
    with pytest.raises(ConfigError, match="compile runs float32, bfloat16 and int8, not"):
        Embedder.load(str(tmp_path), device="cpu", dtype="float16", compile=True)


def test_without_a_compiler_compile_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("model.compiled.shutil.which", lambda name: None)
    refusal = compile_unavailable(torch.device("cpu"), torch.float32)
    assert refusal is not None and "C++ compiler" in refusal

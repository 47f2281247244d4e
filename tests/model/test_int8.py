"""int8 linear layers (`--dtype int8`, model/int8.py): close to float32, refused where they
cannot run, and frozen."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from model import Embedder
from model.device import cpu_flags, resolve_dtype
from model.errors import ConfigError
from model.int8 import (
    FULL_LEVELS,
    NARROW_LEVELS,
    VNNI_FLAG,
    Int8Linear,
    RowwiseInt8Linear,
    int8_unavailable,
    quantize_linears,
    weight_levels,
)
from tests.model.test_parity_sentence_transformers import varied_sentences

# all-MiniLM-L6-v2 on the parity sentences, int8 against float32: tighter than the int8
# issue's bounds (ONNX Runtime's default per-tensor quantization, on STS-B), as per-channel
# weight scales allow (docs/benchmarks.md compares the two).
MIN_MEAN_COSINE = 0.985
MIN_COSINE = 0.95
# The row-wise layers of compiled passes: each token quantized from its own range.
ROWWISE_MIN_MEAN_COSINE = 0.995
ROWWISE_MIN_COSINE = 0.98
LAYERS = [Int8Linear, RowwiseInt8Linear]
needs_int8 = pytest.mark.skipif(
    int8_unavailable(torch.device("cpu")) is not None, reason="no fbgemm kernels on this CPU"
)


@needs_int8
@pytest.mark.parametrize(
    ("compile", "least_mean", "least"),
    [(False, MIN_MEAN_COSINE, MIN_COSINE), (True, ROWWISE_MIN_MEAN_COSINE, ROWWISE_MIN_COSINE)],
    ids=["fbgemm", "rowwise"],
)
def test_minilm_in_int8_stays_close_to_float32(
    minilm: Embedder, compile: bool, least_mean: float, least: float
) -> None:
    """Eagerly on fbgemm's layers; and on the row-wise layers of a compiled model, whose
    eager passes (before any graph is compiled) do what its graphs do."""
    quantized = Embedder.load(device="cpu", dtype="int8", compile=compile)
    assert quantized.info.dtype == "int8" and quantized.quantized == 24  # 6 layers x 4
    layer = RowwiseInt8Linear if compile else Int8Linear
    assert sum(isinstance(module, layer) for module in quantized.network.modules()) == 24
    texts = varied_sentences()
    exact = torch.cat([minilm.embed(texts[i : i + 32]) for i in range(0, len(texts), 32)])
    approx = torch.cat([quantized.embed(texts[i : i + 32]) for i in range(0, len(texts), 32)])
    cosines = torch.nn.functional.cosine_similarity(exact, approx)
    assert cosines.mean() >= least_mean, cosines.mean()
    assert cosines.min() >= least, cosines.min()


@needs_int8
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize(("levels", "bound"), [(FULL_LEVELS, 0.015), (NARROW_LEVELS, 0.02)])
def test_int8_linear_is_close_to_the_float_layer(
    layer: type[Int8Linear | RowwiseInt8Linear], levels: int, bound: float
) -> None:
    if levels > weight_levels(cpu_flags()):
        pytest.skip("no AVX-512 VNNI here: full-range weights saturate 16-bit sums")
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    quantized = layer(linear, levels)
    x = torch.randn(3, 5, 64)  # any leading dimensions
    with torch.inference_mode():
        exact, approx = linear(x), quantized(x)
    assert approx.shape == exact.shape
    relative = (approx - exact).norm() / exact.norm()
    assert relative < bound, relative


@needs_int8
@pytest.mark.parametrize("levels", [FULL_LEVELS, NARROW_LEVELS])
def test_packed_weights_keep_within_their_levels(levels: int) -> None:
    """Each output channel's largest weight lands on the top level, none beyond."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    quantized = Int8Linear(linear, levels)
    weight, _ = torch.ops.quantized.linear_unpack(quantized.packed)
    top = weight.int_repr().abs().amax(dim=1)
    assert torch.equal(top, torch.full_like(top, levels))
    rowwise = RowwiseInt8Linear(linear, levels).weight
    assert torch.equal(rowwise, weight.int_repr())


@needs_int8
@pytest.mark.parametrize("levels", [FULL_LEVELS, NARROW_LEVELS])
def test_a_rowwise_layers_activations_keep_within_its_levels(
    levels: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each row's largest activation lands on the weights' top level: 7 bits where oneDNN's
    16-bit sums could saturate."""
    layer = RowwiseInt8Linear(nn.Linear(64, 48), levels)
    multiplied: list[torch.Tensor] = []
    product = torch._int_mm

    def recorded(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        multiplied.append(rows)
        return product(rows, weight)

    monkeypatch.setattr(torch, "_int_mm", recorded)
    with torch.inference_mode():
        layer(torch.randn(5, 64))
    top = multiplied[0].abs().amax(dim=1)
    assert torch.equal(top, torch.full_like(top, levels))


@needs_int8
def test_a_rowwise_layers_row_is_the_same_alone_and_beside_others() -> None:
    """Each row quantized from its own range: a token's output does not depend on the rows
    beside it, however much larger they are (fbgemm's one range per call would)."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer = RowwiseInt8Linear(linear, weight_levels(cpu_flags()))
    row = torch.randn(1, 64)
    beside = torch.cat([row, 100 * torch.randn(6, 64), torch.zeros(2, 64)])
    with torch.inference_mode():
        alone, together = layer(row), layer(beside)
    assert torch.equal(together[:1], alone)
    assert torch.equal(together[-2:], layer.bias.expand(2, -1))  # padding's rows: the bias
    fbgemm = Int8Linear(linear, weight_levels(cpu_flags()))
    with torch.inference_mode():
        assert not torch.equal(fbgemm(beside)[:1], fbgemm(row))


@needs_int8
@pytest.mark.parametrize("layer", LAYERS)
def test_the_largest_products_do_not_saturate_at_this_cpus_levels(
    layer: type[Int8Linear | RowwiseInt8Linear],
) -> None:
    """Equal positive activations quantize to their top level (fbgemm's unsigned 255, the
    row-wise layer's 127) and equal positive weights to theirs, so every product is the
    largest there is and the result is exact, unless the kernel's sums saturate (16-bit
    pairs without AVX-512 VNNI, at full levels)."""
    linear = nn.Linear(64, 4, bias=False)
    with torch.no_grad():
        linear.weight.fill_(0.5)
    quantized = layer(linear, weight_levels(cpu_flags()))
    x = torch.full((2, 64), 3.0)
    with torch.inference_mode():
        assert torch.allclose(quantized(x), linear(x), rtol=1e-5), quantized(x)


def test_weights_narrow_where_fbgemm_has_no_avx512_vnni() -> None:
    assert weight_levels(frozenset({"avx2", "fma"})) == NARROW_LEVELS
    assert weight_levels(frozenset({"avx2", "avx_vnni"})) == NARROW_LEVELS  # AVX2 kernels
    assert weight_levels(frozenset({"avx512f", "avx512bw"})) == NARROW_LEVELS  # Skylake-SP
    assert weight_levels(frozenset({"avx512f", VNNI_FLAG, "amx_int8"})) == FULL_LEVELS


@needs_int8
def test_a_call_never_asks_the_packed_weight_for_torch_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The question costs a C++ exception thrown and caught per layer call (model/int8.py)."""
    layer = Int8Linear(nn.Linear(16, 8), NARROW_LEVELS)
    asked: list[str] = []
    answer = torch.ScriptObject.__getattr__  # type: ignore[attr-defined]  # pybind11 defines it

    def spy(packed: torch.ScriptObject, name: str) -> object:
        asked.append(name)
        return answer(packed, name)

    monkeypatch.setattr(torch.ScriptObject, "__getattr__", spy)
    x = torch.randn(2, 16)
    layer(x)
    assert asked == []
    torch.ops.quantized.linear_dynamic(x, layer.packed, False)  # the spy sees a bare call's
    assert "__torch_function__" in asked


@needs_int8
def test_a_call_runs_the_public_ops_product_without_its_python_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The op under torch.ops' wrapper, without the wrapper's search of every argument for
    torch.compile's fake objects (model/int8.py)."""
    layer = Int8Linear(nn.Linear(16, 8), NARROW_LEVELS)
    walks: list[object] = []
    walk = torch._ops._must_dispatch_in_python

    def counted(*arguments: object) -> bool:
        walks.append(arguments)
        return bool(walk(*arguments))

    monkeypatch.setattr(torch._ops, "_must_dispatch_in_python", counted)
    x = torch.randn(3, 16)
    ours = layer(x)
    assert walks == []
    assert torch.equal(ours, torch.ops.quantized.linear_dynamic(x, layer.packed, False))
    assert walks  # the public call walks its arguments


@needs_int8
@pytest.mark.parametrize("rowwise", [False, True])
def test_only_exact_linear_layers_are_swapped_and_they_are_frozen(rowwise: bool) -> None:
    class Owned(nn.Linear):  # a subclass another module may read the weight of
        pass

    network = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Owned(8, 8))
    assert quantize_linears(network, NARROW_LEVELS, rowwise=rowwise) == 1
    twin = RowwiseInt8Linear if rowwise else Int8Linear
    assert type(network[0]) is twin and type(network[2]) is Owned
    with pytest.raises(RuntimeError, match="int8 linear layer cannot be moved"):
        network.to(torch.float16)
    with pytest.raises(RuntimeError, match="cannot be saved"):
        network.state_dict()


def test_int8_is_refused_off_the_cpu() -> None:
    with pytest.raises(ConfigError, match="int8 runs on the CPU only"):
        resolve_dtype("int8", torch.device("cuda"))


@needs_int8
def test_a_tiny_model_loads_in_int8_and_says_so(tiny_checkpoint: Path) -> None:
    embedder = Embedder.load(str(tiny_checkpoint), device="cpu", dtype="int8")
    assert embedder.info.dtype == "int8" and embedder.info.dtype_reason == "asked for"
    assert embedder.prepacked == 0 and embedder.quantized == 2 * 4  # 2 layers x 4 linears
    vectors = embedder.embed(["hello world", "the quick brown fox"])
    assert torch.isfinite(vectors).all()

"""The encoder's linear layers on weights prepacked for MKL or oneDNN (model/prepacked.py): the
same vectors as torch's own `F.linear` on the checkpoint layout, and only where they run."""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

from model import AttentionSpec, Embedder, prepacked
from model.activations import Activation, activate
from model.embedder import BatchOutput
from model.frozen import FrozenLinear
from model.prepacked import (
    ROW_BUCKETS,
    MklLinear,
    OnednnLinear,
    PrepackedLinear,
    bucket_rows,
    can_prepack,
    linear_activated,
    linear_plus,
    mkl_packs_float32,
    packed_twin,
    padded_rows,
    prepack_linears,
)
from model.resolve import DEFAULT_MODEL_ID, resolve_model_dir

CPU = torch.device("cpu")
TEXTS = [
    "a short sentence",
    "The cat sits outside while the dog plays in the garden.",
    "Größe 東京 🚀 " * 20,
]
# float32: the kernels' products differ from F.linear's only by rounding (2e-7 seen). bfloat16:
# prepacked layers add their residual and apply their activation inside the product, before
# rounding to bfloat16, where the plain ones round first: a bfloat16 step of slack.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
MIN_COSINE = {torch.float32: 0.99999, torch.bfloat16: 0.9999}
BF16_STEP = 2**-8  # bfloat16's relative precision


KERNELS = [MklLinear, OnednnLinear]


@pytest.fixture
def every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's float32 layers prepacked too, which alone would stay on F.linear."""
    monkeypatch.setattr(prepacked, "MIN_MKL_WEIGHTS", 0)
    monkeypatch.setattr(prepacked, "MIN_ONEDNN_FLOAT32_WEIGHTS", 0)


def runs_here(kernel: type[PrepackedLinear], dtype: torch.dtype) -> bool:
    """Whether `kernel` can compute `dtype` on this machine, chosen by model.prepacked or not
    (MKL's is chosen on Intel CPUs only, but runs on any x86 CPU)."""
    if kernel is OnednnLinear:
        with mock.patch.object(prepacked, "mkl_packs_float32", lambda: False):
            return can_prepack(CPU, dtype)
    x86 = platform.machine() in ("x86_64", "AMD64")
    return x86 and dtype == torch.float32 and mkl_built()


def mkl_built() -> bool:
    return bool(torch.backends.mkl.is_available())  # type: ignore[no-untyped-call]


def linears(embedder: Embedder) -> tuple[int, int]:
    modules = list(embedder.network.modules())
    return (
        sum(type(m) is nn.Linear for m in modules),
        sum(isinstance(m, PrepackedLinear) for m in modules),
    )


# Every kernel each dtype can run on, whichever this machine's CPU would choose.
DTYPE_KERNELS = [
    (torch.float32, MklLinear),
    (torch.float32, OnednnLinear),
    (torch.bfloat16, OnednnLinear),
]


@pytest.fixture
def on_kernel(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> type[PrepackedLinear]:
    """The test's (dtype, kernel) made the one chosen, or the test skipped where it cannot
    run."""
    dtype, kernel = request.param
    if not runs_here(kernel, dtype):
        pytest.skip(f"{kernel.__name__} does not run {dtype} on this CPU")
    monkeypatch.setattr(prepacked, "mkl_packs_float32", lambda: kernel is MklLinear)
    return kernel  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("dtype", "on_kernel"), [(d, (d, k)) for d, k in DTYPE_KERNELS], indirect=["on_kernel"]
)
def test_prepacked_real_model_gives_the_vectors_of_f_linear(
    dtype: torch.dtype, on_kernel: type[PrepackedLinear]
) -> None:
    folder = resolve_model_dir(DEFAULT_MODEL_ID)
    packed = Embedder.from_folder(folder, CPU, dtype)
    plain = Embedder.from_folder(folder, CPU, dtype, prepack=False)
    # all-MiniLM-L6-v2: joined QKV, output, and the two feed-forward layers, in 6 layers.
    assert packed.prepacked == 24
    assert linears(packed) == (0, 24)
    assert all(
        type(m) is on_kernel for m in packed.network.modules() if isinstance(m, PrepackedLinear)
    )
    assert plain.prepacked == 0
    assert linears(plain) == (24, 0)
    ours, theirs = packed.embed(TEXTS), plain.embed(TEXTS)
    assert (ours - theirs).abs().max().item() <= TOLERANCE[dtype]
    assert torch.nn.functional.cosine_similarity(ours, theirs).min().item() >= MIN_COSINE[dtype]


@pytest.mark.usefixtures("every_size")
@pytest.mark.parametrize(
    ("dtype", "on_kernel"), [(d, (d, k)) for d, k in DTYPE_KERNELS], indirect=["on_kernel"]
)
def test_prepacked_token_embeddings_and_attention_maps(
    tiny_checkpoint: Path, dtype: torch.dtype, on_kernel: type[PrepackedLinear]
) -> None:
    """The other outputs read the same layers: per-token vectors and the attention maps. In
    float32 they equal the plain layers' to rounding; in bfloat16, where the fused steps round
    at other places, they are as far from float32's as the plain layers' are, within one
    bfloat16 step (which way depends on the weights)."""
    packed = Embedder.from_folder(tiny_checkpoint, CPU, dtype)
    plain = Embedder.from_folder(tiny_checkpoint, CPU, dtype, prepack=False)
    exact = Embedder.from_folder(tiny_checkpoint, CPU, torch.float32, prepack=False)
    assert packed.prepacked > 0
    assert any(type(m) is on_kernel for m in packed.network.modules())
    spec = AttentionSpec(layers=(0, 1), heads=(0, 1))
    batch = packed.tokenize(TEXTS)
    ours, theirs, reference = (
        embedder.forward(batch, token_embeddings=True, attention=spec)
        for embedder in (packed, plain, exact)
    )
    if dtype == torch.float32:
        assert token_error(ours, theirs) <= TOLERANCE[dtype]
        assert map_error(ours, theirs) <= TOLERANCE[dtype]
    else:
        assert token_error(ours, reference) <= token_error(theirs, reference) + BF16_STEP
        assert map_error(ours, reference) <= map_error(theirs, reference) + BF16_STEP


def token_error(output: BatchOutput, reference: BatchOutput) -> float:
    """The largest difference of the per-token vectors, relative to their size (they are not
    normalised: bfloat16's step is relative to it)."""
    assert output.token_embeddings is not None and reference.token_embeddings is not None
    pairs = zip(output.token_embeddings, reference.token_embeddings, strict=True)
    return max(
        (mine.float() - theirs).abs().max().item() / max(theirs.abs().max().item(), 1.0)
        for mine, theirs in pairs
    )


def map_error(output: BatchOutput, reference: BatchOutput) -> float:
    assert output.attentions is not None and reference.attentions is not None
    pairs = zip(output.attentions, reference.attentions, strict=True)
    return max(
        (maps.float() - theirs[layer]).abs().max().item()
        for mine, theirs in pairs
        for layer, maps in mine.items()
    )


@pytest.mark.usefixtures("every_size")
def test_a_prepacked_layer_refuses_to_be_moved_or_saved(tiny_checkpoint: Path) -> None:
    """Its opaque weight would be skipped by .to() and state_dict(): it says so instead."""
    network = Embedder.from_folder(tiny_checkpoint, CPU, torch.float32).network
    with pytest.raises(RuntimeError, match="cannot be moved or converted: build the model"):
        network.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot be saved: build the model with prepack"):
        network.state_dict()


def test_prepacking_only_where_a_kernel_runs_the_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    if platform.machine() == "x86_64":  # CI's machines: float32 is always prepacked there
        assert can_prepack(CPU, torch.float32)
    assert not can_prepack(CPU, torch.float16)
    assert not can_prepack(torch.device("cuda"), torch.float32)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # oneDNN off
    assert not can_prepack(CPU, torch.bfloat16)
    # MKL's float32 packing needs no oneDNN kernel; where it is not chosen, F.linear.
    assert can_prepack(CPU, torch.float32) is mkl_packs_float32()
    monkeypatch.setattr(prepacked, "mkl_packs_float32", lambda: False)
    assert not can_prepack(CPU, torch.float32)


@pytest.mark.parametrize(
    ("vendor", "chosen"), [("GenuineIntel", True), ("AuthenticAMD", False), ("", False)]
)
def test_mkl_packs_float32_on_intel_cpus_only(
    vendor: str, chosen: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured faster than oneDNN on Intel; elsewhere float32 stays on oneDNN, as measured
    there."""
    if not mkl_built():
        pytest.skip("this torch has no MKL")
    mkl_packs_float32.cache_clear()
    monkeypatch.setattr(prepacked, "cpu_vendor", lambda: vendor)
    try:
        assert mkl_packs_float32() is chosen
    finally:
        mkl_packs_float32.cache_clear()


def test_only_float32_layers_large_enough_to_gain_are_prepacked() -> None:
    """A small float32 product is as fast on F.linear (the tiny model's, 32 wide); where the
    line lies: test_the_kernel_chosen_by_dtype_vendor_and_size."""
    if not can_prepack(CPU, torch.float32):
        pytest.skip("no kernel runs float32 here")
    sizes = [(32, 96), (384, 384), (384, 1536)]  # the last two: all-MiniLM-L6-v2's smallest
    network = nn.Sequential(*(nn.Linear(*size) for size in sizes))
    assert prepack_linears(network) == 2
    kernel = MklLinear if mkl_packs_float32() else OnednnLinear
    assert [type(layer) for layer in network] == [nn.Linear, kernel, kernel]


@pytest.mark.parametrize("intel", [True, False])
def test_the_kernel_chosen_by_dtype_vendor_and_size(
    intel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 on MKL from 2^16 weights on Intel, on oneDNN from 2^17 elsewhere; bfloat16 on
    oneDNN at any size (its F.linear lays the weight out on every call)."""
    kernel = MklLinear if intel else OnednnLinear
    if not runs_here(kernel, torch.float32):
        pytest.skip(f"{kernel.__name__} does not run here")
    monkeypatch.setattr(prepacked, "mkl_packs_float32", lambda: intel)
    smallest = 1 << 16 if intel else 1 << 17
    assert isinstance(packed_twin(nn.Linear(256, smallest // 256)), kernel)
    assert packed_twin(nn.Linear(255, smallest // 256)) is None
    if runs_here(OnednnLinear, torch.bfloat16):
        assert isinstance(packed_twin(nn.Linear(32, 96).to(torch.bfloat16)), OnednnLinear)


@pytest.mark.parametrize(("inputs", "outputs", "bias"), [(96, 160, True), (384, 1536, False)])
def test_mkl_runs_any_row_count_on_one_packed_weight_and_keeps_no_copy(
    inputs: int, outputs: int, bias: bool
) -> None:
    """The weight is packed once, for EXPECTED_ROWS rows, and every call tells MKL its own row
    count: the products must still be F.linear's for every count, on and off that one (which
    pins that MKL's packed layout does not depend on it). Only the packed weight is kept."""
    if not runs_here(MklLinear, torch.float32):
        pytest.skip("this torch has no MKL")
    torch.manual_seed(0)
    layer = nn.Linear(inputs, outputs, bias=bias)
    packed = MklLinear(layer)
    assert packed.agrees(layer)
    assert packed.weight_stand_in.shape == layer.weight.shape
    assert packed.weight_stand_in.untyped_storage().nbytes() == 4  # one float, not a copy
    with torch.inference_mode():
        for rows in [*range(0, 130), 255, 256, 257, 1000, 4099]:
            x = torch.randn(rows, inputs)
            ours = packed(x)
            assert ours.shape == (rows, outputs)
            if rows:
                assert (ours - layer(x)).abs().max().item() <= 1e-4, rows


MKL_INPUTS = {
    "1-D": lambda: torch.randn(48),
    "3-D": lambda: torch.randn(3, 13, 48),
    "empty": lambda: torch.randn(0, 48),
    "transposed view": lambda: torch.randn(48, 7).t(),
}


@pytest.mark.parametrize("make", MKL_INPUTS.values(), ids=MKL_INPUTS.keys())
def test_mkl_takes_any_input_shape_and_layout(make: Callable[[], torch.Tensor]) -> None:
    """Each gives F.linear's products, in the input's shape."""
    if not runs_here(MklLinear, torch.float32):
        pytest.skip("this torch has no MKL")
    torch.manual_seed(0)
    layer = nn.Linear(48, 40)
    packed = MklLinear(layer)
    x = make()
    with torch.inference_mode():
        ours = packed(x)
        assert ours.shape == (*x.shape[:-1], 40)
        if x.numel():
            assert (ours - layer(x)).abs().max().item() <= 1e-5


def test_mkl_is_not_used_where_its_products_disagree(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Should a torch or MKL ever tie the packed layout to its row count, the layer stays on
    F.linear, with a warning, instead of giving other vectors."""
    if not runs_here(MklLinear, torch.float32):
        pytest.skip("this torch has no MKL")
    monkeypatch.setattr(prepacked, "mkl_packs_float32", lambda: True)
    monkeypatch.setattr(MklLinear, "agrees", lambda self, linear: False)
    with caplog.at_level(logging.WARNING, logger="model.prepacked"):
        assert packed_twin(nn.Linear(384, 384)) is None
    assert "MKL's packed products differ from torch's here" in caplog.text


def test_a_frozen_layer_names_what_it_refused() -> None:
    """A kernel's layer without its own message still refuses with one."""

    class Bare(FrozenLinear):
        pass

    layer = Bare(nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="a packed linear layer cannot be saved"):
        layer.state_dict()
    with pytest.raises(RuntimeError, match="cannot be moved or converted"):
        layer.to(torch.float16)


def test_row_counts_round_up_to_a_few_sizes() -> None:
    """Exact below 2 x ROW_BUCKETS rows, then at most 1/ROW_BUCKETS more: the few sizes that
    oneDNN compiles kernels for."""
    sizes = [bucket_rows(rows) for rows in range(1, 16385)]
    assert sizes[: 2 * ROW_BUCKETS - 1] == list(range(1, 2 * ROW_BUCKETS))
    for rows, size in enumerate(sizes, start=1):
        assert rows <= size <= rows * (1 + 1 / ROW_BUCKETS)
        assert bucket_rows(size) == size
    # Every count below 2 x ROW_BUCKETS, ROW_BUCKETS per doubling from there to 2^14 (nine
    # doublings), and 2^14 itself.
    assert len(set(sizes)) == 2 * ROW_BUCKETS - 1 + 9 * ROW_BUCKETS + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 32), (3, 13, 32), (32, 32), (5, 32), (32,), (0, 32)])
def test_a_layer_runs_on_a_bucket_of_rows_and_answers_for_its_own(
    shape: tuple[int, ...], dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Padded with rows of zeros up to its bucket, the product gives each real row what
    F.linear gives it (and the activation and residual too), in the input's own shape."""
    if not runs_here(OnednnLinear, dtype):
        pytest.skip(f"oneDNN does not run {dtype} on this CPU")
    torch.manual_seed(0)
    layer = nn.Linear(32, 48).to(dtype)
    packed = OnednnLinear(layer)
    x = torch.randn(shape, dtype=dtype)
    residual = torch.randn((*shape[:-1], 48), dtype=dtype)
    rows = x.numel() // 32
    ran_on = []

    def spied(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        flat, own = padded_rows(tensor)
        ran_on.append(flat.shape[0])
        return flat, own

    monkeypatch.setattr(prepacked, "padded_rows", spied)
    with torch.inference_mode():
        results = {
            "product": (packed(x), layer(x)),
            "activated": (linear_activated(packed, x, "gelu"), activate(layer(x), "gelu")),
            "plus": (linear_plus(packed, x, residual), layer(x).float() + residual.float()),
        }
    # The product, the activated one, and the residual's product and the residual itself.
    assert ran_on == [bucket_rows(rows)] * 4
    tolerance = 1e-5 if dtype == torch.float32 else 0.05  # a few bfloat16 steps at 4
    for name, (ours, reference) in results.items():
        assert ours.shape == (*shape[:-1], 48), name
        if rows:
            assert (ours.float() - reference.float()).abs().max().item() <= tolerance, name


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_residual_of_another_shape_is_broadcast_as_a_separate_step(
    kernel: type[PrepackedLinear],
) -> None:
    """Fused, rows padded apart would pair the wrong rows: a residual that is not the
    output's shape is added after the product, as torch broadcasts it."""
    if not runs_here(kernel, torch.float32):
        pytest.skip(f"{kernel.__name__} does not run float32 here")
    torch.manual_seed(0)
    layer = nn.Linear(32, 48)
    packed = kernel(layer)
    x = torch.randn(2, 37, 32)
    with torch.inference_mode():
        for residual in (torch.randn(37, 48), torch.randn(48)):
            summed = linear_plus(packed, x, residual)
            assert summed.shape == (2, 37, 48)
            assert (summed - (layer(x) + residual)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_fused_activation_and_residual_equal_the_separate_steps(
    activation: Activation, kernel: type[PrepackedLinear]
) -> None:
    if not runs_here(kernel, torch.float32):
        pytest.skip(f"{kernel.__name__} does not run float32 here")
    torch.manual_seed(0)
    layer = nn.Linear(32, 48)
    packed = kernel(layer)
    x, residual = torch.randn(7, 32), torch.randn(7, 48)
    with torch.inference_mode():
        fused = linear_activated(packed, x, activation)
        separate = linear_activated(layer, x, activation)  # a plain layer: the two steps
        assert (fused - separate).abs().max().item() <= 1e-5
        assert (fused - activate(layer(x), activation)).abs().max().item() <= 1e-5
        summed = linear_plus(packed, x, residual)
        assert (summed - (layer(x) + residual)).abs().max().item() <= 1e-5
        assert torch.equal(linear_plus(layer, x, residual), layer(x) + residual)

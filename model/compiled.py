"""The encoder's passes compiled for a CPU, for the operator who asks for it (`--compile`).

An eager CPU pass calls a few hundred small ops between its matrix products, each through
Python and torch's dispatcher; on one sentence they cost about as much as the products. With
torch.compile's inductor and the weights frozen into the graph, inductor lays the linear
weights out for oneDNN itself (tracing `F.linear` on the checkpoint's weight, which a
prepacked layer keeps for it: model/prepacked.py), fuses what runs between the products
(bias, activation, residual and LayerNorm, the heads' split and merge) into C++ loops, and
calls all of it from generated C++ (`cpp_wrapper`): one Python call a pass. int8's layers are
the row-wise ones (model/int8.py), whose activations' quantizing and scaling inductor fuses
around each product. The price is start-up time (each graph compiles for seconds to tens
of seconds), memory (each graph holds its own layout of the weights) and a C++ compiler on
the machine (docs/benchmarks.md).

The graphs take any batch size and token count (dynamic shapes) and are all compiled at
start-up (`compile_all`): one for a single input, one for batches, and both
again with segment ids for a model that reads pairs, for each thread count a pass may run
on. A compiled pass runs on the padded grid, its attention in
`scaled_dot_product_attention` (model/packing.py's token packing and model/attention.py's
other way read the mask's values, which a graph cannot). So batches run compiled only where
that measured faster at start-up than the eager pass, timed three times: on a batch without
padding (`batches`), on a padded one, against the eager pass on its real tokens
(`padded_batches`: in bfloat16 on AMX and in int8, not in float32, whose products dominate a
batch and grow with its padding), and on one of more than MAX_TOKENS tokens, whose eager pass
runs its feed-forward in chunks (`large_batches`: docs/benchmarks.md says where each ran). A
pass that keeps attention maps, or that no graph takes, runs eagerly: nothing is compiled on a
request's time.
"""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from model.architectures import Encoder
from model.errors import CompileError
from model.packing import FEED_FORWARD_CHUNK

if TYPE_CHECKING:  # torch._dynamo takes seconds to import, which an eager server never spends
    from torch._dynamo.types import GuardFilterEntry

log = logging.getLogger(__name__)

# Inductor's settings while it compiles. Set as its configuration around the compiling calls:
# handed to torch.compile as options, `freezing` came too late to freeze anything (the
# weights stayed graph inputs, on plain GEMMs). Frozen weights are constants, which inductor
# lays out for oneDNN once, and the generated C++ calls every kernel itself.
INDUCTOR = {"freezing": True, "cpp_wrapper": True}
COMPILED_DTYPES = (torch.float32, torch.bfloat16)
# The token count of the inputs the graphs compile on: neither 0 nor 1, sizes that
# torch.compile would specialise a graph to.
SAMPLE_TOKENS = 8
# The batches timed both ways at start-up: short inputs of many lengths, as a server's
# length-grouped batches are at their worst (a third of it padding); and, without padding, as
# many short sentences as a busy server's batches hold, where a graph's fused steps count
# most. Each way timed this many times, alternating, the fastest kept.
SAMPLE_PADDED_LENGTHS = tuple(range(SAMPLE_TOKENS, 4 * SAMPLE_TOKENS, 2))
SAMPLE_LENGTHS = (2 * SAMPLE_TOKENS,) * 32
SAMPLE_TIMINGS = 3
# The most padded tokens a compiled pass runs, unless a larger batch measured faster compiled
# at start-up (`large_batches`). A larger eager pass runs its feed-forward a chunk at a time
# (model/packing.py), its 4x-wide intermediate kept in cache, which a graph cannot (the
# chunks' count would be a symbol), and its steps between the products are a small share of
# it: in a server's one-thread engines, bfloat16's long passages ran compiled at 0.77x their
# eager texts/s; int8's row-wise layers, whose eager steps are many small ops, ran faster
# compiled at every size (docs/benchmarks.md).
MAX_TOKENS = FEED_FORWARD_CHUNK
# The larger batch timed both ways at start-up: inputs of up to this many tokens (the model's
# limit if lower), twice MAX_TOKENS in all, and down to half as many, so that a fifth of the
# grid is padding, which the graph runs and the eager pass does not: the decision holds for
# every batch above MAX_TOKENS, padded or not.
SAMPLE_LARGE_LENGTH = 256
# How much faster compiled that batch must run: timed alone, a graph's feed-forward over the
# whole batch does not show what it costs beside another engine's passes on the same caches.
# Two one-thread bfloat16 engines ran long passages at 0.66x their ceiling so, where the
# start-up timing on one thread, alone, read 0.94x; int8's row-wise layers, whose eager steps
# are many small ops, read 0.65x (docs/benchmarks.md).
LARGE_BATCH_MARGIN = 0.8
# The graphs one model's pass may hold (each model's compile keeps its own graphs and counts
# them alone: `isolate_recompiles`). It needs shapes (2) x segment ids or none (2) x thread
# counts (up to 2): torch.compile's default limit of 8 with no room to spare. Past the limit
# torch.compile would run the pass eagerly, silently: `_compile` refuses instead.
RECOMPILE_LIMIT = 16


def compile_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the encoder's passes cannot be compiled here, or None where they can (`dtype`:
    the weights', float32 for int8's model)."""
    if device.type != "cpu":
        return (
            f"compile is for the CPU, not {device.type}: on a GPU the passes replay as CUDA "
            "graphs (cuda_graphs)"
        )
    if dtype not in COMPILED_DTYPES:
        return f"compile runs float32, bfloat16 and int8, not {dtype}"
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "compile needs a C++ compiler (g++) on the machine, and none was found"
    return None


def checked_guards(guards: Sequence[GuardFilterEntry]) -> list[bool]:
    """Which of a graph's guards each call checks: those on the pass's arguments (their
    shapes and dtypes, which are None) and on torch's state (grad mode, the thread count), and
    the identities of objects, the weights' among them (a graph holds the weights it was
    compiled with). Not the rest, on the modules' attributes and hooks and on the
    module-level code the pass calls, which a served model never changes: they were most of
    the checking, several tens of microseconds a call (docs/benchmarks.md)."""
    return [
        guard.guard_type == "ID_MATCH" or not (guard.is_global or _on_modules(guard))
        for guard in guards
    ]


def _on_modules(guard: GuardFilterEntry) -> bool:
    """Whether a guard is on the compiled network's module tree (its source is `self`)."""
    return guard.name == "self" or guard.name.startswith(("self.", "self["))


class PooledPass(nn.Module):
    """The encoder's pass, and an embedding model's pipeline (pooling, Dense layers, the cut:
    model/pipeline.py) after it, in one graph: eagerly the pipeline's few small steps cost
    more than the graph's kernel for them (docs/benchmarks.md). Other heads run after."""

    def __init__(self, network: Encoder, pipeline: nn.Module | None) -> None:
        super().__init__()
        self.network = network
        self.pipeline = pipeline

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None,
        prompt_lengths: Tensor,
    ) -> tuple[Tensor, Tensor | None]:
        """(B, T, D) last hidden states, and (B, dimensions) vectors where there is a
        pipeline."""
        hidden = self.network(input_ids, attention_mask, token_type_ids).hidden
        if self.pipeline is None:
            return hidden, None
        pooled: Tensor = self.pipeline(hidden, attention_mask, prompt_lengths)
        return hidden, pooled


class CompiledNetwork:
    """An encoder's forward pass compiled by inductor, eager where no compiled graph fits.
    Called on one thread (the engine's compute thread), as the eager network is."""

    # What a pass does when its graph's guards do not hold after all: run eagerly (tests
    # make it fail, to show that every pass `fits` promises runs compiled).
    stance = "eager_on_recompile"

    def __init__(
        self, network: Encoder, *, takes_types: bool, pipeline: nn.Module | None = None
    ) -> None:
        """`takes_types`: the model reads pairs, whose passes take segment ids; `pipeline`:
        an embedding model's, run in the same graph (`PooledPass`)."""
        self.network = network
        self.takes_types = takes_types
        self.pooled_pass = PooledPass(network, pipeline)
        self.graphs = 0
        # The torch thread counts the graphs were compiled for: a graph holds only for the
        # count it was compiled under (torch.compile guards on it), and an engine beside
        # others changes its count per pass (app/cores.py).
        self.thread_counts: frozenset[int] = frozenset()
        # Whether a batch without padding, one with, and one of more than MAX_TOKENS run
        # compiled (see above); decided by `compile_all`.
        self.batches = False
        self.padded_batches = False
        self.large_batches = False
        # torch.compile's typed overloads lack `isolate_recompiles`, which it takes.
        self._compiled = torch.compile(  # type: ignore[call-overload]
            self.pooled_pass,
            dynamic=True,
            fullgraph=True,
            options={"guard_filter_fn": checked_guards},
            isolate_recompiles=True,
        )

    def compile_all(self, thread_counts: Collection[int]) -> int:
        """Compile every graph for each of `thread_counts` now, not on requests' time, and
        time batches both ways (on this thread's count where it is one of them); how many
        graphs. Once: the counts of a later call are not compiled."""
        if self.graphs:
            return self.graphs
        own = torch.get_num_threads()
        counts = sorted(set(thread_counts))
        try:
            for threads in counts:
                torch.set_num_threads(threads)
                for batch in (1, 2):
                    for types in (False, True) if self.takes_types else (False,):
                        started = time.perf_counter()
                        self._compile(batch, types)
                        self.graphs += 1
                        log.info(
                            "compiled the pass of %s%s on %d threads in %.1f s",
                            "one input" if batch == 1 else "a batch",
                            " with segment ids" if types else "",
                            threads,
                            time.perf_counter() - started,
                        )
            self.thread_counts = frozenset(counts)
            torch.set_num_threads(own if own in self.thread_counts else counts[0])
            self.batches = self._runs_faster_compiled(SAMPLE_LENGTHS, "without padding")
            self.padded_batches = self._runs_faster_compiled(SAMPLE_PADDED_LENGTHS, "with padding")
            self.large_batches = self._runs_faster_compiled(
                self._large_lengths(), f"of {2 * MAX_TOKENS} padded tokens", LARGE_BATCH_MARGIN
            )
        finally:
            torch.set_num_threads(own)
        return self.graphs

    def _large_lengths(self) -> tuple[int, ...]:
        """The larger sample's input lengths (SAMPLE_LARGE_LENGTH)."""
        longest = min(SAMPLE_LARGE_LENGTH, self.network.config.max_positions)
        count = 2 * MAX_TOKENS // longest
        return tuple(longest - row * longest // (2 * count) for row in range(count))

    def _compile(self, batch: int, types: bool) -> None:
        """One graph, by a pass on inputs of its shape."""
        ids = torch.full((batch, SAMPLE_TOKENS), self.network.config.pad_token_id + 1)
        mask = torch.ones_like(ids)
        segments = torch.zeros_like(ids) if types else None
        prompts = torch.zeros(batch, dtype=torch.long)
        # Imported here: they import torch._dynamo, seconds that an eager server never spends.
        from torch._dynamo import config as dynamo
        from torch._dynamo.utils import counters
        from torch._inductor import config as inductor

        name = type(self.network).__name__
        graphs_before = counters["stats"]["unique_graphs"]
        try:
            with (
                inductor.patch(INDUCTOR),
                dynamo.patch(recompile_limit=RECOMPILE_LIMIT),
                torch.inference_mode(),
                warnings.catch_warnings(),
            ):
                # Inductor's own use of a torch API it deprecates: nothing to act on.
                warnings.filterwarnings("ignore", r"`torch\.jit\.", DeprecationWarning)
                self._compiled(ids, mask, segments, prompts)
        except Exception as error:  # dynamo's and inductor's own, of many kinds
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise CompileError(
                f"{name}'s pass cannot be compiled ({type(error).__name__}: {first_line}); "
                "serve it without compile"
            ) from error
        if counters["stats"]["unique_graphs"] != graphs_before + 1:
            raise CompileError(
                f"{name}'s pass made no graph of its own (torch.compile holds at most "
                f"{RECOMPILE_LIMIT} a model)"
            )

    def _runs_faster_compiled(
        self, lengths: Sequence[int], batch: str, margin: float = 1.0
    ) -> bool:
        """Whether a batch of inputs of these lengths ran compiled in at most `margin` times
        its eager time (the fastest of SAMPLE_TIMINGS passes each way); `batch` says which,
        for the log."""
        ids = torch.full((len(lengths), max(lengths)), self.network.config.pad_token_id)
        mask = torch.zeros_like(ids)
        for row, length in enumerate(lengths):
            ids[row, :length] = self.network.config.pad_token_id + 1
            mask[row, :length] = 1
        best = {"compiled": float("inf"), "eager": float("inf")}
        prompts = torch.zeros(len(lengths), dtype=torch.long)
        ways: dict[str, Callable[..., object]] = {
            "compiled": self._compiled,
            "eager": self.pooled_pass,
        }
        with torch.inference_mode():
            for _ in range(SAMPLE_TIMINGS):
                for name, way in ways.items():
                    started = time.perf_counter()
                    way(ids, mask, None, prompts)
                    best[name] = min(best[name], time.perf_counter() - started)
        faster = best["compiled"] <= margin * best["eager"]
        log.info(
            "a batch %s took %.1f ms compiled, %.1f ms eagerly: such batches run %s",
            batch,
            best["compiled"] * 1000,
            best["eager"] * 1000,
            "compiled" if faster else "eagerly",
        )
        return faster

    def fits(self, input_ids: Tensor, token_type_ids: Tensor | None, *, padded: bool) -> bool:
        """Whether a compiled graph takes this pass: two tokens or more (a graph assumes
        so), at most MAX_TOKENS in all unless `large_batches`, one unpadded input (whose graph
        attends with no mask) or a batch as `batches` and `padded_batches` say, segment ids
        only where there are graphs for them, on a thread count compiled for."""
        one = input_ids.shape[0] == 1
        return (
            input_ids.shape[1] >= 2
            and (self.large_batches or input_ids.numel() <= MAX_TOKENS)
            and ((self.padded_batches and not one) if padded else (self.batches or one))
            and (token_type_ids is None or self.takes_types)
            and torch.get_num_threads() in self.thread_counts
        )

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None,
        prompt_lengths: Tensor,
        *,
        padded: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """`PooledPass`'s pass on the compiled graph that fits, else eagerly. `padded`:
        whether the mask hides any token (known to the caller without reading it)."""
        arguments = (input_ids, attention_mask, token_type_ids, prompt_lengths)
        if not self.fits(input_ids, token_type_ids, padded=padded):
            eager: tuple[Tensor, Tensor | None] = self.pooled_pass(*arguments)
            return eager
        with torch.compiler.set_stance(self.stance):
            output: tuple[Tensor, Tensor | None] = self._compiled(*arguments)
        return output

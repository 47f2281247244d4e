"""This encoder against ONNX Runtime on a CPU: the same model, texts and threads.

ONNX Runtime is what text-embeddings-inference's CPU image, fastembed and Infinity's optimum
engine run. The default model (all-MiniLM-L6-v2) is exported here with `torch.onnx.export`
(transformers' BertModel, with mean pooling and normalisation in the graph), and quantized
with ONNX Runtime's own `quantize_dynamic` (its defaults: int8 weights per tensor) for int8.
Each engine tokenizes with the same `tokenizers` tokenizer, texts padded to the longest of
their batch. Engines: this encoder in float32, in bfloat16 (where the CPU computes it), in
int8 (`--dtype int8`), and ONNX Runtime in float32 and int8; with `--compile`, this encoder
compiled too (`--compile`, model/compiled.py), in float32, bfloat16 and int8, its graphs
compiled before any timing (the seconds that took printed).

Figures, tokenization included, over `--rounds` rounds:
- throughput: `--texts` sentences sorted by length, in batches of 32: all of an engine's
  texts over all the time its batches took;
- one sentence: the median latency of all its one-sentence calls;
- int8's cosine to its own float32 (mean and minimum) over the same sentences.
The engines take turns block by block (a few batches, or ten sentences), in an order rotated
each block: this machine's speed drifts from one second to the next, and whole rounds taken
in turn (seconds each) met different speeds. Each block of sentences starts with one untimed
call, which brings the engine's weights back into the caches the others' turns took: a
server answering sentences keeps one model's weights there.
Needs the bench extra (`pip install -e '.[bench]'`: onnxruntime, onnx, onnxscript); not in CI.
Usage: python -m bench.onnx_compare [--threads 2] [--rounds 3] [--texts 3000] [--compile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from bench.side_by_side import turns
from bench.workload import varied_sentences
from model import DEFAULT_MODEL_ID, Embedder
from model.compiled import MAX_TOKENS
from model.device import BF16_FLAGS, cpu_flags
from model.resolve import resolve_model_dir

RESULTS = Path(__file__).resolve().parent / "results" / "onnx_compare.json"
BATCH = 32
SINGLE_CALLS = 200
# An engine's turn: long enough that a switch between engines costs little against it, short
# enough that the machine's speed stays put over one turn of every engine.
BLOCK_BATCHES = 4
BLOCK_SENTENCES = 10
Encode = Callable[[list[str]], np.ndarray]


def ours(dtype: str, compile: bool = False) -> Encode:
    embedder = Embedder.load(DEFAULT_MODEL_ID, device="cpu", dtype=dtype, compile=compile)
    if compile:
        started = time.perf_counter()
        graphs = embedder.compile_passes()
        assert embedder.compiled is not None
        compiled = embedder.compiled  # where the start-up timings send batches
        print(
            f"ours {dtype} compiled: {graphs} graphs in {time.perf_counter() - started:.1f} s; "
            f"compiled batches: without padding {compiled.batches}, with padding "
            f"{compiled.padded_batches}, above {MAX_TOKENS} tokens {compiled.large_batches}"
        )
    return lambda texts: embedder.embed(texts).float().numpy()


class Pooled(torch.nn.Module):
    """transformers' BertModel, mean-pooled over the mask and normalised, as the model's
    sentence-transformers modules do: what the exported graph computes."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        from transformers import AutoModel

        self.bert = AutoModel.from_pretrained(folder).eval()

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=ids, attention_mask=mask, token_type_ids=types)[0]
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)


def export(folder: Path, target: Path) -> Path:
    sample = torch.ones((2, 8), dtype=torch.long)
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    dynamic = {name: {0: batch, 1: length} for name in ("ids", "mask", "types")}
    with torch.inference_mode(False), torch.no_grad():
        torch.onnx.export(
            Pooled(folder),
            (sample, sample, torch.zeros_like(sample)),
            str(target),
            input_names=["ids", "mask", "types"],
            output_names=["vectors"],
            dynamic_shapes=dynamic,
        )
    return target


def quantize(model: Path, target: Path) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(model), str(target), weight_type=QuantType.QInt8)
    return target


def session(model: Path, threads: int) -> Any:
    """An ONNX Runtime CPU session on `threads` threads, one node at a time (its default,
    sequential mode)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return onnxruntime.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


def onnx_runtime(model: Path, tokenizer_file: Path, threads: int, max_length: int) -> Encode:
    runs = session(model, threads)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.enable_truncation(max_length)
    tokenizer.enable_padding()

    def encode(texts: list[str]) -> np.ndarray:
        # One text through `encode`: `encode_batch` would hand it to a thread pool.
        single = len(texts) == 1
        encodings = [tokenizer.encode(texts[0])] if single else tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        feeds = {"ids": ids, "mask": mask, "types": np.zeros_like(ids)}
        vectors: np.ndarray = runs.run(None, feeds)[0]
        return vectors

    return encode


def engines(threads: int, work: Path, compile: bool) -> dict[str, Encode]:
    torch.set_num_threads(threads)
    folder = resolve_model_dir(DEFAULT_MODEL_ID, allow_download=False)
    max_length = Embedder.load(DEFAULT_MODEL_ID, device="cpu").info.max_input_tokens
    exported = export(folder, work / "model.onnx")
    quantized = quantize(exported, work / "model-int8.onnx")
    tokenizer = folder / "tokenizer.json"
    dtypes = ["float32"]
    if any(flag in cpu_flags() for flag in BF16_FLAGS):
        dtypes.append("bfloat16")
    found: dict[str, Encode] = {f"ours {dtype}": ours(dtype) for dtype in dtypes}
    if compile:
        found |= {f"ours {dtype} compiled": ours(dtype, compile=True) for dtype in dtypes}
    found["ours int8"] = ours("int8")
    if compile:
        found["ours int8 compiled"] = ours("int8", compile=True)
    found["onnxruntime float32"] = onnx_runtime(exported, tokenizer, threads, max_length)
    found["onnxruntime int8"] = onnx_runtime(quantized, tokenizer, threads, max_length)
    return found


def batches_seconds(encode: Encode, batches: Sequence[list[str]]) -> float:
    started = time.perf_counter()
    for batch in batches:
        encode(batch)
    return time.perf_counter() - started


def single_seconds(encode: Encode, texts: Sequence[str]) -> list[float]:
    """Each text's call alone, after one untimed call on the first."""
    encode([texts[0]])
    seconds = []
    for text in texts:
        started = time.perf_counter()
        encode([text])
        seconds.append(time.perf_counter() - started)
    return seconds


@dataclass
class Timings:
    """One engine's time over every round: its batches' and each single call's."""

    batch_seconds: float = 0.0
    texts: int = 0
    single_seconds: list[float] = field(default_factory=list)

    @property
    def texts_per_s(self) -> float:
        return self.texts / self.batch_seconds

    @property
    def single_p50_ms(self) -> float:
        return statistics.median(self.single_seconds) * 1000


def one_round(
    found: dict[str, Encode],
    batches: Sequence[list[str]],
    singles: Sequence[str],
    timings: dict[str, Timings],
) -> None:
    """Every batch and every single sentence through every engine, the engines taking turns
    block by block."""
    names = list(found)
    for turn, first in enumerate(range(0, len(batches), BLOCK_BATCHES)):
        block = batches[first : first + BLOCK_BATCHES]
        for name in turns(names, turn):
            timings[name].batch_seconds += batches_seconds(found[name], block)
            timings[name].texts += sum(map(len, block))
    for turn, first in enumerate(range(0, len(singles), BLOCK_SENTENCES)):
        sentences = singles[first : first + BLOCK_SENTENCES]
        for name in turns(names, turn):
            timings[name].single_seconds += single_seconds(found[name], sentences)


def cosines(approx: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    norms = np.linalg.norm(approx, axis=1) * np.linalg.norm(exact, axis=1)
    dots = (approx * exact).sum(1) / norms
    return float(dots.mean()), float(dots.min())


def embed_all(encode: Encode, batches: Sequence[list[str]]) -> np.ndarray:
    return np.concatenate([encode(batch) for batch in batches])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--texts", type=int, default=3000)
    parser.add_argument("--compile", action="store_true", help="compiled engines too")
    args = parser.parse_args()
    texts = sorted(varied_sentences(args.texts, seed=11), key=len)
    batches = [texts[i : i + BATCH] for i in range(0, len(texts), BATCH)]
    singles = varied_sentences(SINGLE_CALLS, seed=12)
    with tempfile.TemporaryDirectory() as work:
        found = engines(args.threads, Path(work), args.compile)
        for encode in found.values():  # warm-up: every shape once
            batches_seconds(encode, batches[:: max(1, len(batches) // 8)])
            single_seconds(encode, singles[:20])
        timings = {name: Timings() for name in found}
        for _ in range(args.rounds):
            one_round(found, batches, singles, timings)
        vectors = {name: embed_all(encode, batches) for name, encode in found.items()}
    report(args, timings, vectors)


def report(
    args: argparse.Namespace, timings: dict[str, Timings], vectors: dict[str, np.ndarray]
) -> None:
    rates = {name: timing.texts_per_s for name, timing in timings.items()}
    p50s = {name: timing.single_p50_ms for name, timing in timings.items()}
    base = "onnxruntime float32"
    print(f"all-MiniLM-L6-v2, CPU, {args.threads} threads, {args.texts} sentences sorted by length")
    print(f"in batches of {BATCH}; {args.rounds} rounds, the engines taking turns block by block")
    print(f"{'engine':<25}{'texts/s':>9}{'x ORT f32':>10}{'1 sentence p50':>16}{'x ORT f32':>10}")
    for name in timings:
        rate, p50 = rates[name], p50s[name]
        print(
            f"{name:<25}{rate:>9.0f}{rate / rates[base]:>10.2f}"
            f"{p50:>13.2f} ms{p50 / p50s[base]:>10.2f}"
        )
    figures: dict[str, Any] = {"threads": args.threads, "texts": args.texts, "engines": {}}
    for name in timings:
        figures["engines"][name] = {"texts_per_s": rates[name], "single_p50_ms": p50s[name]}
    int8s = [name for name in timings if name.endswith(("int8", "int8 compiled"))]
    for name in int8s:
        mean, low = cosines(vectors[name], vectors[f"{name.split()[0]} float32"])
        print(f"{name} cosine to its float32: mean {mean:.4f}, minimum {low:.4f}")
        figures["engines"][name]["cosine_to_float32"] = {"mean": mean, "min": low}
    for name in [name for name in int8s if name.startswith("ours")]:
        print(
            f"{name} / onnxruntime int8: throughput "
            f"{rates[name] / rates['onnxruntime int8']:.2f}x, one sentence p50 "
            f"{p50s[name] / p50s['onnxruntime int8']:.2f}x"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=2))
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()

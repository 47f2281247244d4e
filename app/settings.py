"""Every setting in one place: env vars with prefix EMBED_, or the same names as CLI flags."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from model import DEFAULT_MODEL_ID
from model.cpus import available_cpus
from model.info import Task

# What a model's name cannot hold: it is a path segment of its routes.
UNROUTABLE = re.compile(r"[\s?#%]")


# The batch wait on a CPU, where one full pass beats two half ones (Settings.batch_wait).
CPU_BATCH_WAIT_MS = 50.0
# The settings a models file may set per model; the others are the server's.
PER_MODEL_SETTINGS = frozenset(
    {
        "task",
        "dtype",
        "calibration_file",
        "max_input_tokens",
        "max_batch_tokens",
        "max_batch_inputs",
        "batch_wait_ms",
        "max_inputs_per_request",
        "max_input_chars",
        "max_request_tokens",
        "max_token_values",
        "max_attention_values",
        "max_chunks_per_input",
        "max_chunks_per_request",
        "request_timeout",
        "max_queue_wait",
        "auto_truncate",
        "cuda_graphs",
        "prepack",
        "compile",
    }
)


@dataclass(frozen=True)
class ServedModel:
    """One served model: the name requests choose it by, where it comes from, and the
    settings it has of its own (from a models file)."""

    name: str
    model_id: str  # a folder or an installed package's id
    own: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_entry(cls, entry: object, where: str) -> ServedModel:
        """One entry of a models file: {"name", "model_id", and per-model settings}."""
        if not isinstance(entry, dict) or not isinstance(entry.get("model_id"), str):
            raise ValueError(f"{where}: each model is an object with a model_id")
        own = {k: v for k, v in entry.items() if k not in ("name", "model_id")}
        if unknown := sorted(set(own) - PER_MODEL_SETTINGS):
            raise ValueError(
                f"{where}: {', '.join(unknown)} cannot be set per model; a model may set "
                f"{', '.join(sorted(PER_MODEL_SETTINGS))}"
            )
        name = entry.get("name", entry["model_id"])
        spec = cls.parse(f"{name}={entry['model_id']}")
        return cls(spec.name, spec.model_id, tuple(sorted(own.items())))

    @classmethod
    def parse(cls, spec: str) -> ServedModel:
        """`name=folder`, or an id alone (named by itself)."""
        name, sign, model_id = spec.partition("=")
        if not sign:
            name = model_id = spec
        if not name or not model_id:
            raise ValueError(f"{spec!r}: a named model is name=folder")
        if UNROUTABLE.search(name):
            raise ValueError(
                f"{name!r}: a model's name is part of its routes' paths (/models/{{name}}/), "
                "so it takes no whitespace, '?', '#' or '%'; name it with name=folder"
            )
        return cls(name, model_id)


class Settings(BaseSettings):
    """Built once at start-up and passed to the app factory; never read at import time."""

    # The served models, read from `model_id` or `models_file` when the settings are made.
    # A tuple: copies of these settings (model_copy, for_model) share it.
    _served: tuple[ServedModel, ...] = PrivateAttr(default=())

    model_config = SettingsConfigDict(
        env_prefix="EMBED_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_prog_name="embedding-server",
        extra="forbid",
    )

    model_id: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [DEFAULT_MODEL_ID],
        description=(
            "A local checkpoint folder, or the id of an installed model package; given more "
            "than once, one server serves them all, each under its name: `name=folder`, or "
            "the id as given. The first is the default model of the routes that name none."
        ),
    )
    models_file: Path | None = Field(
        None,
        description=(
            'A JSON list of the models to serve instead of `model_id`, each {"name", '
            '"model_id"} and any of the per-model settings (task, dtype, the limits, '
            "request_timeout, max_queue_wait, ...: docs/models.md); the rest are the server's."
        ),
    )
    memory_budget_mb: int | None = Field(
        None,
        ge=1,
        description=(
            "Refuse to start when the models' weights, at the dtype they will run in, need "
            "more than this many MiB; unset: no check."
        ),
    )
    task: Literal["auto"] | Task = Field(
        "auto",
        description=(
            "What the model serves: embeddings, classification/reranking (a cross-encoder), "
            "or sparse (SPLADE) embeddings; auto reads it from the model folder."
        ),
    )
    allow_download: bool = Field(
        False, description="Fetch unknown model ids with huggingface_hub (needs a network)."
    )
    calibration_file: Path | None = Field(
        None,
        description=(
            "Texts, one per line, whose vectors set the ranges of int8 and uint8 encodings "
            "(published in /info); unset: a built-in set of varied sentences."
        ),
    )
    devices: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["auto"],
        description=(
            "One engine per listed device: auto, cpu, cuda or cuda:N, comma-separated "
            "(cuda:0,cuda:1; cpu,cpu runs two engines sharing the CPU's cores). auto: the GPU "
            "if there is one, else two engines on the CPU where it has two or more cores."
        ),
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16", "int8"] = Field(
        "auto",
        description=(
            "auto: float16 on CUDA; on the CPU bfloat16 where the CPU computes it natively "
            "(AMX or AVX-512 BF16), else float32. int8 (CPU only, never chosen by auto): the "
            "encoder's linear layers in int8, activations quantized per call; faster, a little "
            "less accurate (docs/benchmarks.md)."
        ),
    )
    host: str = Field("0.0.0.0", description="Address to listen on.")
    port: int = Field(8080, ge=1, le=65535, description="Port to listen on.")
    grpc_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Also serve text-embeddings-inference's gRPC API (tei.v1, with server reflection) "
            "on this port, on the same address; unset: no gRPC."
        ),
    )
    placement: Literal["auto", "in-process", "split"] = Field(
        "auto",
        description=(
            "in-process: one process serves HTTP and runs the model; split: engine processes "
            "(one per device) behind front-end processes that never import torch. auto: "
            "split on a GPU or with several engines or front ends, else in-process."
        ),
    )
    frontends: int | None = Field(
        None,
        ge=1,
        le=64,
        description=(
            "HTTP front-end processes on the one port (split placement); default: half the "
            "CPUs (at most 8) on a GPU, else one per engine."
        ),
    )
    threads: int | None = Field(
        None,
        ge=1,
        le=256,
        description=(
            "Torch intra-op threads per engine; default: the CPUs the process may use "
            "(cgroup quota), divided among the engines."
        ),
    )
    max_batch_tokens: int = Field(
        16384, ge=1, description="Padded tokens (longest x count) one forward pass may hold."
    )
    max_batch_inputs: int = Field(64, ge=1, description="Inputs one forward pass may hold.")
    batch_wait_ms: float | None = Field(
        None,
        ge=0,
        le=1000,
        description=(
            "Most milliseconds the worker keeps waiting for a fuller batch while inputs keep "
            "arriving (it stops after 2 ms without one): throughput against latency under load. "
            f"Default: {CPU_BATCH_WAIT_MS:g} on a CPU, 0 on a GPU."
        ),
    )
    max_inputs_per_request: int = Field(
        2048, ge=1, description="Inputs one request may carry (more: 413); OpenAI's own limit."
    )
    max_input_chars: int = Field(
        200_000, ge=1, description="Characters one input may have (more: 413)."
    )
    max_request_tokens: int = Field(
        300_000,
        ge=1,
        description="Tokens one request may hold after truncation (more: 413); OpenAI's limit.",
    )
    max_chunks_per_input: int = Field(
        512, ge=1, description="Chunks one text may be cut into (more: 413)."
    )
    max_chunks_per_request: int = Field(
        2048, ge=1, description="Chunks one request may hold, over all its texts (more: 413)."
    )
    max_input_tokens: int | None = Field(
        None, ge=1, description="Tokens per input; default and ceiling: the model's own limit."
    )
    cuda_graphs: bool = Field(
        True,
        description=(
            "On a GPU, run embedding batches of up to 4,096 padded tokens as CUDA graphs "
            "captured at start-up (one replay instead of a launch per kernel); off: eagerly."
        ),
    )
    prepack: bool = Field(
        True,
        description=(
            "On a CPU, lay the encoder's linear weights out once for their kernel (MKL or "
            "oneDNN) at start-up (small batches faster; docs/benchmarks.md), each engine its "
            "own copy; off: torch's "
            "matmul on the checkpoint layout, and engines on one CPU share every weight."
        ),
    )
    compile: bool = Field(
        False,
        description=(
            "On a CPU, in float32, bfloat16 or int8, compile the encoder's passes with "
            "torch.compile (inductor) at start-up: a single input a sixth to a fifth faster in "
            "one process, int8's a quarter to a third, its activations quantized per token "
            "(docs/benchmarks.md), for tens of seconds more to start and hundreds of MiB more "
            "per engine; needs a C++ compiler (g++). A pass that keeps attention maps runs "
            "eagerly."
        ),
    )
    auto_truncate: bool = Field(
        True, description="Truncate long inputs when a request does not say (else 422)."
    )
    request_timeout: float = Field(
        30.0,
        gt=0,
        description=(
            "Seconds a request may wait for its results before 504; the queue admits work "
            "only while it is estimated to finish within this time (else 429)."
        ),
    )
    max_queue_wait: float = Field(
        10.0,
        gt=0,
        description=(
            "Seconds of work (estimated) a request may find queued ahead of it; past that, "
            "429. Bounds the latency of accepted requests under overload, and how long the "
            "backlog takes to clear once the load drops."
        ),
    )
    body_timeout: float = Field(
        30.0, gt=0, description="Seconds a client may take to send its body (else 408)."
    )
    max_concurrent_requests: int = Field(
        512,
        ge=1,
        description=(
            "Requests in progress (probes and metrics aside) before new ones get a fast 429."
        ),
    )
    max_connections: int = Field(
        2048,
        ge=1,
        description="Open connections before new requests, probes included, get uvicorn's 503.",
    )
    payload_limit: int = Field(2_000_000, ge=1024, description="Largest request body in bytes.")
    api_key: SecretStr | None = Field(
        None, description="If set, inference and /info need 'Authorization: Bearer <key>'."
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Origins allowed by CORS (none: CORS off)."
    )
    max_attention_values: int = Field(
        4_000_000,
        ge=1,
        description=(
            "Most attention-map values (layers x heads x T x T) one request may ask for, and "
            "one batch may compute."
        ),
    )
    max_token_values: int = Field(
        4_000_000,
        ge=1,
        description="Most per-token embedding values (tokens x hidden size) one request gets.",
    )
    drain_delay: float = Field(
        0.0,
        ge=0,
        description=(
            "Seconds after SIGTERM during which /health is 503 but requests are still accepted, "
            "so that a load balancer's health checks move traffic away before any refusal."
        ),
    )
    shutdown_grace: float = Field(
        30.0, ge=0, description="Seconds accepted requests get to finish after SIGTERM."
    )
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info")
    access_log: bool = Field(False, description="Log every request (costs throughput).")

    def models(self) -> tuple[ServedModel, ...]:
        """The served models, in order, each with its name (read once, when validated)."""
        return self._served

    def _read_models_file(self, path: Path) -> list[ServedModel]:
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"models_file {path}: {exc}") from exc
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"models_file {path}: a non-empty JSON list of models")
        return [
            ServedModel.from_entry(entry, f"models_file {path}, model {index}")
            for index, entry in enumerate(entries)
        ]

    def for_model(self, served: ServedModel) -> Settings:
        """These settings with the model's own (validated as the server's are)."""
        if not served.own:
            return self
        own = dict(served.own)
        server = self.model_dump(exclude={"model_id", "models_file"})
        checked = type(self).model_validate({**server, **own})
        return self.model_copy(update={key: getattr(checked, key) for key in own})

    def engine_count(self) -> int:
        """Engines in all: one per device for each model."""
        return len(self.devices) * len(self.models())

    def engine_threads(self) -> int:
        """Torch threads per engine: `threads`, or the CPUs this process may use over the
        engines (at least one)."""
        return self.threads or max(1, available_cpus() // self.engine_count())

    def batch_wait(self, device: str) -> float:
        """Seconds an engine on `device` may wait for a fuller batch. On a CPU a pass's time
        grows with its inputs, and one full pass beats two half ones; on a GPU a small
        model's pass costs about the same at any small batch, so waiting only idles the
        device while clients come back (measured: docs/benchmarks.md)."""
        if self.batch_wait_ms is not None:
            return self.batch_wait_ms / 1000
        return 0.0 if device.startswith("cuda") else CPU_BATCH_WAIT_MS / 1000

    def on_gpu(self) -> bool:
        return any(device.startswith("cuda") for device in self.devices)

    def split(self) -> bool:
        """Whether engines run in processes of their own, behind front-end processes."""
        if self.placement != "auto":
            return self.placement == "split"
        return self.on_gpu() or len(self.devices) > 1 or (self.frontends or 1) > 1

    def frontend_count(self) -> int:
        """On a GPU, half the CPUs (at most 8): the device outruns one event loop many times
        over. On a CPU, one per engine (docs/benchmarks.md)."""
        if self.frontends is not None:
            return self.frontends
        return min(8, max(1, available_cpus() // 2)) if self.on_gpu() else len(self.devices)

    def placed_on(self, found: list[str]) -> Settings:
        """These settings with `devices` as found on this machine. `auto` that finds the CPU
        runs two engines on it, each on its share of the cores, where the process may use two
        or more CPUs (measured best at every load on two cores, docs/benchmarks.md); one where
        `threads` leaves no room for two, or one process is asked for."""
        devices = found
        if self.devices == ["auto"] and found == ["cpu"] and len(self.models()) == 1:
            cpus = available_cpus()
            room = cpus >= 2 and (self.threads is None or 2 * self.threads <= cpus)
            if room and self.placement != "in-process":
                devices = ["cpu", "cpu"]
        return self.model_copy(update={"devices": devices})

    def cpu_oversubscription(self) -> str | None:
        """Why the torch threads asked for would fight over the CPUs, if they would. Each
        pass's threads meet at a barrier after every parallel region, so one descheduled
        thread holds up the rest (docs/architecture.md)."""
        cpus, threads = available_cpus(), self.engine_threads()
        engines = self.engine_count()
        if threads * engines <= cpus:
            return None
        return (
            f"{engines} engine(s) x {threads} torch threads is more than the {cpus} "
            f"CPUs this process may use: forward passes will stall each other; leave "
            f"`threads` unset or keep engines x threads <= {cpus}"
        )

    @model_validator(mode="after")
    def _one_process_runs_one_engine(self) -> Settings:
        if self.placement == "in-process" and (len(self.devices) > 1 or (self.frontends or 1) > 1):
            raise ValueError(
                "placement in-process runs one engine behind one front end: name one device "
                "and no more front ends, or choose placement split"
            )
        return self

    @model_validator(mode="after")
    def _read_models(self) -> Settings:
        """The served models, from `model_id` or `models_file`, named apart, each with its
        own settings checked now rather than when it loads."""
        if self.models_file is None:
            served = [ServedModel.parse(spec) for spec in self.model_id]
        elif "model_id" in self.model_fields_set:
            raise ValueError("name the models with model_id or in models_file, not both")
        else:
            served = self._read_models_file(self.models_file)
        names = [each.name for each in served]
        if len(set(names)) < len(names):
            how = "with name=folder" if self.models_file is None else 'by their "name"'
            raise ValueError(f"two models have one name: {names}; name them apart {how}")
        self._served = tuple(served)
        for each in served:
            try:
                self.for_model(each)
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
                )
                raise ValueError(f"model {each.name}: {problems}") from exc
        return self

    @field_validator("model_id", mode="before")
    @classmethod
    def _list_models(cls, value: object) -> object:
        # A string: the flag given once or more (which the CLI joins with commas), or
        # EMBED_MODEL_ID as ids with commas or as a JSON list.
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                return json.loads(value)
            return [spec.strip() for spec in value.split(",") if spec.strip()]
        return value

    @field_validator("model_id")
    @classmethod
    def _check_models(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("name at least one model")
        return value

    @field_validator("devices", mode="before")
    @classmethod
    def _split_devices(cls, value: object) -> object:
        if isinstance(value, str):
            return [device.strip() for device in value.split(",") if device.strip()]
        return value

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("name at least one device")
        for device in value:
            if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
                raise ValueError(f"{device!r} is not a device (auto, cpu, cuda or cuda:N)")
        if "auto" in value and len(value) > 1:
            raise ValueError("auto stands alone: list the devices instead")
        return value

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: object) -> object:
        # Allow EMBED_CORS_ORIGINS=https://a,https://b as well as a JSON list.
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                return json.loads(value)
            return [origin.strip() for origin in value.split(",") if origin.strip()]
        return value

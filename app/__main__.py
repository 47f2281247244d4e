"""`python -m app` / `embedding-server`: settings from flags and EMBED_* variables, then one
process that serves HTTP and runs the model (app/server.py), or engine and front-end
processes under a supervisor (app/supervisor.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pydantic import ValidationError
from pydantic_settings import CliApp

from app.logs import configure_logging
from app.memory import limit_arenas
from app.settings import Settings
from app.supervisor import resolve_devices_in_child, supervise
from app.tokenization import tokenize_on_calling_threads
from model import ModelError
from model.footprint import weight_bytes
from model.resolve import resolve_model_dir


def load_settings(argv: list[str] | None) -> Settings:
    try:
        return CliApp.run(Settings, cli_args=argv if argv is not None else sys.argv[1:])
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}" for error in exc.errors()
        )
        sys.exit(f"embedding-server: invalid setting: {problems}")


# Device files that GPU drivers make (NVIDIA's, ROCm's, WSL's): where none exists, CUDA
# cannot be available, and `auto` is the CPU without asking torch.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def placed(settings: Settings) -> Settings:
    """The settings on the devices this machine has (`auto` found, and on a CPU as many
    engines as measure best, see Settings.placed_on); ConfigError unless every device can
    work. Asked of a child process, so that a supervisor never imports torch, unless no GPU
    driver is there: the child's import of torch is seconds of every start."""
    if all(device == "cpu" for device in settings.devices):
        return settings
    if settings.devices == ["auto"] and not any(map(os.path.exists, GPU_DEVICE_FILES)):
        return settings.placed_on(["cpu"])
    return settings.placed_on(resolve_devices_in_child(settings.devices))


def model_folders(settings: Settings) -> dict[str, Path]:
    """Each served model's folder; a ModelError names the model that has none."""
    folders = {}
    for served in settings.models():
        try:
            folders[served.name] = resolve_model_dir(
                served.model_id, allow_download=settings.allow_download
            )
        except ModelError as exc:
            raise type(exc)(f"model {served.name}: {exc}") from exc
    return folders


def over_budget(settings: Settings, folders: dict[str, Path]) -> str | None:
    """Why the models cannot fit `memory_budget_mb`, if they cannot: their weights at the
    dtype they run in, once per GPU they are on and, on the CPU, once per engine where each
    lays its linear layers out for its kernel (`prepack`, and int8 served eagerly), else once
    for all (which share one copy); compiled (`compile`), once more for the checkpoint's
    layout a prepacked layer keeps (shared) and once for each graph inductor compiles (one
    input and batches, on each thread count a pass may run on; twice that for a model that
    reads pairs, which is not known before it loads), but not in int8, whose graphs share its
    layers' int8 weights. An estimate: the engines' working memory and inductor's own are not
    counted."""
    if settings.memory_budget_mb is None:
        return None
    gpus = sum(1 for device in settings.devices if device.startswith("cuda"))
    cpu_engines = len(settings.devices) - gpus
    mib = {}
    for served in settings.models():
        own = settings.for_model(served)
        shared = min(cpu_engines, 1)
        # Each engine's own copy where its layers are packed for their kernel: prepacked
        # float layers, and int8's fbgemm ones; a compiled int8 model's are plain, shared.
        int8 = own.dtype == "int8"
        own_copies = not own.compile if int8 else own.prepack
        cpu_copies = cpu_engines if own_copies else shared
        if own.compile and not int8:
            thread_counts = 2 if cpu_engines > 1 else 1  # a lone pass takes every core
            kept = shared if own.prepack else 0
            cpu_copies += kept + cpu_engines * 2 * thread_counts
        size = weight_bytes(folders[served.name], own.dtype)
        mib[served.name] = (gpus + cpu_copies) * size / 2**20
    if sum(mib.values()) <= settings.memory_budget_mb:
        return None
    each = ", ".join(f"{name}: {size:.0f} MiB" for name, size in mib.items())
    return (
        f"the models' weights need about {sum(mib.values()):.0f} MiB ({each}), more than "
        f"memory_budget_mb {settings.memory_budget_mb}"
    )


def main(argv: list[str] | None = None) -> None:
    # Before any thread starts: a malloc arena per thread is what makes RSS creep.
    limit_arenas()
    tokenize_on_calling_threads()  # inherited by every front end
    settings = load_settings(argv)
    configure_logging(settings.log_level, settings.log_format)
    try:
        # Fail before binding the port when a model id or the device cannot work.
        folders = model_folders(settings)
        settings = placed(settings)
    except ModelError as exc:
        sys.exit(f"embedding-server: {exc}")
    if (refusal := over_budget(settings, folders)) is not None:
        sys.exit(f"embedding-server: {refusal}")
    if settings.split():
        sys.exit(supervise(settings))
    from app.server import serve  # with torch: only a server that runs the model needs it

    sys.exit(serve(settings))


if __name__ == "__main__":
    main()

"""What runs on every rank for one trial: build the step, time it, read the peak memory."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import statistics
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..config import CPConfig
from ..context import context_parallel
from ..errors import CPTuneError
from ..workload import Workload
from .memory import current_usage, read_peak, reset_peak
from .settings import MeasureSettings
from .steps import ProxyStep, build_model_step, build_user_step


def rank_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _release_free_memory() -> None:
    """Free what earlier trials left in reference cycles (a model under FSDP2 is one), then give freed heap back
    to the OS, so that VmHWM starts from what is really in use. Uncollected, the previous trial's model was freed
    during the next trial, which reused its pages: that trial's rise, so its peak, came out too low."""
    held = {signal.SIGINT, signal.SIGTERM}
    main = threading.current_thread() is threading.main_thread()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held) if main else None
    try:  # signals wait: a search's stop raised inside a weakref callback the collection runs would be dropped
        gc.collect()
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_on_rank(workload: Workload, config: CPConfig, settings: MeasureSettings) -> dict:
    """Time ``workload``'s step under ``config`` on this rank. Collective: call on every rank."""
    device = rank_device()
    if workload.compile or workload.step or workload.model:
        # Compile afresh, as the training job will: the ranks have compiled other configs' steps,
        # and past torch.compile's recompile limit (8) the code would silently run eagerly.
        torch.compiler.reset()
    _release_free_memory()
    baseline = current_usage(device)
    reset_peak(device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = config.parallel_dims(world)
    cp = dims.cp
    docs, window = workload.document_ids(), workload.window_pair
    if workload.ac == "auto":
        raise CPTuneError("a trial runs one activation checkpointing mode; ac='auto' is the search's dimension")
    if workload.step or workload.model:
        if not dims.is_dp_cp and not workload.model:
            raise CPTuneError(f"{config.label()}: only a --model step is split by tensor parallelism")
        step, buffers, seq_dims = build_model_step(workload, device, dims) if workload.model else \
            build_user_step(workload, device)
        buffers, seq_dims = list(buffers), list(seq_dims)

        def run() -> None:
            with context_parallel(buffers=buffers, seq_dims=seq_dims, config=config, causal=workload.causal,
                                  documents=docs, window=window):
                step(*buffers)
    else:
        proxy = ProxyStep(workload, device, cp)
        # packed or windowed: the sequence's positions as a buffer, so the block knows its length and layout
        masked = docs is not None or window is not None
        positions = [torch.arange(workload.seq_len, device=device).unsqueeze(0)] if masked else []

        def run() -> None:
            with context_parallel(buffers=positions or None, seq_dims=[1] if positions else None, config=config,
                                  causal=workload.causal, documents=docs, window=window):
                proxy()

    for i in range(settings.warmup):
        t0 = time.perf_counter()
        run()
        _sync(device)
        if i == 0:
            first_step = time.perf_counter() - t0  # with torch.compile: includes compiling
    times: list[float] = []
    start = time.perf_counter()
    while True:
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64,
                               device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        n = len(times)
        if n >= settings.max_repeats or (n >= settings.min_repeats and elapsed.item() >= settings.min_seconds):
            break
    _sync(device)
    return {"rank": dist.get_rank(), "times": times, "peak": read_peak(device), "baseline": baseline,
            "pid": os.getpid(), "first_step": first_step if settings.warmup else None}


def check_on_rank(workload: Workload) -> str | None:
    """The first-step check of a ``--model`` workload (:func:`.steps.check_model`) on this rank: its report line
    (None: a proven family), or the refusal (raised). Collective: call on every rank."""
    from .steps import check_model

    _release_free_memory()
    try:
        return check_model(workload, rank_device())
    finally:
        _release_free_memory()


def baseline_on_rank(mesh_shapes: Sequence[tuple[int, int]] = ()) -> int:
    """Memory a rank uses before any trial: the interpreter, torch, the process groups of every
    mesh in the search, and the attention kernels' code and thread pools, paged in by a tiny
    forward + backward under each mesh shape."""
    device = rank_device()
    tiny = Workload(seq_len=64, heads=2, head_dim=16)
    for dp, cp in [(dist.get_world_size(), 1), *mesh_shapes]:
        proxy = ProxyStep(tiny, device, cp)
        with context_parallel(config=CPConfig(mesh_shape=(dp, cp)), causal=True):
            proxy()
        del proxy
    _release_free_memory()
    return current_usage(device)


def tokens_per_step(workload: Workload, config: CPConfig) -> int:
    """Tokens the whole world processes in one step: dp replicas x batch x sequence length."""
    return config.parallel_dims().dp * workload.batch * workload.seq_len


def summarize(per_rank: Sequence[dict], workload: Workload, config: CPConfig, base: int | None = None) -> dict:
    """Step time = median over repeats of the slowest rank; tokens/s for the whole world.

    Peak memory per rank: with ``base`` (what a fresh rank holds, from :func:`baseline_on_rank`),
    ``base`` + the rise of the peak over the rank's memory at the start of the trial, so a
    config's figure does not depend on what ran before it in the same process (allocator
    caches, communication buffers); without it, the absolute peak.
    """
    peaks = [r["peak"] if base is None else base + r["peak"] - r["baseline"] for r in per_rank]
    steps = [max(r["times"][i] for r in per_rank) for i in range(min(len(r["times"]) for r in per_rank))]
    step_time = statistics.median(steps)
    firsts = [r.get("first_step") for r in per_rank]
    tokens = tokens_per_step(workload, config)
    return {
        "step_time_s": step_time,
        "tokens_per_s": tokens / step_time,
        "peak_bytes": max(peaks),
        "peak_per_rank": peaks,
        "repeats": len(steps),
        "step_times": steps,
        "spread": (max(steps) - min(steps)) / step_time if steps else 0.0,
        **({"compile_s": max(0.0, max(firsts) - step_time)} if workload.compile and all(firsts) else {}),
        # the warm-up step's figure (slowest rank): a timed step slower than it was slowed by something else
        **({"warmup_tokens_per_s": tokens / max(firsts)} if all(firsts) else {}),
    }

"""Hardware profiles: what one accelerator and its links can do, as data files with their sources.

A profile gives vendors' published peaks (dense TFLOP/s per dtype, memory size and bandwidth,
NVLink and network bandwidth per GPU, one direction) and the *efficiencies* that turn peaks into
what training reaches (the share of the GEMM peak, of it for attention kernels, of memory and link
bandwidth, and a fixed cost per layer pass). Peaks come from the vendor; efficiencies are nominal
until calibrated (:mod:`._calibrate`), and each profile says what calibrated it.
"""

from __future__ import annotations

from typing import Literal

import json
from pathlib import Path

from pydantic import Field, field_validator

from ..config import StrictModel
from .._files import read_json_object
from ..errors import Problem, ProblemError, ValidationError
from ..sizes import parse_size

PROFILES = Path(__file__).with_name("profiles")


class Link(StrictModel):
    """One GPU's share of a link, one direction."""

    GBps: float = Field(gt=0, json_schema_extra={"fix": "give the link's GB/s per GPU, one direction"})
    latency_us: float = Field(10.0, ge=0, json_schema_extra={"fix": "give a latency in microseconds"})


class Efficiency(StrictModel):
    """Shares of the peaks reached in training, and the fixed cost of one layer's pass (launches, Python)."""

    gemm: float = Field(0.6, gt=0, le=10, json_schema_extra={"fix": "give a share of the peak, e.g. 0.6"})
    attention: float = Field(0.33, gt=0, le=10, json_schema_extra={"fix": "give a share of the peak, e.g. 0.33"})
    memory: float = Field(0.7, gt=0, le=10, json_schema_extra={"fix": "give a share of memory bandwidth"})
    communication: float = Field(0.75, gt=0, le=10, json_schema_extra={"fix": "give a share of link bandwidth"})
    layer_overhead_ms: float = Field(0.0, ge=0, json_schema_extra={"fix": "give milliseconds per layer pass"})


class Hardware(StrictModel):
    """One accelerator type (or this CPU) and its links: read with :func:`load_hardware`."""

    name: str
    device_type: Literal["cuda", "cpu"] = Field("cuda", json_schema_extra={
        "fix": "give device_type \"cuda\" (a GPU, nccl) or \"cpu\" (gloo)"})
    """What a recipe planned for it runs on: its ``device_type`` (and ``backend``: nccl, or gloo for the CPU)."""
    sources: list[str] = Field(default_factory=list)
    """Where each peak comes from (vendor datasheets), or how it was measured."""
    peak_tflops: dict[str, float] = Field(json_schema_extra={
        "fix": "give dense TFLOP/s per dtype, e.g. {\"bfloat16\": 989.5, \"float32\": 67}"})
    memory: str | int = Field(json_schema_extra={"fix": "give the memory per device, e.g. 80GiB"})
    memory_GBps: float = Field(gt=0, json_schema_extra={"fix": "give memory bandwidth in GB/s"})
    intra_node: Link
    inter_node: Link
    efficiency: Efficiency = Field(default_factory=Efficiency)
    baseline: str | int = Field("3GiB", json_schema_extra={
        "fix": "give what a process holds before training (CUDA context, NCCL buffers), e.g. 3GiB"})
    calibrated_by: list[str] = Field(default_factory=list)
    """What set the efficiencies: nominal, a benchmark run, a probe of this machine, a study's trials."""

    @field_validator("memory", "baseline")
    @classmethod
    def _size(cls, value: str | int, info) -> str | int:
        try:
            parse_size(value, info.field_name)
        except ValidationError as exc:
            raise ProblemError(exc.problems[0]) from None
        return value

    @property
    def memory_bytes(self) -> int:
        return parse_size(self.memory, "memory")

    @property
    def baseline_bytes(self) -> int:
        return parse_size(self.baseline, "baseline")

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (float32 falls back to the lowest listed)."""
        if dtype in self.peak_tflops:
            return self.peak_tflops[dtype] * 1e12
        return min(self.peak_tflops.values()) * 1e12

    def save(self, path: str | Path) -> Path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".partial")
        tmp.write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")
        tmp.replace(target)  # whole or not at all
        return target


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.json"))


def load_hardware(name_or_path: str | Path, argument: str = "hardware") -> Hardware:
    """A shipped profile by name (``h100``, ``h200``, ``a100``, ``b200``, ``cpu``) or a JSON file of the same form."""
    text = str(name_or_path)
    path = PROFILES / f"{text.lower()}.json" if text.lower() in profile_names() else Path(text).expanduser()
    if not path.is_file():
        raise ValidationError([Problem(argument, f"{text!r} is neither a shipped profile nor a file",
                                       f"use one of {', '.join(profile_names())}, or a JSON file like "
                                       f"{PROFILES / 'h100.json'}")])
    data = read_json_object(path, argument, f"write a profile like {PROFILES / 'h100.json'}")
    try:
        return Hardware(**data)
    except ValidationError as exc:
        raise ValidationError([Problem(f"{argument} {path.name}: {p.argument}", p.message, p.fix)
                               for p in exc.problems]) from None


def for_device(device_type: str, device_name: str) -> Hardware:
    """The shipped profile that best describes the device a search runs on (the search calibrates it)."""
    if device_type != "cuda":
        return load_hardware("cpu")
    name = device_name.upper()
    for key in ("B200", "H200", "H100", "A100"):
        if key in name:
            return load_hardware(key.lower())
    return load_hardware("h100").model_copy(update={"name": f"{device_name} (H100 figures, uncalibrated)"})

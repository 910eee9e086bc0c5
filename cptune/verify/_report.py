"""The first-step check's verdict: what is compared, what is allowed of it, the report and the refusal (the package's
docstring says what the check is)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import Problem, ValidationError

SKETCH = 8
"""Random directions each token's vector is projected on, for comparing per-position tensors."""
TOLERANCE = {torch.float32: (1e-3, 1e-3), torch.float64: (1e-9, 1e-9), torch.bfloat16: (2e-2, 0.3),
             torch.float16: (5e-3, 0.1)}
"""The least relative error allowed, by the dtype the model computes in: (what each position holds, and the loss;
a parameter's gradient). In half precision a parameter's gradient, a sum over every token that nearly cancels (a
norm's bias, a router), comes out tens of percent apart from another order of the same sum, which no perturbation of
the activations reproduces; what a family that reads its shard as the whole sequence does is larger still (a
gradient missing, or its sign), and shows in the activations first."""
NOISE = {torch.float32: 2.0 ** -22, torch.float64: 2.0 ** -51, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
"""What the check's third run adds to each element of each layer's output and of the gradient flowing into it,
relative to the element: a unit of the dtype's last place, what another order of the same sums changes."""
MARGIN = 8.0
"""A measure is exact within this many times what :data:`NOISE` alone moves it in one process (its floor): a mixture of
experts in bfloat16 routes some tokens to other experts for a rounding, and its router's gradient moves by tens of
percent, as it does between two runs of one process. ``python -m benchmarks.check`` measures rounding and failures on
the support matrix's families against it."""
TOKENS = 4096
"""The most tokens the check runs by default (``tokens=`` / ``--check-tokens`` raise it)."""
MIN_TOKENS = 128
_REACH = re.compile(r"(window|chunk_size|compress_ratio|floor_scale|topk|budget)$")
"""Config fields that say how far a layer reaches along the sequence (a window, a chunk, a compressed block, a
temperature's step, how many keys a sparse attention picks): the check's sequence covers twice the largest."""


@dataclass
class Measure:
    """One thing compared: its relative error split against whole, and what is allowed of it (its floor's
    :data:`MARGIN` times, at least the dtype's :data:`TOLERANCE`)."""

    what: str
    error: float
    allowed: float

    @property
    def exact(self) -> bool:
        return self.error <= self.allowed


@dataclass
class CheckReport:
    """What one check measured, and its verdict: the loss, the final output, the input gradient, the worst parameter
    gradient and the first layer whose output differs (or the worst one), each a :class:`Measure`."""

    subject: str
    layout: str
    tokens: int
    packed: bool
    dtype: str
    measures: dict[str, Measure] = field(default_factory=dict)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(m.exact for m in self.measures.values())

    @property
    def worst(self) -> float:
        """The largest error over what it is allowed."""
        return max((m.error / m.allowed for m in self.measures.values()), default=0.0)

    def line(self) -> str:
        shown = "; ".join(f"{key} {m.error:.1e} (allowed {m.allowed:.0e})" for key, m in self.measures.items())
        return (f"cptune first-step check of {self.subject} under {self.layout} ({self.tokens} tokens"
                f"{', packed' if self.packed else ''}, {self.dtype}): {'exact' if self.passed else 'WRONG'}; "
                f"{shown}; {self.seconds:.2f} s" + "".join(f"; {n}" for n in self.notes))

    def problem(self, argument: str, fix: str) -> Problem:
        order = ["layers", "outputs", "input gradient", "parameter gradients", "loss"]  # where it starts first
        failed = sorted((k for k, m in self.measures.items() if not m.exact),
                        key=lambda k: order.index(k) if k in order else len(order))
        what = "; ".join(f"{self.measures[k].what} by {self.measures[k].error:.1e} (allowed "
                         f"{self.measures[k].allowed:.0e})" for k in failed)
        return Problem(argument, f"{self.subject} fails cptune's first-step check under {self.layout} ({self.tokens} "
                       f"tokens{', packed' if self.packed else ''}, {self.dtype}): split over the CP ranks it differs "
                       f"from one process in {what} (relative errors; a run of one process with its rounding "
                       "perturbed moves them far less). Training it so would be silently wrong", fix)


def judge(errors: Mapping[str, float], floors: Mapping[str, float], dtype: torch.dtype) -> dict[str, float]:
    """What is allowed of each measure: :data:`MARGIN` times its floor, at least the dtype's :data:`TOLERANCE` (a
    'param ...' measure's second one)."""
    positions, params = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    return {key: max(params if key.startswith("param ") else positions, MARGIN * floors.get(key, 0.0))
            for key in errors}


def layout_label(config, dims, causal: bool = True) -> str:
    """'dp1·cp2 alltoall lb default': the configuration as it runs on ``dims`` (load balancing decided)."""
    return config.model_copy(update={"mesh_shape": dims.shape,
                                     "load_balance": config.load_balance_for(causal, dims.cp)}).label()


def check_tokens(reaches: Mapping[str, int], granule: int, seq_len: int | None, tokens: int | None
                 ) -> tuple[int, list[str]]:
    """The check's sequence length, a multiple of ``granule``: ``tokens`` when given, else twice the longest reach the
    config states (at least :data:`MIN_TOKENS`), within :data:`TOKENS` and the user's own ``seq_len``; and what it
    leaves out."""
    field_name, reach = max(reaches.items(), key=lambda kv: kv[1], default=("", 0))
    want = tokens or max(2 * reach, MIN_TOKENS)
    want = -(-want // granule) * granule  # up to a multiple of the granule
    cap = min(TOKENS, seq_len) if seq_len and not tokens else (TOKENS if not tokens else want)
    length = max(granule, min(want, cap // granule * granule))
    notes = [f"{field_name} {reach} reaches beyond the check's {length} tokens"] if 2 * reach > length and \
        reach < (seq_len or math.inf) else []
    return length, notes


def reaches(config) -> dict[str, int]:
    """The fields of a transformers config (its text config's) that say how far a layer reaches (:data:`_REACH`)."""
    text = getattr(config, "get_text_config", lambda: config)()
    values = text.to_dict() if hasattr(text, "to_dict") else dict(vars(text))
    return {k: v for k, v in values.items() if _REACH.search(k) and not k.startswith("num_")
            and isinstance(v, int) and not isinstance(v, bool) and v > 0}


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.float().norm().item()
    diff = (got.float() - want.float()).norm().item()
    return diff / scale if scale > 0 else diff


def assess(errors: dict[str, float], floors: dict[str, float], dtype: torch.dtype, labels: Mapping[str, str],
           layers: list[str]) -> dict[str, Measure]:
    """The report's measures from every rank's errors and floors (the most of each over the ranks): ``labels``' keys
    as they are, the worst 'param ...' by its error over what it is allowed, and the first 'layer ...' (in
    ``layers``' order) over what it is allowed, else the worst."""
    keys = sorted(errors)
    agreed = agree([errors[k] for k in keys] + [floors.get(k, 0.0) for k in keys])
    errors, floors = dict(zip(keys, agreed[:len(keys)])), dict(zip(keys, agreed[len(keys):]))
    allowed = judge(errors, floors, dtype)
    measures = {key: Measure(what, errors[key], allowed[key]) for key, what in labels.items() if key in errors}
    params = [k for k in keys if k.startswith("param ")]
    if params:
        worst = max(params, key=lambda k: errors[k] / allowed[k])
        measures["parameter gradients"] = Measure(f"the gradient of {worst[6:]}", errors[worst], allowed[worst])
    found = [f"layer {name}" for name in layers if f"layer {name}" in errors]
    if found:
        first = next((k for k in found if errors[k] > allowed[k]), max(found, key=lambda k: errors[k] / allowed[k]))
        measures["layers"] = Measure(f"the output of {first[6:]}" + (" first" if errors[first] > allowed[first]
                                                                     else ""), errors[first], allowed[first])
    return measures


def agree(values: list[float]) -> list[float]:
    """The most of each value over every rank, so every rank reaches the same verdict."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def where_raised(exc: BaseException, model: nn.Module) -> str:
    """The innermost module of ``model`` whose code raised ``exc``: 'model.layers.0.self_attn.indexer
    (DeepseekV32Indexer.forward, modeling_deepseek_v32.py:212)'."""
    names = {id(m): n for n, m in model.named_modules()}
    found, tb = "", exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            code = tb.tb_frame.f_code
            found = (f"{names[id(owner)] or type(owner).__name__} ({type(owner).__name__}.{code.co_name}, "
                     f"{code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno})")
        tb = tb.tb_next
    return found


def raised_problem(exc: BaseException, model: nn.Module, subject: str, layout: str, argument: str,
                   fix: str) -> ValidationError:
    """The refusal of a model whose code raised under cp although one process runs it."""
    where = where_raised(exc, model)
    return ValidationError([Problem(argument, f"{subject} fails cptune's first-step check under {layout}: one process "
                                    f"runs it, but split over the CP ranks its code raised {type(exc).__name__}: "
                                    f"{str(exc)[:200]}" + (f" in {where}" if where else "") + ". It reads something "
                                    "cptune splits (a mask, a shape, a position) as the whole sequence's", fix)])


def timed() -> Callable[[], float]:
    start = time.perf_counter()
    return lambda: time.perf_counter() - start

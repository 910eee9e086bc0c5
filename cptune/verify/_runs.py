"""The first-step check's runs: the blocks it opens (inside a block set aside, or on its own), the conditions of a fair
comparison (no dropout, the user's gradients and generators kept), the probes that sketch what each position holds,
the third run's perturbation, and the gradients as the optimizer sees them."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .. import _session, _torch_cp
from ..config import CPConfig
from ..experts import averaged
from ._report import NOISE, SKETCH

# -- the blocks the check runs in ---------------------------------------------------------------------------------
@contextlib.contextmanager
def set_aside(session: _session._Session):
    """``session`` not active for a while, its SDPA hook passing calls to torch's own SDPA and what it recorded of
    the forwards kept: what runs inside runs as one process would (cptune's first-step check, from inside a block)."""
    record = (session._record.since_backward, session._record.checkpointed)
    _session._ACTIVE.remove(session)
    session._route.paused = True
    try:
        yield
    finally:
        session._route.paused = False
        _session._ACTIVE.append(session)
        session._record.since_backward, session._record.checkpointed = record


@contextlib.contextmanager
def opened(config: CPConfig, causal: bool, mesh: DeviceMesh | None, buffers: Mapping[str, torch.Tensor],
           documents: torch.Tensor | None = None, window: Any = None, seq_dims: Mapping[str, int] | None = None):
    """A block of its own over ``buffers`` (each split along its ``seq_dims``, default 1, not in place), the active
    one while open: the first-step check's, which may open inside a block set aside (:func:`set_aside`). Yields the
    session; its ``shards`` in the order of ``buffers``, by ``plan.names``."""
    session = _session._Session(config, causal, None, documents, window)
    session.start(mesh, dict(buffers), dict(seq_dims) if seq_dims is not None else dict.fromkeys(buffers, 1), (),
                  inplace=False)
    try:
        yield session
    except BaseException:
        session.stop(failing=True)
        raise
    session.stop()


# -- the conditions of a fair comparison ------------------------------------------------------------------------
@contextlib.contextmanager
def quiet(model: nn.Module) -> Iterator[dict[str, torch.Tensor | None]]:
    """No dropout or router noise, the generators and the user's gradients as they were afterwards; yields the
    gradients set aside (each parameter's, by name)."""
    zeroed: list[tuple[object, str, float]] = []
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and value > 0 and ("dropout" in name or "jitter" in name or name == "p"
                                                           and isinstance(module, nn.modules.dropout._DropoutNd)):
                zeroed.append((module, name, value))
                setattr(module, name, 0.0)
    saved = {name: p.grad for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield saved
    finally:
        for module, name, value in zeroed:
            setattr(module, name, value)
        params = dict(model.named_parameters())
        for name, grad in saved.items():
            params[name].grad = grad


def take_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient (None ones left out), taken off the parameter."""
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad
            p.grad = None
    return grads


# -- what each position holds ---------------------------------------------------------------------------------
class Probes:
    """Hooks that keep a sketch of what each position holds: modules' outputs (``outputs``: name -> module),
    a module's input (``inputs``), and the gradient of a module's output (``grads``), in the order of the calls of
    one run (pieces along the sequence, e.g. one per document)."""

    def __init__(self, outputs: Mapping[str, nn.Module], inputs: Mapping[str, nn.Module],
                 grads: Mapping[str, nn.Module]) -> None:
        self.pieces: dict[str, dict[int, torch.Tensor]] = {}
        self.dtype: torch.dtype | None = None  # what the model computes in: the first hidden states seen
        self.length: int | None = None
        """The tokens of the call under way on this rank: a tensor of another length is not one a position each
        (tensor parallelism's sequence shards), and is not kept."""
        self._calls: dict[str, int] = {}
        self.names = [*outputs, *inputs, *grads]
        self._handles = []
        for name, module in outputs.items():
            self._handles.append(module.register_forward_hook(self._output_hook(name)))
        for name, module in inputs.items():
            self._handles.append(module.register_forward_pre_hook(self._input_hook(name)))
        for name, module in grads.items():
            self._handles.append(module.register_forward_hook(self._grad_hook(name)))

    def _index(self, name: str) -> int | None:
        if _torch_cp.in_backward():  # an activation checkpoint's recompute: seen already
            return None
        index = self._calls.get(name, 0)
        self._calls[name] = index + 1
        return index

    def _keep(self, name: str, index: int, t: torch.Tensor) -> None:
        if self.length is not None and t.shape[1] != self.length and not hasattr(t, "full_tensor"):
            return
        self.dtype = self.dtype or t.dtype
        self.pieces.setdefault(name, {})[index] = sketch(t)

    def _output_hook(self, name: str) -> Callable:
        @_torch_cp.not_compiled
        def hook(module, args, out):
            index = self._index(name)
            first = out[0] if isinstance(out, (tuple, list)) else out
            if index is not None and isinstance(first, torch.Tensor) and first.ndim == 3:
                self._keep(name, index, first.detach())
        return hook

    def _input_hook(self, name: str) -> Callable:
        @_torch_cp.not_compiled
        def hook(module, args):
            index = self._index(name)
            if index is not None and args and isinstance(args[0], torch.Tensor) and args[0].ndim == 3:
                self._keep(name, index, args[0].detach())
        return hook

    def _grad_hook(self, name: str) -> Callable:
        @_torch_cp.not_compiled
        def hook(module, args, out):
            index = self._index(name)
            if index is not None and isinstance(out, torch.Tensor) and out.requires_grad and out.ndim == 3:
                out.register_hook(lambda g: self._keep(name, index, g.detach()))
        return hook

    def take(self, calls: int = 1) -> dict[str, torch.Tensor]:
        """Each probe's pieces joined along the sequence (a probe kept at each of the run's ``calls`` only); cleared
        for the next run."""
        joined = {name: torch.cat([pieces[i] for i in sorted(pieces)], dim=1) for name, pieces in self.pieces.items()
                  if sorted(pieces) == list(range(calls))}
        self.pieces, self._calls = {}, {}
        return joined

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


_DIRECTIONS: dict[tuple[int, str], torch.Tensor] = {}


def sketch(t: torch.Tensor) -> torch.Tensor:
    """(B, L, :data:`SKETCH`) float32: each position's vector projected on fixed random directions (the same on every
    rank and run for a width)."""
    if hasattr(t, "full_tensor"):  # a DTensor (tensor parallelism): its whole value
        t = t.full_tensor()
    key = (t.shape[-1], str(t.device))
    if key not in _DIRECTIONS:
        gen = torch.Generator().manual_seed(t.shape[-1])
        _DIRECTIONS[key] = torch.randn(t.shape[-1], SKETCH, generator=gen).to(t.device) / math.sqrt(t.shape[-1])
    return t.float() @ _DIRECTIONS[key]


# -- the comparison ----------------------------------------------------------------------------------------------
def _norm2(t: torch.Tensor) -> torch.Tensor:
    """The squared norm of a gradient as the optimizer sees it (a DTensor's over all its shards)."""
    if hasattr(t, "full_tensor"):
        return torch.linalg.vector_norm(t.float()).full_tensor() ** 2
    return t.float().pow(2).sum()


def average_over(grads: dict[str, torch.Tensor], group, size: int, reduced: bool,
                 experts: Mapping[str, Any] | None = None) -> None:
    """Gradients averaged over the cp ranks where nothing averaged them (no FSDP2): as the user averages them; the
    ``experts`` expert parallelism split (name -> their replicas' group) as :func:`per_rank` takes them."""
    if reduced:
        return
    experts = experts or {}
    per_rank(grads, experts, reduced)
    if size == 1:
        return
    for name, g in grads.items():
        if name in experts:
            continue
        local = g.to_local() if hasattr(g, "to_local") else g
        dist.all_reduce(local, group=group)
        local /= size


def per_rank(grads: dict[str, torch.Tensor], experts: Mapping[str, Any], reduced: bool) -> None:
    """Where nothing averaged them (no FSDP2), an expert-parallel rank's expert gradients as the world's average
    (:func:`cptune.experts.averaged`): run whole, every rank of an ep group sent its experts every token once; split,
    each its share, each share's loss cp times it."""
    if not reduced and experts:
        averaged(grads, dict(experts))


def grad_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each parameter's relative gradient error ('param NAME' -> error). A gradient below a hundredth of the median
    parameter's is measured against that (rounding alone moves a near-zero gradient by all of it)."""
    norms = {}
    for name in sorted(set(got) | set(want)):
        w, g = want.get(name), got.get(name)
        w2 = _norm2(w) if w is not None else torch.zeros(())
        d2 = _norm2(g - w) if g is not None and w is not None else _norm2(g if g is not None else w)
        norms[name] = (float(w2) ** 0.5, float(d2) ** 0.5)
    if not norms:
        return {}
    least = 1e-2 * sorted(w for w, _ in norms.values())[len(norms) // 2]
    return {f"param {name}": d / max(w, least) if max(w, least) > 0 else d for name, (w, d) in norms.items()}


@contextlib.contextmanager
def perturbed(modules: Iterable[nn.Module], dtype: torch.dtype, seed: int = 0) -> Iterator[None]:
    """Each of ``modules``' outputs, and the gradient flowing back into it, each element moved by :data:`NOISE` of
    itself while the context is open (not an activation checkpoint's recompute): the check's third run, which
    measures what rounding alone moves each measure in one process."""
    eps = NOISE.get(dtype, NOISE[torch.float32])
    generators: dict[str, torch.Generator] = {}

    def noisy(t: torch.Tensor) -> torch.Tensor:
        gen = generators.setdefault(str(t.device), torch.Generator(device=t.device).manual_seed(seed))
        noise = torch.randn(t.shape, device=t.device, generator=gen)
        return t + (eps * t.detach().float() * noise).to(t.dtype)  # each element by a few units of its last place

    @_torch_cp.not_compiled
    def hook(module, args, out):
        first = out[0] if isinstance(out, (tuple, list)) else out
        if _torch_cp.in_backward() or not isinstance(first, torch.Tensor) or not first.is_floating_point() \
                or hasattr(first, "full_tensor"):
            return None
        first = noisy(first)
        if first.requires_grad:
            first.register_hook(noisy)
        return (first, *out[1:]) if isinstance(out, tuple) else first

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()

"""One activation of ``cptune.context_parallel``: validation, mesh, shards, the SDPA hook, and undo."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention import sdpa_kernel

from . import _torch_cp
from . import losses as _loss
from . import attention as A
from .config import CPConfig
from .mesh import ParallelDims, built_mesh, data_groups, data_rank
from .errors import CPTuneError, CPTuneWarning, Problem, ValidationError, raise_if
from .recipe import world_size_problems
from ._validate import BufferPlan, check_buffers, transport_problems

LATE_PACKING_IMBALANCE = 1.1
"""Documents a model brings after the block dealt its tokens head-tail: warn past this imbalance (max / mean)."""

_ACTIVE: list[_Session] = []  # sessions inside a with-block / decorated call, innermost last


def active() -> _Session | None:
    """The open session (the innermost block), or None outside every block."""
    return _ACTIVE[-1] if _ACTIVE else None


class _Session:
    """One activation of a context_parallel: validated inputs, mesh, shards, and what to undo."""

    def __init__(self, config: CPConfig, causal: bool, recipe: Any = None, documents: Any = None,
                 window: Any = None) -> None:
        self.config, self.causal, self.recipe = config, causal, recipe
        self.documents: torch.Tensor | None = None  # (B or 1, S) int64 on the CPU, once checked
        self._packing: torch.Tensor | None = None  # documents of a buffer named position_ids: for the layout only
        self.window = None
        self._asked = (documents, window)
        self.dp = self.cp = self.ulysses = self.ring = 1
        self.cp_rank = self.dp_rank = 0
        self.ulysses_group: dist.ProcessGroup | None = None  # ranks that trade heads (Ulysses / hybrid)
        self.ring_group: dist.ProcessGroup | None = None  # ranks that pass key/value blocks round (ring / hybrid)
        self.dims = ParallelDims()
        self.mesh: DeviceMesh | None = None
        self.cp_mesh: DeviceMesh | None = None
        self.group: dist.ProcessGroup | None = None
        self.plan = BufferPlan()
        self.backends: tuple[str, ...] = config.sdpa_backend or A.default_backends()
        self.device_type = "cpu"
        self.shards: dict[str, torch.Tensor] = {}
        self._grad_buffers: dict[int, tuple[torch.Tensor, int]] = {}
        self._stack = contextlib.ExitStack()
        self._restores: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []
        self._originals: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, buffer, whole sequence)
        self._route = A.Route(A.Setup(A.Layout(1, 1, False), self.backends))  # its setup: resolved when the block opens
        self._record = A.ForwardRecord()  # the CP attention forwards since the last backward

    # -- setting up ------------------------------------------------------------------
    def start(self, mesh: DeviceMesh | None, buffers: Any, seq_dims: Any, no_restore: Sequence[Any],
              inplace: bool) -> _Session:
        problems = self._resolve_mesh(mesh, _first_device_type(buffers))
        problems += self.config.degree_problems(self.cp)
        self.ulysses, self.ring = self.config.degrees(self.cp)
        backend = dist.get_backend() if dist.is_initialized() else None
        problems += transport_problems(self.device_type, backend, self.ring, self.config.rotate_method)
        if self.recipe is not None:
            problems += self._recipe_problems()
        self.plan, buffer_problems = check_buffers(
            buffers, seq_dims, cp=self.cp, load_balance=self.config.load_balance, causal=self.causal,
            device_type=self.device_type, no_restore=no_restore, ring=self.ring)
        problems += buffer_problems
        problems += self._mask_rules()
        if self.plan.seq_len is None:
            self.plan.load_balance = self.config.load_balance_for(self.causal, self.cp)
        dtype = next((t.dtype for t in self.plan.tensors if t.is_floating_point()), None)
        if self.config.sdpa_backend is not None:
            problems += A.pick_backend(self.backends, self.device_type, dtype, ring=self.ring > 1)[1]
        raise_if(problems)  # nothing has been communicated or changed yet
        if self.cp > 1:
            problem = _torch_cp.support_problem()
            if problem:
                raise CPTuneError(problem)
        self._build_mesh()
        for note in self.plan.notes:
            if not dist.is_initialized() or dist.get_rank() == 0:
                warnings.warn(note, CPTuneWarning, stacklevel=4)
        self._resolve()
        try:
            self._shard(no_restore, inplace)
            if self.config.sdpa_backend is not None:
                self._stack.enter_context(
                    sdpa_kernel([A.SDPA_KERNELS[b] for b in self.backends], set_priority=True))
            if self.cp > 1 or self.documents is not None or self.window is not None:
                self._stack.enter_context(A.SDPAMode(self._route))
                self._stack.enter_context(A.patched_sdpa(self._route))
                self._record = self._stack.enter_context(A.recording())
        except BaseException:
            self.stop(failing=True)
            raise
        _ACTIVE.append(self)
        return self

    def _mask_rules(self) -> list[Problem]:
        """Check the block's documents and window (before anything is sharded) and keep them in planner form."""
        documents, window = self._asked
        problems = []
        try:
            self.window = A.check_window(window)
        except ValidationError as exc:
            problems += exc.problems
        if (documents is not None or window is not None) and self.plan.seq_len is None:
            return problems + [Problem("documents" if documents is not None else "window", "is given but no buffer "
                                       "is sharded, so the block knows no sequence to apply it to",
                                       "pass the sequence buffers too (buffers= / seq_dims=)")]
        if documents is not None:
            found = A.document_problems(documents, self.plan.seq_len, None)
            if found:
                return problems + found
            self.documents = A.as_rows(documents)
        else:
            self._packing = self._packed_position_ids()
        return problems

    def _packed_position_ids(self) -> torch.Tensor | None:
        """The documents of a buffer named ``position_ids`` (a dict key, or the decorator's argument) that restarts
        at 0 in each document, as transformers reads a packed batch: the block deals the tokens by their work when
        it opens. They apply to attention only when the model says so (``cptune.hf`` finds the same packing)."""
        for name, t, dim in zip(self.plan.names, self.plan.tensors, self.plan.dims):
            text = A.text_positions(t) if name.endswith("['position_ids']") and dim == t.ndim - 1 else None
            if text is not None and text.ndim <= 2 and not text.is_floating_point() and text.dtype != torch.bool \
                    and text.shape[-1] == self.plan.seq_len:
                return A.packed_documents(text.detach().cpu().reshape(-1, text.shape[-1]))
        return None

    def _resolve_mesh(self, mesh: DeviceMesh | None, buffer_device: str | None) -> list[Problem]:
        if mesh is not None:
            if not isinstance(mesh, DeviceMesh):
                return [Problem("mesh", f"is a {type(mesh).__name__}, not a DeviceMesh",
                                "pass a torch.distributed.device_mesh.DeviceMesh or mesh=None")]
            self.dims, problems = ParallelDims.of_mesh(mesh)
            if problems:
                return problems
            self.cp_mesh = mesh if mesh.ndim == 1 else mesh["cp"]
            self.mesh, self.device_type, self.dp, self.cp = mesh, mesh.device_type, self.dims.dp, self.dims.cp
            if self.config.mesh_shape is not None:
                try:
                    wanted = self.config.parallel_dims(mesh.size())
                except ValidationError as exc:
                    return list(exc.problems)
                if wanted.shape != self.dims.shape:  # ep folds over the mesh: no dim of its own to compare
                    return [Problem("config.mesh_shape", f"{self.config.mesh_shape} ({wanted.label()}) disagrees "
                                    f"with the mesh passed ({self.dims.label()})",
                                    "drop config.mesh_shape or pass mesh=None")]
            return []
        world = dist.get_world_size() if dist.is_initialized() else 1
        try:
            self.dims = self.config.parallel_dims(world)
            self.dp, self.cp = self.dims.dp, self.dims.cp
        except ValidationError as exc:
            problems = list(exc.problems)
            if not dist.is_initialized():
                problems.append(Problem("torch.distributed", "no process group is initialized (world size 1)",
                                        "launch with torchrun and call dist.init_process_group() first"))
            return problems
        if buffer_device is not None:
            self.device_type = buffer_device
        elif dist.is_initialized() and dist.get_backend() == "nccl":
            self.device_type = "cuda"
        return []

    def _recipe_problems(self) -> list[Problem]:
        prov = self.recipe.provenance
        problems = world_size_problems(self.recipe, dist.get_world_size() if dist.is_initialized() else 1)
        if prov.device_type != self.device_type:
            problems.append(Problem("recipe", f"was measured on {prov.device_type} but these buffers are on "
                                    f"{self.device_type}", f"run on {prov.device_type} or search again on "
                                    f"{self.device_type}"))
        return problems

    def _build_mesh(self) -> None:
        if self.cp_mesh is None and (self.cp > 1 or not self.dims.is_dp_cp):
            key = (self.device_type, self.dims, id(dist.group.WORLD))
            self.mesh = built_mesh(key, lambda: self.dims.device_mesh(self.device_type))
            self.cp_mesh = self.mesh["cp"]
        if self.cp_mesh is not None:
            self.group = self.cp_mesh.get_group()
            self.cp_rank = self.cp_mesh.get_local_rank()
            if self.ulysses == self.cp:
                self.ulysses_group = self.group
            elif self.ulysses == 1:
                self.ring_group = self.group
            else:
                self.ulysses_group, self.ring_group = A.hybrid_groups(self.mesh or self.cp_mesh, self.cp,
                                                                                  self.ulysses)
        if self.mesh is not None:
            self.dp_rank = data_rank(self.mesh)
        elif dist.is_initialized():  # no mesh: every rank its own replica (cp = 1, tp = 1)
            self.dp_rank = self.dims.replica(dist.get_rank())

    def _shard(self, no_restore: Sequence[Any], inplace: bool) -> None:
        for name, t, dim in zip(self.plan.names, self.plan.tensors, self.plan.dims):
            self._originals.append((name, t, t.detach() if inplace and self.cp > 1 else t))
            if self.cp == 1:
                self.shards[name] = t
            elif t.requires_grad:
                # Autograd forbids resizing such tensors: shard them where they are used.
                self._grad_buffers[id(t)] = (t, dim)
                self.shards[name] = self.setup.local(t) if not inplace else t
            elif not inplace:
                self.shards[name] = A.shard(t, dim, self.layout, self.cp_rank)
            else:
                with torch.no_grad():
                    saved = t.detach()
                    t.set_(A.shard(t, dim, self.layout, self.cp_rank))
                if not any(t is x for x in no_restore):
                    self._restores.append((name, t, saved, _torch_cp.use_count(t)))
                self.shards[name] = t

    def _resolve(self) -> None:
        """The block's attention setup, resolved once (the work-balanced layout of its documents included)."""
        chunks = None
        documents = self.documents if self.documents is not None else self._packing
        if (documents is not None or self.window is not None) and self.plan.load_balance and self.ring > 1:
            work = A.token_work(documents, self.plan.seq_len, self.causal, self.window)
            found = A.work_chunks(work, self.ring)  # head-tail chunks lay out as chunks=None does
            chunks = found[0] if found is not None else None
        layout = A.Layout(self.cp, self.ring, self.plan.load_balance, chunks)
        self._route.setup = A.Setup(
            layout, self.backends, causal=self.causal, strategy=self.config.strategy,
            rotate_method=self.config.rotate_method, load_balance=self.plan.load_balance, seq_len=self.plan.seq_len,
            cp_rank=self.cp_rank, group=self.group, ulysses_group=self.ulysses_group, ring_group=self.ring_group,
            documents=self.documents, window=self.window, positions=A.ring_positions(layout, self.plan.seq_len),
            grad_buffers=self._grad_buffers)

    # -- inside the block --------------------------------------------------------------
    @property
    def setup(self) -> A.Setup:
        """What the block's attention runs with (its route's: the routed calls and direct ones read one value)."""
        return self._route.setup

    @property
    def layout(self) -> A.Layout:
        return self.setup.layout

    def use_documents(self, documents: torch.Tensor, source: str) -> None:
        """Apply documents found after the block opened (a transformers packed batch): same as given, or refused."""
        ids = A.as_rows(documents)
        if self.documents is None:
            raise_if(A.document_problems(ids, self.plan.seq_len, None, source))
            self.documents = ids
            self._route.setup = dataclasses.replace(self.setup, documents=ids)
            self._warn_if_dealt_blind(ids, source)
        elif not _same_documents(self.documents, ids):
            raise_if([Problem(source, "describe other documents than the block's documents=",
                              "pass the same packing to both, or leave documents= out and let the model's "
                              "packed inputs say it")])

    def _warn_if_dealt_blind(self, ids: torch.Tensor, source: str) -> None:
        """Documents the block learns only now were dealt head-tail: say how to deal them by work, if it matters."""
        positions = self.setup.positions
        if self._packing is not None or positions is None or not self.plan.load_balance or self.ring == 1:
            return
        work = A.token_work(ids, self.plan.seq_len, self.causal, self.window)
        loads = work[positions].sum(-1)
        if float(loads.max() / loads.mean()) > LATE_PACKING_IMBALANCE and (not dist.is_initialized() or
                                                                            dist.get_rank() == 0):
            warnings.warn(f"cptune: the packed batch's documents ({source}) reached the block after it dealt the "
                          "tokens, so they are dealt head-tail and the busiest rank attends more than "
                          f"{LATE_PACKING_IMBALANCE}x the mean; give the block the packing when it opens (buffers "
                          "as a dict with the position ids under 'position_ids', or documents="
                          "cptune.documents_from_position_ids(position_ids)) to deal them by work", CPTuneWarning,
                          stacklevel=2)

    @contextlib.contextmanager
    def own_attention(self) -> Iterator[None]:
        """SDPA calls inside go to torch's own SDPA, not the block's (a vision tower attending within one image on
        this rank's images; its recompute under activation checkpointing enters this again)."""
        paused, self._route.paused = self._route.paused, True
        try:
            yield
        finally:
            self._route.paused = paused

    def held(self) -> list[torch.Tensor]:
        """Each CP rank's positions of the block's sequence, in its local order."""
        return [self.layout.indices(self.plan.seq_len, r) for r in range(self.cp)]

    def local_positions(self) -> torch.Tensor:
        """(B or 1, this rank's tokens): where each token this rank holds sits in its document (in the row when
        nothing is packed), in the rank's local order; what a model's ``arange`` over its tokens means to say."""
        seq = self.plan.seq_len
        within = A.positions_in_documents(self.documents, seq)
        return within[:, self.layout.indices(seq, self.cp_rank)] if self.cp > 1 else within

    def full_tensor(self, shard: torch.Tensor) -> torch.Tensor | None:
        """The whole-sequence tensor whose shard this is, if it is one of the block's buffers (no communication)."""
        for name, t, saved in self._originals:
            if self.shards.get(name) is shard:
                return saved
        return None

    # -- afterwards ---------------------------------------------------------------------
    def stop(self, failing: bool = False) -> None:
        """Undo everything; unless the block is already failing, refuse a backward that would go wrong."""
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        try:
            self._stack.close()
        finally:
            keep = [] if failing or not self._record.since_backward else [
                name for name, t, _, count in self._restores if _torch_cp.use_count(t) > count]
            for name, t, saved, _ in self._restores:
                if name not in keep:
                    _restore(t, saved)
        if keep and (not dist.is_initialized() or dist.get_rank() == 0):
            # Restoring would make the pending backward fail (torch's in-place check); left sharded,
            # that backward is exact. Said, not raised: code that never calls backward still runs.
            warnings.warn(f"cptune: {', '.join(keep)} left sharded after the block: the autograd graph still "
                          "holds it (backward has not run yet) and restoring the full tensor would break that "
                          "backward. Call loss.backward() inside the with-block (or the decorated function), or "
                          "list it in no_restore=[...] to keep it sharded on purpose (and silence this)",
                          CPTuneWarning, stacklevel=3)
        if self._record.checkpointed and not failing:
            raise_if([Problem(
                "backward", "attention ran under activation checkpointing in this block and backward has "
                "not run yet; its recompute would run outside the block as single-device attention on "
                "this rank's shard (wrong gradients)", "call loss.backward() inside the with-block (or "
                "inside the decorated function)")])

    def num_items_in_batch(self, labels: torch.Tensor, ignore_index: int, over: str) -> torch.Tensor:
        raise_if([Problem("over", f"is {over!r}", "use over='all' (every dp x cp rank) or over='cp' "
                          "(this dp replica)")] if over not in ("all", "cp") else [])
        groups = [self.group] if self.group is not None else []
        if over == "all" and self.dp > 1:
            # the mesh's data-parallel dims (never tp: its ranks hold the same tokens); with cp = 1 and no tp, no
            # mesh is built and the world is dp
            groups += data_groups(self.mesh) if self.mesh is not None else [dist.group.WORLD]
        return _loss.count_items(labels, groups, self.cp * (self.dp if over == "all" else 1), ignore_index)

    def unshard(self, tensors: Any, seq_dims: Any) -> Any:
        single = isinstance(tensors, torch.Tensor)
        items = [tensors] if single else list(tensors)
        dims = [seq_dims] * len(items) if isinstance(seq_dims, int) else list(seq_dims)
        if len(dims) != len(items):
            raise ValidationError([Problem("seq_dims", f"{len(dims)} dims for {len(items)} tensors",
                                           "give one sequence dim per tensor (or one int for all)")])
        if self.cp == 1:
            out = [t.detach() for t in items]
        else:
            out = [A.gather(t.detach(), d % t.ndim, self.group, self.layout)
                   for t, d in zip(items, dims)]
        return out[0] if single else out


def _same_documents(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (rows, S) id tensors cut the sequence the same way (ids may be numbered differently)."""
    if a.shape[-1] != b.shape[-1] or (a.shape[0] != b.shape[0] and 1 not in (a.shape[0], b.shape[0])):
        return False
    rows = max(a.shape[0], b.shape[0])
    a, b = a.expand(rows, -1), b.expand(rows, -1)
    return bool(((a[:, 1:] != a[:, :-1]) == (b[:, 1:] != b[:, :-1])).all())


def _restore(t: torch.Tensor, saved: torch.Tensor) -> None:
    with torch.no_grad():
        t.set_(saved)


def _first_device_type(buffers: Any) -> str | None:
    if isinstance(buffers, torch.Tensor):
        return buffers.device.type
    values = buffers.values() if isinstance(buffers, Mapping) else buffers if isinstance(buffers, (list, tuple)) else ()
    for b in values:
        found = _first_device_type(b)
        if found is not None:
            return found
    return None

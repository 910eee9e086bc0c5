"""``cptune.context_parallel`` (context manager and decorator) and ``cptune.unshard``."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from . import attention as A
from ._session import _Session, active
from .config import ConfigLike, CPConfig, as_config
from .errors import CPTuneError, CPTuneWarning, Problem, ValidationError, raise_if
from .mesh import ParallelDims, data_rank
from .recipe import ENV_VAR, Recipe, load_recipe
from ._torch_cp import not_compiled


def _recipe_for(config: ConfigLike, recipe: Any) -> Any:
    """The recipe to follow: the one given, else $CPTUNE_RECIPE when no config is given."""
    if recipe is not None and config is not None:
        raise ValidationError([Problem("recipe", "is given together with config",
                                       "pass either config= or recipe=, not both")])
    if recipe is None and config is None and os.environ.get(ENV_VAR):
        recipe = os.environ[ENV_VAR]
    if recipe is None or isinstance(recipe, Recipe):
        return recipe
    return load_recipe(recipe)


def config_for(config: ConfigLike, recipe: Any) -> CPConfig:
    """The configuration to run: the recipe's (:func:`_recipe_for`), else ``config``, else the default."""
    found = _recipe_for(config, recipe)
    return found.config if found is not None else as_config(config)


class context_parallel:  # noqa: N801 - used like a function, as torch's own context_parallel
    """Run attention context-parallel: shard ``buffers`` along ``seq_dims`` and ring every SDPA call.

    As a context manager::

        with cptune.context_parallel(buffers=[q, k, v], seq_dims=[2, 2, 2], config=cfg) as cp:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        full_out = cp.unshard(out, 2)

    Buffers that do not require grad are sharded in place (inside the block each holds this
    rank's part of the sequence) and restored on exit unless listed in ``no_restore``.
    Buffers that require grad cannot be resized, so they keep their shape and are sharded
    where SDPA consumes them; their gradients come back full-size, in original order, as
    the gradient of the mean of the CP ranks' losses (DDP's convention).

    As a decorator, ``seq_dims`` maps argument names to sequence dims and the named tensor
    arguments are sharded for each call::

        @cptune.context_parallel(seq_dims={"input_ids": 1, "labels": 1}, config=cfg)
        def train_step(model, input_ids, labels): ...

    ``recipe``: a recipe file (or :class:`cptune.recipe.Recipe`) whose configuration to use;
    with neither ``config`` nor ``recipe`` given, the recipe named by $CPTUNE_RECIPE (set by
    ``cptune launch``) is used if set. A recipe for another world size or device is an error.

    ``documents``: packed documents, as integer ids per token of the whole sequence, (B, S) or
    (S,) (``cptune.documents_from_position_ids`` / ``_from_lengths`` / ``_from_cu_seqlens`` /
    ``_from_eos`` make them; the decorator form also takes the name of an argument holding them).
    Every SDPA call in the block then attends inside documents only, at the cost of the attended
    pairs (no (S, S) mask is built), under every strategy; with causal load balancing the
    sequence is dealt to the ranks by work. ``window=(left, right)``: each token attends to
    ``left`` earlier and ``right`` later tokens besides itself (with causal attention, earlier
    only), e.g. ``(4095, 0)`` for Mistral's ``sliding_window=4096``. They apply with cp = 1 too.

    ``mesh``: a 1-D mesh (all CP), or a named mesh whose dims are named from dp_replicate, dp_shard (or dp),
    cp and tp, one of them "cp" (a torchtitan-style world mesh): buffers are sharded over cp only, every tp rank
    of a cp rank holding the same tokens (and attending on the heads it holds); replicas are its data-parallel
    dims. None builds the mesh of ``config.mesh_shape`` (:class:`cptune.ParallelDims`) over the default process
    group: ("dp", "cp") for a (dp, cp) shape, all four dims otherwise. On exit every global cptune set
    (SDPA kernel choice, torch's rotate method and load-balance flag, the SDPA hook) is back
    as it was, also when the block raises.

    One block per process at a time, its attention on the block's own thread: the SDPA hook is
    process-wide, so an SDPA call from another thread while the block is open is refused (a
    recompute in autograd's threads during backward is the block's and runs as usual).
    """

    def __init__(self, buffers: Any = None, seq_dims: Any = None, *, config: ConfigLike = None,
                 mesh: DeviceMesh | None = None, causal: bool = True, no_restore: Sequence[Any] = (),
                 recipe: Any = None, documents: Any = None, window: Any = None) -> None:
        self.recipe = _recipe_for(config, recipe)
        self.config = self.recipe.config if self.recipe is not None else as_config(config)
        self.buffers, self.seq_dims, self.mesh = buffers, seq_dims, mesh
        self.causal, self.no_restore = bool(causal), tuple(no_restore)
        self.documents, self.window = documents, window
        self._session: _Session | None = None

    def _new_session(self, documents: Any = None) -> _Session:
        current = active()
        if current is not None and current is self._session:
            raise CPTuneError("this context_parallel is already active; it cannot be entered twice at once")
        if current is not None:
            raise CPTuneError("a cptune.context_parallel block is already active in this process; "
                              "nest attention inside one block instead of opening another")
        self._session = _Session(self.config, self.causal, self.recipe, documents, self.window)
        return self._session

    @not_compiled  # set-up and teardown run eagerly; torch.compile traces the block's model code
    def __enter__(self) -> context_parallel:
        if isinstance(self.documents, str):
            raise_if([Problem("documents", f"is the name {self.documents!r}, which only the decorator form reads",
                              "pass the document ids tensor itself to the with-block")])
        self._new_session(self.documents).start(self.mesh, self.buffers, self.seq_dims, self.no_restore, inplace=True)
        return self

    @not_compiled
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._session is not None
        self._session.stop(failing=exc_type is not None)
        ours = A.unwrap(exc)
        if ours is not None:
            raise ours from None

    def __call__(self, fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        problems = []
        if self.buffers is not None:
            problems.append(Problem("buffers", "is given to the decorator form",
                                    "name the arguments to shard in seq_dims={'arg': dim, ...} instead"))
        if not isinstance(self.seq_dims, Mapping) or not self.seq_dims:
            problems.append(Problem("seq_dims", "the decorator needs a dict of argument names to sequence dims",
                                    "use seq_dims={'input_ids': 1, 'labels': 1}"))
        else:
            unknown = [n for n in self.seq_dims if n not in sig.parameters]
            if isinstance(self.documents, str) and self.documents not in sig.parameters:
                unknown.append(self.documents)
            if unknown:
                problems.append(Problem("seq_dims", f"names {unknown} that {fn.__name__} does not take",
                                        f"use argument names of {fn.__name__}: {list(sig.parameters)}"))
        raise_if(problems)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            named = {n: bound.arguments[n] for n in self.seq_dims if bound.arguments.get(n) is not None}
            raise_if([Problem(n, f"is a {type(t).__name__}, not a tensor",
                              f"pass a tensor for {n} or drop it from seq_dims")
                      for n, t in named.items() if not isinstance(t, torch.Tensor)])
            docs = bound.arguments.get(self.documents) if isinstance(self.documents, str) else self.documents
            session = self._open(named, docs)
            try:
                for name, path in zip(named, session.plan.names):
                    bound.arguments[name] = session.shards[path]
                result = fn(*bound.args, **bound.kwargs)
            except BaseException as exc:
                _stop(session, failing=True)
                ours = A.unwrap(exc)
                if ours is not None:
                    raise ours from None
                raise
            _stop(session)
            return result

        return wrapper

    @not_compiled
    def _open(self, named: dict[str, torch.Tensor], documents: Any) -> _Session:
        """Set up eagerly: under torch.compile of a decorated step, only the step is traced."""
        return self._new_session(documents).start(self.mesh, named, {n: self.seq_dims[n] for n in named}, (),
                                         inplace=False)

    # -- what the block knows ---------------------------------------------------------------
    def _require(self) -> _Session:
        if self._session is None:
            raise CPTuneError("this context_parallel has not run yet; use it in a with-block or as a decorator")
        return self._session

    @property
    def cp_size(self) -> int:
        return self._require().cp

    @property
    def cp_rank(self) -> int:
        return self._require().cp_rank

    @property
    def dp_size(self) -> int:
        return self._require().dp

    @property
    def device_mesh(self) -> DeviceMesh | None:
        return self._require().mesh

    @property
    def load_balance(self) -> bool:
        """Whether load balancing is really on (it can be turned off, with a warning)."""
        return self._require().plan.load_balance

    @property
    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every buffer, by its path ('buffers[0]', "buffers['labels']")."""
        return dict(self._require().shards)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica: its coordinates in the mesh's data-parallel dims (never tp)."""
        return self._require().dp_rank

    def unshard(self, tensors: Any, seq_dims: Any) -> Any:
        return self._require().unshard(tensors, seq_dims)

    def num_items_in_batch(self, labels: torch.Tensor, ignore_index: int = -100, over: str = "all") -> torch.Tensor:
        """The divisor that turns this rank's *summed* token loss into its exact share of the mean.

        ``labels``: this rank's shard of the (already shifted) labels. ``over="all"`` (default):
        the mean over every valid token of the global batch (all dp x cp ranks; tp ranks hold the same tokens);
        ``over="cp"``: the mean over this dp replica's tokens, averaged over replicas (DDP's
        convention). Gradients averaged over all ranks (FSDP/DDP, cptune's buffer grads) are
        then the single-device gradient of that mean. transformers' causal-LM losses take it
        as ``num_items_in_batch=``. A collective: call it on every rank.
        """
        return self._require().num_items_in_batch(labels, ignore_index, over)


@not_compiled
def _stop(session: _Session, failing: bool = False) -> None:
    session.stop(failing=failing)


def replica(*, config: ConfigLike = None, recipe: Any = None, mesh: DeviceMesh | None = None) -> tuple[int, int, int]:
    """(dp replicas, cp, this rank's replica). The named mesh is row-major with tp innermost, so the replica is
    rank // (cp x tp): the cp and tp ranks of a replica share its rows. ``config``/``recipe`` as for
    :class:`context_parallel` ($CPTUNE_RECIPE when neither is given); ``mesh``: a named device mesh instead (its
    data-parallel dims say the replica)."""
    if mesh is not None:
        dims, problems = ParallelDims.of_mesh(mesh)
        raise_if(problems)
        return dims.dp, dims.cp, data_rank(mesh)
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    dims = config_for(config, recipe).parallel_dims(world)
    return dims.dp, dims.cp, dims.replica(rank)


def replica_rows(global_batch: int, *, config: ConfigLike = None, recipe: Any = None,
                 mesh: DeviceMesh | None = None) -> slice:
    """This rank's rows of a global batch: its dp replica's share, the same on all of the replica's CP and TP ranks.
    ``config``/``recipe`` as for :class:`context_parallel` ($CPTUNE_RECIPE when neither is given), or the named
    ``mesh`` the block is given. Use it before the step::

        rows = cptune.replica_rows(len(batch), recipe=recipe)
        loss = train_step(input_ids[rows], labels[rows], positions[rows])
    """
    dp, _, index = replica(config=config, recipe=recipe, mesh=mesh)
    if global_batch % dp:
        raise ValidationError([Problem("global_batch", f"{global_batch} rows do not split over {dp} dp replicas",
                                       f"use a global batch divisible by {dp}, or a config with another dp degree")])
    per = global_batch // dp
    return slice(index * per, (index + 1) * per)


def _active(needs: str = "this needs an active cptune.context_parallel block (or decorated call); call it "
            "inside one, or use the object the with-statement returned") -> _Session:
    session = active()
    if session is None:
        raise CPTuneError(needs)
    return session


def num_items_in_batch(labels: torch.Tensor, ignore_index: int = -100, over: str = "all") -> torch.Tensor:
    """:meth:`context_parallel.num_items_in_batch` of the active block (for the decorator form)."""
    return _active().num_items_in_batch(labels, ignore_index, over)


def unshard(tensors: Any, seq_dims: Any, *, context: context_parallel | None = None) -> Any:
    """The full tensors back from every CP rank's shard, in original order (load balancing undone).

    ``tensors``: one tensor or a list; ``seq_dims``: one int for all or one per tensor.
    ``context``: the context_parallel that sharded them; by default the active one.
    This is a collective over the CP group: call it on every rank.
    """
    if context is not None:
        return context.unshard(tensors, seq_dims)
    return _active("cptune.unshard outside a context_parallel block needs context=: "
                   "pass the object the with-statement returned (with ... as cp)").unshard(tensors, seq_dims)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False, *, window: Any = None,
                                 documents: Any = None, chunk: int | None = None,
                                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with packed documents and a sliding window, in a block or on one device.

    Inside a ``cptune.context_parallel`` block it runs as the block's CP attention; ``window`` and
    ``documents`` default to the block's (None), ``False`` turns them off for this call, a value
    replaces them. ``chunk``: attention within chunks of this many tokens of each document (Llama 4's chunked
    layers). ``sinks``: (query heads,) learned logits that join each row's softmax denominator with a zero value
    (GPT-OSS's attention sinks). Outside a block it is single-device attention with the equivalent (S, S) mask
    (with sinks: cptune's own kernel loop, no (S, S) tensor).
    """
    session = active()
    if session is not None:
        return A.attend(session.setup, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                        window="block" if window is None else window or None,
                        documents="block" if documents is None else documents, chunk=chunk, sinks=sinks)
    window = A.check_window(window or None)
    documents = documents if documents is not False else None
    if chunk is not None and chunk < query.shape[-2]:
        documents = A.chunked(documents, query.shape[-2], chunk)
    if documents is not None:
        raise_if(A.document_problems(documents, query.shape[-2], None))
    if sinks is not None:
        return A.alone(query, key, value, sinks, attn_mask, dropout_p, is_causal, scale, documents=documents,
                       window=window)
    if documents is None and window is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    rules = A.dense_mask(documents, window, is_causal, query.shape[-2], query.device)
    if attn_mask is not None:
        rules = rules & attn_mask if attn_mask.dtype == torch.bool else \
            torch.where(rules, attn_mask, torch.tensor(float("-inf"), dtype=attn_mask.dtype, device=attn_mask.device))
    return F.scaled_dot_product_attention(query, key, value, rules, dropout_p, False, scale=scale,
                                          enable_gqa=enable_gqa)


__all__ = ["context_parallel", "unshard", "num_items_in_batch", "replica_rows", "scaled_dot_product_attention",
           "CPTuneWarning"]

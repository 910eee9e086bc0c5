"""cptune: context parallelism for PyTorch that validates its inputs, runs on CPU and GPU, and tunes itself.

Main API:
- :class:`CPConfig`: one context-parallel configuration (strategy: ring, Ulysses or hybrid; rotate
  method, mesh shape, SDPA backend, load balancing).
- :func:`context_parallel`: context manager / decorator that shards sequence buffers and runs
  every SDPA call inside as context-parallel attention over the CP ranks.
- :func:`unshard`: the full tensors back, in original order.
- :func:`shift_labels` / :func:`num_items_in_batch`: next-token labels shifted before sharding,
  and the loss divisor that makes a summed loss the exact single-device mean;
  :func:`packed_labels_and_positions` for packed documents.
- :data:`RING_ATTENTION_OPS` / :data:`ULYSSES_OPS`: the ring attention ops and Ulysses' all-to-alls,
  for selective activation checkpointing policies.
- :func:`scaled_dot_product_attention` and ``documents_from_*``: packed documents and sliding
  windows (``context_parallel(documents=..., window=...)``), at the cost of the attended pairs.
- ``cptune.hf.enable(model)``: transformers models under CP; ``cptune.models``: a transformers model from
  its config, prepared for training (AC, compile, FSDP2) as ``cptune search --model`` measures it.
- :func:`head_loss`: the next-token loss through an LM head without the whole logits (vocabulary-parallel under tp).
- :func:`parallelize`: a plain PyTorch model split by tensor parallelism (sequence parallel on the residual stream),
  checkpointed and compiled, then sharded by FSDP2 over the named mesh, in torchtitan's order.
- :func:`check`: the first-step check of a plain model's step: run as one process and split over cp, outputs and
  gradients compared, before training it (``cptune.hf.enable`` does it for transformers families cptune has not proven).
- :func:`tune`: measure configurations on real ranks, return the fastest that fits in memory (``cptune.search``
  is its subpackage: settings, results, storage; calling it is the deprecated spelling of ``tune``).
- :func:`init_rank` / :func:`close_rank`: the start and end of a training process under python or torchrun.
- :func:`load_recipe` / :class:`Recipe`: the search's result as a torchrun recipe file.
- :class:`CPTuneError` / :class:`ValidationError`: everything cptune raises on purpose.
"""

from . import _deps

_deps.check()  # a dependency older than cptune's floor: one clear ImportError, not an AttributeError mid-search

from .attention import RING_ATTENTION_OPS, ULYSSES_OPS, documents_from_cu_seqlens, documents_from_eos, \
    documents_from_lengths, documents_from_position_ids
from .losses import packed_labels_and_positions, shift_labels
from ._version import __version__  # noqa: F401
from .config import CPConfig
from .context import CPTuneWarning, context_parallel, num_items_in_batch, replica_rows, scaled_dot_product_attention, \
    unshard
from .errors import CPTuneError, Problem, ValidationError
from .mesh import ParallelDims
from .verify import check
from .losses import head_loss
from .models import parallelize
from ._rank import close_rank, init_rank
from .recipe import Recipe, load_recipe, save_recipe
from . import search  # the subpackage (calling it is the deprecated spelling of tune)
from .search import SearchResult, Workload
from .search import search as tune


__all__ = [
    "CPConfig",
    "CPTuneError",
    "CPTuneWarning",
    "ParallelDims",
    "Problem",
    "RING_ATTENTION_OPS",
    "Recipe",
    "SearchResult",
    "ULYSSES_OPS",
    "ValidationError",
    "Workload",
    "check",
    "close_rank",
    "context_parallel",
    "documents_from_cu_seqlens",
    "documents_from_eos",
    "documents_from_lengths",
    "documents_from_position_ids",
    "head_loss",
    "init_rank",
    "load_recipe",
    "num_items_in_batch",
    "packed_labels_and_positions",
    "parallelize",
    "replica_rows",
    "save_recipe",
    "scaled_dot_product_attention",
    "search",
    "shift_labels",
    "tune",
    "unshard",
]

"""The attention core: one SDPA call of a block, run as context-parallel attention.

It holds the SDPA call forms (``_forms``), packed documents and windows (``_documents``), block
planning (``_blocks``), the kernels (``_kernels``), PyTorch's ring as custom ops (``_ring``),
cptune's masked ring (``_masked_ring``), Ulysses (``_ulysses``), the sequence layout
(``_sharding``), the routing of SDPA calls inside a block (``_routing``), what the ops record
(``_hooks``) and the dispatch of one call (``_attend``).

Data flows one way: the block (``cptune._session``) resolves everything once into a
:class:`Setup` and passes it down; nothing here imports or calls the block. torch's private
code is reached only through ``cptune._torch_cp``. The names below are what the rest of cptune
uses (benchmarks too: PyTorch's own CP module through :func:`require_cp`); the package is internal (the public
ones are re-exported by ``cptune``).
"""

from ._attend import RING_ATTENTION_OPS, Setup, alone, attend, ring_positions
from ._blocks import needs
from ._documents import as_rows, check_window, chunked, dense_mask, document_problems, documents_from_cu_seqlens, \
    documents_from_eos, documents_from_lengths, documents_from_position_ids, lengths_from_spec, \
    packed_documents, positions_in_documents, read_spec, text_positions, token_work, work_chunks
from ._hooks import ForwardRecord, counting, recording
from ._kernels import RING_BACKENDS, SDPA_BACKENDS, SDPA_KERNELS, backend_problem, default_backends, pick_backend, \
    ring_backend_problem
from ._ring import ring_attention
from ._routing import Route, SDPAMode, patched_sdpa, unwrap
from ._sharding import Layout, gather, shard
from ._ulysses import ULYSSES_OPS, heads_to_seq, hybrid_groups, kv_replication, release_groups, seq_to_heads
from .._torch_cp import require_cp

__all__ = [
    "RING_ATTENTION_OPS", "RING_BACKENDS", "SDPA_BACKENDS", "SDPA_KERNELS", "ULYSSES_OPS", "alone", "as_rows", "attend",
    "backend_problem", "check_window", "chunked", "counting", "default_backends", "dense_mask",
    "document_problems", "documents_from_cu_seqlens", "documents_from_eos", "documents_from_lengths",
    "documents_from_position_ids", "ForwardRecord", "gather", "heads_to_seq", "hybrid_groups", "kv_replication",
    "Layout", "lengths_from_spec", "needs", "packed_documents", "patched_sdpa", "pick_backend",
    "positions_in_documents", "read_spec", "recording", "release_groups", "require_cp", "ring_attention",
    "ring_backend_problem", "ring_positions", "Route", "SDPAMode", "seq_to_heads", "Setup", "shard",
    "text_positions", "token_work", "unwrap", "work_chunks",
]

"""The ring's geometry as the step model and the search's memory model both price it: which positions each ring rank
holds (as the block deals them), the attended pairs of the busiest, the K/V blocks a rank receives and sends
(cptune's masked ring: only those some query attends), and what the rotation and an attention layer keep."""

from __future__ import annotations

import functools

import torch

from ..attention import Layout, documents_from_lengths, lengths_from_spec, needs, token_work, work_chunks
from ..config import CPConfig
from ..workload import Workload


def prefetches(config: CPConfig, workload: Workload) -> bool:
    """Whether the ring sends the next K/V block during this one's: the point-to-point rotation, and cptune's
    masked ring (documents or a window) with either rotate method."""
    return config.rotate_method == "alltoall" or workload.documents is not None or workload.window is not None


def ring_buffer_bytes(block: float, ring: int, config: CPConfig, workload: Workload, received: int) -> float:
    """What the ring's rotation holds, ``block`` being one ring step's K and V and ``received`` the blocks this rank
    receives (:func:`ring_blocks`): PyTorch's all-gather every ring rank's block and the next, its point-to-point
    rotation three in flight; cptune's masked ring (documents or a window) every block it receives at once
    (allgather) or two at a time (alltoall), besides its own."""
    if ring == 1:
        return 0.0
    if workload.documents is None and workload.window is None:
        return block * (3 if config.rotate_method == "alltoall" else ring + 1)
    return block * (1 + (received if config.rotate_method == "allgather" else min(2, received)))


def kept_attention_layer(q_bytes: float, ring: int, exchanged: float) -> float:
    """What autograd keeps of an attention-only layer, ``q_bytes`` one (B, H, S/cp, D) tensor: its input,
    output and residual sum, and under the ring the float32 merged output and log-sum-exp (calibrated on CPU,
    float32); ``exchanged``: Ulysses' head-sharded q, k, v and out."""
    return (3.5 if ring == 1 else 5.5) * q_bytes + exchanged


@functools.lru_cache(maxsize=32)
def _ids(seq_len: int, documents: str | None) -> torch.Tensor | None:
    """(1, S) document ids of a workload's documents spec, or None."""
    return documents_from_lengths(lengths_from_spec(documents, seq_len)) if documents else None


@functools.lru_cache(maxsize=32)
def _work(seq_len: int, documents: str | None, causal: bool, window: int | None) -> torch.Tensor:
    return token_work(_ids(seq_len, documents), seq_len, causal, None if window is None else (window, 0))


@functools.lru_cache(maxsize=32)
def _positions(seq_len: int, documents: str | None, causal: bool, window: int | None, ring: int,
               balanced: bool) -> torch.Tensor:
    """(ring, S / ring): the positions each ring rank holds, dealt as the block deals them (:func:`work_chunks`)."""
    chunks = None
    if balanced:
        found = work_chunks(_work(seq_len, documents, causal, window), ring,
                            by_work=bool(documents) or window is not None)
        chunks = found[0] if found is not None else None
    layout = Layout(ring, ring, balanced, chunks)
    return torch.stack([layout.ring_positions(seq_len, r) for r in range(ring)])


def busiest_pairs(workload: Workload, ring: int, balanced: bool) -> float:
    """Attended (query, key) pairs per sequence of the ring position with the most, over ``ring`` shards."""
    w = workload
    return _busiest(w.seq_len, w.documents, w.causal, w.window, ring, balanced)


@functools.lru_cache(maxsize=256)
def _busiest(seq_len: int, documents: str | None, causal: bool, window: int | None, ring: int,
             balanced: bool) -> float:
    work = _work(seq_len, documents, causal, window)
    if ring == 1:
        return float(work.sum())
    return float(work[_positions(seq_len, documents, causal, window, ring, balanced)].sum(-1).max())


@functools.lru_cache(maxsize=64)
def _blocks(seq_len: int, documents: str | None, causal: bool, window: int | None, ring: int,
            balanced: bool) -> tuple[int, int]:
    positions = _positions(seq_len, documents, causal, window, ring, balanced)
    need = needs(positions, _ids(seq_len, documents), 1, causal, None if window is None else (window, 0))
    others = [[s for s in range(ring) if s != d] for d in range(ring)]
    return (max(sum(need[d][s] for s in others[d]) for d in range(ring)),
            max(sum(need[d][s] for d in others[s]) for s in range(ring)))


def ring_blocks(workload: Workload, ring: int, balanced: bool) -> tuple[int, int]:
    """(the most K/V blocks a ring rank receives, the most one sends) per pass over the ring: every other rank's
    under PyTorch's ring; under cptune's masked ring (documents or a window) only the blocks some query of the
    receiver attends (the send rule, :func:`cptune.attention.needs`)."""
    w = workload
    if ring == 1:
        return 0, 0
    if w.documents is None and w.window is None:
        return ring - 1, ring - 1
    return _blocks(w.seq_len, w.documents, w.causal, w.window, ring, balanced)

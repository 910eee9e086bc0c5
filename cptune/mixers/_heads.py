"""Gated DeltaNet and Mamba2 split over cp by heads (Qwen3.5, Qwen3-Next; Bamba, Granite 4): memory split like
Ulysses attention's.

Gated DeltaNet: inside a block of cp > 1 each rank projects its own tokens (the module's ``in_proj`` layers: query,
key, value, the gate's ``z``, ``b`` and ``a``), then one all-to-all trades sequence shards for head shards, as
Ulysses does for attention: each rank receives every token of cp-th of the key heads (with their value heads' value,
``b`` and ``a``) in sequence order, load balancing undone. On those heads it computes beta and the decay (its heads'
``A_log`` and ``dt_bias``: their gradients are summed over the whole sequence in one place, as one process sums
them), runs the depthwise short convolution (its channels split with the heads), the activation, and the model's own
chunked gated delta rule over the whole sequence; a second all-to-all hands each rank its tokens of every head back,
and the gated norm and ``out_proj`` run on its own tokens. A rank holds S x H/cp of the layer's activations (the
generic path holds S x H). Backward: each all-to-all's is the other.

Mamba2 (Bamba's mixer, :func:`_mamba2_forward`): the projection and the short convolution on the rank's own tokens
(the convolution by :func:`cptune.mixers._halo.halo_conv`), x and dt by the all-to-all to cp-th of the heads, B and C (one
per group of heads: small) gathered whole, the model's own chunked scan on those heads, the all-to-all back, the gated
norm and ``out_proj`` on the rank's tokens. (State passing between ranks, flash-linear-attention's route, would keep
every head on every rank and pass each rank's final state to the next: a serial chain of cp scans, or a second pass,
and a kernel that takes an initial state and returns its gradient; the all-to-all keeps the model's own kernel as it
is and runs every rank at once, as Megatron-Core's Mamba CP does.)

Packed documents: the convolution and the recurrence restart at each document (each is run on each document of the
sequence alone, as one process running each document alone). Exact: the same products and sums as the module's own
forward (float32 rounding).

A layer takes this path where :func:`splittable` recognizes it and :func:`fits` (its heads divide by cp); otherwise,
and wherever the block asks for the generic path (``CPConfig(mixers="whole")``), the generic path runs it
(:mod:`cptune.mixers._generic`); :mod:`cptune.mixers._choice` decides. Outside a block, or with cp = 1, the layer is called as it is.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._generic import GatherSequence, by_document
from .. import attention as _ulysses
from ..errors import Problem, raise_if

_PARTS = ("conv1d", "A_log", "dt_bias", "norm", "out_proj")
_PROJECTIONS = (("in_proj_qkvz", "in_proj_ba"), ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
"""Qwen3-Next's two projections (grouped per key head), Qwen3.5's four."""


def _deltanet(module: nn.Module) -> bool:
    """A Gated DeltaNet: a ``*GatedDeltaNet`` with its projections (one of :data:`_PROJECTIONS`), a depthwise causal
    ``conv1d`` over query, key and value, ``A_log``, ``dt_bias``, a gated ``norm`` and ``out_proj``."""
    conv = getattr(module, "conv1d", None)
    return (type(module).__name__.endswith("GatedDeltaNet") and all(hasattr(module, p) for p in _PARTS)
            and any(all(isinstance(getattr(module, n, None), nn.Linear) for n in names) for names in _PROJECTIONS)
            and isinstance(conv, nn.Conv1d) and conv.groups == conv.in_channels == module.conv_dim
            and conv.padding == (conv.kernel_size[0] - 1,) and _kernel(module) is not None)


@functools.lru_cache(maxsize=None)
def _bamba_form(cls: type) -> bool:
    """Whether ``cls`` is a Mamba2 mixer whose forward is Bamba's, word for word but its class's name (transformers
    copies it into Granite 4, Nemotron-H, Mamba2 and Zamba2; Falcon-H1's scales its projections, so it is not), in a
    release whose modeling file has the chunked scan as a function (5.x)."""
    import inspect
    import re

    try:
        from transformers.models.bamba import modeling_bamba
    except ImportError:
        return False
    if getattr(sys.modules[cls.__module__], "mamba2_chunk_scan", None) is None or not hasattr(cls, "forward"):
        return False

    def form(c: type) -> str:
        return re.sub(r"\b\w+(Mixer|MambaLayer)\b", "X", inspect.getsource(c.forward))

    try:
        return form(cls) == form(modeling_bamba.BambaMixer)
    except (OSError, TypeError):
        return False


def _mamba2(module: nn.Module) -> bool:
    return isinstance(getattr(module, "conv1d", None), nn.Conv1d) and isinstance(getattr(module, "in_proj", None),
                                                                                   nn.Linear) \
        and _bamba_form(type(module))


NAME = "heads"

def splittable(module: nn.Module) -> bool:
    """Whether ``module`` is a layer this path runs split: a Gated DeltaNet (Qwen3.5, Qwen3-Next) or a Mamba2 mixer
    of Bamba's form (Bamba, Granite 4; tested on both)."""
    return _deltanet(module) or _mamba2(module)


def fits(module: nn.Module, cp: int) -> bool:
    """Whether the heads divide over ``cp`` ranks (each rank takes whole heads; a Gated DeltaNet's key heads, each
    with its value heads)."""
    if _mamba2(module):
        return module.num_heads % cp == 0
    return module.num_k_heads % cp == 0 and module.num_v_heads % module.num_k_heads == 0


def _kernel(module: nn.Module):
    """The model's own chunked gated delta rule: the module's (transformers 4.57 kept it on the module) or its
    modeling file's torch one (5.x; flash-linear-attention's where transformers put it there)."""
    return getattr(module, "chunk_gated_delta_rule", None) or getattr(sys.modules[type(module).__module__],
                                                                       "torch_chunk_gated_delta_rule", None)


def _project(module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """query, key (b, s, nk, dk), value, z (b, s, nv, dv), b, a (b, s, nv) of this rank's tokens, by the module's
    own projections."""
    if hasattr(module, "in_proj_qkvz"):
        return module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden), module.in_proj_ba(hidden))
    batch, length = hidden.shape[:2]
    q, k, v = module.in_proj_qkv(hidden).split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    return (q.view(batch, length, -1, module.head_k_dim), k.view(batch, length, -1, module.head_k_dim),
            v.view(batch, length, -1, module.head_v_dim),
            module.in_proj_z(hidden).view(batch, length, -1, module.head_v_dim),
            module.in_proj_b(hidden), module.in_proj_a(hidden))


@functools.lru_cache(maxsize=64)
def _orders(layout, seq_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the global position of each slot of the ranks' shards laid end to end, rank after rank; the slot of each
    global position), or None where that is the sequence's own order."""
    if layout.contiguous:
        return None
    slots = torch.cat([layout.indices(seq_len, r) for r in range(layout.cp)])
    return slots, torch.empty_like(slots).index_copy_(0, slots, torch.arange(seq_len))


def to_heads(t: torch.Tensor, session) -> torch.Tensor:
    """(b, s, H, d) of this rank's tokens -> (b, S, H/cp, d): every token, in sequence order, of this rank's heads."""
    whole = _ulysses.seq_to_heads(t.transpose(1, 2), session.group, session.cp).transpose(1, 2)
    orders = _orders(session.layout, whole.shape[1])
    return whole if orders is None else whole.index_select(1, orders[1].to(t.device))


def to_sequence(t: torch.Tensor, session) -> torch.Tensor:
    """The inverse of :func:`to_heads`."""
    orders = _orders(session.layout, t.shape[1])
    t = t if orders is None else t.index_select(1, orders[0].to(t.device))
    return _ulysses.heads_to_seq(t.transpose(1, 2), session.group, session.cp).transpose(1, 2)


def _channels(module: nn.Module, rank: int, cp: int, device) -> torch.Tensor:
    """The convolution's channels of this rank's heads: its query, key and value channels, in that order."""
    nk, nv, dk, dv = module.num_k_heads // cp, module.num_v_heads // cp, module.head_k_dim, module.head_v_dim
    q = torch.arange(rank * nk * dk, (rank + 1) * nk * dk)
    v = torch.arange(rank * nv * dv, (rank + 1) * nv * dv) + 2 * module.key_dim
    return torch.cat([q, q + module.key_dim, v]).to(device)


def _mix(module: nn.Module, q, k, v, beta, g, weight) -> torch.Tensor:
    """The convolution, its activation and the gated delta rule of one run of tokens (a whole row, or a document of
    one): (b, L, nv_local, dv)."""
    from transformers.activations import ACT2FN

    batch, length, nk = q.shape[:3]
    mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1).transpose(1, 2)
    mixed = F.conv1d(mixed.to(weight.dtype), weight.unsqueeze(1), padding=weight.shape[-1] - 1,
                     groups=weight.shape[0])[..., :length]
    mixed = ACT2FN[module.activation](mixed).to(q.dtype).transpose(1, 2)
    q, k, v = mixed.split([q[0, 0].numel(), k[0, 0].numel(), v[0, 0].numel()], dim=-1)
    repeat = v.shape[-1] // module.head_v_dim // nk
    q = q.reshape(batch, length, nk, -1).repeat_interleave(repeat, dim=2)
    k = k.reshape(batch, length, nk, -1).repeat_interleave(repeat, dim=2)
    out, _ = _kernel(module)(q, k, v.reshape(batch, length, -1, module.head_v_dim), g=g, beta=beta,
                             initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    return out


def _deltanet_forward(module: nn.Module, hidden_states: torch.Tensor, session) -> torch.Tensor:
    batch, length = hidden_states.shape[:2]
    q, k, v, z, b, a = _project(module, hidden_states)
    nk, cp, rank = module.num_k_heads, session.cp, session.cp_rank
    # one all-to-all: each key head's query, key, and its value heads' value, b and a
    packed = torch.cat([q, k, *(t.reshape(batch, length, nk, -1) for t in (v, b, a))], dim=-1)
    packed = to_heads(packed, session)
    local, seq_len = nk // cp, packed.shape[1]
    dk, per_v = module.head_k_dim, module.num_v_heads // nk
    q, k, v, b, a = packed.split([dk, dk, per_v * module.head_v_dim, per_v, per_v], dim=-1)
    v, b, a = (v.reshape(batch, seq_len, local * per_v, -1), b.reshape(batch, seq_len, -1),
               a.reshape(batch, seq_len, -1))
    heads = slice(rank * local * per_v, (rank + 1) * local * per_v)  # this rank's value heads
    beta = b.sigmoid()
    decay = -module.A_log[heads].float().exp() * F.softplus(a.float() + module.dt_bias[heads])
    weight = module.conv1d.weight[:, 0].index_select(0, _channels(module, rank, cp, q.device))
    out = by_document(session, lambda q, rest: _mix(module, q, *rest, weight), q, {"rest": (k, v, beta, decay)})
    out = to_sequence(out, session)  # (b, s, nv, dv): this rank's tokens of every head
    out = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(out.reshape(batch, length, -1))


def _mamba2_forward(module: nn.Module, hidden_states: torch.Tensor, session) -> torch.Tensor:
    """Bamba's mixer: the projection and the short convolution on this rank's tokens (the convolution by a halo
    exchange), an all-to-all of x and dt to cp-th of the heads, B and C (one per group of heads: small) gathered
    whole, the model's own chunked scan on those heads over the whole sequence, an all-to-all back, then the gated
    norm and ``out_proj`` on this rank's tokens."""
    from transformers.activations import ACT2FN

    from ._halo import halo_conv

    batch, length = hidden_states.shape[:2]
    dtype, cp, rank = hidden_states.dtype, session.cp, session.cp_rank
    heads, width, states = module.num_heads, module.head_dim, module.n_groups * module.ssm_state_size
    gate, xbc, dt = module.in_proj(hidden_states).split([module.intermediate_size, module.conv_dim, heads], dim=-1)
    xbc = ACT2FN[module.activation](halo_conv(xbc, module.conv1d.weight[:, 0], module.conv1d.bias, session))
    x, B, C = xbc.split([module.intermediate_size, states, states], dim=-1)
    packed = to_heads(torch.cat([x.reshape(batch, length, heads, width), dt.unsqueeze(-1)], dim=-1), session)
    x, dt = packed[..., :width], packed[..., width]
    local = heads // cp
    mine = slice(rank * local, (rank + 1) * local)
    group = torch.arange(rank * local, (rank + 1) * local, device=x.device) // (heads // module.n_groups)
    B, C = (GatherSequence.apply(t, 1, session.group, session.layout, rank)
            .reshape(batch, -1, module.n_groups, module.ssm_state_size).index_select(2, group) for t in (B, C))
    scan = getattr(sys.modules[type(module).__module__], "mamba2_chunk_scan")
    A = -torch.exp(module.A_log[mine].float())

    def run(x, dt, B, C):
        return scan(x, dt, A, B, C, chunk_size=module.chunk_size, D=module.D[mine], dt_bias=module.dt_bias[mine],
                    dt_softplus=True, dt_limit=module.time_step_limit)

    out = to_sequence(by_document(session, lambda x, rest: run(x, *rest), x, {"rest": (dt, B, C)}),
                      session)  # (b, s, heads, width)
    out = module.norm(out.reshape(batch, length, module.intermediate_size), gate)
    return module.out_proj(out.to(dtype))


def split_forward(module: nn.Module, hidden_states: torch.Tensor, session, *args, **kwargs) -> torch.Tensor:
    """The layer (:func:`splittable`, its heads dividing by cp) on this rank's tokens inside a block of cp > 1
    (:mod:`cptune.mixers._choice` calls it)."""
    cache = kwargs.get("cache", kwargs.get("cache_params", args[0] if args else None))
    raise_if([] if cache is None else [Problem("use_cache", f"is on inside a block: a {type(module).__name__}'s "
                                                "recurrent state cannot be cached across CP ranks", "call the model "
                                                "with use_cache=False while training under cptune")])
    return (_mamba2_forward if _mamba2(module) else _deltanet_forward)(module, hidden_states, session)

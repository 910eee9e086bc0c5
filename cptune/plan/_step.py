"""The step model: one training step of a transformer under CP, per rank, predicted from first principles.

Time: dense FLOPs at the GEMM rate; attention FLOPs of the busiest rank (attended pairs, so packed
documents and windows cost what they attend, and an unbalanced causal split costs its heaviest
shard) at the attention kernel's rate, forward + backward (2.5x forward); elementwise traffic at
memory bandwidth; activation-checkpointing recompute; a fixed cost per layer pass. Communication:
each strategy's bytes per layer over the link its group crosses (NVLink inside a node, the network
across nodes): the ring's K/V blocks (forward, then K/V and float32 gradients backward; under
cptune's masked ring only the blocks some query of the receiver attends, :func:`ring_blocks`), Ulysses'
four all-to-alls each way, both for the hybrid, FSDP's all-gathers and reduce-scatter over dp x cp.
Overlap is explicit: the ring's point-to-point rotation (and cptune's masked ring, either rotation) hides behind
the block being computed, FSDP behind the layers' compute (all but the first gather); PyTorch's all-gather rotation
and Ulysses' all-to-alls are exposed. What is not hidden is reported as exposed communication.

Memory: parameters, gradients and AdamW states sharded by FSDP over dp x cp, the gathered layers,
activations per AC mode, the loss's working set (cptune's chunked loss: one chunk's float32 logits over this tp
rank's share of the vocabulary, and a float per token; ``loss: whole``: the whole logits), the attention's
temporaries and communication buffers, and the process's baseline. A mixture of experts (:mod:`._experts`) holds
every expert (FSDP gathers an MoE layer whole, or its E / ep under expert parallelism, which trades each routed
copy by all-to-all) and computes what a token goes through: its top-k experts. A vision-language model's tower
(:mod:`._tower`): its parameters, and with a video its frames' work and rows' trade."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ..models import keeps_tp_shards
from ..losses import chunk_tokens_for
from ..sizes import format_size
from ..attention import kv_replication
from ..config import CPConfig, decide_load_balance
from ..workload import Workload
from . import _experts, _mixer_step, _tower
from ._ring import busiest_pairs, kept_attention_layer, prefetches, ring_blocks, ring_buffer_bytes
from ._dims import ModelDims
from ._hardware import Hardware

BACKWARD = 2.5
"""Attention backward / forward FLOPs (flash: recompute QK^T, then dP, dV, dQ, dK)."""

RING_STEP_BYTES = {"forward": (29.5, 21.4), "backward": (11.5, 65.6)}
"""What the ring moves in memory per further ring step outside its kernels, in bytes per query element and per key
element (V has as many): forward, the float32 merge of the block's output and log-sum-exp (under load balancing half
the steps on half the queries) and K and V concatenated for the rotation; backward, the float32 dq, dk and dv
accumulated (half the steps a partial update, which clones) and dk, dv and K, V concatenated. Measured on CPU by
``python -m benchmarks.ring_traffic`` (PyTorch's ring's own operations, float32, from memory: caches flushed,
no fresh pages): 29.5 + 21.4 and 11.5 + 65.6."""


@dataclass(frozen=True)
class Point:
    """One configuration the plan ranks: CP over a (dp, cp) mesh, activation checkpointing, and how gradients
    are kept in step: ``fsdp`` (FSDP2 over dp x cp, as cptune's model steps and torchtitan train), ``allreduce``
    (replicated parameters), ``none`` (a forward + backward only, as a ``--workload`` step may measure)."""

    config: CPConfig
    ac: str = "none"
    sync: str = "fsdp"

    @property
    def fsdp(self) -> bool:
        return self.sync == "fsdp"

    def label(self) -> str:
        return f"{self.config.model_copy(update={'sdpa_backend': None}).label().replace(' default', '')} ac-{self.ac}"


@dataclass
class Prediction:
    """What the model predicts for one point: seconds and bytes per rank, and why it cannot run if so."""

    point: Point
    step_s: float
    tokens_per_s: float
    """The whole world's tokens per second (dp replicas x batch x sequence / step)."""
    tokens_per_s_per_gpu: float
    time: dict[str, float] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    peak_bytes: int = 0
    bottleneck: str = "compute"
    infeasible: str | None = None

    @property
    def compute_s(self) -> float:
        return self.time["compute"]

    @property
    def exposed_s(self) -> float:
        return self.time["exposed_communication"]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["point"] = {"label": self.point.label(), "config": self.point.config.model_dump(mode="json"),
                      "ac": self.point.ac, "sync": self.point.sync}
        return d


class _Links:
    def __init__(self, hw: Hardware, gpus_per_node: int) -> None:
        self.hw, self.per_node = hw, gpus_per_node

    def seconds(self, nbytes: float, messages: float, span: int) -> float:
        """Moving ``nbytes`` from one rank in ``messages`` messages within a group of ``span`` consecutive ranks."""
        link = self.hw.inter_node if span > self.per_node else self.hw.intra_node
        return nbytes / (link.GBps * 1e9 * self.hw.efficiency.communication) + messages * link.latency_us * 1e-6


def predict(dims: ModelDims, workload: Workload, point: Point, hw: Hardware, gpus_per_node: int = 8,
            budget: int | None = None, optimizer: bool = True, gemm_dtype: str | None = None) -> Prediction:
    """Predict one training step of ``dims`` on ``workload``'s sequences (``batch`` per dp replica) under ``point``.

    ``gemm_dtype``: the linear layers' dtype when it is not the workload's (``float8`` for Float8 training)."""
    w, c, eff = workload, point.config, hw.efficiency
    mesh = c.parallel_dims()
    dp, cp, tp = mesh.dp, mesh.cp, mesh.tp
    world = mesh.world
    ulysses, ring = c.degrees(cp)
    lb = decide_load_balance(c.load_balance, causal=w.causal, cp=cp, ring=ring, seq_len=w.seq_len).on
    e, b, s = w.itemsize, w.batch, w.seq_len
    tokens = b * s // cp  # this rank's tokens (before Ulysses' exchange); the same on each of its tp ranks
    # tensor parallelism splits what is between a layer's column- and row-parallel matmuls: heads, K/V and the
    # MLP's width; sequence parallelism splits the residual stream and its norms by token over tp (each block's
    # input gathered whole, kept by its column-parallel matmuls); the embeddings and the LM head stay whole
    h, hq, kv, vw, L = dims.hidden, dims.q_width // tp, dims.kv_width // tp, dims.v_width // tp, dims.layers
    mlp = _experts.mlp_terms(dims.experts, dims.ffn, h, L, tp, e)  # the MLPs' (an MoE's top-k experts, its router)
    gathered_in = 2 * h if tp > 1 else 0  # per token: the attention's and the MLP's whole inputs
    # kept for backward: whole under compile; as this tp rank's shard without AC (gathered again in backward,
    # cptune.models.keeps_tp_shards); under AC the recompute gathers them again
    keep_shards = tp > 1 and keeps_tp_shards(point.ac, w.compile)
    kept_in = gathered_in / tp if keep_shards else gathered_in
    kv_heads = dims.attended_kv_heads // tp
    heads = dims.heads // tp
    rep = kv_replication(heads, kv_heads, ulysses) if ulysses > 1 else 1
    kv_dim = (dims.head_dim + dims.value_dim) / 2  # a head's K and V, half each (MLA's are not as wide)
    kv_att = kv_heads * rep * kv_dim  # per token: K's and V's mean width as attention receives them
    block = 2 * b * (kv_heads * rep / ulysses) * (s // ring) * kv_dim * e  # one ring step's K and V
    exchanged = (2 * hq + 2 * kv_att) * e if ulysses > 1 else 0  # per token: what Ulysses swaps (q, k, v, out)
    # the point-to-point rotation, and cptune's masked ring with either one, send the next block during this one's
    prefetched = prefetches(c, w)
    received, sent = ring_blocks(w, ring, lb)
    hops = max(received, sent)  # ring steps whose transfer the busiest rank waits for (links are full duplex)
    links = _Links(hw, gpus_per_node)
    gemm_rate = hw.flops(gemm_dtype or w.dtype) * eff.gemm
    attn_rate = hw.flops(w.dtype) * eff.attention
    mem_rate = hw.memory_GBps * 1e9 * eff.memory

    # a hybrid's mixer layers (cptune.plan._mixer_step), the rest softmax attention
    mix = dims.mixer
    M = mix.layers if mix is not None else 0
    La = L - M
    mixing = _mixer_step.terms(mix, _mixer_step.path(mix, cp, c.mixers), tokens, cp, h, e) if M else None

    # -- compute -------------------------------------------------------------------------
    # the matmuls of what a token goes through (an MoE layer's top-k and shared experts, its router)
    matmul = (dims.active_layer_params / L - 2 * h) / tp if not dims.attention_only else 0
    # the LM head and loss: chunked, each tp rank its share of the vocabulary (recomputed in backward under tp); whole
    # (loss: whole), every tp rank the whole vocabulary
    head = 0 if dims.attention_only or not dims.vocab else dims.vocab / (tp if w.loss == "chunked" else 1)
    head_recompute = 2 * tokens * h * head if w.loss == "chunked" and tp > 1 else 0
    dense_fwd = 2 * tokens * (L * matmul + h * head)
    if mixing is not None:  # the generic path projects the whole sequence on every rank
        dense_fwd += M * (mixing.dense_flops - 2 * tokens * mix.params)
    pairs = busiest_pairs(w, ring, lb) * b
    attn_fwd = 2 * (dims.head_dim + dims.value_dim) * (heads / ulysses) * pairs * La + (
        M * mixing.recurrence_flops if M else 0)
    # elementwise traffic per token: the residual stream's and the heads' (split by tp), the gathered inputs, the MLP's
    per_token = 3 * hq if dims.attention_only else 14 * h / tp + gathered_in + mlp.elementwise
    expanded = 2 * hq if dims.kv_expanded else 0  # repeat_kv writes query-wide K and V (and autograd keeps them)
    per_token += expanded
    elem_fwd = tokens * L * per_token * e + tokens * head * 12
    dense_t, attn_fwd_t, elem_t = dense_fwd / gemm_rate, attn_fwd / attn_rate, elem_fwd / mem_rate
    # selective checkpointing keeps the matmuls and the ring's attention ops; without a ring (cp = 1, or
    # Ulysses alone) attention is a plain SDPA call, which the policies recompute like the elementwise ops
    kept_attention = ring > 1
    recompute = {"none": 0.0, "selective": elem_t + (0.0 if kept_attention else attn_fwd_t),
                 "full": dense_t + attn_fwd_t + elem_t}[point.ac]
    passes = 3 + (1 if point.ac != "none" else 0)
    overhead = eff.layer_overhead_ms * 1e-3 * L * passes
    attention_t = attn_fwd_t * (1 + BACKWARD)
    # each further ring step merges the block's output (forward, again when full AC recomputes it) and
    # accumulates dq, dk, dv (backward) in float32, and concatenates what rotates: RING_STEP_BYTES
    fwd_q, fwd_kv = RING_STEP_BYTES["forward"]
    bwd_q, bwd_kv = RING_STEP_BYTES["backward"]
    merge_passes = 2 if point.ac == "full" else 1
    per_step = merge_passes * (fwd_q * hq + fwd_kv * kv_att) + bwd_q * hq + bwd_kv * kv_att
    merge = La * received * tokens * per_step / mem_rate
    recompute += head_recompute / gemm_rate
    compute = 3 * dense_t + attention_t + 3 * elem_t + recompute + overhead + merge
    seen = _tower.terms(dims.tower, w.video_grid, b, cp, e, point.ac) if dims.tower and w.video_grid else None
    compute += _tower.seconds(seen, gemm_rate, attn_rate, point.ac) if seen is not None else 0.0

    # -- communication (per layer, this rank) -----------------------------------------------
    comm: dict[str, float] = {}
    exposed = 0.0
    if hops:
        fwd = links.seconds(hops * block, hops, cp * tp)  # the cp group's ranks lie tp apart
        bwd = links.seconds(hops * block * (1 + 4 / e), 2 * hops, cp * tp)
        passes_fwd = 2 if point.ac == "full" else 1
        ring_t = La * (passes_fwd * fwd + bwd)
        comm["ring"] = ring_t
        if prefetched:  # step k's block travels while step k-1's is computed
            hidden_by = (attention_t + (attn_fwd_t if point.ac == "full" else 0)) * (ring - 1) / ring
            exposed += max(0.0, ring_t - hidden_by)
        else:
            exposed += ring_t
    if tp > 1:  # a layer pass: the blocks' all-gathers and reduce-scatters (an all-reduce's bytes each pair), exposed
        one = links.seconds(2 * tokens * h * e * (tp - 1) / tp, 2 * (tp - 1), tp)
        # forward, backward, then the recompute: full AC's whole forward, selective's two all-gathers (and no AC's
        # when backward gathers the kept shards again)
        comm["tp"] = L * (2 + 2 + {"none": int(keep_shards), "selective": 1, "full": 2}[point.ac]) * one
        exposed += comm["tp"]
    if seen is not None and cp > 1:  # the tower's rows to the ranks that hold their placeholders, and back
        comm["vision"] = links.seconds(2 * seen.trade_bytes * (cp - 1) / cp, 2 * (cp - 1), cp * tp)
        exposed += comm["vision"]
    if ulysses > 1:
        one = links.seconds(tokens * exchanged * (ulysses - 1) / ulysses, 4 * (ulysses - 1), ulysses * tp)
        comm["ulysses"] = La * (2 + (1 if point.ac == "full" else 0)) * one
        exposed += comm["ulysses"]
    if mixing is not None and mixing.messages:  # the mixers' all-to-alls, gathers, all-reduces: exposed
        again = mixing.forward_bytes if point.ac == "full" else 0
        comm["mixers"] = M * links.seconds(mixing.forward_bytes + mixing.backward_bytes + again,
                                           mixing.messages * (3 if again else 2), cp * tp)
        exposed += comm["mixers"]
    sharded = mesh.dp_shard * cp  # FSDP2's ranks (each tp rank's own); HSDP replicates over dp_replicate
    ept = _experts.ep_terms(dims.experts, mesh.ep, L, tokens, h, e, point.ac, sharded // mesh.ep)  # None: no ep
    if ept is not None:  # each routed copy to its expert's rank and back: ep consecutive ranks
        comm["ep"] = ept.passes * links.seconds(ept.trade_bytes, ept.messages, mesh.ep * tp)
        exposed += comm["ep"]
    shards = sharded if point.fsdp else 1
    layer_p = dims.all_layer_params / L / tp  # a tp rank's share of a layer (its norms, a rounding here, whole)
    # what FSDP2 gathers for a layer (an MoE layer: every expert in it, or its E / ep under ep)
    unit_p, moved_p = ((dims.unit_params - ept.unit_less) / tp, layer_p - ept.layer_less / tp) if ept else \
        (dims.unit_params / tp, layer_p)
    root_p = dims.params - dims.all_layer_params
    if dims.params and world > 1:
        if point.fsdp and sharded > 1:  # the FSDP group's ranks lie tp apart: it spans cp x dp_shard x tp ranks
            per_layer = links.seconds(moved_p * (2 * e + 4) * (sharded - 1) / sharded, 3 * (sharded - 1), sharded * tp)
            r = ept.replicas if ept else 1  # a rank's own experts: over their replicas, ranks ep apart
            per_layer += links.seconds(ept.own_layer / tp * (2 * e + 4) * (r - 1) / r, 3 * (r - 1), sharded * tp) \
                if r > 1 else 0.0
            fsdp_t = L * per_layer + links.seconds(root_p, 3, sharded * tp)
            comm["fsdp"] = fsdp_t
            exposed += max(0.0, fsdp_t - compute) + per_layer  # the first gather is not hidden
        if point.fsdp and mesh.dp_replicate > 1:  # HSDP: each shard's gradient all-reduced across the replicas
            comm["hsdp"] = links.seconds(2 * 4 * (L * layer_p + root_p) / sharded, 2, world)
            exposed += comm["hsdp"]
        elif point.sync == "allreduce":
            comm["allreduce"] = links.seconds(2 * (L * layer_p + root_p) * 4 * (dp * cp - 1) / (dp * cp), 2, world)
            exposed += comm["allreduce"]
    step = compute + exposed
    time = {"dense": 3 * dense_t, "attention": attention_t, "elementwise": 3 * elem_t, "recompute": recompute,
            "ring_merge": merge, "overhead": overhead, "layer_passes": L * passes, "compute": compute, **{f"comm_{k}": v for k, v in comm.items()},
            "communication": sum(comm.values()), "exposed_communication": exposed}

    # -- memory (per rank) -----------------------------------------------------------------
    p = L * layer_p + root_p  # a tp rank's parameters, before FSDP2 shards them
    gathered = (2 * unit_p + dims.vocab * h) * e if point.fsdp and p and sharded > 1 else 0
    lse = heads * 4
    ring_extra = hq * 4 + lse if ring > 1 else 0
    if dims.attention_only:
        full_layer = kept_attention_layer(hq * e, ring, exchanged)
        kept = {"none": full_layer, "selective": full_layer, "full": hq * e}[point.ac]
    else:
        # what autograd keeps of a Llama-style block: two norms (input, normalized, output: 3h each; split by
        # token under sequence parallelism, where the blocks' gathered inputs are kept whole), q and k before and
        # after rotary, v, the attention's output and its transposed copy (MLA: its compressed q and kv too), the MLP's
        # (:func:`cptune.plan._experts.mlp_terms`); selective keeps the layer's input and the two row-parallel
        # matmuls' outputs (whole, before their reduce-scatter)
        latent = dims.latent.kept if dims.latent else 0
        attention = (6 * h / tp + kept_in + 4 * hq + 2 * kv + vw + expanded + latent) * e + lse + ring_extra + exchanged
        full_layer = attention + mlp.full
        selective = (h / tp + 2 * h + 2 * hq + kv + vw + latent / 2) * e + lse + ring_extra + exchanged + mlp.selective
        kept = {"none": full_layer, "selective": selective, "full": h * e / tp}[point.ac]
    per_layer = [(La, kept, full_layer)]
    if mixing is not None:  # a mixer layer: its norms, residual and MLP as attention's, the mixer's own (selective
        # keeps its matmuls' outputs: about all of it)
        full_mixer = 6 * h * e + mlp.full + mixing.kept_bytes / tokens
        per_layer.append((M, full_mixer if point.ac != "full" else h * e, full_mixer))
    # backward holds one layer's gradients (about its activations) besides what is kept; a checkpointed
    # layer's recomputed activations too: the largest layer's (an MoE layer's where the MLPs differ)
    largest = max(full for _, _, full in per_layer) + (0 if dims.attention_only else mlp.largest - mlp.full)
    activations = tokens * (sum(n * k for n, k, _ in per_layer) + largest + (largest if point.ac != "none" else 0))
    if w.loss == "whole":
        loss = tokens * head * (e + 8)  # the logits, their float32 copy and its gradient
    else:  # a chunk's, and each token's log-normalizer (vocabulary-parallel) or its target's logit
        loss = min(tokens, chunk_tokens_for(dims.vocab)) * head * (e + 8) + tokens * 4 if head else 0
    q_local = tokens * hq
    kv_local = tokens * kv_att
    temps = 2 * q_local * 4 + (3 * q_local + 4 * kv_local) * 4 // 2
    temps += int(ring_buffer_bytes(block, ring, c, w, received))
    temps += 2 * tokens * exchanged + (2 * ept.trade_bytes if ept else 0)  # Ulysses' and ep's send and receive
    memory = {"baseline": hw.baseline_bytes, "parameters": int(4 * p // shards), "gradients": int(4 * p // shards),
              "optimizer": int(8 * p // shards) if optimizer else 0, "gathered_layers": int(gathered),
              "activations": int(activations), "loss": int(loss), "attention_buffers": int(temps),
              **({"vision_tower": int(seen.kept_bytes + seen.largest_bytes)} if seen is not None else {})}
    tps = dp * b * s / step
    pred = Prediction(point=point, step_s=step, tokens_per_s=tps, tokens_per_s_per_gpu=tps / world, time=time,
                      memory=memory, peak_bytes=sum(memory.values()))
    return judge(pred, hw.memory_bytes if budget is None else budget)


def judge(pred: Prediction, budget: int) -> Prediction:
    """``pred`` with its peak and verdict set from its own figures (the step model's, or as calibrated): its peak is
    its memory parts summed, and it is infeasible when that exceeds ``budget``, whatever else it says; else its
    bottleneck, from the step model's exposed communication against its step (a tp row's: its collectives too)."""
    peak = sum(pred.memory.values())
    t = pred.time
    exposed, step = t["exposed_communication"], t["compute"] + t["exposed_communication"]
    infeasible = None
    if peak > budget:
        infeasible, bottleneck = f"predicted peak {format_size(peak)} > budget {format_size(budget)}", "memory"
    elif exposed > 0.25 * step:
        bottleneck = f"exposed communication ({exposed / step:.0%} of the step)"
    else:
        bottleneck = "compute" + (f" ({exposed / step:.0%} exposed communication)" if exposed > 0.01 * step else "")
    tp = pred.point.config.parallel_dims().tp
    if tp > 1:  # why a tp row wins or loses: its collectives against what it saves
        bottleneck += f"; tp{tp}: gathers and reduce-scatters {t['comm_tp'] / step:.0%} of the step, matmuls {tp}x narrower"
    return replace(pred, peak_bytes=peak, infeasible=infeasible, bottleneck=bottleneck)

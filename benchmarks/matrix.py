"""The support matrix: every family people train at long context, a tiny config from transformers' own config class,
checked against one process under cptune on real ranks. Each cell is exact (float32: loss within 1e-5, every
parameter gradient within 1e-4 of the largest of its tensor) or refused by name; anything else is a failure
(``tests/test_matrix.py`` runs it in CI and holds the table in docs/transformers.md to it).

    python -m benchmarks.matrix                 # prints the matrix; results in benchmarks/results/matrix-*.json
    python -m benchmarks.matrix --update-docs   # and writes it into docs/transformers.md and cptune/_proven.json

Cells: on 2 ranks the ring (load balanced) and Ulysses, each on two unpadded rows and on one row of packed
documents (position ids restarting per document); on 4 ranks tp2·cp2 (each decoder layer split by the family's own
TP plan with sequence parallelism, FSDP2 over cp), where the family has a TP plan. A family this transformers does
not have is left out (the floor lane runs the families 4.56 has).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from .matrix_docs import CP_CELLS, TP_CELL, documented, proven, short, table, update_docs, write_proven  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
FLOOR_NOISE, FLOOR_RUNS, FLOOR_MARGIN = 2.0 ** -21, 3, 10.0
"""A gradient beyond GRAD_TOL is still exact within FLOOR_MARGIN times the most that FLOOR_RUNS one-process runs move
it with each layer's output and its gradient perturbed by FLOOR_NOISE of their largest (4 units of float32's last
place: the masked ring merges a document's softmax blocks over several steps, each rounding): the reference's own
rounding floor (:func:`_rounding_floor`). tests/test_hybrid.py holds the generic path itself to 1e-5 on one layer fed
the same input."""
SEQ = 32
BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "attention_dropout": 0.0, "residual_dropout": 0.0}  # dropout is random: no run equals another
MOE = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_intermediate_size": 32,
       "num_experts_per_tok": 2, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
       "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1}
GDN = {"num_hidden_layers": 4, "linear_num_value_heads": 8, "linear_num_key_heads": 4, "linear_key_head_dim": 16,
       "linear_value_head_dim": 16}
MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1}
SLIDING = {"sliding_window": 8}
MLA = {**MOE, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
       "head_dim": 8, "num_key_value_heads": 4}  # DeepSeek's multi-head latent attention: a key per query head
FAMILIES: dict[str, dict] = {
    "llama": {}, "mistral": SLIDING, "qwen2": {}, "qwen3": {}, "qwen3_moe": MOE, "qwen3_next": {**MOE, **GDN},
    "qwen3_5_text": GDN, "gemma": {}, "gemma2": SLIDING, "gemma3_text": {**SLIDING, "final_logit_softcapping": 30.0}, "phi": {}, "phi3": {}, "olmo2": {},
    "olmo3": SLIDING, "olmoe": MOE, "granite": {"logits_scaling": 4.0}, "granitemoe": MOE,
    "deepseek_v3": MLA,
    "mixtral": MOE, "qwen2_moe": MOE, "gpt_oss": {**MOE, **SLIDING}, "glm4": {}, "glm4_moe": MOE, "smollm3": {},
    "cohere": {}, "cohere2": SLIDING, "ernie4_5": {}, "exaone4": SLIDING, "starcoder2": {}, "apertus": {},
    "seed_oss": {}, "lfm2": {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention"] * 2,
                             "block_ff_dim": 128},
    "bamba": {"num_hidden_layers": 4, "attn_layer_indices": [1, 3], **MAMBA2},
    "falcon_h1": {**MAMBA2, "mamba_d_ssm": 128, "lm_head_multiplier": 0.5},
    "jamba": {**MOE, "num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "mamba_d_state": 8, "mamba_dt_rank": 8},
    "granitemoehybrid": {**MOE, "num_hidden_layers": 4, "layer_types": ["mamba", "attention"] * 2, **MAMBA2},
    "minimax": {**MOE, "num_hidden_layers": 4},
    # a 10M-token window: chunked layers (chunks of 8 here) and NoPE layers whose query temperature steps every 4
    "llama4_text": {**MOE, "attention_chunk_size": 8, "no_rope_layers": [1, 0], "floor_scale": 4, "attn_scale": 0.5,
                    "intermediate_size_mlp": 128},
    "zamba2": {"num_hidden_layers": 4, "layers_block_type": ["mamba", "hybrid"] * 2, "mamba_headdim": 16,
               "n_mamba_heads": 8, "mamba_d_state": 16},  # a shared transformer block feeding its Mamba layers
    "deepseek_v32": {**MLA, "index_topk": 8, "index_n_heads": 2, "index_head_dim": 16},  # DSA: a sparse indexer
    "glm_moe_dsa": {**MLA, "index_topk": 8, "index_n_heads": 2, "index_head_dim": 16},
    "qwen4_exp_text": {**MOE, **GDN, "layer_types": ["linear_attention", "indexed_attention"] * 2, "hc_lowrank": 16,
                       "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 4},  # QSA
}
ACCEPTED = ("exact", "refused", "no plan", "no reference")
"""A cell's outcomes that are not failures: exact, refused by name, no TP plan, or one process (transformers alone,
without cptune) cannot train the family here, so there is nothing to be exact to (4.56's Jamba on a CPU)."""


def tiny_config(family: str):
    """``family``'s tiny config from transformers' own config class (None: this transformers has no such family)."""
    import transformers

    if family not in transformers.CONFIG_MAPPING:
        return None
    config = transformers.CONFIG_MAPPING[family](**{**BASE, **FAMILIES[family]})
    config.use_cache = False
    return config


def families() -> list[str]:
    """The families this transformers has."""
    return [f for f in FAMILIES if tiny_config(f) is not None]


def _batch(packed: bool):
    gen = torch.Generator().manual_seed(3)
    if packed:  # three documents in one row, positions restarting at each (DataCollatorWithFlattening's form)
        ids = torch.randint(3, 128, (1, SEQ), generator=gen)
        positions = torch.cat([torch.arange(n) for n in (11, 5, 16)]).view(1, SEQ)
        labels = ids.clone()
        labels[positions == 0] = -100
        return ids, labels, positions
    ids = torch.randint(3, 128, (2, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100
    return ids, labels, torch.arange(SEQ).expand(2, SEQ).contiguous()


def _relative(grad: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return (grad - want).abs().max().item() / scale if scale > 0 else (grad - want).abs().max().item()


def _documents(positions: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, end) of each document of a packed row (its positions restart at 0)."""
    starts = (positions[0] == 0).nonzero().flatten().tolist() + [positions.shape[1]]
    return list(zip(starts, starts[1:]))


def _one_process(model, ids, labels, positions, packed: bool) -> torch.Tensor:
    """One process's loss (the mean over counted labels), its backward done. A packed row is what packing means: its
    documents, each run alone (transformers 4.56's own forward of OLMoE and Qwen2-MoE attends across the documents
    of a packed row; 5.x's keeps to them, and so does cptune)."""
    import cptune

    if not packed:
        loss = model(input_ids=ids, position_ids=positions, labels=labels, use_cache=False).loss
        loss.backward()
        return loss
    total = torch.zeros(())
    for start, end in _documents(positions):
        logits = model(input_ids=ids[:, start:end], position_ids=positions[:, start:end], use_cache=False).logits
        total = total + torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), cptune.shift_labels(
            labels[:, start:end]).flatten(), reduction="sum")
    loss = total / (cptune.shift_labels(labels) != -100).sum()
    loss.backward()
    return loss


def _refused(exc: Exception) -> dict:
    return {"status": "refused", "message": str(exc)}


def _cp_cell(family: str, strategy: str, packed: bool, ac: str = "none", compile: bool = False) -> dict:
    """One family on this group's ranks under ``strategy``: loss and every parameter gradient against one process
    (the cp model built with ``ac`` and ``compile``, as the training paths build it)."""
    import torch.distributed as dist

    import cptune
    from cptune import models
    from cptune.hf import causal_lm_loss

    ids, labels, positions = _batch(packed)
    try:  # a config each: on 4.x the model's attention implementation is its config's, shared
        reference = models.build_model(tiny_config(family), "cpu")
        model = models.build_model(tiny_config(family), "cpu", ac=ac, compile=compile, cp=dist.get_world_size())
    except cptune.ValidationError as exc:
        return _refused(exc)
    reference.train()
    try:
        want = _one_process(reference, ids, labels, positions, packed)
    except Exception as exc:  # noqa: BLE001 - transformers itself cannot train it here (4.56's Jamba on a CPU)
        return {"status": "no reference", "message": f"one process: {type(exc).__name__}: {exc}"[:300]}
    shifted = cptune.shift_labels(labels)
    config_cp = cptune.CPConfig(strategy=strategy, rotate_method="alltoall")
    buffers = {"input_ids": ids, "shift_labels": shifted, "position_ids": positions}
    try:
        with cptune.context_parallel(buffers=buffers, seq_dims=dict.fromkeys(buffers, 1), config=config_cp):
            loss = causal_lm_loss(model, ids, shifted, position_ids=positions)  # no whole logits
            loss.backward()
    except cptune.ValidationError as exc:
        return _refused(exc)
    world = dist.get_world_size()
    loss = loss.detach()
    dist.all_reduce(loss)
    want_grads = _grads(reference)
    errors = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        errors[name] = _relative(g / world, want_grads[name])
    floor = _rounding_floor(reference, ids, labels, positions, packed, want_grads, errors)
    paths = sorted({m._cptune_path for m in model.modules() if hasattr(m, "_cptune_path")})
    return {**_judged(abs(loss.item() / world - want.item()), errors, floor), **({"paths": paths} if paths else {})}


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for name, p in model.named_parameters()}


def _rounding_floor(reference, ids, labels, positions, packed, want: dict[str, torch.Tensor],
                    errors: dict[str, float]) -> dict[str, float]:
    """Where a gradient is off by more than GRAD_TOL: how far float32's rounding alone moves it in one process. The
    reference runs again with every decoder layer's output, and the gradient flowing back into it, perturbed by
    FLOOR_NOISE of its largest: what another order of the same sums does, as cptune's ranks sum
    in another order. The most of FLOOR_RUNS draws. Gated DeltaNet's torch fallback moves some gradients (A_log,
    dt_bias: sums that nearly cancel) by 1e-3 so."""
    if max(errors.values(), default=0.0) <= GRAD_TOL:
        return {}
    from cptune import models

    def noisy(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        return t + FLOOR_NOISE * t.abs().max() * torch.randn(t.shape, generator=gen, dtype=t.dtype)

    floor = dict.fromkeys(want, 0.0)
    for seed in range(FLOOR_RUNS):
        gen = torch.Generator().manual_seed(seed)

        def perturb(module, args, out):
            first = out[0] if isinstance(out, tuple) else out
            first = noisy(first, gen)
            first.register_hook(lambda g: noisy(g, gen))
            return (first, *out[1:]) if isinstance(out, tuple) else first

        reference.zero_grad()
        handles = [layer.register_forward_hook(perturb) for layer in models.decoder_layers(reference)]
        try:
            _one_process(reference, ids, labels, positions, packed)
        finally:
            for handle in handles:
                handle.remove()
        for name, g in _grads(reference).items():
            floor[name] = max(floor[name], _relative(g, want[name]))
    return floor


def _judged(loss_err: float, errors: dict[str, float], floor: dict[str, float] | None = None) -> dict:
    """Exact: the loss within LOSS_TOL, every gradient within GRAD_TOL or within FLOOR_MARGIN times what float32's
    rounding alone moves it in one process (:func:`_rounding_floor`)."""
    floor = floor or {}
    over = {name: e for name, e in errors.items() if e > max(GRAD_TOL, FLOOR_MARGIN * floor.get(name, 0.0))}
    grad_err = max(errors.values(), default=0.0)
    cell = {"status": "exact" if loss_err <= LOSS_TOL and not over else "wrong", "loss_err": loss_err,
            "grad_err": grad_err}
    if grad_err > GRAD_TOL:  # the worst gradient beyond GRAD_TOL and one process's own rounding floor for it
        worst = max(errors, key=errors.get)
        cell.update(worst=worst, floor=floor.get(worst, 0.0))
    return cell


def _tp_cell(family: str) -> dict:
    """tp2·cp2 on 4 ranks: the family split by its own TP plan, FSDP2 over cp, against one process."""
    import cptune
    from cptune import models
    from cptune.mesh import ParallelDims

    dims = ParallelDims(1, 1, 2, 2)
    try:
        reference = models.build_model(tiny_config(family), "cpu")
        model = models.build_model(tiny_config(family), "cpu", fsdp_mesh=dims.model_mesh("cpu"), ac="none",
                                    cp=dims.cp)
    except cptune.ValidationError as exc:
        return _refused(exc)
    ids, labels, positions = _batch(False)
    labels = cptune.shift_labels(labels)

    def loss_of(m, block=None):
        logits = m(input_ids=ids, position_ids=positions).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return loss / (block.num_items_in_batch(labels) if block is not None else (labels != -100).sum())

    reference.train()
    want = loss_of(reference)
    want.backward()
    cp_config = cptune.CPConfig(mesh_shape=dims.shape)
    try:
        with cptune.context_parallel(buffers=[ids, labels, positions], seq_dims=[1, 1, 1], config=cp_config) as b:
            loss = loss_of(model, b)
            loss.backward()
    except cptune.ValidationError as exc:
        return _refused(exc)
    import torch.distributed as dist

    loss = loss.detach()
    dist.all_reduce(loss)  # FSDP2 averages over the cp ranks: each holds cp x its share, once per tp rank
    grads = dict(reference.named_parameters())
    errors = {name: _relative(p.grad.full_tensor(), grads[name].grad) for name, p in model.named_parameters()}
    return _judged(abs(loss.item() / dims.world - want.item()), errors)


def _caught(cell, *args) -> dict:
    """A cell, an error that is not cptune's refusal kept as the cell's failure (the matrix goes on)."""
    try:
        return cell(*args)
    except Exception as exc:  # noqa: BLE001 - any other error is what the matrix reports, by family
        return {"status": "error", "message": f"{type(exc).__name__}: {exc}"[:500]}


def _family_cells(names: list[str], cells: dict[str, tuple[str, bool]]) -> dict[str, dict[str, dict]]:
    return {family: {label: _caught(_cp_cell, family, strategy, packed) for label, (strategy, packed) in cells.items()}
            for family in names}


def _tp_cells(names: list[str]) -> dict[str, dict]:
    return {family: _caught(_tp_cell, family) for family in names}


def has_tp_plan(family: str) -> bool:
    config = tiny_config(family)
    text = getattr(config, "get_text_config", lambda: config)()
    return bool(getattr(text, "base_model_tp_plan", None))


def run(group2, group4=None, names: list[str] | None = None) -> dict[str, dict[str, dict]]:
    """The matrix over ``names`` (default: every family this transformers has): rank 0's cells, every rank's
    agreeing (a cell where ranks disagree is a failure: 'disagree')."""
    names = families() if names is None else names
    per_rank = group2.run(_family_cells, names, CP_CELLS)
    matrix = _agreed(per_rank)
    if group4 is not None:
        tp_names = [f for f in names if has_tp_plan(f)]
        tp = _agreed([{f: {TP_CELL: c} for f, c in r.items()} for r in group4.run(_tp_cells, tp_names)])
        for family in names:
            matrix[family][TP_CELL] = tp.get(family, {}).get(TP_CELL, {"status": "no plan"})
    return matrix


def _agreed(per_rank: list[dict]) -> dict:
    first = per_rank[0]
    for family, cells in first.items():
        for label, cell in cells.items():
            if any(r[family][label]["status"] != cell["status"] for r in per_rank[1:]):
                cell["status"] = "disagree"
            cell["grad_err"] = max((r[family][label].get("grad_err", 0.0) for r in per_rank), default=0.0)
    return first


def main(argv: list[str]) -> int:
    import transformers

    from cptune.launch import WorkerGroup

    start = time.time()
    group2, group4 = WorkerGroup(2, timeout=300), WorkerGroup(4, timeout=300)
    try:
        matrix = run(group2, group4)
    finally:
        group2.close()
        group4.close()
    text = table(matrix, transformers.__version__)
    print(text)
    bad = [(f, c) for f, cells in matrix.items() for c, cell in cells.items()
           if cell["status"] not in ACCEPTED]
    print(f"{len(matrix)} families, {sum(len(c) for c in matrix.values())} cells, {len(bad)} neither exact nor "
          f"refused {bad}; {time.time() - start:.0f} s")
    out = ROOT / "benchmarks" / "results" / f"matrix-{transformers.__version__}-{time.strftime('%Y%m%d-%H%M')}.json"
    out.write_text(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                               "matrix": matrix}, indent=1, default=str))
    if "--update-docs" in argv:
        update_docs(text, transformers.__version__)
        write_proven(matrix, transformers.__version__)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

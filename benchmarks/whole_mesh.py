"""The whole mesh on 8 CPU ranks, once: dp_replicate 2 x dp_shard 1 x cp 2 x tp 2 (HSDP across the two replicas,
FSDP2 over cp inside each, each decoder layer split by the model's own TP plan, the sequence by CP), against one
process. Too slow for the suite on 2 cores (8 gloo ranks); the same code paths run on 4 ranks there.

    python -m benchmarks.whole_mesh            # prints the errors; results in benchmarks/results/whole-mesh-*.json

A bf16 Llama checkpoint in several files is loaded straight into the shards; each replica trains on its own row of
the global batch, its loss normalized by the tokens of the whole batch (``num_items_in_batch``); two AdamW steps.
Reported: the largest logit, gradient (first step) and loss (both steps) errors against one process that takes the
whole batch, and the share of each kind of weight a rank holds.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
DIMS = (2, 1, 2, 2)
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def _losses(model, ids, labels, positions, optimizer, block_for):
    """Two AdamW steps: (losses, logits and gradients of the first)."""
    losses, first = [], None
    for _ in range(2):
        with block_for() as block:
            logits = model(input_ids=ids, position_ids=positions).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            items = block.num_items_in_batch(labels) if block is not None else (labels != -100).sum()
            (loss / items).backward()
            whole = block.unshard(logits.detach(), 1) if block is not None else logits.detach()
        total = (loss / items).detach()
        if block is not None:
            dist.all_reduce(total)  # each dp x cp rank's loss is the mean's over dp x cp ranks, counted tp times
            total /= dist.get_world_size()
        losses.append(total.item())
        if first is None:
            first = whole, {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                            for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return losses, first


def rank_case(folder: str) -> dict:
    import contextlib

    import transformers

    import cptune
    from cptune import models
    from cptune.mesh import ParallelDims

    dims = ParallelDims(*DIMS)
    ids = (torch.arange(2 * 32).view(2, 32) * 7) % 256
    labels, positions = cptune.shift_labels(ids), torch.arange(32).expand(2, 32).contiguous()
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                  attn_implementation="sdpa")
    want_losses, (want_logits, want_grads) = _losses(reference, ids, labels, positions,
                                                     torch.optim.AdamW(reference.parameters(), lr=1e-2),
                                                     lambda: contextlib.nullcontext())
    model = models.build_model(models.load_config(folder), "cpu", weights=folder, fsdp_mesh=dims.model_mesh("cpu"),
                               ac="none")
    rows = cptune.replica_rows(2, config={"mesh_shape": DIMS})
    mine = [t[rows].contiguous() for t in (ids, labels, positions)]
    config = cptune.CPConfig(mesh_shape=DIMS)
    losses, (logits, grads) = _losses(model, *mine, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      lambda: cptune.context_parallel(buffers=list(mine), seq_dims=[1, 1, 1],
                                                                      config=config))
    shares = sorted({round(p.to_local().numel() / p.numel(), 4) for p in model.parameters()})
    return {"logits": (logits - want_logits[rows]).abs().max().item(),
            "grads": max((grads[n] - g).abs().max().item() for n, g in want_grads.items()),
            "losses": max(abs(a - b) for a, b in zip(losses, want_losses)), "shares": shares}


def main() -> None:
    import transformers

    from cptune import models
    from cptune.launch import WorkerGroup

    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(json.dumps(CONFIG))
        config = models.load_config(tmp)
        torch.manual_seed(3)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16)
        model.config.dtype = torch.bfloat16
        model.save_pretrained(Path(tmp, "model"), max_shard_size="60KB")
        files = len(list(Path(tmp, "model").glob("*.safetensors")))
        with WorkerGroup(8, timeout=600) as group:
            results = group.run(rank_case, str(Path(tmp, "model")))
    worst = {k: max(r[k] for r in results) for k in ("logits", "grads", "losses")}
    line = (f"dp_replicate 2 x dp_shard 1 x cp 2 x tp 2 on 8 CPU ranks, a bf16 checkpoint in {files} files: "
            f"logits {worst['logits']:.1e}, gradients {worst['grads']:.1e}, losses (2 AdamW steps) "
            f"{worst['losses']:.1e} from one process; a rank holds {results[0]['shares']} of each weight "
            f"({time.time() - start:.0f} s)")
    print(line)
    out = ROOT / "benchmarks/results" / f"whole-mesh-{time.strftime('%Y%m%d-%H%M')}.json"
    out.write_text(json.dumps({"dims": DIMS, "files": files, "errors": worst, "ranks": results, "line": line,
                               "torch": torch.__version__, "transformers": transformers.__version__}, indent=2))
    sys.exit(0 if max(worst.values()) <= 1e-5 else 1)


if __name__ == "__main__":
    main()

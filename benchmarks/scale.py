"""A model bigger than a rank, on 4 CPU ranks: its float32 parameters, gradients and AdamW states are at least 3x
one rank's memory budget, yet ``cptune search --model`` measures it within that budget and
``examples/train_hf.py`` trains it from the recipe; each rank's build peak beside the shard it keeps.

    python -m benchmarks.scale                       # builds (sharded and whole), search, training
    python -m benchmarks.scale --no-whole --trials 1   # the sharded build only, one trial

The budget is a third of the states, so a smaller model leaves too little of it for what every rank holds besides
its shard (the interpreter with torch and transformers, 0.3 GiB): the default is 240 layers at 32 tokens (the
suite's test, 180 at 8); a few layers are refused by the search, by name, before any rank starts.

Build peaks: a rank's peak RSS (each rank a fresh process) while ``cptune.models.build_model`` makes the model
(``VmHWM`` reset before, read after: the rise), beside its shard (parameters it keeps, float32) and the largest unit
materialized at once (a decoder layer, or the root's embedding, norm and head); the bound is 1.25 x (shard + largest
unit).
``--whole``: the same for the whole-model build it replaced (``from_config`` on every rank, then FSDP2).
Results: benchmarks/results/scale-<stamp>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOUND = 1.25


def model_config(layers: int, hidden: int = 512, intermediate: int = 1408, heads: int = 8, kv_heads: int = 8,
                 vocab: int = 4096) -> dict:
    """A Llama of 512 hidden, 1408 MLP, 8 heads: 3.2M parameters a layer (many small layers: a rank's
    transients, a gathered layer or two, stay small beside its shard), a small vocabulary; or other sizes
    (:data:`EMBEDDING_HEAVY`: issue 52's Mistral, whose embedding and head are each 2.8 decoder layers)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "tie_word_embeddings": False}


EMBEDDING_HEAVY = {"layers": 16, "hidden": 1024, "intermediate": 2816, "heads": 16, "kv_heads": 8, "vocab": 32000}
"""970 MiB of float32: 16 decoder layers of 45 MiB, an embedding and an LM head of 125 MiB each."""
LAYER_BOUND = 1.5
"""A sharded build's rise on every rank: at most 1.5 x (its shard + one decoder layer) (issue 52)."""


def sizes(config: dict) -> dict:
    """Parameters of the whole model, of a decoder layer and of the root (what is outside the layers)."""
    h, f, v, L = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["num_hidden_layers"]
    kv = h * config["num_key_value_heads"] // config["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    root = v * h * (1 if config["tie_word_embeddings"] else 2) + h
    return {"params": L * layer + root, "layer": layer, "root": root}


def write_model(folder: Path, layers: int, **sizes_: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model_config(layers, **sizes_)))
    return folder


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def build_rank(model: str, whole: bool) -> dict:
    """On one rank of a fresh group: build the model (sharded, or whole then FSDP2); this rank's figures."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cptune import models

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    config = models.load_config(model)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_kb("VmRSS") * 1024
    t0 = time.perf_counter()
    if whole:
        import transformers

        built = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        models.prepare_for_training(built, fsdp_mesh=mesh)
    else:
        built = models.build_model(config, "cpu", fsdp_mesh=mesh, ac="none")
    seconds = time.perf_counter() - t0
    rise = _status_kb("VmHWM") * 1024 - before
    shard = sum(p.to_local().numel() * 4 for p in built.parameters())
    return {"rank": dist.get_rank(), "rise": rise, "shard": shard, "seconds": seconds}


def build_peaks(model: Path, ranks: int, whole: bool) -> list[dict]:
    """Each rank's build figures, from ``ranks`` processes started for this build alone (forked from cptune's fork
    server, which imported torch and cptune once: each rank as fresh as a torchrun rank, without its imports)."""
    from cptune.launch import WorkerGroup

    with WorkerGroup(ranks, timeout=1200) as group:
        return group.run(build_rank, str(model), whole)


def search_and_train(model: Path, ranks: int, budget: int, work: Path, trials: int = 2, steps: int = 2,
                     margin: float | None = None, seq_len: int = 32) -> dict:
    """``cptune search --model`` at ``seq_len`` tokens under ``budget`` (``trials`` configurations; ``margin``: its
    --memory-margin, default the search's), then ``cptune launch`` of its recipe (``steps`` steps; 0: not launched)."""
    cmd = [sys.executable, "-m", "cptune", "search", "--model", str(model), "--seq-len", str(seq_len),
           "--nproc", str(ranks),
           "--memory-budget", f"{budget // 2**20}MiB", "--n-trials", str(trials), "--min-seconds", "0", "--storage",
           f"sqlite:///{work}/scale.db", "--out", str(work / "scale.yaml"),
           *(["--memory-margin", str(margin)] if margin is not None else [])]
    t0 = time.perf_counter()
    found = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=2400)
    search_s = time.perf_counter() - t0
    if found.returncode != 0:
        raise RuntimeError(found.stdout[-3000:] + found.stderr[-3000:])
    import cptune

    recipe = cptune.load_recipe(work / "scale.yaml")
    searched = {"search_command": " ".join(cmd[1:]), "search_s": search_s, "best": recipe.config.label(),
                "search_peak_per_rank": recipe.metrics.peak_bytes_per_rank, "search_table": found.stdout,
                "search_tokens_per_s": recipe.metrics.tokens_per_s}
    if not steps:
        return searched
    train = [sys.executable, "-m", "cptune", "launch", str(work / "scale.yaml"), "--", str(ROOT / "examples/train_hf.py"),
             "--steps", str(steps), "--losses-out", str(work / "losses.json")]
    t0 = time.perf_counter()
    trained = subprocess.run(train, cwd=work, capture_output=True, text=True, timeout=2400)
    train_s = time.perf_counter() - t0
    if trained.returncode != 0:
        raise RuntimeError(trained.stdout[-3000:] + trained.stderr[-3000:])
    losses = json.loads((work / "losses.json").read_text())
    return {**searched, "train_s": train_s, "losses": losses["losses"], "train_peak_per_rank": losses.get("peaks")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=240)
    parser.add_argument("--trials", type=int, default=2, help="Configurations the search measures")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--whole", action=argparse.BooleanOptionalAction, default=True,
                        help="Also measure the whole-model build (every rank holds the model once)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = write_model(work / "model", args.layers)
        n = sizes(model_config(args.layers))
        states = 16 * n["params"]
        budget = states // 3 // 2**20 * 2**20  # MiB: as --memory-budget takes it
        largest = 4 * max(n["layer"], n["root"])
        result = {"layers": args.layers, "ranks": args.ranks, **n, "states_bytes": states, "budget_bytes": budget,
                  "largest_unit_bytes": largest, "sharded": build_peaks(model, args.ranks, False)}
        for r in result["sharded"]:
            r["bound"] = BOUND * (r["shard"] + largest)
            r["ratio"] = r["rise"] / (r["shard"] + largest)
        if args.whole:
            result["whole"] = build_peaks(model, args.ranks, True)
        result.update(search_and_train(model, args.ranks, budget, work, args.trials))
    gib = 2**30
    print(f"model: {n['params'] / 1e6:.0f}M parameters ({args.layers} layers); float32 parameters + gradients + "
          f"AdamW {states / gib:.2f}GiB = {states / budget:.2f} x the budget {budget / gib:.2f}GiB per rank")
    for r in result["sharded"]:
        print(f"  rank {r['rank']}: sharded build peak {r['rise'] / gib:.3f}GiB = {r['ratio']:.2f} x (shard "
              f"{r['shard'] / gib:.3f}GiB + largest unit {largest / gib:.3f}GiB), {r['seconds']:.1f}s")
    for r in result.get("whole", []):
        print(f"  rank {r['rank']}: whole build peak {r['rise'] / gib:.3f}GiB, {r['seconds']:.1f}s")
    print(f"search: best {result['best']}, measured peak per rank "
          f"{', '.join(f'{b / gib:.2f}GiB' for b in result['search_peak_per_rank'])} (budget {budget / gib:.2f}GiB), "
          f"{result['search_s']:.0f}s")
    print(f"train: losses {', '.join(f'{x:.4f}' for x in result['losses'])}; peak per rank "
          f"{', '.join(f'{b / gib:.2f}GiB' for b in result['train_peak_per_rank'] or [])}, {result['train_s']:.0f}s")
    out = ROOT / "benchmarks/results" / f"scale-{time.strftime('%Y-%m-%d-%H%M')}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"written: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

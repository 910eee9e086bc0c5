"""A long-video training step split over cp, measured: one step (forward, backward) of a narrow Qwen2.5-VL on one long
video on 4 CPU ranks (cp4, the ring load balanced) against one process on the whole sequence, float32. Each rank's
peak rise over the step (the worst rank's) over one process's, and the tower's time on the slowest rank over the
mean, for:

* cptune: the tower's temporal patches dealt over the ranks by cost, each row sent to the rank that holds its
  placeholder (:mod:`cptune.vision`);
* the way peers do it (ms-swift's and VeOmni's sequence parallelism for Qwen2.5-VL): the tower whole on every rank,
  each rank keeping its own placeholders' rows, then the language model's sequence split.

Issue 59's goals: a rank's peak <= 0.35x one process's, the tower's slowest rank <= 1.15x the mean; and a video that
one process cannot hold in ``--budget`` (each rank's memory in a search) while every cp4 rank can.

    python -m benchmarks.vision_memory                      # 512 temporal patches (1,024 frames): 32K+ tokens
    python -m benchmarks.vision_memory --frames 256         # 512 frames: 16K+ tokens
    python -m benchmarks.vision_memory --report benchmarks/results/vision-memory-<stamp>.json

Results: benchmarks/results/vision-memory-<stamp>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .report import run_json, save_results

ROOT = Path(__file__).resolve().parents[1]
GRID = (16, 16)
"""Each temporal patch's height and width in patches (14 pixels each): 64 tokens after the 2 x 2 merge."""
TEXT = 256
"""Tokens of text around the video."""


def config():
    import transformers

    text = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1 << 20,
            "rope_parameters": {"rope_type": "default", "mrope_section": [16, 8, 8], "rope_theta": 1e6}}
    tower = {"depth": 2, "hidden_size": 128, "intermediate_size": 256, "num_heads": 2, "out_hidden_size": 256,
             "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112,
             "fullatt_block_indexes": [1], "in_channels": 3}
    made = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=tower, image_token_id=2000,
                                         video_token_id=2001, vision_start_token_id=2002, vision_end_token_id=2003)
    made.use_cache = False
    return made


def video(frames: int):
    """(ids, pixel values, grid) of one row: text, the video's placeholders, text; padded to a multiple of 8."""
    import torch

    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor([[frames, *GRID]])
    tokens = frames * GRID[0] * GRID[1] // 4
    head = torch.randint(0, 2000, (TEXT // 2,), generator=gen)
    tail = torch.randint(0, 2000, (TEXT // 2 + (-(tokens + TEXT + 2)) % 8,), generator=gen)
    ids = torch.cat([head, torch.tensor([2002]), torch.full((tokens,), 2001), torch.tensor([2003]), tail]).view(1, -1)
    pixels = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14, generator=gen)
    return ids, pixels, grid


def _peers(found, plan_for) -> None:
    """The tower whole on every rank, each rank keeping its own placeholders' rows (no trade)."""
    original = type(found).get_video_features.__get__(found)

    def whole_then_keep(pixels, grid=None, **kwargs):
        out = original(pixels, grid, **kwargs)
        out.pooler_output = (torch_cat(out.pooler_output).index_select(0, plan_for(grid)),)
        return out

    found.get_video_features = whole_then_keep


def torch_cat(rows):
    import torch

    return torch.cat(list(rows)) if isinstance(rows, (list, tuple)) else rows


def rank_job(mode: str, frames: int) -> None:
    """One step measured: ``one`` (one process), or on each rank (torchrun) ``cptune`` / ``peers``."""
    import json

    import torch
    import torch.distributed as dist
    import transformers

    import cptune
    import cptune.hf
    from cptune import vision as V
    from cptune.attention import Layout

    from .loss import _measure

    torch.set_num_threads(1 if mode != "one" else 2)
    _, world, rank = cptune.init_rank()
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config())
    model.train()
    cptune.hf.enable(model)
    found = model.model
    ids, pixels, grid = video(frames)
    positions = cptune.hf.position_ids(model, ids, video_grid_thw=grid)
    labels = ids.clone()
    labels[ids >= 2000] = -100
    labels = cptune.shift_labels(labels)
    if mode == "peers":  # the rows this rank's placeholders need, in its load-balanced (head-tail) order
        layout = Layout(world, world, True)
        held = [layout.indices(ids.shape[1], r) for r in range(world)]

        def plan_for(g):
            units = V.units(g.cpu(), 2, 128)
            return V.routing(ids == 2001, held, units, V.deal(units, world)).needed[rank]
        _peers(found, plan_for)
    tower_seconds = []
    forward = found.visual.forward

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            tower_seconds.append(time.perf_counter() - start)

    found.visual.forward = timed
    config_ = cptune.CPConfig(mesh_shape=(1, world), load_balance=world > 1)

    def call():
        with cptune.context_parallel(buffers={"input_ids": ids, "labels": labels, "position_ids": positions},
                                     seq_dims={"input_ids": 1, "labels": 1, "position_ids": 2}, config=config_):
            cptune.hf.causal_lm_loss(model, ids, labels, position_ids=positions, pixel_values_videos=pixels,
                                     video_grid_thw=grid).backward()
        model.zero_grad(set_to_none=True)

    got = _measure(call, repeats=1)
    got["tower_seconds"] = tower_seconds[-1]
    every = [got]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, got)
    if rank == 0:
        towers = [r["tower_seconds"] for r in every]
        print(json.dumps({"peak_rise": max(r["peak_rise"] for r in every), "seconds": max(r["seconds"] for r in every),
                          "tower_max": max(towers), "tower_mean": sum(towers) / len(towers), "ranks": world,
                          "tokens": ids.shape[1], "frames": 2 * frames}))
    cptune.close_rank()


def report(results: dict) -> None:
    gib = 2 ** 30
    one, budget = results["one"], results["budget_gib"] * gib
    print(f"narrow Qwen2.5-VL, one video of {results['frames'] * 2} frames ({results['frames']} temporal patches of "
          f"{GRID[0]}x{GRID[1]} patches), {one['tokens']} tokens, float32, one step (forward + backward)")
    print(f"  one process: peak rise {one['peak_rise'] / gib:.2f} GiB ({'over' if one['peak_rise'] > budget else 'within'}"
          f" a {results['budget_gib']:g} GiB budget), {one['seconds']:.1f} s")
    for mode, label in (("cptune", "cptune (tower split)"), ("peers", "peers (tower whole on every rank)")):
        r = results[mode]
        if "failed" in r:
            print(f"  cp4 ring lb, {label}: {r['failed']}")
            continue
        print(f"  cp4 ring lb, {label}: worst rank's peak rise {r['peak_rise'] / gib:.2f} GiB = "
              f"{r['peak_rise'] / one['peak_rise']:.2f}x one process's ({'over' if r['peak_rise'] > budget else 'within'}"
              f" the budget), step {r['seconds']:.1f} s = {r['seconds'] / one['seconds']:.2f}x; tower on the slowest "
              f"rank {r['tower_max']:.2f} s = {r['tower_max'] / r['tower_mean']:.2f}x the mean", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=512, help="temporal patches (2 frames each)")
    parser.add_argument("--budget", type=float, default=2.0, help="a rank's memory for the step, GiB")
    parser.add_argument("--report", metavar="RESULTS", help="print a saved run's figures")
    parser.add_argument("--rank-job", default=None)
    args = parser.parse_args(argv)
    if args.rank_job:
        rank_job(args.rank_job, args.frames)
        return 0
    if args.report:
        import json

        report(json.loads(Path(args.report).read_text()))
        return 0
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    job = ["-m", "benchmarks.vision_memory", "--frames", str(args.frames), "--rank-job"]
    results = {"frames": args.frames, "budget_gib": args.budget, "one": run_json([sys.executable, *job, "one"], ROOT)}
    for mode in ("cptune", "peers"):
        try:
            results[mode] = run_json([*torchrun, *job, mode], ROOT)
        except RuntimeError as exc:  # a rank killed for memory: 4 ranks did not fit this machine
            results[mode] = {"failed": "killed (SIGKILL: out of memory)" if "SIGKILL" in str(exc) else str(exc)[-300:]}
    report(results)
    save_results(ROOT, "vision-memory", results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

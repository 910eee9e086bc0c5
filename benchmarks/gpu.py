"""GPU benchmark (one GPU, under 8 minutes): ring check, SDPA backend sweep at cp=1, memory-model calibration.

    python -m benchmarks.gpu                   # on a machine with a CUDA GPU
    python -m benchmarks.gpu --smoke           # a tiny CPU run of the same code path (CI)

0. Ring check on ONE GPU (two NCCL ranks need two): cptune's ring attention op forced through
   a 1-rank process group, for each CUDA backend (flash, efficient, cuDNN), eager and under
   torch.compile(fullgraph=True), forward + backward, against plain SDPA: errors against a
   float32 reference next to plain SDPA's own, and ring / plain step time. (pytest -m gpu
   runs the same check and asserts the errors.)

1. Backend sweep: flash, efficient and cuDNN attention, bfloat16, causal forward + backward,
   B=1, H=16, D=128, sequence lengths 8K to 64K: achieved TFLOP/s (7 * B * H * S^2 * D flops:
   causal forward 2 * B*H*S^2*D, backward 2.5x that).
2. Memory model calibration: the proxy step at cp=1 for each length, predicted peak
   (cptune.search.memory.predict_peak) against torch.cuda.max_memory_allocated.
Writes benchmarks/results/gpu-<date>/results.md and results.json.

On a node with several GPUs, the ring vs Ulysses vs hybrid sweep (and the GQA before/after
comparison) runs as ``torchrun --nproc-per-node 8 -m benchmarks.strategies --device cuda``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cptune.config import CPConfig
from cptune.search.memory import current_usage, predict_peak, read_peak, reset_peak
from cptune.search.steps import ProxyStep
from cptune.workload import Workload

KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "cudnn": SDPBackend.CUDNN_ATTENTION}


def _time(fn, device: torch.device, warmup: int = 2, repeats: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ring_check(device: torch.device, backends, dtype: torch.dtype, seq_len: int = 4096, heads: int = 8,
               head_dim: int = 64, group=None) -> list:
    """cptune's ring op through a 1-rank group vs plain SDPA, per backend, eager and compiled.

    Errors are max |x - float32 reference| for the output and q/k/v grads of
    loss = sum(out**2); ``single_*`` are plain SDPA's own errors at ``dtype``.
    """
    import torch.distributed as dist

    from cptune import attention as A

    group = group or dist.group.WORLD
    torch.manual_seed(0)
    full = [torch.randn(1, heads, seq_len, head_dim, device=device) for _ in range(3)]

    def run(fn, leaves_dtype):
        leaves = [t.detach().to(leaves_dtype).requires_grad_() for t in full]  # fresh leaves, float32 too
        out = fn(*leaves)
        out.float().square().sum().backward()
        return out.detach().float(), [t.grad.float() for t in leaves]

    ref_out, ref_grads = run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), torch.float32)

    def errors(out, grads):
        return (out - ref_out).abs().max().item(), [(g - r).abs().max().item() for g, r in zip(grads, ref_grads)]

    rows = []
    for name in backends:
        problem = A.ring_backend_problem(device.type, name, dtype)
        if problem:
            rows.append({"backend": name, "skipped": problem})
            print(rows[-1], flush=True)
            continue

        def plain(q, k, v, kernel=KERNELS[name] if device.type == "cuda" else SDPBackend.FLASH_ATTENTION):
            with sdpa_kernel(kernel):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        single_out, single_grads = errors(*run(plain, dtype))
        for compiled in (False, True):
            def ring(q, k, v, name=name):
                return A.ring_attention(q, k, v, group, name, True, None, "alltoall", False)

            fn = torch.compile(ring, fullgraph=True) if compiled else ring
            row = {"backend": name, "compiled": compiled, "dtype": str(dtype).replace("torch.", ""), "seq_len": seq_len}
            try:
                out_err, grad_errs = errors(*run(fn, dtype))
                leaves = [t.detach().to(dtype).requires_grad_() for t in full]
                ring_s = _time(lambda fn=fn: fn(*leaves).float().sum().backward(), device, warmup=1, repeats=3)
                plain_s = _time(lambda: plain(*leaves).float().sum().backward(), device, warmup=1, repeats=3)
            except Exception as exc:  # noqa: BLE001 - one failing kernel must not hide the others' figures
                rows.append({**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
                print(rows[-1], flush=True)
                continue
            rows.append({**row, "out_err": out_err, "grad_errs": grad_errs, "single_out_err": single_out,
                         "single_grad_errs": single_grads, "ring_over_plain": ring_s / plain_s})
            print(rows[-1], flush=True)
    return rows


def backend_sweep(device: torch.device, lengths, heads: int, head_dim: int, dtype: torch.dtype, backends) -> list:
    rows = []
    for s in lengths:
        q, k, v = (torch.randn(1, heads, s, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(1, heads, s, head_dim, device=device, dtype=dtype)
        for name in backends:
            def step(kernel=KERNELS.get(name, SDPBackend.FLASH_ATTENTION), qkv=(q, k, v), grad=grad) -> None:
                with sdpa_kernel(kernel):
                    F.scaled_dot_product_attention(*qkv, is_causal=True).backward(grad)
            try:
                seconds = _time(step, device)
                flops = 7 * heads * s * s * head_dim
                rows.append({"backend": name, "seq_len": s, "seconds": seconds, "tflops": flops / seconds / 1e12})
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                rows.append({"backend": name, "seq_len": s, "error": str(exc).splitlines()[0][:120]})
            print(rows[-1], flush=True)
        del q, k, v, grad
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def calibrate(device: torch.device, lengths, heads: int, head_dim: int, dtype: str) -> list:
    rows = []
    for s in lengths:
        workload = Workload(seq_len=s, heads=heads, head_dim=head_dim, dtype=dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        base = current_usage(device)
        reset_peak(device)
        step = ProxyStep(workload, device, cp=1)
        step()
        peak = read_peak(device) - (base if device.type == "cuda" else 0)
        predicted = predict_peak(workload, CPConfig(mesh_shape=(1, 1)), 0 if device.type == "cuda" else base)
        rows.append({"seq_len": s, "measured": peak, "predicted": predicted, "ratio": predicted / peak})
        print(rows[-1], flush=True)
        del step
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, to check the code path")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cpu") if args.smoke or not torch.cuda.is_available() else torch.device("cuda", 0)
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("no CUDA GPU here: run with --smoke for a CPU check of the code path")
    lengths = (256, 512) if args.smoke else (8192, 16384, 32768, 65536)
    heads, head_dim = (2, 16) if args.smoke else (16, 128)
    backends = ("flash",) if args.smoke else ("flash", "efficient", "cudnn")
    dtype = "float32" if args.smoke else "bfloat16"
    started = time.monotonic()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)"
    import torch.distributed as dist

    if not dist.is_initialized():  # a 1-rank group for the ring check
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    results = {"device": name, "torch": torch.__version__, "command": "python -m benchmarks.gpu"
               + (" --smoke" if args.smoke else ""),
               "ring_check": ring_check(device, backends, getattr(torch, dtype), seq_len=lengths[0],
                                        heads=heads, head_dim=head_dim),
               "sweep": backend_sweep(device, lengths, heads, head_dim, getattr(torch, dtype), backends),
               "calibration": calibrate(device, lengths, heads, head_dim, dtype)}
    results["seconds"] = time.monotonic() - started
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M")
    out = Path(args.out or f"benchmarks/results/gpu-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [f"# GPU benchmark: {name}, torch {results['torch']}", "", f"Command: `{results['command']}` "
             f"({results['seconds']:.0f} s)", "", "Ring check (1-rank group vs plain SDPA; max abs error vs float32):", "",
             "| backend | compiled | out err (plain) | max grad err (plain) | ring / plain time |", "|---|---|---|---|---|"]
    for r in results["ring_check"]:
        if "skipped" in r or "error" in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r['error']}"
            lines.append(f"| {r['backend']} | {r.get('compiled', '-')} | {why} | | |")
            continue
        lines.append(f"| {r['backend']} | {r['compiled']} | {r['out_err']:.2e} ({r['single_out_err']:.2e}) | "
                     f"{max(r['grad_errs']):.2e} ({max(r['single_grad_errs']):.2e}) | {r['ring_over_plain']:.2f} |")
    lines += ["", "| backend | seq len | TFLOP/s |", "|---|---|---|"]
    lines += [f"| {r['backend']} | {r['seq_len']} | {r.get('tflops', 0):.1f}{' ' + r['error'] if 'error' in r else ''} |"
              for r in results["sweep"]]
    lines += ["", "| seq len | measured peak MiB | predicted MiB | predicted/measured |", "|---|---|---|---|"]
    lines += [f"| {r['seq_len']} | {r['measured'] / 2**20:.0f} | {r['predicted'] / 2**20:.0f} | {r['ratio']:.2f} |"
              for r in results["calibration"]]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print(f"written: {out}/results.md ({results['seconds']:.0f}s)")


if __name__ == "__main__":
    main()

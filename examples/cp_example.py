"""The canonical context-parallel example, made to run: on CPU (gloo) and, unchanged, on GPUs (nccl).

    torchrun --standalone --nproc-per-node=2 examples/cp_example.py

Each rank holds half of a 4096-token sequence; SDPA inside the block runs as ring attention,
and backward() after the block gives q, k, v gradients of the full shape, in original order.
The script then checks the result against single-device attention on the full sequence and
prints the max absolute error of the output and of each gradient (fp32 on CPU: < 1e-5),
and the same relative to the largest reference value.
Options: --seq-len, --heads, --head-dim, --rotate-method, --dtype (default float32 on CPU,
bfloat16 on GPU).
"""

import os
from types import SimpleNamespace

import click
import torch
import torch.nn.functional as F

import cptune
from cptune.examples import options


@click.command(cls=options.Script, help=__doc__.split("\n")[0])
@click.option("--seq-len", type=options.COUNT, default=4096, show_default=True, help="Tokens in the sequence.")
@click.option("--heads", type=options.COUNT, default=4, show_default=True, help="Attention heads.")
@click.option("--head-dim", type=options.COUNT, default=64, show_default=True, help="Channels per head.")
@click.option("--rotate-method", type=options.OneOf(["allgather", "alltoall"]), default="allgather",
              show_default=True, help="How the ring passes key/value blocks.")
@click.option("--dtype", type=options.OneOf(["float32", "bfloat16", "float16"]), default=None,
              help="Default: float32 on CPU, bfloat16 on GPU.")
def main(**given) -> None:
    if "RANK" not in os.environ:
        raise cptune.ValidationError([cptune.Problem("cp_example.py", "runs under torchrun (it compares two ranks' "
                                                     "context parallelism with one device)", "torchrun --standalone "
                                                     "--nproc-per-node=2 examples/cp_example.py")])
    run(SimpleNamespace(**given))


def run(args: SimpleNamespace) -> None:
    device, _, rank = cptune.init_rank()  # the process group joined: nccl on GPUs, gloo on CPU
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))

    torch.manual_seed(0)  # the same full tensors on every rank
    qkv = [torch.randn(1, args.heads, args.seq_len, args.head_dim, device=device, dtype=dtype, requires_grad=True)
           for _ in range(3)]

    config = cptune.CPConfig(rotate_method=args.rotate_method, sdpa_backend="flash")
    with cptune.context_parallel(buffers=tuple(qkv), seq_dims=(2, 2, 2), config=config) as cp:
        output = F.scaled_dot_product_attention(*qkv, is_causal=True)

    output.float().square().mean().backward()

    # Check against single-device attention on the full sequence.
    full_output = cp.unshard(output, 2)
    reference = [t.detach().clone().requires_grad_() for t in qkv]
    expected = F.scaled_dot_product_attention(*reference, is_causal=True)
    expected.float().square().mean().backward()
    pairs = {"output": (full_output, expected)}
    pairs.update({f"grad_{n}": (t.grad, ref.grad) for n, t, ref in zip("qkv", qkv, reference)})
    errors = {k: (a.float() - b.float()).abs().max().item() for k, (a, b) in pairs.items()}
    relative = {k: errors[k] / b.float().abs().max().item() for k, (_, b) in pairs.items()}
    if rank == 0:
        print(f"cp={cp.cp_size} seq_len={args.seq_len} dtype={str(dtype).replace('torch.', '')} "
              f"rotate={args.rotate_method} load_balance={cp.load_balance} device={device.type}")
        print("max abs error vs single device: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
        print("relative to the largest value:  " + ", ".join(f"{k} {v:.2e}" for k, v in relative.items()))
    cptune.close_rank()


if __name__ == "__main__":
    main()

"""The reference sparse attention's two forms on the CPU: gathered slots vs dense scores masked by
the selection, fwd+bwd, for a selection that holds every causal key (a short window with a top-k
near its length, as in CPU training) and for a sparse one.

    python benchmarks/bench_cpu_dense_selection.py --threads 2 --lengths 512,1024,2048

Prints per length and selection width the best of --repeats runs of each form and which form the
reference picks. Results: docs/model.md ("sparse_attention_reference").
"""

import argparse
import time

import torch

from genolong.model import dsa


def causal_selection(batch: int, seq: int, width: int) -> torch.Tensor:
    """Query t selects keys 0..t (the first `width` of them), -1 beyond."""
    t = torch.arange(seq)
    idx = torch.arange(width)[None, :].expand(seq, width).clone()
    idx[idx > t[:, None]] = -1
    return idx[None].expand(batch, seq, width).int().contiguous()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", default="512,1024,2048")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--latent", type=int, default=64)
    p.add_argument("--sparse-width", type=int, default=67, help="the sparse case's slots (16 pools of 4 + tail)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for seq in (int(s) for s in args.lengths.split(",")):
        for width in (seq + 3, args.sparse_width):
            q = torch.randn(args.batch, seq, args.heads, args.latent, requires_grad=True)
            kv = torch.randn(args.batch, seq, args.latent, requires_grad=True)
            idx = causal_selection(args.batch, seq, width)
            row = []
            for name, fn in (("gathered", dsa._gathered_attention), ("dense", dsa._masked_dense_attention)):
                best = float("inf")
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    fn(q, kv, idx, scale=0.1, return_lse=False).sum().backward()
                    best = min(best, time.perf_counter() - t0)
                row.append(f"{name} {best:.3f} s")
            picked = "dense" if dsa._dense_is_cheaper(q, kv, idx) else "gathered"
            print(f"T={seq} W={width}: {', '.join(row)}; the reference picks {picked}", flush=True)


if __name__ == "__main__":
    main()

"""What one slot block of the sparse-MLA kernels' main loop costs, read from the sm_90 SASS without a GPU.

    python benchmarks/sass_census.py                      # the table below for the candidate configs
    python benchmarks/sass_census.py --kernel bwd --heads 4 --configs 16x16x4x5,16x16x4x5k4 --adds coalesced,layout

Each kernel is built as the JIT builds it on an H200 (genolong/kernels/aot.py), disassembled with the
nvdisasm Triton ships, and the innermost loop that holds tensor-core instructions (the slot loop: one
iteration per BN selected keys of one query) is counted instruction by instruction, for the whole
program (per-warp counts times the warps). Columns:

- hmma: tensor-core instructions (mma.sync m16n8k16);
- smem rd / wr KiB: shared-memory bytes read (ldmatrix, LDS) and written (STS, STSM, and the
  asynchronous global->shared copies of the gathered keys), every lane counted;
- red KiB: bytes sent as global reductions (the fp32 dkv and dq adds), every lane counted, vector
  reductions (F32x2, F32x4) apart from scalar ones: the adds in the products' layout
  (`_red_add_pairs`) also hold a scalar fallback for pairs that are not neighbours, predicated off in
  these kernels, so their "scalar" column is code, not traffic;
- bar: block-wide barriers; instr: all instructions, per warp.

This is a static count (predicated-off instructions and lanes are counted as executed; loop-invariant
work the compiler left in the loop is counted every iteration). Its use is a prediction before a GPU
measurement: at ~128 bytes per clock per SM, shared memory alone bounds a slot block's time on an SM.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sparse_attention import parse_config  # noqa: E402

from genolong.kernels import sparse_mla_triton  # noqa: E402

LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*\w*)\s*(.*?);")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")
LANE_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def sass(kernel) -> list[str]:
    nvdisasm = Path(sparse_mla_triton.triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout.splitlines()


def slot_loop(lines: list[str]) -> list[str]:
    """The instructions of the innermost loop (a backward branch's span) that holds HMMA."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line))}
    loops = []
    for i, line in enumerate(lines):
        m = BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i:
            body = lines[labels[m.group(1)]:i + 1]
            if any("HMMA" in b or "HGMMA" in b for b in body):
                loops.append(body)
    if not loops:
        raise SystemExit("no loop with tensor-core instructions found")
    return min(loops, key=len)


def lane_bytes(opcode: str) -> int:
    for part in opcode.split(".")[1:]:
        if part in LANE_BYTES:
            return LANE_BYTES[part]
    return 4


def census(lines: list[str], warps: int) -> dict:
    counts = dict(hmma=0, smem_rd=0, smem_wr=0, red=0, red_scalar=0, bar=0, instr=0)
    for line in lines:
        m = LINE.match(line)
        if not m:
            continue
        op = m.group(1)
        counts["instr"] += 1
        if op.startswith(("HMMA", "HGMMA")):
            counts["hmma"] += warps
        elif op.startswith(("LDSM", "STSM")):
            n = int(re.search(r"\.(\d)$", op.split(".M")[1]).group(1)) if re.search(r"\.(\d)$", op) else 1
            counts["smem_rd" if op.startswith("LDSM") else "smem_wr"] += 128 * n * warps
        elif op.startswith("LDS"):
            counts["smem_rd"] += 32 * lane_bytes(op) * warps
        elif op.startswith("STS"):
            counts["smem_wr"] += 32 * lane_bytes(op) * warps
        elif op.startswith("LDGSTS"):
            counts["smem_wr"] += 32 * lane_bytes(op) * warps
        elif op.startswith(("RED", "ATOM")):
            vec = re.search(r"F32x(\d)", op)
            counts["red" if vec else "red_scalar"] += 32 * 4 * (int(vec.group(1)) if vec else 1) * warps
        elif op.startswith("BAR"):
            counts["bar"] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", choices=("fwd", "bwd"), action="append", help="default: both")
    ap.add_argument("--heads", type=int, action="append", help="default: 4 and 64")
    ap.add_argument("--configs", default="", help="<HB>x<BN>x<warps>x<stages>[k<slices>],...; default: a list per kernel and heads")
    ap.add_argument("--adds", default="coalesced,layout", help="the backward's fp32 adds: coalesced (tl.atomic_add), layout (in the products' layout)")
    ap.add_argument("--one-pass", action="store_true", help="the backward's one-pass (atomic) form instead of the key-chunked one")
    args = ap.parse_args()
    defaults = {("fwd", 4): "16x32x8x5,16x32x8x5k8,16x32x4x5k4,16x16x4x5k4",
                ("bwd", 4): "16x16x4x5,16x16x4x5k4,16x16x8x5k8,16x32x8x5k8",
                ("fwd", 64): "64x32x8x5,32x32x8x5,32x32x8x5k8",
                ("bwd", 64): "32x16x8x5,32x16x8x5k8"}
    print(f"{'kernel':<6} {'heads':>5} {'config':<22} {'adds':<9} {'hmma':>5} {'smem rd KiB':>11} {'smem wr KiB':>11} "
          f"{'red KiB':>7} {'scalar':>6} {'bar':>4} {'instr':>6} {'regs':>5} {'smem KiB':>8}")
    for kind in args.kernel or ("fwd", "bwd"):
        for heads in args.heads or (4, 64):
            for text in (args.configs or defaults[(kind, heads)]).split(","):
                config = parse_config(text)
                if config is None:
                    raise SystemExit(f"{text}: not a config (<HB>x<BN>x<warps>x<stages>[k<slices>])")
                for adds in (args.adds.split(",") if kind == "bwd" else ["-"]):
                    kernel = sparse_mla_triton.aot_compile(kind, heads, 512, config, ranged=not args.one_pass, red=adds == "layout")
                    c = census(slot_loop(sass(kernel)), config.num_warps)
                    from genolong.kernels import aot

                    regs, spills = aot.ptxas_usage(kernel)
                    print(f"{kind:<6} {heads:>5} {config.label():<22} {adds:<9} {c['hmma']:>5} {c['smem_rd'] / 1024:>11.1f} "
                          f"{c['smem_wr'] / 1024:>11.1f} {c['red'] / 1024:>7.1f} {c['red_scalar'] / 1024:>6.1f} {c['bar']:>4} {c['instr']:>6} "
                          f"{regs:>5}{'!' if spills else ' '} {kernel.metadata.shared / 1024:>7.1f}", flush=True)


if __name__ == "__main__":
    main()

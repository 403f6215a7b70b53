"""Run one cell's moe_ops calls a few times, for a hardware-counter profile of its kernels (not part
of the test suite). Under Nsight Compute, e.g. (the clocks left alone, METHOD.md):

    ncu --clock-control none --kernel-name regex:'gate_up|down_kernel' --launch-skip 2 \
        --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats python benchmarks/ncu_profile.py --cell qwen3_30b_a3b:2048

--backward also runs the backward (saved z); --calls sets how many calls (default 3: the first
compiles, so skip its launches)."""
from __future__ import annotations

import argparse

import torch

from moe_ops import bench
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.launch.dispatch_backward import dispatch_backward_triton


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cell", default="qwen3_30b_a3b:2048", help="shape:T")
    p.add_argument("--backward", action="store_true")
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args()
    c = bench.cell_inputs(args.cell, torch.device("cuda"), torch.bfloat16)
    wt, hidden, tw, ids = c.weights, c.hidden, c.topk_weights, c.topk_ids
    go = torch.randn_like(hidden)
    for _ in range(args.calls):
        if args.backward:
            out, z = dispatch_triton(hidden, wt.w13, wt.w2, tw, ids, save_z=True)
            dispatch_backward_triton(go, hidden, wt.w13, wt.w2, tw, ids, z=z)
        else:
            out = dispatch_triton(hidden, wt.w13, wt.w2, tw, ids)
    torch.cuda.synchronize()
    print("done", args.cell, tuple(out.shape))


if __name__ == "__main__":
    main()

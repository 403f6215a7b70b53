"""What a CUDA-graph replay costs with (almost) nothing in it (not part of the test suite): the
bench's timer (`moe_ops.bench.Timer`, do_bench's median with the L2 flushed between calls) on
graphs of 1-4 one-program Triton kernels that each store one float, plus a graph of one
`torch.Tensor.add_`. The decode cells' graph-replay figures (e.g. Qwen3-30B-A3B T=1: two
kernels) include this fixed cost; the intercept is the replay itself, the slope each kernel
boundary's.

    PYTHONPATH=. python benchmarks/replay_floor.py [--rounds 3]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from moe_ops import bench


@triton.jit
def _store_one(ptr, i):
    tl.store(ptr + i, 1.0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best reported)")
    args = p.parse_args()
    dev = torch.device("cuda")
    timer = bench.Timer(dev, warmup_ms=10, rep_ms=50)
    buf = torch.zeros(8, device=dev)
    cases = {}
    for n in (1, 2, 3, 4):
        def fn(n=n):
            for i in range(n):
                _store_one[(1,)](buf, i)
            return buf
        cases[f"{n} kernel" + ("s" if n > 1 else "")] = bench.capture_graph(fn)[0]
    cases["torch add_"] = bench.capture_graph(lambda: buf.add_(1.0))[0]
    res = {}
    for _ in range(args.rounds):
        for name, graph in cases.items():
            res.setdefault(name, []).append(timer(graph.replay) * 1e3)
    print(f"{'graph':<12} {'replay us (best of rounds)':>28}   all rounds")
    for name, v in res.items():
        print(f"{name:<12} {min(v):28.2f}   " + " ".join(f"{x:.2f}" for x in v))


if __name__ == "__main__":
    main()

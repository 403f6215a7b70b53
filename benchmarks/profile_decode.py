"""Where a decode-size moe.dispatch call spends its time (one GPU; not part of the test suite):
per-kernel device time from torch.profiler against the CUDA-graph replay time of the whole call.
replay - sum(kernels) is what launches, dependencies and tails cost inside the graph.

    PYTHONPATH=. python benchmarks/profile_decode.py [--cells qwen3_30b_a3b:1 olmoe:1 ...]
"""
from __future__ import annotations

import argparse

import torch

from moe_ops import bench
from moe_ops.launch.dispatch import dispatch_triton


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", nargs="+",
                   default=["qwen3_30b_a3b:1", "olmoe:1", "qwen3_30b_a3b:8", "mixtral_8x7b:1"])
    args = p.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    timer = bench.Timer(dev, warmup_ms=25, rep_ms=100)
    rows = []
    for cell in args.cells:
        c = bench.cell_inputs(cell, dev, dt)
        wt, hidden, tw, ids = c.weights, c.hidden, c.topk_weights, c.topk_ids
        fn = lambda: dispatch_triton(hidden, wt.w13, wt.w2, tw, ids)  # noqa: E731
        graph, _ = bench.capture_graph(fn)
        replay_us = timer(graph.replay) * 1e3
        acc = bench.kernel_times_us(graph.replay, n=50, name_len=24)
        if not acc:   # a profiler that does not see into graphs: the same kernels, eager
            acc = bench.kernel_times_us(fn, n=50, name_len=24)
        total = sum(acc.values())
        kern = ", ".join(f"{k} {v:.1f}" for k, v in sorted(acc.items(), key=lambda kv: -kv[1]))
        rows.append((cell, replay_us, total, kern))
        print(f"{cell}: replay {replay_us:.1f} us, kernels {total:.1f} us: {kern}", flush=True)
        del c, wt, graph
        torch.cuda.empty_cache()
    print(f"\n{'cell':<22} {'replay us':>9} {'kernels us':>10} {'gap us':>7}  per kernel (us)")
    for cell, rep, tot, kern in rows:
        print(f"{cell:<22} {rep:9.1f} {tot:10.1f} {rep - tot:7.1f}  {kern}")


if __name__ == "__main__":
    main()

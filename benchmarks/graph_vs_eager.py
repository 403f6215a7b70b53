"""Eager launch against CUDA-graph replay of the same moe_ops forward, timed alternately (not part
of the test suite). The full bench times eager first and graph replay next; at large T the graph
came out 5-13% slower (RESULTS.md, fourth session). Alternating the order separates an effect of
the graph from one of the order (clocks, power).

    PYTHONPATH=. python benchmarks/graph_vs_eager.py [--cells mixtral_8x7b:2048 ...] [--rounds 3]
"""
from __future__ import annotations

import argparse

import torch

from moe_ops import bench
from moe_ops.launch.dispatch import dispatch_triton


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", nargs="+", default=["mixtral_8x7b:2048", "olmoe:8192"])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    dev = torch.device("cuda")
    timer = bench.Timer(dev, warmup_ms=25, rep_ms=100)
    for cell in args.cells:
        c = bench.cell_inputs(cell, dev, torch.bfloat16)
        wt, hidden, tw, ids = c.weights, c.hidden, c.topk_weights, c.topk_ids
        fn = lambda: dispatch_triton(hidden, wt.w13, wt.w2, tw, ids)  # noqa: E731
        graph, _ = bench.capture_graph(fn)
        line = []
        for r in range(args.rounds):
            order = [("graph", graph.replay), ("eager", fn)] if r % 2 else \
                [("eager", fn), ("graph", graph.replay)]
            for what, f in order:
                line.append(f"{what} {timer(f) * 1e3:.0f}")
        print(f"{cell}: " + ", ".join(line), flush=True)
        del graph, c, wt, hidden, tw, ids
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

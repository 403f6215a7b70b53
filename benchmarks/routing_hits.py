"""moe_ops' decode time against the number of experts a routing draw hits (not part of the test
suite). At small T the floor is the weights of the experts hit, so one random routing draw
decides the floor: Mixtral T=8 (16 draws of 8 experts) hits 7 or 8. BENCHMARK.md's Mixtral T=8
floor (494 us) is that of a draw hitting fewer experts than the bench's seed-1 draw (582-585 us,
all 8), so its best number (vLLM, 566 us) and moe_ops' are not timed on the same bytes. This
script times moe_ops' dispatch (CUDA-graph replay, routing done once outside, as `python -m
moe_ops.bench --graph-all` does) on the bench's tokens and weights under several routing draws
(token seeds 1, 2, ...) and prints experts hit, floor, time and fraction per draw.

    PYTHONPATH=. python benchmarks/routing_hits.py [--cell mixtral_8x7b:8] [--draws 12]
"""
from __future__ import annotations

import argparse

import torch

from moe_ops import bench


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cell", default="mixtral_8x7b:8", help="shape:T")
    p.add_argument("--draws", type=int, default=12, help="routing draws (token seeds 1..N)")
    args = p.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    timer = bench.Timer(dev, warmup_ms=25, rep_ms=100)
    bw, rate, desc = bench.measure_ceilings(dev, timer, tiny=False)
    print("ceilings:", desc)
    name, T = args.cell.split(":")
    T = int(T)
    s = bench.SHAPES[name]
    wt = bench.make_weights(s, dev, dt, seed=0)
    rows = []
    for seed in range(1, args.draws + 1):
        hidden, logits = bench.make_tokens(s, wt, T, dev, dt, seed=seed)
        tw, ids = bench.route(s, logits, wt.bias)
        hit = int(torch.unique(ids[ids >= 0]).numel())
        n_bytes, flops = bench.floor_terms(s, T, hit, hidden.element_size())
        floor_us = max(n_bytes / bw, flops / rate) * 1e6
        graph, _ = bench.capture_graph(
            lambda: bench.moe_ops_dispatch(hidden, wt.w13, wt.w2, tw, ids))
        us = timer(graph.replay) * 1e3
        rows.append((seed, hit, floor_us, us))
        print(f"seed {seed:2d}: {hit} experts hit, floor {floor_us:7.1f} us, moe_ops {us:7.1f} us "
              f"({floor_us / us:.0%})", flush=True)
        del graph
    print("\nexperts hit  draws  floor us  moe_ops us (median)  fraction")
    for hit in sorted({r[1] for r in rows}):
        sel = sorted(r[3] for r in rows if r[1] == hit)
        fl = [r[2] for r in rows if r[1] == hit][0]
        med = sel[len(sel) // 2]
        print(f"{hit:11d}  {len(sel):5d}  {fl:8.1f}  {med:19.1f}  {fl / med:8.0%}")


if __name__ == "__main__":
    main()

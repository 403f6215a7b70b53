"""A/B of the one-launch alignment scan on one GPU: one program walking every group of table
blocks against a program per group (moe_ops.launch.alignment.scan_programs), or (--warps) the
scan's warps per program (moe_ops.launch.alignment.SCAN_WARPS); CUDA-graph replay of the whole
dispatch and of the alignment alone, alternating, on decode cells that take the scan. Not part
of the test suite.

    PYTHONPATH=. python benchmarks/ab_scan.py [--cells qwen3_30b_a3b:8 ...] [--warps 1 2 4 8]
"""
from __future__ import annotations

import argparse

import torch

import moe_ops.launch.alignment as la
from moe_ops import bench
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.tuning.heuristics import heuristic_config


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", nargs="+", default=[
        "qwen3_30b_a3b:8", "qwen3_30b_a3b_zipf:8", "olmoe:8", "mixtral_8x7b:8", "mixtral_8x7b:32",
        "mixtral_8x7b:128"])
    p.add_argument("--warps", nargs="+", type=int,
                   help="time these warps per scan program (a program per group) instead")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    timer = bench.Timer(dev, warmup_ms=25, rep_ms=100)
    grid = la.scan_programs
    warps0 = la.SCAN_WARPS
    rows = []
    for cell in args.cells:
        c = bench.cell_inputs(cell, dev, dt)
        s, T, wt, hidden, tw, ids = c.shape, c.T, c.weights, c.hidden, c.topk_weights, c.topk_ids
        cfg = heuristic_config(T, s.E, s.K, s.H, s.I, "cuda", dt)
        if args.warps:
            variants = [(f"{w} warps", grid, w) for w in args.warps]
        else:
            variants = [("one program", lambda n, b: 1, warps0), ("per group", grid, warps0)]
        res = {v[0]: [] for v in variants}
        ref = None
        for _round in range(args.rounds):
            for variant, fn, warps in variants:
                la.scan_programs = fn
                la.SCAN_WARPS = warps
                call = lambda: dispatch_triton(hidden, wt.w13, wt.w2, tw, ids, config=cfg)  # noqa
                g, out = bench.capture_graph(call)
                ga, _ = bench.capture_graph(lambda: la.align_triton(ids, s.E, cfg.block_m))
                us, ua = timer(g.replay) * 1e3, timer(ga.replay) * 1e3
                ref = out.clone() if ref is None else ref
                assert torch.equal(out, ref), (cell, variant)
                res[variant].append((us, ua))
                g = ga = None
        la.scan_programs = grid
        la.SCAN_WARPS = warps0
        for variant, times in res.items():
            us = min(x[0] for x in times)
            ua = min(x[1] for x in times)
            rows.append((cell, variant, us, ua))
            print(f"{cell} {variant}: dispatch {us:.1f} us, alignment {ua:.1f} us", flush=True)
        res = ref = None
        torch.cuda.empty_cache()
    print(f"\n{'cell':<24} {'scan':<12} {'dispatch us':>11} {'align us':>9}")
    for cell, variant, us, ua in rows:
        print(f"{cell:<24} {variant:<12} {us:11.1f} {ua:9.1f}")


if __name__ == "__main__":
    main()

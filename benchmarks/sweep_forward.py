"""Forward-config sweep on one GPU (not part of the test suite): for each (shape, T) cell, times
moe_ops' dispatch (CUDA-graph replay; routing done once outside, as `python -m moe_ops.bench
--graph-all` times it) under the heuristic config and its neighbours
(moe_ops.tuning.heuristics.neighbours), checks every variant's output against the heuristic's,
and prints the floor fraction of each.

    PYTHONPATH=. python benchmarks/sweep_forward.py [--cells mixtral_8x7b:512 ...] [--only WORD ...]
        [--rounds 3] [--extra 'n32 s5=block_n1:32,num_stages:5' ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc

import torch

from moe_ops import bench
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.tuning.heuristics import heuristic_config, neighbours

# The cells where the forward was slower than BENCHMARK.md's best number (RESULTS.md, bdcc6f2).
DEFAULT_CELLS = ["mixtral_8x7b:8", "mixtral_8x7b:128", "mixtral_8x7b:512", "mixtral_8x7b:2048",
                 "mixtral_8x7b:8192", "deepseek_v3_routed:512", "deepseek_v3_routed:2048",
                 "deepseek_v3_routed:8192", "qwen3_30b_a3b_zipf:512"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", nargs="+", default=DEFAULT_CELLS, help="shape:T")
    p.add_argument("--only", nargs="+", help="time only the variants whose name contains one of "
                   "these words (and the heuristic)")
    p.add_argument("--rounds", type=int, default=1, help="timings per variant, interleaved "
                   "(median reported)")
    p.add_argument("--extra", nargs="+", default=[], metavar="NAME=FIELD:VALUE,...",
                   help="more variants: DispatchConfig fields replaced in the heuristic's config, "
                   "e.g. 'n32 s5=block_n1:32,num_stages:5'")
    args = p.parse_args()
    extra = {}
    for spec in args.extra:
        vname, fields = spec.split("=", 1)
        extra[vname] = {f.split(":")[0]: int(f.split(":")[1]) for f in fields.split(",")}
    dev = torch.device("cuda")
    dt = torch.bfloat16
    timer = bench.Timer(dev, warmup_ms=25, rep_ms=100)
    rows = []
    weights = {}
    for cell in args.cells:
        name = cell.split(":")[0]
        if name not in weights:   # one shape's weights at a time (DeepSeek-V3: 22 GB)
            weights.clear()
            gc.collect()
            torch.cuda.empty_cache()
        c = bench.cell_inputs(cell, dev, dt, weights.get(name))
        weights[name] = c.weights
        s, T, wt, hidden, tw, ids = c.shape, c.T, c.weights, c.hidden, c.topk_weights, c.topk_ids
        n_bytes, flops = bench.floor_terms(s, T, int(torch.unique(ids[ids >= 0]).numel()),
                                           hidden.element_size())
        floor_us = max(n_bytes / 4.28e12, flops / 750e12) * 1e6   # BENCHMARK.md's nominal rates
        base = heuristic_config(T, s.E, s.K, s.H, s.I, "cuda", dt)
        ref = dispatch_triton(hidden, wt.w13, wt.w2, tw, ids, config=base)
        graphs = {}
        variants = neighbours(base, dt)
        variants.update({k: dataclasses.replace(base, **v) for k, v in extra.items()})
        for vname, cfg in variants.items():
            if (args.only and vname != "heuristic" and vname not in extra
                    and not any(w in vname for w in args.only)):
                continue
            fn = lambda: dispatch_triton(hidden, wt.w13, wt.w2, tw, ids, config=cfg)  # noqa: E731
            try:
                graph, out = bench.capture_graph(fn)
                graph.replay()
                graphs[vname] = (graph, bench.rel_err(out, ref), cfg)
            except Exception as exc:  # a config that does not compile (shared memory)
                print(f"{cell} {vname}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            out = None
        # Variants interleaved over rounds (median reported): the same variant timed twice in a
        # row and another one later differ by more than a neighbour's effect on a noisy machine.
        times = {vname: [] for vname in graphs}
        for _ in range(args.rounds):
            for vname, (graph, _, _) in graphs.items():
                times[vname].append(timer(graph.replay) * 1e3)
        for vname, (graph, err, cfg) in graphs.items():
            us = sorted(times[vname])[len(times[vname]) // 2]
            rows.append((cell, vname, us, floor_us / us, err, cfg))
            spread = f" (rounds {min(times[vname]):.1f}-{max(times[vname]):.1f})" \
                if args.rounds > 1 else ""
            print(f"{cell} {vname}: {us:.1f} us{spread} ({floor_us / us:.0%} of floor "
                  f"{floor_us:.0f}), rel {err:.1e}", flush=True)
        graphs = None
        c = hidden = tw = ids = ref = None
    print(f"\n{'cell':<26} {'variant':<14} {'us':>9} {'floor':>6} {'rel':>8}  config")
    for cell, vname, us, frac, err, cfg in rows:
        c = (f"bm{cfg.block_m} n1={cfg.block_n1} k1={cfg.block_k1} n2={cfg.block_n2} "
             f"k2={cfg.block_k2} w{cfg.num_warps} s{cfg.num_stages} g{cfg.group_m}")
        print(f"{cell:<26} {vname:<14} {us:9.1f} {frac:6.0%} {err:8.1e}  {c}")


if __name__ == "__main__":
    main()

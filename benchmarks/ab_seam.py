"""A/B of a module-level switch of moe_ops (a seam added for an experiment, e.g. commit
1ad3e1d's moe_ops.launch.dispatch.COMBINE_IDS_EARLY, since removed: NOTES.md entry 21) on one
GPU: CUDA-graph replay of the whole dispatch under the heuristic config with the switch at each
value, alternating over rounds (best of the rounds reported), outputs compared (bitwise, else
their relative difference, which must stay under bf16 rounding). `config:FIELD` instead of a
module seam sets a DispatchConfig field of the heuristic's config (e.g. `config:half_tail True
False`). --kernels adds per-kernel device times (torch.profiler) of each value's replay.
Not part of the test suite.

    PYTHONPATH=. python benchmarks/ab_seam.py moe_ops.launch.dispatch:SOME_SWITCH True False \
        [--cells qwen3_30b_a3b:8 ...] [--rounds 3] [--kernels]
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib

import torch

from moe_ops import bench
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.tuning.heuristics import heuristic_config


def main():
    p = argparse.ArgumentParser()
    p.add_argument("seam", help="module:attribute")
    p.add_argument("values", nargs=2, help="two Python literals")
    p.add_argument("--cells", nargs="+", default=[
        "qwen3_30b_a3b:8", "qwen3_30b_a3b_zipf:8", "olmoe:8", "mixtral_8x7b:8", "qwen3_30b_a3b:32",
        "olmoe:128"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kernels", action="store_true", help="per-kernel times of each value")
    args = p.parse_args()
    mod_name, attr = args.seam.split(":")
    values = [ast.literal_eval(v) for v in args.values]
    on_config = mod_name == "config"
    mod = None if on_config else importlib.import_module(mod_name)
    saved = None if on_config else getattr(mod, attr)
    dev = torch.device("cuda")
    dt = torch.bfloat16
    timer = bench.Timer(dev, warmup_ms=25, rep_ms=100)
    rows = []
    try:
        for cell in args.cells:
            c = bench.cell_inputs(cell, dev, dt)
            s, T, wt, hidden, tw, ids = (c.shape, c.T, c.weights, c.hidden, c.topk_weights,
                                         c.topk_ids)
            base = heuristic_config(T, s.E, s.K, s.H, s.I, "cuda", dt)
            best = {repr(v): float("inf") for v in values}
            diff, kern = {}, {}
            ref = None
            for rnd in range(args.rounds):
                for v in values:
                    cfg = base
                    if on_config:
                        cfg = dataclasses.replace(base, **{attr: v})
                    else:
                        setattr(mod, attr, v)
                    g, out = bench.capture_graph(
                        lambda: dispatch_triton(hidden, wt.w13, wt.w2, tw, ids, config=cfg))
                    best[repr(v)] = min(best[repr(v)], timer(g.replay) * 1e3)
                    ref = out.clone() if ref is None else ref
                    same = torch.equal(out, ref)
                    err = 0.0 if same else bench.rel_err(out, ref)
                    diff[repr(v)] = "bitwise" if same else f"rel {err:.1e}"
                    assert err < 1e-2, (cell, v, err)
                    if args.kernels and rnd == args.rounds - 1:
                        acc = bench.kernel_times_us(g.replay, n=20, name_len=24)
                        kern[repr(v)] = ", ".join(f"{k} {t:.1f}" for k, t in
                                                  sorted(acc.items(), key=lambda kv: -kv[1]))
                    g = out = None
            for v, us in best.items():
                rows.append((cell, v, us))
                print(f"{cell} {attr}={v}: dispatch {us:.1f} us ({diff[v]}) {kern.get(v, '')}",
                      flush=True)
            wt = ref = None
            torch.cuda.empty_cache()
    finally:
        if not on_config:
            setattr(mod, attr, saved)
    print(f"\n{'cell':<24} {attr:<20} {'dispatch us':>11}")
    for cell, v, us in rows:
        print(f"{cell:<24} {v:<20} {us:11.1f}")


if __name__ == "__main__":
    main()

"""A/B of the persistent weight-gradient kernel's tile schedule (not part of the test suite):
the fixed round robin over (expert, row block, column block) against the LPT schedule
(BackwardConfig.wg_lpt: ranked and snaking where the routing is skewed), the same forced on at
any skew, and its two parts alone (experts ranked by rows without the snaking deal, the
snaking deal over experts in index order), on the benchmark's inputs and routing.
Variants alternate within each round; the best backward of the rounds and the weight-gradient
kernel's profiler time (last round) are kept; gradients are compared bitwise.

    PYTHONPATH=. python benchmarks/ab_wg_schedule.py [--cells qwen3_30b_a3b_zipf:8192 ...]
"""
from __future__ import annotations

import argparse
import dataclasses

import torch
import triton

import moe_ops.launch.dispatch_backward as db
from moe_ops import bench
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.tuning.heuristics import backward_config, dispatch_config

VARIANTS = {   # name: (wg_lpt, LPT_SORT, LPT_SNAKE, LPT_MIN_SKEW)
    "fixed": (False, True, True, 2),
    "lpt": (True, True, True, 2),                  # ranked and snaking where skewed (default)
    "lpt forced": (True, True, True, 0),           # ranked and snaking everywhere
    "sort, round robin": (True, True, False, 0),
    "index order, snake": (True, False, True, 0),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", nargs="+", default=["qwen3_30b_a3b_zipf:8192", "qwen3_30b_a3b:8192",
                                                  "deepseek_v3_routed:8192"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = p.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    table = []
    for cell in args.cells:
        ci = bench.cell_inputs(cell, dev, dt)
        x, w13, w2 = ci.hidden, ci.weights.w13, ci.weights.w2
        tw, ids = ci.topk_weights, ci.topk_ids
        T, H = x.shape
        E, I, K = w2.shape[0], w2.shape[2], ids.shape[1]
        go = torch.randn(T, H, device=dev, dtype=dt, generator=torch.Generator(
            device=dev).manual_seed(5))
        cfg = dispatch_config(T, E, K, H, I, "cuda", dt)
        base = backward_config(cfg, "cuda", dt, rows_per_expert=T * K / E, inter_size=I)
        _, z = dispatch_triton(x, w13, w2, tw, ids, config=cfg, save_z=True)
        best = {v: float("inf") for v in args.variants}
        wg_ms, outs = {}, {}
        for rnd in range(args.rounds):
            for v in args.variants:
                lpt, db.LPT_SORT, db.LPT_SNAKE, db.LPT_MIN_SKEW = VARIANTS[v]
                bc = dataclasses.replace(base, wg_persistent=True, wg_lpt=lpt)
                fn = (lambda bc=bc: db.dispatch_backward_triton(go, x, w13, w2, tw, ids, z=z,
                                                                config=cfg, bwd_config=bc))
                if rnd == 0:
                    outs[v] = fn()
                best[v] = min(best[v], triton.testing.do_bench(fn, warmup=20, rep=200))
                if rnd == args.rounds - 1:
                    kt = bench.kernel_times_us(fn, 3)
                    wg_ms[v] = sum(t for k, t in kt.items() if k.startswith("weight_grad")) / 1e3
        db.LPT_SORT = db.LPT_SNAKE = True
        db.LPT_MIN_SKEW = 2
        ref = outs[args.variants[0]]
        for v in args.variants:
            same = all(torch.equal(a, b) for a, b in zip(outs[v], ref))
            table.append((cell, v, best[v], wg_ms[v], same))
            print(f"{cell:26s} {v:20s} backward {best[v]:8.3f} ms  weight grads {wg_ms[v]:7.3f} "
                  f"ms  bitwise={same}", flush=True)
        outs = ref = z = None
        torch.cuda.empty_cache()
    print("\n| cell | variant | backward ms (best of rounds) | weight-gradient kernels ms | bitwise |")
    print("|---|---|---|---|---|")
    for c, v, b, w, same in table:
        print(f"| {c} | {v} | {b:.3f} | {w:.3f} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

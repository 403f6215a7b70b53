"""Backward-kernel sweep on one GPU (not part of the test suite): times the forward (with and
without saving z) and the backward of moe.dispatch for several BackwardConfig variants, with a
per-kernel breakdown from torch.profiler, and checks every variant's gradients against the
default variant's (bitwise-equal weight-gradient order is not expected across tile shapes).

    PYTHONPATH=. python benchmarks/sweep_backward.py [--tokens 8192] [--shapes ...] [--rounds 3]

One do_bench of a whole backward moved by up to 15% between two timings of one config in one
process (NOTES.md entry 30): for effects of a few percent, time the variants in --rounds
alternating rounds (the best of each kept) and read the per-kernel breakdown too.
"""
from __future__ import annotations

import argparse
import gc
import dataclasses

import torch
import triton

from moe_ops import bench
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.launch.dispatch_backward import dispatch_backward_triton
from moe_ops.tuning.heuristics import backward_config, dispatch_config
from moe_ops.tuning.shapes import SHAPES


def variants(base):
    r = dataclasses.replace
    return {
        "default": base,
        "wg 128x128 w4 s2 x2": r(base, wg_n=128, wg_warps=4, wg_stages=2, wg_per_sm=2),
        "wg 128x128 w4 s3 split x2": r(base, wg_n=128, wg_warps=4, wg_stages=3, wg_split=2,
                                       wg_per_sm=2),
        "wg 128x128 w4 s3 x1": r(base, wg_n=128, wg_warps=4, wg_stages=3),
        "tma": r(base, tma=not base.tma),   # the weight tiles (with the base's tma_a)
        "tma a" if not base.tma_a else "no tma a": r(base, tma_a=not base.tma_a),
        "3 stages": r(base, num_stages=3),
        "wg 128x128": r(base, wg_n=128),
        "da n128 w4": r(base, da_n=128, da_warps=4),
        "ew r8 i256": r(base, ew_r=8, ew_i=256),
        "ew r4 i512": r(base, ew_r=4, ew_i=512),
        "ew r16 i256": r(base, ew_r=16, ew_i=256),
        "ew r2 i1024": r(base, ew_r=2, ew_i=1024),
        "ew r8 i512": r(base, ew_r=8, ew_i=512),
        "half tail": r(base, half_tail=not base.half_tail),
        "wg untrimmed": r(base, wg_trim=False),
        "wg 128x128 w4 s3": r(base, wg_n=128, wg_warps=4, num_stages=3),
        "wg s3": r(base, num_stages=3),
        "wg persistent": r(base, wg_persistent=not base.wg_persistent, wg_stages=3),
        "wg persistent s2": r(base, wg_persistent=True, wg_stages=2),
        "wg persistent 128x128 s4": r(base, wg_persistent=True, wg_n=128, wg_stages=4),
        "wg persistent k32 s6": r(base, wg_persistent=True, wg_k=32, wg_stages=6),
        "wg persistent k128 128x128 s2": r(base, wg_persistent=True, wg_k=128, wg_n=128,
                                           wg_stages=2),
        "wg persistent k128 128x128 s3": r(base, wg_persistent=True, wg_k=128, wg_n=128,
                                           wg_stages=3),
        "wg chunk16": r(base, wg_persistent=True, wg_stages=3, wg_chunk=16),
        "wg split s4": r(base, wg_persistent=True, wg_stages=4, wg_split=2),
        "wg split s3": r(base, wg_persistent=True, wg_stages=3, wg_split=2),
        "wg split4 s4": r(base, wg_persistent=True, wg_stages=4, wg_split=4),
        "wg k128 split s2": r(base, wg_persistent=True, wg_k=128, wg_stages=2, wg_split=2),
        "wg k128 split4 s2": r(base, wg_persistent=True, wg_k=128, wg_stages=2, wg_split=4),
        "wg ws s3": r(base, wg_ws=True, wg_n=256, wg_stages=3),
        "wg ws 128x128 s4": r(base, wg_ws=True, wg_n=128, wg_stages=4),
        "wg ws s3 + rows ws": r(base, wg_ws=True, wg_n=256, wg_stages=3, rows_ws=True,
                                da_n=128),
        "wg ws s3 + rows ws s3": r(base, wg_ws=True, wg_n=256, wg_stages=3, rows_ws=True,
                                   da_n=128, num_stages=3),
        "wg ws s3 + rows ws dx128": r(base, wg_ws=True, wg_n=256, wg_stages=3, rows_ws=True,
                                      da_n=128, dx_n=128),
        "wg lpt": r(base, wg_persistent=True, wg_lpt=not base.wg_lpt),
        "da half" if not base.da_half else "da float32": r(base, da_half=not base.da_half),
    }


def kernel_times(fn, n=3):
    """ms per call of each kernel."""
    return {k: v / 1000.0 for k, v in bench.kernel_times_us(fn, n).items()}


def rel(a, b):
    a, b = a[:4], b[:4]   # the first rows / experts: a float32 copy of a DeepSeek dW13 is 28 GiB
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[8192])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--quick", action="store_true", help="default variant only, z saved + recomputed")
    p.add_argument("--variants", nargs="+", help="names from variants() to time (default: all)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every variant this many times, alternating; the best is kept")
    p.add_argument("--bench-routing", action="store_true",
                   help="the benchmark's weights, tokens and routing (bench.cell_inputs); "
                        "--shapes may then name bench shapes such as qwen3_30b_a3b_zipf")
    args = p.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    rows = []
    for name in args.shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        if args.bench_routing:
            s = bench.SHAPES[name]
            H, I, E, K = s.H, s.I, s.E, s.K
            wt = bench.make_weights(s, dev, dt, seed=0)
            w13, w2 = wt.w13, wt.w2
        else:
            H, I, E, K = SHAPES[name]
            w13 = torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) * H ** -0.5
            w2 = torch.randn(E, H, I, device=dev, dtype=dt, generator=g) * I ** -0.5
        for T in args.tokens:
            if args.bench_routing:
                ci = bench.cell_inputs(f"{name}:{T}", dev, dt, weights=wt)
                x, tw, ids = ci.hidden, ci.topk_weights, ci.topk_ids
                go = torch.randn(T, H, device=dev, dtype=dt, generator=g)
            else:
                x = torch.randn(T, H, device=dev, dtype=dt, generator=g)
                go = torch.randn(T, H, device=dev, dtype=dt, generator=g)
                logits = torch.randn(T, E, device=dev, generator=g)
                tw, ids = torch.topk(logits.softmax(-1), K, dim=-1)
                tw = tw.to(dt)
                ids = ids.to(torch.int32)
            cfg = dispatch_config(T, E, K, H, I, "cuda", dt)
            base = backward_config(cfg, "cuda", dt, rows_per_expert=T * K / E, inter_size=I)
            flops = 2 * T * K * 3 * H * I
            t_f = triton.testing.do_bench(lambda: dispatch_triton(x, w13, w2, tw, ids, config=cfg))
            t_fz = triton.testing.do_bench(
                lambda: dispatch_triton(x, w13, w2, tw, ids, config=cfg, save_z=True))
            _, z = dispatch_triton(x, w13, w2, tw, ids, config=cfg, save_z=True)
            ref = dispatch_backward_triton(go, x, w13, w2, tw, ids, z=z, config=cfg, bwd_config=base)
            vs = {"default": base} if args.quick else variants(base)
            if args.variants:
                vs = {k: v for k, v in vs.items() if k in args.variants or k == "default"}
            runs = {}   # (name, use_z) -> [fn, max rel err vs default, kernel ms, best ms]
            for rnd in range(args.rounds):
                for vname, bc in vs.items():
                    for use_z in ((True, False) if vname == "default" else (True,)):
                        zz = z if use_z else None
                        key = (vname, use_z)
                        if key not in runs:
                            if rnd:   # it failed to compile in the first round
                                continue
                            fn = (lambda zz=zz, bc=bc: dispatch_backward_triton(
                                go, x, w13, w2, tw, ids, z=zz, config=cfg, bwd_config=bc))
                            try:
                                out = fn()
                            except Exception as exc:  # a config that does not compile
                                print(f"{name} T={T} {vname}: {type(exc).__name__}: "
                                      f"{str(exc)[:200]}")
                                continue
                            runs[key] = [fn, max(rel(a, b) for a, b in zip(out, ref)), None,
                                         float("inf")]
                            out = None
                        run = runs[key]
                        run[3] = min(run[3], triton.testing.do_bench(run[0]))
                        if rnd == args.rounds - 1:
                            run[2] = kernel_times(run[0])
            for (vname, use_z), (_, err, kt, t_b) in runs.items():
                total = t_fz + t_b if use_z else t_f + t_b
                frac = 3 * flops / (total * 1e-3) / 786e12
                label = vname + ("" if use_z else " [recompute]")
                rows.append((name, T, label, t_f, t_fz, t_b, total, frac, err))
                print(f"{name} T={T} {label}: fwd {t_f:.2f} fwd+z {t_fz:.2f} bwd {t_b:.2f} ms"
                      f"{f' (best of {args.rounds})' if args.rounds > 1 else ''}, fwd+bwd "
                      f"{total:.2f} ms ({frac:.0%} of 786 TFLOP/s), max rel vs default {err:.1e}")
                print("   kernels ms:", ", ".join(f"{k} {v:.2f}" for k, v in list(kt.items())[:8]))
            runs = None
            del x, go
            ref = z = out = None
        del w13, w2
        wt = None
        gc.collect()
        torch.cuda.empty_cache()
    print("\nshape                T      variant                           fwd   fwd+z    bwd   "
          "fwd+bwd  roofline  rel")
    for r in rows:
        print(f"{r[0]:<20} {r[1]:<6} {r[2]:<32} {r[3]:6.2f} {r[4]:6.2f} {r[5]:7.2f} {r[6]:8.2f}"
              f"  {r[7]:7.0%}  {r[8]:.0e}")


if __name__ == "__main__":
    main()

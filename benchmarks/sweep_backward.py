"""Backward-kernel sweep on one GPU (not part of the test suite): times the forward (with and
without saving z) and the backward of moe.dispatch for several BackwardConfig variants, with a
per-kernel breakdown from torch.profiler, and checks every variant's gradients against the
default variant's (bitwise-equal weight-gradient order is not expected across tile shapes).

    PYTHONPATH=. python benchmarks/sweep_backward.py [--tokens 8192] [--shapes ...]
"""
from __future__ import annotations

import argparse
import collections
import gc
import dataclasses

import torch
import triton

from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.launch.dispatch_backward import dispatch_backward_triton
from moe_ops.tuning.heuristics import backward_config, dispatch_config
from moe_ops.tuning.shapes import SHAPES


def variants(base):
    r = dataclasses.replace
    return {
        "default": base,
        "old(64x64x32 wg, 64 dx)": r(base, wg_m=64, wg_n=64, wg_k=32, dx_n=64),
        "wg 128x256": r(base, wg_n=256),
        "wg k32": r(base, wg_k=32),
        "wg 4 stages": r(base, num_stages=4),
        "act n128": r(base, act_n=128),
        "dx n256": r(base, dx_n=256),
        "act n128 w4": r(base, act_n=128, act_warps=4),
        "act n128 s4": r(base, act_n=128, num_stages=4),
        "act n256": r(base, act_n=256),
        "act k128": r(base, act_k=128),
    }


WG_TILES = [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
            (128, 128, 64, 4, 4), (64, 128, 64, 4, 4)]


def probe_weight_grads(name, T, x, go, ids, cfg, base, I, rows_out):
    """Weight-gradient kernel alone: the row-major operands as the backward has them
    (the contraction runs over rows, so the left operand is M-contiguous) against transposed
    copies (left operand contiguous along the rows = K-major)."""
    from moe_ops.launch.alignment import align_triton
    from moe_ops.launch.dispatch_backward import weight_grad_triton
    E = rows_out["E"]
    H = x.shape[1]
    K = ids.shape[1]
    al = align_triton(ids, E, cfg.block_m)
    dz = torch.randn(al.max_rows, 2 * I, device=x.device, dtype=x.dtype)
    sa = torch.randn(al.max_rows, I, device=x.device, dtype=x.dtype)
    dzT = dz.t().contiguous()
    saT = sa.t().contiguous()
    dw13 = torch.empty(E, 2 * I, H, device=x.device, dtype=x.dtype)
    dw2 = torch.empty(E, H, I, device=x.device, dtype=x.dtype)
    n_slots = T * K
    fl13 = 2 * n_slots * 2 * I * H
    fl2 = 2 * n_slots * I * H
    for tile in WG_TILES:
        bc = dataclasses.replace(base, wg_m=tile[0], wg_n=tile[1], wg_k=tile[2], wg_warps=tile[3],
                                 num_stages=tile[4])
        cases = {
            "dW13 rowmajor": (lambda: weight_grad_triton(dz, x, dw13, al, n_slots, K, False, True,
                                                         bc, "tf32"), fl13),
            "dW13 K-major": (lambda: weight_grad_triton(dzT.t(), x, dw13, al, n_slots, K, False, True,
                                                        bc, "tf32"), fl13),
            "dW2 rowmajor": (lambda: weight_grad_triton(go, sa, dw2, al, n_slots, K, True, False, bc,
                                                        "tf32"), fl2),
            "dW2 K-major": (lambda: weight_grad_triton(saT.t(), go, dw2.transpose(1, 2), al, n_slots,
                                                       K, False, True, bc, "tf32"), fl2),
        }
        res = []
        for cname, (fn, fl) in cases.items():
            try:
                t = triton.testing.do_bench(fn)
                res.append(f"{cname} {t:.2f} ms {fl / t / 1e9 / 786:.0%}")
            except Exception as exc:
                res.append(f"{cname} {type(exc).__name__}")
        print(f"WG {name} T={T} tile {tile}: " + " | ".join(res), flush=True)
    # K-major result equals the row-major one (same products, same row order)
    bc = base
    weight_grad_triton(dz, x, dw13, al, n_slots, K, False, True, bc, "tf32")
    a = dw13.clone()
    weight_grad_triton(dzT.t(), x, dw13, al, n_slots, K, False, True, bc, "tf32")
    print(f"WG {name}: K-major vs row-major dW13 max rel {rel(dw13, a):.1e}")
    del dz, sa, dzT, saT, dw13, dw2


def kernel_times(fn, n=3):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    acc = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            acc[ev.name.split("(")[0][:28]] += ev.device_time_total / n / 1000.0
    return dict(sorted(acc.items(), key=lambda kv: -kv[1]))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[8192])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--quick", action="store_true", help="default variant only, z saved + recomputed")
    p.add_argument("--probe-wg", action="store_true", help="weight-gradient layouts and tiles only")
    args = p.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    rows = []
    for name in args.shapes:
        H, I, E, K = SHAPES[name]
        g = torch.Generator(device=dev).manual_seed(0)
        w13 = torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) * H ** -0.5
        w2 = torch.randn(E, H, I, device=dev, dtype=dt, generator=g) * I ** -0.5
        for T in args.tokens:
            x = torch.randn(T, H, device=dev, dtype=dt, generator=g)
            go = torch.randn(T, H, device=dev, dtype=dt, generator=g)
            logits = torch.randn(T, E, device=dev, generator=g)
            tw, ids = torch.topk(logits.softmax(-1), K, dim=-1)
            tw = tw.to(dt)
            ids = ids.to(torch.int32)
            cfg = dispatch_config(T, E, K, H, I, "cuda", dt)
            base = backward_config(cfg, "cuda", dt)
            flops = 2 * T * K * 3 * H * I
            if args.probe_wg:
                probe_weight_grads(name, T, x, go, ids, cfg, base, I, {"E": E})
                continue
            t_f = triton.testing.do_bench(lambda: dispatch_triton(x, w13, w2, tw, ids, config=cfg))
            t_fz = triton.testing.do_bench(
                lambda: dispatch_triton(x, w13, w2, tw, ids, config=cfg, save_z=True))
            _, z = dispatch_triton(x, w13, w2, tw, ids, config=cfg, save_z=True)
            ref = dispatch_backward_triton(go, x, w13, w2, tw, ids, z=z, config=cfg, bwd_config=base)
            vs = {"default": base} if args.quick else variants(base)
            for vname, bc in vs.items():
                for use_z in ((True, False) if vname == "default" else (True,)):
                    zz = z if use_z else None
                    fn = lambda: dispatch_backward_triton(go, x, w13, w2, tw, ids, z=zz, config=cfg,
                                                          bwd_config=bc)
                    try:
                        out = fn()
                        errs = [rel(a, b) for a, b in zip(out, ref)]
                        t_b = triton.testing.do_bench(fn)
                        kt = kernel_times(fn)
                    except Exception as exc:  # a config that does not compile (shared memory)
                        print(f"{name} T={T} {vname}: {type(exc).__name__}: {str(exc)[:200]}")
                        continue
                    total = t_fz + t_b if use_z else t_f + t_b
                    frac = 3 * flops / (total * 1e-3) / 786e12
                    rows.append((name, T, vname + ("" if use_z else " [recompute]"), t_f, t_fz, t_b,
                                 total, frac, max(errs)))
                    print(f"{name} T={T} {vname}{'' if use_z else ' [recompute]'}: fwd {t_f:.2f} "
                          f"fwd+z {t_fz:.2f} bwd {t_b:.2f} ms, fwd+bwd {total:.2f} ms "
                          f"({frac:.0%} of 786 TFLOP/s), max rel vs default {max(errs):.1e}")
                    print("   kernels ms:", ", ".join(f"{k} {v:.2f}" for k, v in list(kt.items())[:8]))
            del x, go
            ref = z = out = None
        del w13, w2
        gc.collect()
        torch.cuda.empty_cache()
    print("\nshape                T      variant                           fwd   fwd+z    bwd   "
          "fwd+bwd  roofline  rel")
    for r in rows:
        print(f"{r[0]:<20} {r[1]:<6} {r[2]:<32} {r[3]:6.2f} {r[4]:6.2f} {r[5]:7.2f} {r[6]:8.2f}"
              f"  {r[7]:7.0%}  {r[8]:.0e}")


if __name__ == "__main__":
    main()

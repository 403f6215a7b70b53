"""Are quantized moe.dispatch outputs bitwise the same call after call, alone and beside another
process using the GPU? For each cell, N calls on the same random inputs (half through the
launcher, `dispatch_quantized(..., out=NaN buffer)`, half through `torch.ops.moe.dispatch`;
a config variant: every call through the launcher), each on memory poisoned with NaN,
compared with the first call: how many elements and rows differ, by how much, and which config
variant (QuantDispatchConfig fields overridden on the heuristic's) changes that. Prints one
line per cell, variant and condition, then a table.

    PYTHONPATH=. python benchmarks/probe_repeatability.py --cells gpt_oss_20b:128,2048 \\
        --layouts plain mma --variants "" "prefetch_scales=0" --calls 12 [--noise] [--csv F]

With --noise a second process runs bf16 matmuls on the same GPU for the whole probe (the
condition under which Triton 3.6's warp-specialised kernels went wrong; docs/design.md). A
variant is a comma-separated list of field=value (ints; 0/1 for flags; "" is the heuristic).
Exit status 1 if any cell's calls differ."""
from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys

import torch

from moe_ops.launch.quant import dispatch_quantized, quant_dispatch_config
from moe_ops.mxfp4_layout import swizzle_mxfp4
from moe_ops.tools._timing import gpu_noise, poison_cuda_allocator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # sweep_quant, beside this file
from sweep_quant import SHAPES, make_weights, parse_variant  # noqa: E402


def inputs(name, T, seed):
    """sweep_quant's weights for the shape, random hidden and softmax top-K routing; gpt-oss
    shapes with float32 biases of scale 0.1 (test_mxfp4_gpt_oss_accuracy's inputs)."""
    E, K, H, I, fmt, gpt_oss = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13, w2, kw = make_weights(E, H, I, fmt, gpt_oss, g)
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    logits = torch.randn(T, E, device="cuda", generator=g)
    tw, ids = logits.softmax(-1).topk(K, dim=-1)
    tw = (tw / tw.sum(-1, keepdim=True)).float()
    if gpt_oss:
        kw.update(w13_bias=torch.randn(E, 2 * I, device="cuda", generator=g) * 0.1,
                  w2_bias=torch.randn(E, H, device="cuda", generator=g) * 0.1)
    return hidden, w13, w2, tw, ids.int(), kw, fmt


def probe(hidden, w13, w2, tw, ids, kw, cfg, calls):
    """[(call, differing elements, differing rows, max abs difference)] against call 0."""
    first, rows = None, []
    for c in range(calls):
        if hidden.is_cuda:   # free cached memory poisoned: unwritten intermediates show up
            poison_cuda_allocator()
        if c % 2 and cfg is None:
            got = torch.ops.moe.dispatch(hidden, w13, w2, tw, ids, **kw)
        else:
            got = torch.full_like(hidden, float("nan"))
            dispatch_quantized(hidden, w13, w2, tw, ids, **kw, config=cfg, out=got)
        if first is None:
            first = got
            rows.append((c, int((~torch.isfinite(got)).sum()), 0, 0.0))
            continue
        bad = got != first
        diff = (got.float() - first.float()).abs()
        rows.append((c, int(bad.sum()), int(bad.any(1).sum()),
                     float(diff[bad].max()) if bad.any() else 0.0))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", nargs="+", default=["gpt_oss_20b:1,128,2048"],
                   help="shape:T,T,... (shapes: " + ", ".join(SHAPES) + ")")
    p.add_argument("--layouts", nargs="+", default=["plain", "mma"], choices=["plain", "mma"],
                   help="MXFP4 layouts (FP8 cells ignore this)")
    p.add_argument("--variants", nargs="+", default=[""])
    p.add_argument("--calls", type=int, default=12)
    p.add_argument("--noise", action="store_true", help="a matmul process beside the probe")
    p.add_argument("--csv")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA")
    if args.calls < 2:
        p.error("--calls must be >= 2")
    cells = []
    for cell in args.cells:
        name, _, ts = cell.partition(":")
        if name not in SHAPES or not ts:
            p.error(f"--cells {cell!r}: expected shape:T[,T...] with a shape among {list(SHAPES)}")
        cells += [(name, int(t)) for t in ts.split(",")]
    import triton

    results, any_diff = [], False
    with gpu_noise(args.noise):
        for name, T in cells:
            hidden, b13, b2, tw, ids, kw, fmt = inputs(name, T, 1000 + T)
            E, K, H, I = SHAPES[name][:4]
            layouts = args.layouts if fmt == "mxfp4" else ["plain"]
            for layout in layouts:
                w13, w2, lkw = b13, b2, dict(kw)
                if layout == "mma":
                    w13, w2 = swizzle_mxfp4(b13), swizzle_mxfp4(b2)
                    lkw["mxfp4_layout"] = "mma"
                for v in args.variants:
                    cfg = None
                    if v:
                        base = quant_dispatch_config(T, E, K, H, I, fmt, 128 if fmt == "fp8" else 32,
                                                     "cuda", quant_a=fmt == "fp8",
                                                     mma=layout == "mma")
                        cfg = dataclasses.replace(base, **parse_variant(v))
                    rows = probe(hidden, w13, w2, tw, ids, lkw, cfg, args.calls)
                    nonfinite = rows[0][1]
                    differ = [r for r in rows[1:] if r[1]]
                    any_diff |= bool(differ) or nonfinite > 0
                    worst = max(rows[1:], key=lambda r: r[1])
                    line = dict(triton=triton.__version__, shape=name, T=T, layout=layout,
                                variant=v or "heuristic", noise=int(args.noise), calls=args.calls,
                                nonfinite_first=nonfinite, calls_differing=len(differ),
                                max_elements=worst[1], max_rows=worst[2], max_abs=worst[3])
                    results.append(line)
                    print(" ".join(f"{k}={x}" for k, x in line.items()), flush=True)
    print("\nshape T layout variant noise | calls differing / calls-1 | worst: elements rows max|diff|")
    for r in results:
        print(f"{r['shape']} {r['T']} {r['layout']} {r['variant']} {r['noise']} | "
              f"{r['calls_differing']} / {r['calls'] - 1} | {r['max_elements']} {r['max_rows']} "
              f"{r['max_abs']:.3g}")
    if args.csv and results:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(results[0]))
            w.writeheader()
            w.writerows(results)
    return 1 if any_diff else 0


if __name__ == "__main__":
    sys.exit(main())

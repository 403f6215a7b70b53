"""Tile and path variants of the quantized expert GEMMs on the GPU: each variant of
moe_ops.launch.quant.QuantDispatchConfig (fields overridden on the heuristic config of each cell)
timed by CUDA-graph replay (median of triton.testing.do_bench, L2 flushed), its output compared
with the heuristic config's (each checked output written into a NaN-filled buffer), and the
heuristic config's time split per kernel (torch.profiler; every variant's with --split-all).

    python benchmarks/sweep_quant.py --cells deepseek_v3:1,128,2048 gpt_oss_20b:1,2048 \
        --fp8 "block_m=64,num_warps=8" "num_stages=4" --mxfp4 "mxfp4_dot_scaled=1" \
        [--csv sweep.csv] [--split-all]

A variant is a comma-separated list of field=value (ints; 0/1 for flags); "w8a16" as a field
(w8a16=1) runs the FP8 weights with quantize_activations=False; "pad_scales" (pad_scales=1)
passes the weight scales as views of buffers whose rows are padded to a multiple of 16 bytes
(MXFP4: gpt-oss's 90-byte scale rows are not 4-byte aligned), the same values; "mma_layout"
(mma_layout=1, MXFP4) passes the weights in moe_ops.mxfp4_layout's order. The table
printed last has one row per cell and variant: time, the ratio to the heuristic config, the
relative L2 difference of the outputs, and the floor (quantized weight bytes of the experts hit
at the copy rate)."""
from __future__ import annotations

import argparse
import csv
import dataclasses

import torch

from moe_ops.launch.quant import dispatch_quantized, quant_dispatch_config
from moe_ops.mxfp4_layout import swizzle_mxfp4
from moe_ops.tools._timing import capture_graph
from moe_ops.tools.bench import (
    Timer,
    environment,
    kernel_times_us,
    measure_ceilings,
    text_table,
)
from moe_ops.tools.quant_baselines import BLOCK_SHAPE, random_quantized

SHAPES = {  # E, K, H, I, format, gpt-oss arithmetic
    "deepseek_v3": (256, 8, 7168, 2048, "fp8", False),
    "qwen3_30b_a3b": (128, 8, 2048, 768, "fp8", False),
    "gpt_oss_20b": (32, 4, 2880, 2880, "mxfp4", True),
    "gpt_oss_120b": (128, 4, 2880, 2880, "mxfp4", True),
}


def make_weights(E, H, I, fmt, gpt_oss, g):
    """Random quantized weights in the checkpoints' layouts (quant_baselines.random_quantized:
    FP8 e4m3 with [128, 128]-block scales ~1e-4, weights ~0.01; MXFP4 random nibbles with e8m0
    scales 2^-9..2^-6) and dispatch_quantized's arguments for them; gpt-oss: its biases,
    activation and interleaved gate/up rows."""
    w13, w2, s13, s2 = random_quantized(E, H, I, fmt, "cuda", g)
    extra = {"w13_scale": s13, "w2_scale": s2}
    if fmt == "fp8":
        extra["block_shape"] = list(BLOCK_SHAPE)
    if gpt_oss:
        extra.update(activation="swiglu_oai", gate_up_interleaved=True,
                     w13_bias=torch.randn(E, 2 * I, device="cuda", generator=g).bfloat16(),
                     w2_bias=torch.randn(E, H, device="cuda", generator=g).bfloat16())
    return w13, w2, extra


def padded_rows(s: torch.Tensor) -> torch.Tensor:
    """`s` as a view of a buffer whose last-dimension rows are padded to a multiple of 16 bytes."""
    n = s.shape[-1]
    per16 = max(1, 16 // s.element_size())
    buf = torch.zeros(*s.shape[:-1], -(-n // per16) * per16, dtype=s.dtype, device=s.device)
    buf[..., :n] = s
    return buf[..., :n]


def parse_variant(spec: str) -> dict:
    out = {}
    for item in filter(None, spec.split(",")):
        k, v = item.split("=")
        out[k.strip()] = int(v)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", nargs="+", default=["deepseek_v3:1,128,2048", "qwen3_30b_a3b:1,2048",
                                                   "gpt_oss_20b:1,128,2048"])
    p.add_argument("--fp8", nargs="*", default=[], help="FP8 variants (field=value,...)")
    p.add_argument("--mxfp4", nargs="*", default=[], help="MXFP4 variants")
    p.add_argument("--rep-ms", type=float, default=50)
    p.add_argument("--csv", default=None)
    p.add_argument("--split-all", action="store_true",
                   help="per-kernel split (torch.profiler) of every variant, not only the heuristic")
    opts = p.parse_args()
    dev = torch.device("cuda")
    timer = Timer(dev, warmup_ms=10, rep_ms=opts.rep_ms)
    for k, v in environment(dev):
        print(f"{k}: {v}")
    bw, _, desc = measure_ceilings(dev, timer, tiny=False)
    print(f"ceilings: {desc}", flush=True)
    rows = []
    for cell in opts.cells:
        name, tokens = cell.split(":")
        E, K, H, I, fmt, gpt_oss = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        w13, w2, qkw = make_weights(E, H, I, fmt, gpt_oss, g)
        mma_w = None
        wbytes = (1.0 + 4 / 128 ** 2) if fmt == "fp8" else (0.5 + 1 / 32)
        for T in [int(t) for t in tokens.split(",")]:
            hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
            w, ids = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(K, -1)
            tw, ids = (w / w.sum(-1, keepdim=True)).float(), ids.int()
            hit = int(ids.unique().numel())
            floor_us = (3 * H * I * hit * wbytes + 4 * T * H) / bw * 1e6
            base = quant_dispatch_config(T, E, K, H, I, fmt, 128, "cuda", quant_a=fmt == "fp8")
            ref = None
            t_ref = None
            for spec in ["", *(opts.fp8 if fmt == "fp8" else opts.mxfp4)]:
                fields = parse_variant(spec)
                qa = not fields.pop("w8a16", 0)
                qkw_v = qkw
                if fields.pop("pad_scales", 0):
                    qkw_v = dict(qkw, w13_scale=padded_rows(qkw["w13_scale"]),
                                 w2_scale=padded_rows(qkw["w2_scale"]))
                if fields.pop("mma_layout", 0):   # MXFP4 weights in the mma layout
                    if mma_w is None:
                        mma_w = swizzle_mxfp4(w13), swizzle_mxfp4(w2)
                    qkw_v = dict(qkw_v, mxfp4_layout="mma")
                    wts = mma_w
                else:
                    wts = (w13, w2)
                if fmt == "fp8" and not qa:
                    base_v = quant_dispatch_config(T, E, K, H, I, fmt, 128, "cuda", quant_a=False)
                else:
                    base_v = base
                label = spec or "heuristic"
                try:
                    cfg = dataclasses.replace(base_v, **{k: (bool(v) if isinstance(
                        getattr(base_v, k), bool) else v) for k, v in fields.items()})
                    extra = {"quantize_activations": qa} if fmt == "fp8" else {}

                    def fn(cfg=cfg, extra=extra, args=(hidden, *wts, tw, ids), qkw=qkw_v,
                           out=None):
                        return dispatch_quantized(*args, **qkw, **extra, config=cfg, out=out)
                    # the checked output goes to a NaN-poisoned buffer: a fresh one could hold
                    # the previous variant's values where a kernel writes nothing
                    out = fn(out=torch.full((T, H), float("nan"), device="cuda",
                                            dtype=hidden.dtype)).float()
                    if not torch.isfinite(out).all():
                        raise RuntimeError(f"non-finite output ({int((~out.isfinite()).sum())} "
                                           f"of {out.numel()})")
                    graph, _ = capture_graph(fn)
                    us = timer(graph.replay) * 1e3
                    if ref is None or opts.split_all:
                        split = kernel_times_us(graph.replay, name_len=22)
                        print(f"{name} T={T} {label}: " + ", ".join(
                            f"{k} {v:.1f}" for k, v in split.items()), flush=True)
                    if ref is None:
                        ref, t_ref = out, us
                    diff = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
                    row = [name, str(T), label, f"{us:.1f}", f"{t_ref / us:.2f}",
                           f"{diff:.1e}", f"{floor_us:.1f}", f"{100 * floor_us / us:.0f}%"]
                    del graph
                except Exception as exc:  # noqa: BLE001 - a variant that fails is reported
                    msg = str(exc).splitlines()[0][:60] if str(exc) else ""
                    row = [name, str(T), label, "failed", "", f"{type(exc).__name__}: {msg}",
                           "", ""]
                rows.append(row)
                print(" | ".join(row), flush=True)
        w13 = w2 = qkw = mma_w = None   # free this shape's weights before the next
        torch.cuda.empty_cache()
    header = ["shape", "T", "variant", "us", "x heur", "diff", "floor us", "floor %"]
    print()
    print(text_table(header, rows))
    if opts.csv:
        with open(opts.csv, "w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(header)
            wr.writerows(rows)


if __name__ == "__main__":
    main()

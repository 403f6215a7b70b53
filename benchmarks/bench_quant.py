"""Quantized expert weights on the GPU (issue 42): moe.dispatch with FP8 block-scaled (W8A8,
W8A16) and MXFP4 weights against dequantize-then-bf16-moe_ops, bf16 moe_ops on weights
dequantized ahead of time, and torch._scaled_grouped_mm (rowwise FP8, where this torch has it),
with the floors of issue 42: the quantized bytes (weights of the experts hit + their scales +
activations in and out) at the copy rate, and the FLOPs at the FP8 ceiling (torch._scaled_mm on
8192^3, measured in the same run; bf16 matmul for MXFP4, which runs bf16 MMAs on Hopper).

    python benchmarks/bench_quant.py [--shapes deepseek_v3,qwen3_30b_a3b,gpt_oss_20b]
                                     [--tokens 1,8,32,128,512,2048,8192] [--quick]

Times are the median of triton.testing.do_bench (L2 flushed), the better of eager and CUDA-graph
replay for moe_ops; errors are relative L2 against float64 on the dequantized weights with
unquantized activations (one sampled call per cell)."""
from __future__ import annotations

import argparse
import dataclasses

import torch

import moe_ops
from moe_ops.tools._timing import capture_graph
from moe_ops.tools.bench import Timer, environment, measure_ceilings, text_table
from moe_ops.launch.quant import dispatch_quantized, has_dot_scaled, quant_dispatch_config
from moe_ops.reference.quant import dequantize_weights, quantized_dispatch_reference

SHAPES = {  # E, K, H, I, format
    "deepseek_v3": (256, 8, 7168, 2048, "fp8"),
    "qwen3_30b_a3b": (128, 8, 2048, 768, "fp8"),
    "gpt_oss_20b": (32, 4, 2880, 2880, "mxfp4"),
    "gpt_oss_120b": (128, 4, 2880, 2880, "mxfp4"),
}


def fp8_ceiling(timer: Timer, n: int = 8192) -> float:
    """FLOP/s of torch._scaled_mm on n^3 e4m3 operands (tensor-wise scales, bf16 out)."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    return max(2 * n ** 3 / (timer(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                             out_dtype=torch.bfloat16)) * 1e-3)
               for _ in range(3))


def make_weights(E, H, I, fmt, g):
    if fmt == "fp8":
        kw = dict(device="cuda", dtype=torch.uint8, generator=g)
        # e4m3 bytes below 0x78 (|v| < 256, no NaN), scales ~ 1e-4: weights ~ 0.01
        q13 = torch.randint(0, 0x78, (E, 2 * I, H), **kw).bitwise_or_(
            torch.randint(0, 2, (E, 2 * I, H), **kw) << 7).view(torch.float8_e4m3fn)
        q2 = torch.randint(0, 0x78, (E, H, I), **kw).bitwise_or_(
            torch.randint(0, 2, (E, H, I), **kw) << 7).view(torch.float8_e4m3fn)
        s13 = torch.rand(E, -(-2 * I // 128), -(-H // 128), device="cuda", generator=g) * 2e-4
        s2 = torch.rand(E, -(-H // 128), -(-I // 128), device="cuda", generator=g) * 2e-4
        return q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=[128, 128])
    kw = dict(device="cuda", dtype=torch.uint8, generator=g)
    b13 = torch.randint(0, 256, (E, 2 * I, H // 2), **kw)
    b2 = torch.randint(0, 256, (E, H, I // 2), **kw)
    s13 = torch.randint(118, 122, (E, 2 * I, H // 32), **kw)
    s2 = torch.randint(118, 122, (E, H, I // 32), **kw)
    return b13, b2, dict(w13_scale=s13, w2_scale=s2)


def dequantized_bf16(w13, w2, kw):
    """bf16 copies, one expert at a time (a float32 intermediate of every expert would not fit
    next to the others at DeepSeek-V3's shape)."""
    bs = kw.get("block_shape")
    out = []
    for w, s in ((w13, kw["w13_scale"]), (w2, kw["w2_scale"])):
        E, N, Kp = w.shape
        K = 2 * Kp if w.dtype == torch.uint8 else Kp
        d = torch.empty(E, N, K, dtype=torch.bfloat16, device=w.device)
        for e in range(E):
            d[e] = dequantize_weights(w[e], s[e], bs, torch.float32)
        out.append(d)
    return out


def scaled_grouped_mm_moe(hidden, q13_rw, s13_rw, q2_rw, s2_rw, tw, ids):
    """Rowwise-FP8 MoE on torch._scaled_grouped_mm: tokens sorted by expert, activations
    quantized per row, gate+up, SiLU*up, quantize, down, weighted scatter-add."""
    T, K = ids.shape
    E = q13_rw.shape[0]
    flat = ids.reshape(-1).long()
    order = flat.argsort()
    counts = torch.histc(flat.float(), bins=E, min=0, max=E - 1).int()
    offs = counts.cumsum(0).int()
    x = hidden[order // K]

    def rowwise(a):
        s = a.float().abs().amax(-1).clamp_min(1e-12) / 448.0
        return (a.float() / s[:, None]).to(torch.float8_e4m3fn), s

    xq, xs = rowwise(x)
    h = torch._scaled_grouped_mm(xq, q13_rw.transpose(1, 2), xs, s13_rw, offs=offs,
                                 out_dtype=torch.bfloat16)
    I = h.shape[1] // 2
    a = torch.nn.functional.silu(h[:, :I].float()) * h[:, I:].float()
    aq, as_ = rowwise(a)
    y = torch._scaled_grouped_mm(aq, q2_rw.transpose(1, 2), as_, s2_rw, offs=offs,
                                 out_dtype=torch.bfloat16)
    y = y.float() * tw.reshape(-1)[order, None]
    out = torch.zeros(T, hidden.shape[1], device=hidden.device, dtype=torch.float32)
    out.index_add_(0, order // K, y)
    return out.to(hidden.dtype)


def rowwise_weights(w13_bf16, w2_bf16):
    def q(w):
        s = w.float().abs().amax(-1).clamp_min(1e-12) / 448.0
        return (w.float() / s[..., None]).to(torch.float8_e4m3fn), s
    return (*q(w13_bf16), *q(w2_bf16))


def best_time(timer, fn):
    """min(eager, CUDA-graph replay) in us."""
    t_eager = timer(fn) * 1e3
    try:
        graph, _ = capture_graph(fn)
        t_graph = timer(graph.replay) * 1e3
    except Exception:  # noqa: BLE001 - a capture failure leaves the eager time
        t_graph = float("inf")
    return min(t_eager, t_graph)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="deepseek_v3,qwen3_30b_a3b,gpt_oss_20b")
    p.add_argument("--tokens", default="1,8,32,128,512,2048,8192")
    p.add_argument("--quick", action="store_true", help="shorter timing (25 ms rep)")
    opts = p.parse_args()
    dev = torch.device("cuda")
    timer = Timer(dev, warmup_ms=10 if opts.quick else 25, rep_ms=25 if opts.quick else 100)
    for k, v in environment(dev):
        print(f"{k}: {v}")
    bw, bf16_rate, desc = measure_ceilings(dev, timer, tiny=False)
    f8_rate = fp8_ceiling(timer)
    print(f"ceilings: {desc}; fp8 _scaled_mm 8192^3: {f8_rate / 1e12:.0f} TFLOP/s")
    rows = []
    for name in opts.shapes.split(","):
        E, K, H, I, fmt = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        w13, w2, qkw = make_weights(E, H, I, fmt, g)
        d13, d2 = dequantized_bf16(w13, w2, qkw)
        rw = rowwise_weights(d13, d2) if fmt == "fp8" and hasattr(torch, "_scaled_grouped_mm") \
            else None
        wbytes = (1.0 + 4 / 128 ** 2) if fmt == "fp8" else (0.5 + 1 / 32)   # per weight
        for T in [int(t) for t in opts.tokens.split(",")]:
            hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
            w, ids = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(K, -1)
            tw, ids = (w / w.sum(-1, keepdim=True)).float(), ids.int()
            hit = int(ids.unique().numel())
            n_bytes = 3 * H * I * hit * wbytes + 2 * T * H * 2
            flops = 2 * T * K * 3 * H * I
            floor_us = max(n_bytes / bw, flops / (f8_rate if fmt == "fp8" else bf16_rate)) * 1e6
            cells = {}
            variants = ({"W8A8": dict(quantize_activations=True),
                         "W8A16": dict(quantize_activations=False)} if fmt == "fp8"
                        else {"W4A16": {}, "W4A16 dot_scaled": {}})
            err = None
            for label, extra in variants.items():
                if label.endswith("dot_scaled"):
                    if not has_dot_scaled():
                        cells[label] = "n/a (no tl.dot_scaled)"
                        continue
                    cfg = dataclasses.replace(
                        quant_dispatch_config(T, E, K, H, I, fmt, 32, "cuda"),
                        mxfp4_dot_scaled=True)

                    def fn(cfg=cfg):
                        return dispatch_quantized(hidden, w13, w2, tw, ids, **qkw, config=cfg)
                else:
                    def fn(extra=extra):
                        return moe_ops.dispatch(hidden, w13, w2, tw, ids, **qkw, **extra)
                cells[label] = best_time(timer, fn)
                if err is None and T <= 2048:
                    ref = quantized_dispatch_reference(hidden, w13, w2, tw, ids, **qkw,
                                                       emulate_kernel=False)
                    err = float((fn().double() - ref).norm() / ref.norm())

            def bf16_only():
                return moe_ops.dispatch(hidden, d13, d2, tw, ids)

            def deq_then_bf16():
                a, b = dequantized_bf16(w13, w2, qkw)
                return moe_ops.dispatch(hidden, a, b, tw, ids)
            cells["bf16"] = best_time(timer, bf16_only)
            cells["deq+bf16"] = timer(deq_then_bf16) * 1e3
            if rw is not None:
                try:
                    cells["scaled_grouped_mm"] = timer(
                        lambda: scaled_grouped_mm_moe(hidden, *rw, tw, ids)) * 1e3
                except Exception as exc:  # noqa: BLE001
                    cells["scaled_grouped_mm"] = f"n/a ({type(exc).__name__})"
            best = min(v for k, v in cells.items() if k in variants and isinstance(v, float))
            rows.append([name, str(T), *(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in cells.items()),
                         f"floor {floor_us:.1f}", f"{100 * floor_us / best:.0f}% of floor",
                         f"err {err:.1e}" if err is not None else ""])
            print(" | ".join(rows[-1]), flush=True)
        w13 = w2 = d13 = d2 = rw = None   # free this shape's weights before the next
        torch.cuda.empty_cache()
    print()
    print(text_table(["shape", "T", "times (us) ...", "", "", "", "", "", "", ""],
                     [r + [""] * (10 - len(r)) for r in rows]))


if __name__ == "__main__":
    main()

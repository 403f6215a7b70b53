"""The expert variants' cost (issue 36): moe.dispatch at the gpt-oss-20b expert shape (E=32, K=4,
H=I=2880) with gpt-oss's experts (biases, swiglu_oai, interleaved gate/up rows, weights read as
transposed views of the checkpoint's storage) against the same shape as Mixtral-style experts
(SwiGLU, no biases, [E, 2I, H] storage): the same bytes and flops, so the ratio is the variants'
overhead. CUDA-graph replay medians (triton.testing.do_bench), forward; also forward+backward.

    python benchmarks/bench_variants.py [--tokens 1 8 128 2048 8192] [--backward]
"""
from __future__ import annotations

import argparse

import torch
import triton

import moe_ops
from moe_ops.tools._timing import capture_graph


def inputs(T, H, I, E, K, gpt_oss, g):
    hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    logits = torch.randn(T, E, device="cuda", generator=g)
    tw, ids = torch.ops.moe.route(logits, K)
    if gpt_oss:   # checkpoint storage [E, H, 2I] and [E, I, H], read through transposed views
        gu = (torch.randn(E, H, 2 * I, device="cuda", generator=g) * 0.02).bfloat16()
        dn = (torch.randn(E, I, H, device="cuda", generator=g) * 0.02).bfloat16()
        kw = dict(w13_bias=(torch.randn(E, 2 * I, device="cuda", generator=g) * 0.02).bfloat16(),
                  w2_bias=(torch.randn(E, H, device="cuda", generator=g) * 0.02).bfloat16(),
                  activation="swiglu_oai", alpha=1.702, limit=7.0, gate_up_interleaved=True)
        return hidden, gu.transpose(1, 2), dn.transpose(1, 2), tw, ids, kw
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.02).bfloat16()
    return hidden, w13, w2, tw, ids, {}


def time_fwd(args):
    hidden, w13, w2, tw, ids, kw = args
    graph, _ = capture_graph(lambda: moe_ops.dispatch(hidden, w13, w2, tw, ids, **kw))
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3


def time_train(args):
    hidden, w13, w2, tw, ids, kw = args
    leaves = [t.detach().requires_grad_() for t in (hidden, w13, w2, tw)]
    extra = {k: (v.detach().requires_grad_() if torch.is_tensor(v) else v) for k, v in kw.items()}
    go = torch.randn_like(hidden)

    def step():
        out = moe_ops.dispatch(*leaves, ids, **extra)
        out.backward(go)
    return triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median") * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 128, 2048, 8192])
    p.add_argument("--backward", action="store_true", help="also forward+backward (eager)")
    opts = p.parse_args(argv)
    H, I, E, K = 2880, 2880, 32, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'T':>6s} {'plain us':>10s} {'gpt-oss us':>11s} {'plain/gpt-oss':>14s}"
          + (f" {'train plain':>12s} {'train gpt-oss':>14s} {'ratio':>6s}" if opts.backward else ""))
    for T in opts.tokens:
        plain, oss = inputs(T, H, I, E, K, False, g), inputs(T, H, I, E, K, True, g)
        a, b = time_fwd(plain), time_fwd(oss)
        line = f"{T:6d} {a:10.1f} {b:11.1f} {a / b:14.3f}"
        if opts.backward:
            c, d = time_train(plain), time_train(oss)
            line += f" {c:12.1f} {d:14.1f} {c / d:6.3f}"
        print(line, flush=True)
        del plain, oss
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Ungated ReLU-squared experts (NemotronH: up_proj, relu^2, down_proj) on the GPU, bf16, as
transformers' integration runs them: `moe.dispatch(w13=up, w3=up, activation="relu")`, where w3
is w13 itself and the gate+up kernel computes the product once (SAME_W3). Beside it, in the same
run and on the same inputs:
- "w3 copy": w3 a copy of up (the kernel's two-product w3 path: what the same call cost before
  the one-product path; the output must be bitwise equal);
- the floor: the weight bytes of the experts hit (up + down, bf16) at the copy rate measured
  in the same run.
Times: median of triton.testing.do_bench over CUDA-graph replays (L2 flushed). Each output is
checked against float64 (rel. L2 <= 1.5e-2) before it is timed.

    PYTHONPATH=. python benchmarks/bench_ungated.py [--tokens 1 128 2048] [--csv out.csv]"""
from __future__ import annotations

import argparse
import csv

import torch

from moe_ops.tools._timing import capture_graph
from moe_ops.tools.bench import Timer, environment, measure_ceilings, text_table

SHAPE = (128, 6, 2688, 1856)   # Nemotron-3-Nano-30B-A3B experts: E, K, H, I


def reference(h, up, w2, w, ids):
    out = torch.zeros(h.shape, dtype=torch.float64, device=h.device)
    for e in ids.unique().tolist():
        t, k = (ids == e).nonzero(as_tuple=True)
        a = torch.relu(h[t].double() @ up[e].double().t()) ** 2
        out.index_add_(0, t, w[t, k, None].double() * (a @ w2[e].double().t()))
    return out


def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 128, 2048])
    p.add_argument("--rep-ms", type=float, default=50)
    p.add_argument("--csv", default=None)
    opts = p.parse_args()
    dev = torch.device("cuda")
    timer = Timer(dev, 10, opts.rep_ms)
    for k, v in environment(dev):
        print(f"{k}: {v}")
    bw, _, desc = measure_ceilings(dev, timer, tiny=False)
    print(f"ceilings: {desc}", flush=True)
    E, K, H, I = SHAPE
    g = torch.Generator(device="cuda").manual_seed(0)
    up = (torch.randn(E, I, H, device=dev, generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=dev, generator=g) * I ** -0.5).bfloat16()
    up_copy = up.clone()
    rows, bad = [], 0
    for T in opts.tokens:
        h = torch.randn(T, H, device=dev, generator=g).bfloat16()
        w, ids = torch.randn(T, E, device=dev, generator=g).softmax(-1).topk(K, -1)
        ids = ids.int()
        hit = int(ids.unique().numel())
        floor_us = (2 * 2 * H * I * hit + 4 * T * H) / bw * 1e6
        ref = reference(h, up, w2, w, ids)
        calls = {
            "w3 = w13 (one product)": lambda: torch.ops.moe.dispatch(h, up, w2, w, ids, "relu",
                                                                     w3=up),
            "w3 copy (two products)": lambda: torch.ops.moe.dispatch(h, up, w2, w, ids, "relu",
                                                                     w3=up_copy),
        }
        first = None
        for name, fn in calls.items():
            out = fn()
            err = rel(out, ref)
            if err > 1.5e-2:
                bad += 1
                print(f"T={T} {name}: rel. error {err:.3g} > 1.5e-2")
            if first is None:
                first = out
            elif not torch.equal(out, first):
                bad += 1
                print(f"T={T} {name}: output differs from the one-product path")
            graph, _ = capture_graph(fn)
            us = timer(graph.replay) * 1e3
            rows.append(dict(T=T, variant=name, us=round(us, 1), floor_us=round(floor_us, 1),
                             floor_frac=round(floor_us / us, 3), rel_err=err))
    base = {r["T"]: r["us"] for r in rows if r["variant"].startswith("w3 = w13")}
    for r in rows:
        r["vs_one_product"] = round(r["us"] / base[r["T"]], 3)
    if opts.csv:
        with open(opts.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
    header = list(rows[0])
    print(text_table(header, [[f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c])
                               for c in header] for r in rows]))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

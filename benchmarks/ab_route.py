"""A/B of moe.route's rows per program on one GPU (not part of the test suite): CUDA-graph replay
of route_triton with the launcher's rule and with 1, 2, 4, 8, 16 rows per program, on each
shape's routing (bias and groups as the bench makes them), every variant's ids and weights
checked against the rule's (ids exact, weights to float32 rounding).

    PYTHONPATH=. python benchmarks/ab_route.py [--tokens 1 8 128 512 2048 8192 32768]

Context: benchmarks/RESULTS.md (seventeenth session) found the route kernel 50-80% slower at
T >= 512 after the available-expert mask; at T > 128 the rule takes up to 64 rows per program
with 4 warps (few programs, each a chain of cross-warp reductions: barriers), where one row
per program and one warp (the T <= 128 rule) has no barriers and many programs per SM.
"""
from __future__ import annotations

import argparse

import torch

from moe_ops import bench
from moe_ops.launch.routing import route_triton

SHAPES = {   # E, K, scoring, bias, num_groups, topk_groups
    "qwen3_30b_a3b": (128, 8, "softmax", False, 1, 1),
    "olmoe": (64, 8, "softmax", False, 1, 1),
    "mixtral_8x7b": (8, 2, "softmax", False, 1, 1),
    "deepseek_v3_routed": (256, 8, "sigmoid", True, 8, 4),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 128, 512, 2048, 8192, 32768])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args()
    dev = torch.device("cuda")
    timer = bench.Timer(dev, warmup_ms=10, rep_ms=50)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name in args.shapes:
        E, K, scoring, has_bias, groups, topk_groups = SHAPES[name]
        bias = torch.randn(E, device=dev, generator=g) * 0.1 if has_bias else None
        for T in args.tokens:
            logits = torch.randn(T, E, device=dev, generator=g, dtype=torch.bfloat16)
            call = lambda bt: route_triton(logits, K, scoring, True, bias, groups,  # noqa: E731
                                           topk_groups, 2.5 if has_bias else 1.0, block_t=bt)
            ref_w, ref_i = call(None)
            res = {}
            for _round in range(2):
                for bt in (None, 1, 2, 4, 8, 16):
                    graph, (w, i) = bench.capture_graph(lambda: call(bt))
                    graph.replay()
                    torch.cuda.synchronize()
                    # ids exact; weights to float32 rounding (a row's softmax sum runs over
                    # another thread layout at another block size)
                    assert torch.equal(i, ref_i), (name, T, bt)
                    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)
                    res.setdefault(bt, []).append(timer(graph.replay) * 1e3)
            line = " ".join(f"{'rule' if bt is None else bt}:{min(v):.1f}" for bt, v in res.items())
            print(f"{name} T={T}: {line}", flush=True)
            rows.append((name, T, {bt: min(v) for bt, v in res.items()}))
    print(f"\n{'shape':<20} {'T':>6} " + " ".join(f"{h:>7}" for h in
                                               ("rule", "1", "2", "4", "8", "16")))
    for name, T, r in rows:
        print(f"{name:<20} {T:>6} " + " ".join(f"{r[bt]:7.1f}" for bt in (None, 1, 2, 4, 8, 16)))


if __name__ == "__main__":
    main()

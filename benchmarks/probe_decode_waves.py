"""Decode time against the number of experts hit (one GPU; not part of the test suite).

At decode sizes each expert hit streams its whole weight matrices once, so a call's time should
be a + b * n for n experts hit: b is the marginal cost of one more expert's weights (its rate
against the copy rate says whether the streaming itself is slow) and a is what does not scale
with the weights (launches, ramps, the last wave's tail, programs of experts not hit). This
probe routes T tokens to exactly n distinct experts (every token's K ids distinct, slots dealt
round robin over a random choice of n experts) for a range of n, and prints per-kernel times
(torch.profiler over graph replays) and the replay time of the whole call, then the
least-squares line of each against n.

    PYTHONPATH=. python benchmarks/probe_decode_waves.py [--cell qwen3_30b_a3b:8] [--n 16 64 2]
"""
from __future__ import annotations

import argparse

import torch

from moe_ops import bench
from moe_ops.launch.dispatch import dispatch_triton


def ids_hitting(n: int, T: int, K: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """[T, K] int32 ids over exactly n distinct experts, each row's K ids distinct (n >= K)."""
    experts = torch.randperm(E, generator=gen)[:n]
    slots = torch.arange(T * K).reshape(T, K)
    return experts[slots % n].to(torch.int32)


def fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cell", default="qwen3_30b_a3b:8")
    p.add_argument("--n", nargs=3, type=int, default=[16, 64, 2], metavar=("FROM", "TO", "STEP"))
    args = p.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    timer = bench.Timer(dev, warmup_ms=25, rep_ms=100)
    c = bench.cell_inputs(args.cell, dev, dt)
    s, T = c.shape, c.T
    assert s.K <= args.n[0] and args.n[1] <= min(s.E, T * s.K), "n must be in [K, min(E, T*K)]"
    copy_tbs = bench._copy_bandwidth(dev, timer, 2**30) / 1e12
    per_expert = 3 * s.H * s.I * 2   # bytes of one expert's w13 + w2
    gen = torch.Generator().manual_seed(0)
    rows, names = [], set()
    for n in range(args.n[0], args.n[1] + 1, args.n[2]):
        ids = ids_hitting(n, T, s.K, s.E, gen).to(dev)
        assert int(torch.unique(ids).numel()) == n
        fn = lambda: dispatch_triton(c.hidden, c.weights.w13, c.weights.w2, c.topk_weights, ids)  # noqa: E731
        graph, _ = bench.capture_graph(fn)
        replay = timer(graph.replay) * 1e3
        acc = bench.kernel_times_us(graph.replay, n=30, name_len=24)
        names.update(acc)
        rows.append((n, replay, acc))
        print(f"n={n}: replay {replay:.1f} us, " +
              ", ".join(f"{k} {v:.1f}" for k, v in sorted(acc.items())), flush=True)
        del graph
    names = sorted(names)
    print(f"\n{args.cell}: {per_expert / 1e6:.2f} MB of weights per expert, copy rate "
          f"{copy_tbs:.3f} TB/s (read + write)")
    print(f"{'n':>3} {'replay':>7} " + " ".join(f"{k[:14]:>14}" for k in names))
    for n, rep, acc in rows:
        print(f"{n:3d} {rep:7.1f} " + " ".join(f"{acc.get(k, 0.0):14.1f}" for k in names))
    xs = [r[0] for r in rows]
    print("\nleast squares, time = a + b * n (us); rate = the weight bytes it streams per expert / b")
    streams = {"gate_up": ("w13", 2 * s.H * s.I * 2), "down": ("w2", s.H * s.I * 2)}
    for label, ys in [("replay", [r[1] for r in rows])] + [
            (k, [r[2].get(k, 0.0) for r in rows]) for k in names]:
        a, b = fit(xs, ys)
        what, nbytes = next((v for k, v in streams.items() if label.startswith(k)),
                            ("w13 + w2", per_expert) if label == "replay" else (None, 0))
        rate = f"  ({nbytes / (b * 1e-6) / 1e12:.2f} TB/s on {what})" if what and b > 0 else ""
        print(f"{label[:24]:<24} a {a:7.1f}  b {b:6.3f}{rate}")


if __name__ == "__main__":
    main()

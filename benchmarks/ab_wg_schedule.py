"""A/B of the persistent weight-gradient kernel's tile schedule (not part of the test suite):
the fixed round robin over (expert, row block, column block) against the LPT schedule
(BackwardConfig.wg_lpt: ranked and snaking where the routing is skewed), the same forced on at
any skew, and its two parts alone (experts ranked by rows without the snaking deal, the
snaking deal over experts in index order), on the benchmark's inputs and routing.
Variants alternate within each round; the best backward of the rounds and the weight-gradient
kernel's profiler time (last round) are kept; gradients are compared bitwise.

With --wg-alone, each weight-gradient launch of one backward (dW2, dW13) is timed by itself
instead (do_bench of that launch on the backward's own operands, and its kernels' device
time by the profiler over 30 calls, which leaves host time out; variants alternating per
round, best of the rounds): a profiled round of the whole backward cannot resolve 1-2%
(NOTES.md entry 56).

With --graph, each variant's backward is also timed as a CUDA-graph replay (no host time in
it). The variant "fixed, scratch" is the fixed deal with an unused tensor of the LPT order
scratch's size allocated before each weight-gradient launch: whether the allocation alone moves
the backward.

    PYTHONPATH=. python benchmarks/ab_wg_schedule.py [--cells qwen3_30b_a3b_zipf:8192 ...]
        [--wg-alone] [--graph]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses

import torch
import triton

import moe_ops.launch.dispatch_backward as db
from moe_ops import bench
from moe_ops._runtime import next_pow2
from moe_ops.launch.dispatch import dispatch_triton, num_programs
from moe_ops.tuning.heuristics import backward_config, dispatch_config

VARIANTS = {   # name: (wg_lpt, LPT_SORT, LPT_SNAKE, LPT_MIN_SKEW)
    "fixed": (False, True, True, 2),
    "lpt": (True, True, True, 2),                  # ranked and snaking where skewed (default)
    "lpt forced": (True, True, True, 0),           # ranked and snaking everywhere
    "sort, round robin": (True, True, False, 0),
    "index order, snake": (True, False, True, 0),
}
_SWITCHES = ("LPT_SORT", "LPT_SNAKE", "LPT_MIN_SKEW")
# the fixed deal with LPT's order scratch allocated (unused) before each weight-gradient launch:
# does the allocation alone (host time, the later buffers' addresses) move the backward?
SCRATCH_VARIANTS = {"fixed, scratch": "fixed"}


@contextlib.contextmanager
def _lpt_switches():
    """Restores dispatch_backward's LPT switches, which _variant sets, on the way out."""
    saved = [getattr(db, k) for k in _SWITCHES]
    try:
        yield
    finally:
        for k, v in zip(_SWITCHES, saved):
            setattr(db, k, v)


def _variant(base, v):
    """The backward config of variant v (persistent weight gradients), its switches set."""
    lpt, *switches = VARIANTS[v]
    for k, val in zip(_SWITCHES, switches):
        setattr(db, k, val)
    return dataclasses.replace(base, wg_persistent=True, wg_lpt=lpt)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", nargs="+", default=["qwen3_30b_a3b_zipf:8192", "qwen3_30b_a3b:8192",
                                                  "deepseek_v3_routed:8192"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS),
                   choices=list(VARIANTS) + list(SCRATCH_VARIANTS))
    p.add_argument("--wg-alone", action="store_true",
                   help="time each weight-gradient launch by itself (see above)")
    p.add_argument("--graph", action="store_true",
                   help="also time each variant's backward as a CUDA-graph replay (no host time)")
    args = p.parse_args(argv)
    if args.wg_alone and set(args.variants) & set(SCRATCH_VARIANTS):
        p.error(f"--wg-alone times the launches themselves: the variants "
                f"{sorted(SCRATCH_VARIANTS)} apply to the whole backward only")
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
        if args.wg_alone:
            table += _wg_alone(cell, args, base, lambda bc: db.dispatch_backward_triton(
                go, x, w13, w2, tw, ids, z=z, config=cfg, bwd_config=bc))
            z = None
            torch.cuda.empty_cache()
            continue
        best = {v: float("inf") for v in args.variants}
        best_graph = dict(best)
        wg_ms, outs, graphs = {}, {}, {}
        with _lpt_switches():
            for rnd in range(args.rounds):
                for v in args.variants:
                    bc = _variant(base, SCRATCH_VARIANTS.get(v, v))
                    fn = (lambda bc=bc, sc=v in SCRATCH_VARIANTS: _with_scratch(
                        sc, lambda: db.dispatch_backward_triton(
                            go, x, w13, w2, tw, ids, z=z, config=cfg, bwd_config=bc)))
                    if rnd == 0:
                        outs[v] = fn()
                        if args.graph:
                            graphs[v] = bench.capture_graph(fn)[0]
                    best[v] = min(best[v], triton.testing.do_bench(fn, warmup=20, rep=200))
                    if args.graph:
                        best_graph[v] = min(best_graph[v], triton.testing.do_bench(
                            graphs[v].replay, warmup=20, rep=200))
                    if rnd == args.rounds - 1:
                        kt = bench.kernel_times_us(fn, 20)
                        wg_ms[v] = sum(t for k, t in kt.items()
                                       if k.startswith("weight_grad")) / 1e3
        ref = outs[args.variants[0]]
        for v in args.variants:
            same = all(torch.equal(a, b) for a, b in zip(outs[v], ref))
            table.append((cell, v, best[v], best_graph[v], wg_ms[v], same))
            print(f"{cell:26s} {v:20s} backward {best[v]:8.3f} ms  replay {best_graph[v]:8.3f} "
                  f"ms  weight grads {wg_ms[v]:7.3f} ms  bitwise={same}", flush=True)
        outs = ref = z = graphs = None
        torch.cuda.empty_cache()
    if args.wg_alone:
        print("\n| cell | variant | dW2 launch ms | dW13 launch ms | dW2 kernels ms | "
              "dW13 kernels ms | bitwise |")
        print("|---|---|---|---|---|---|---|")
        for c, v, t2, t13, k2, k13, same in table:
            print(f"| {c} | {v} | {t2:.4f} | {t13:.4f} | {k2:.4f} | {k13:.4f} | {same} |")
        return 0
    print("\n| cell | variant | backward ms (best of rounds) | graph replay ms | "
          "weight-gradient kernels ms | bitwise |")
    print("|---|---|---|---|---|---|")
    for c, v, b, bg, w, same in table:
        print(f"| {c} | {v} | {b:.3f} | {bg:.3f} | {w:.3f} | {same} |")
    return 0


@contextlib.contextmanager
def _around_weight_grad(hook):
    """dispatch_backward's weight_grad_triton calls hook(*args, **kwargs) before each launch
    (what hook returns is kept alive until the launch returns); restored on the way out.
    Yields the original launch function."""
    launch = db.weight_grad_triton

    def wrapped(*a, **k):
        held = hook(*a, **k)   # noqa: F841
        return launch(*a, **k)

    db.weight_grad_triton = wrapped
    try:
        yield launch
    finally:
        db.weight_grad_triton = launch


def _with_scratch(on, fn):
    """fn(), with (on) an unused [programs, next_pow2(E)] int32 tensor allocated before each
    weight-gradient launch and freed after it, as the LPT path allocates its order scratch."""
    if not on:
        return fn()

    def scratch(left, right, out, al, bc, *_, **__):
        n = num_programs(out.device) * bc.wg_per_sm * next_pow2(out.shape[0])
        return torch.empty(n, dtype=torch.int32, device=out.device)

    with _around_weight_grad(scratch):
        return fn()


def _wg_alone(cell, args, base, backward):
    """Rows (cell, variant, dW2 ms, dW13 ms, dW2 kernels ms, dW13 kernels ms, bitwise) for
    --wg-alone (do_bench, then the profiler's device time): the weight-gradient launches of one
    backward with `base` recorded (their operands kept), then each launched by itself under
    every variant."""
    calls = []
    with _around_weight_grad(lambda *a, **k: calls.append(a)) as launch:
        backward(dataclasses.replace(base, wg_persistent=True))
    assert len(calls) == 2, len(calls)   # dW2, dW13
    best = {(v, i): float("inf") for v in args.variants for i in range(2)}
    dev_ms = dict(best)   # the launch's kernels' device time (profiler, no host time)
    outs = {}
    with _lpt_switches():
        for rnd in range(args.rounds):
            for v in args.variants:
                bc = _variant(base, v)
                for i, (left, right, out, al, _, prec) in enumerate(calls):
                    fn = (lambda left=left, right=right, out=out, al=al, bc=bc, prec=prec:
                          launch(left, right, out, al, bc, prec))
                    if rnd == 0:   # poisoned: a tile a deal skipped would keep NaN, not the
                        out.fill_(float("nan"))   # previous deal's sums
                        fn()
                        outs[v, i] = out.clone()
                    best[v, i] = min(best[v, i],
                                     triton.testing.do_bench(fn, warmup=20, rep=200))
                    dev_ms[v, i] = min(dev_ms[v, i],
                                       sum(bench.kernel_times_us(fn, 30).values()) / 1e3)
    rows = []
    for v in args.variants:
        same = all(torch.equal(outs[v, i], outs[args.variants[0], i]) for i in range(2))
        rows.append((cell, v, best[v, 0], best[v, 1], dev_ms[v, 0], dev_ms[v, 1], same))
        print(f"{cell:26s} {v:20s} dW2 {best[v, 0]:8.4f} ms  dW13 {best[v, 1]:8.4f} ms  "
              f"kernels {dev_ms[v, 0]:8.4f} {dev_ms[v, 1]:8.4f} ms  bitwise={same}", flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

"""Eager host time of one MoE layer call (torch.ops.moe.route + torch.ops.moe.dispatch under
torch.no_grad, the bench's inputs) for this tree, this tree with MOE_OPS_FAST_LAUNCH=0, and
another checkout of moe_ops (--other DIR, e.g. `mkdir -p .scratch/old && git archive REV moe_ops
| tar -x -C .scratch/old`): one process per variant and round, variants alternating, the
minimum over rounds. Host time per call = the loop's wall time without synchronising (what an
eager caller pays when the GPU work is shorter); also the synchronised eager time (do_bench).
One GPU; not part of the test suite.

    PYTHONPATH=. python benchmarks/eager_ab.py [--other .scratch/old] [--cells qwen3_30b_a3b:1 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEFAULT_CELLS = ["qwen3_30b_a3b:1", "qwen3_30b_a3b:8", "olmoe:8", "mixtral_8x7b:1",
                 "qwen3_30b_a3b:512"]


def child(cells, n):
    import torch
    import triton.testing

    import moe_ops  # noqa: F401
    from moe_ops import bench

    dev = torch.device("cuda")
    res = {}
    weights = {}
    with torch.no_grad():
        for cell in cells:
            name = cell.split(":")[0]
            c = bench.cell_inputs(cell, dev, torch.bfloat16, weights=weights.get(name))
            weights = {name: c.weights}
            s, wt = c.shape, c.weights
            logits = torch.randn(c.T, s.E, device=dev)

            def fn():
                tw, ids = bench.route(s, logits, wt.bias)
                return torch.ops.moe.dispatch(c.hidden, wt.w13, wt.w2, tw, ids)
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                best = min(best, (time.perf_counter() - t0) / n * 1e6)
                torch.cuda.synchronize()
            res[cell] = (best, triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3)
            if "--stats" in sys.argv:
                from moe_ops.launch import fast

                print(cell, fast.stats(), file=sys.stderr)
    print("RESULT " + json.dumps(res))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", nargs="+", default=DEFAULT_CELLS)
    p.add_argument("--other", default=None, help="a folder holding another moe_ops package")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.cells, args.calls)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = os.environ.get("PYTHONPATH", "")
    variants = {"this": dict(PYTHONPATH=os.pathsep.join([here, base])),
                "this, MOE_OPS_FAST_LAUNCH=0": dict(PYTHONPATH=os.pathsep.join([here, base]),
                                                    MOE_OPS_FAST_LAUNCH="0")}
    if args.other:
        variants["other"] = dict(PYTHONPATH=os.pathsep.join([os.path.abspath(args.other), base]))
    best: dict = {}
    for _ in range(args.rounds):
        for name, env in variants.items():
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--calls",
                   str(args.calls), "--cells", *args.cells]
            r = subprocess.run(cmd, env=dict(os.environ, **env), capture_output=True, text=True,
                               cwd="/")
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if r.returncode or not line:
                print(f"{name}: rc={r.returncode}\n{r.stderr[-2000:]}")
                continue
            for cell, (host, synced) in json.loads(line[0][7:]).items():
                h, s = best.get((name, cell), (float("inf"), float("inf")))
                best[(name, cell)] = (min(h, host), min(s, synced))
    names = list(variants)
    print("host us per route+dispatch call (min over rounds); synchronised eager us in brackets")
    print("| cell | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for cell in args.cells:
        cols = []
        for name in names:
            h, s = best.get((name, cell), (float("nan"), float("nan")))
            cols.append(f"{h:.1f} ({s:.1f})")
        print(f"| {cell} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()

"""Eager time of one MoE layer call (torch.ops.moe.route + torch.ops.moe.dispatch under
torch.no_grad, the bench's inputs) for this tree and another checkout of moe_ops (--other DIR,
e.g. `mkdir -p .scratch/old && git archive REV moe_ops | tar -x -C .scratch/old`), one process
per variant and round, alternating. Inside each process the fast launch (moe_ops.launch.fast)
is switched on and off (MOE_OPS_FAST_LAUNCH) in alternating blocks of calls: for a checkout
without it the two columns measure the same code, which shows the noise. "queued": wall time
per call of a loop that never synchronises (what an eager caller pays while the GPU keeps up);
"synced": with a synchronisation after every call. Minimum over blocks and rounds. One GPU; not
part of the test suite.

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


def _per_call_us(fn, n, sync):
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
        if sync:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def child(cells, n, blocks):
    import torch

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
            for _ in range(blocks):
                for fast in ("1", "0"):
                    os.environ["MOE_OPS_FAST_LAUNCH"] = fast
                    for _ in range(20):
                        fn()
                    for sync in (False, True):
                        k = f"{cell}|{fast}|{int(sync)}"
                        res[k] = min(res.get(k, float("inf")), _per_call_us(fn, n, sync))
    print("RESULT " + json.dumps(res))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", nargs="+", default=DEFAULT_CELLS)
    p.add_argument("--other", default=None, help="a folder holding another moe_ops package")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--blocks", type=int, default=3, help="on/off blocks per process and cell")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.cells, args.calls, args.blocks)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = os.environ.get("PYTHONPATH", "")
    variants = {"this": os.pathsep.join([here, base])}
    if args.other:
        variants["other"] = os.pathsep.join([os.path.abspath(args.other), base])
    best: dict = {}
    for _ in range(args.rounds):
        for name, path in variants.items():
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--calls",
                   str(args.calls), "--blocks", str(args.blocks), "--cells", *args.cells]
            r = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=path), capture_output=True,
                               text=True, cwd="/")
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if r.returncode or not line:
                print(f"{name}: rc={r.returncode}\n{r.stderr[-2000:]}")
                continue
            for k, v in json.loads(line[0][7:]).items():
                best[(name, k)] = min(best.get((name, k), float("inf")), v)
    cols = [(name, fast, sync) for name in variants for fast in ("1", "0") for sync in ("0", "1")]
    print("us per route+dispatch call, eager, no grad (min over blocks and rounds)")
    print("| cell | " + " | ".join(
        f"{name} {'fast' if fast == '1' else 'jit'} {'synced' if sync == '1' else 'queued'}"
        for name, fast, sync in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for cell in args.cells:
        vals = [best.get((name, f"{cell}|{fast}|{sync}"), float("nan")) for name, fast, sync in cols]
        print(f"| {cell} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")


if __name__ == "__main__":
    main()

"""Where the time of a moe.dispatch call goes, kernel by kernel (one CUDA GPU; not a test).

Three modes over cells "shape:T" (shapes as in `moe-ops-bench`, e.g. qwen3_30b_a3b:8):

  forward (default)  the forward in a CUDA graph: replay time against the sum of its kernels'
                     device times (torch.profiler). replay - kernels is what launches,
                     dependencies and tails cost inside the graph (at decode sizes the largest
                     item after the weight stream).
  --train            one autograd training step (leaves' .grad set to None, forward, backward)
                     as bench_train.py times it, the two internal ops (moe.dispatch_train,
                     moe.dispatch_backward_saved) timed alone, and every kernel of the step.
                     --graph adds the step captured in a CUDA graph (small steps are host-bound
                     eagerly); --host adds the step's host time, torch.profiler's CPU table and a
                     cProfile of its Python.
  --calls N          only run N calls of the cell (forward, or with --train a training step)
                     and exit: the target for Nsight Compute, e.g.

    ncu --clock-control none --kernel-name regex:'gate_up|down' --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python benchmarks/profile_moe.py --cells qwen3_30b_a3b:2048 --calls 3

    python benchmarks/profile_moe.py --cells qwen3_30b_a3b:1 olmoe:1 qwen3_30b_a3b:8
    python benchmarks/profile_moe.py --train --cells qwen3_30b_a3b:8192 --graph
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)   # this checkout's moe_ops, without PYTHONPATH or an install

import moe_ops  # noqa: E402,F401  (registers torch.ops.moe.*)
from moe_ops.tools import bench  # noqa: E402

DTYPE = torch.bfloat16


def forward_call(cell: str, dev: torch.device):
    """(fn, keep): fn() runs the forward of `cell` with the bench's inputs, without autograd."""
    c = bench.cell_inputs(cell, dev, DTYPE)
    wt = c.weights

    def fn():
        with torch.no_grad():
            return torch.ops.moe.dispatch(c.hidden, wt.w13, wt.w2, c.topk_weights, c.topk_ids)
    return fn, c


def training_step(cell: str, dev: torch.device):
    """(step, args, go): step() runs one autograd training step of moe.dispatch with the
    bench's inputs (as bench_train.py); args = (hidden, w13, w2, topk_weights, topk_ids)
    detached, for calling the two internal ops directly with grad_out `go`."""
    c = bench.cell_inputs(cell, dev, DTYPE)
    hidden = c.hidden.detach().clone().requires_grad_(True)
    w13 = c.weights.w13.detach().requires_grad_(True)
    w2 = c.weights.w2.detach().requires_grad_(True)
    tw = c.topk_weights.detach().float().clone().requires_grad_(True)
    ids = c.topk_ids.to(torch.int32)
    go = torch.randn_like(c.hidden)
    leaves = [hidden, w13, w2, tw]

    def step():
        for t in leaves:
            t.grad = None
        torch.ops.moe.dispatch(hidden, w13, w2, tw, ids).backward(go)

    return step, (hidden.detach(), w13.detach(), w2.detach(), tw.detach(), ids), go


def host_us(f, n=50):
    """(queued host us per call, us per call including the GPU's catch-up)."""
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def profile_forward(cells, top: int) -> None:
    dev = torch.device("cuda")
    timer = bench.Timer(dev, warmup_ms=25, rep_ms=100)
    rows = []
    for cell in cells:
        fn, keep = forward_call(cell, dev)
        graph, _ = bench.capture_graph(fn)
        replay_us = timer(graph.replay) * 1e3
        acc = bench.kernel_times_us(graph.replay, n=50, name_len=24)
        if not acc:   # a profiler that does not see into graphs: the same kernels, eager
            acc = bench.kernel_times_us(fn, n=50, name_len=24)
        total = sum(acc.values())
        kern = ", ".join(f"{k} {v:.1f}" for k, v in
                         sorted(acc.items(), key=lambda kv: -kv[1])[:top])
        rows.append((cell, replay_us, total, kern))
        print(f"{cell}: replay {replay_us:.1f} us, kernels {total:.1f} us: {kern}", flush=True)
        del fn, keep, graph
        torch.cuda.empty_cache()
    print(f"\n{'cell':<22} {'replay us':>9} {'kernels us':>10} {'gap us':>7}  per kernel (us)")
    for cell, rep, tot, kern in rows:
        print(f"{cell:<22} {rep:9.1f} {tot:10.1f} {rep - tot:7.1f}  {kern}")


def host_report(step, args, go) -> None:
    """--host: the step's host time against the two ops', then torch.profiler's CPU table and a
    cProfile of the step's Python."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    def ops():
        with torch.no_grad():
            _, z = torch.ops.moe.dispatch_train(*args)
            torch.ops.moe.dispatch_backward_saved(go, z, *args)

    for _ in range(3):
        print("   autograd step: host %.0f us, with GPU %.0f us" % host_us(step),
              "| the two ops: host %.0f us, with GPU %.0f us" % host_us(ops))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        step()
    pr.disable()
    torch.cuda.synchronize()
    sio = io.StringIO()
    pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(30)
    print("cProfile of 50 autograd steps (Python functions by own time):")
    print(sio.getvalue())


def profile_train(cells, top: int, graph: bool, rounds: int, host: bool) -> None:
    import triton

    dev = torch.device("cuda")
    rows = []
    for cell in cells:
        step, args, go = training_step(cell, dev)
        with torch.no_grad():
            _, z = torch.ops.moe.dispatch_train(*args)
            t_f = triton.testing.do_bench(lambda: torch.ops.moe.dispatch_train(*args))
            t_b = triton.testing.do_bench(
                lambda: torch.ops.moe.dispatch_backward_saved(go, z, *args))
        step()
        t_s = triton.testing.do_bench(step)
        kt = bench.kernel_times_us(step, n=3, name_len=40)
        total = sum(kt.values()) / 1000.0
        print(f"\n== {cell}: step {t_s:.2f} ms | forward alone {t_f:.2f} + backward alone "
              f"{t_b:.2f} = {t_f + t_b:.2f} ms | kernels in the step {total:.2f} ms "
              f"(step - kernels = {t_s - total:.2f} ms of gaps)")
        for name, us in list(kt.items())[:top]:
            print(f"   {us / 1000.0:9.3f} ms  {name}")
        t_g = None
        if graph:
            replay = bench.capture_graph(step)[0].replay   # warmed up on a side stream
            # alternating rounds (the GPU's clocks drift over a run); medians of the rounds
            pairs = [(triton.testing.do_bench(step), triton.testing.do_bench(replay))
                     for _ in range(rounds)]
            t_s = sorted(e for e, _ in pairs)[len(pairs) // 2]
            t_g = sorted(g for _, g in pairs)[len(pairs) // 2]
            print("   eager step / its CUDA graph's replay, ms per round: " +
                  ", ".join(f"{e:.2f}/{g:.2f}" for e, g in pairs))
            print("   replay: host %.0f us, with GPU %.0f us per replay" % host_us(replay))
            kg = bench.kernel_times_us(replay, n=3, name_len=40)
            print(f"   kernels in the replay {sum(kg.values()) / 1000.0:.2f} ms:")
            for name, us in list(kg.items())[:top]:
                print(f"   {us / 1000.0:9.3f} ms  {name} (eager {kt.get(name, 0.0) / 1000.0:.3f})")
            replay = None
        if host:
            host_report(step, args, go)
        rows.append((cell, t_s, t_f, t_b, total, t_g))
        step = args = go = z = None   # free before the next cell
        torch.cuda.empty_cache()
    print("\ncell                   step ms  fwd ms  bwd ms  fwd+bwd  kernels  step-kernels  graph ms")
    for cell, t_s, t_f, t_b, total, t_g in rows:
        print(f"{cell:<22} {t_s:8.2f} {t_f:7.2f} {t_b:7.2f} {t_f + t_b:8.2f} {total:8.2f} "
              f"{t_s - total:12.2f}  " + ("-" if t_g is None else f"{t_g:8.2f}"))


def run_calls(cells, calls: int, train: bool) -> None:
    """--calls: run each cell `calls` times and nothing else (for ncu / nsys)."""
    dev = torch.device("cuda")
    for cell in cells:
        if train:
            fn = training_step(cell, dev)[0]
        else:
            fn, _keep = forward_call(cell, dev)
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        print("done", cell, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=None,
                   help="shape:T (default: decode cells forward, two prefill cells with --train)")
    p.add_argument("--train", action="store_true", help="profile a training step")
    p.add_argument("--graph", action="store_true", help="--train: also the step in a CUDA graph")
    p.add_argument("--rounds", type=int, default=3, help="--graph: alternating eager/graph rounds")
    p.add_argument("--host", action="store_true", help="--train: host time and CPU profiles")
    p.add_argument("--top", type=int, default=16, help="kernels listed per cell")
    p.add_argument("--calls", type=int, default=0,
                   help="only run this many calls per cell (for Nsight Compute), no timing")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_moe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    cells = a.cells or (["mixtral_8x7b:32768", "qwen3_30b_a3b:8192"] if a.train else
                        ["qwen3_30b_a3b:1", "olmoe:1", "qwen3_30b_a3b:8", "mixtral_8x7b:1"])
    if a.calls:
        run_calls(cells, a.calls, a.train)
    elif a.train:
        profile_train(cells, a.top, a.graph, a.rounds, a.host)
    else:
        profile_forward(cells, a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the time of one training step of moe.dispatch goes (not part of the test suite).

docs/design.md: on Mixtral T=32768 the two ops' kernels timed apart
(sweep_backward.py: forward with z 36.1 ms + backward 76.2 ms) sum to ~10 ms less than
bench_train.py's autograd step (122.1 ms at eced948). For each cell this prints the step as
bench_train times it (leaves' .grad set to None, forward under autograd, backward), the
forward (moe.dispatch_train) and the backward (moe.dispatch_backward_saved) timed alone, and
every CUDA kernel of the step with its time per step (torch.profiler), so that what is
neither op's kernel (gradient accumulation, copies, fills) and the gaps between kernels show.
With --host also the host time of the step against the two ops called directly,
torch.profiler's CPU table of the step and a cProfile of its Python ; with --graph
the step captured in a CUDA graph (H200: small-T training steps are host-bound eagerly).

    PYTHONPATH=. python benchmarks/profile_train_step.py --cells mixtral_8x7b:32768 qwen3_30b_a3b:8192
    PYTHONPATH=. python benchmarks/profile_train_step.py --cells qwen3_30b_a3b:64 --host --graph
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def training_step(cell: str, dev: torch.device, dt: torch.dtype):
    """bench_train's inputs for `cell` ("shape:T" as in moe_ops.bench): (step, args, go), where
    step() runs one autograd training step of moe.dispatch (the leaves' .grad set to None first)
    and args = (hidden, w13, w2, topk_weights, topk_ids) detached, for calling the two ops
    (moe.dispatch_train, moe.dispatch_backward_saved with grad_out `go`) directly."""
    from moe_ops import bench

    c = bench.cell_inputs(cell, dev, dt)
    hidden = c.hidden.detach().clone().requires_grad_(True)
    w13 = c.weights.w13.detach().requires_grad_(True)
    w2 = c.weights.w2.detach().requires_grad_(True)
    tw = c.topk_weights.detach().float().clone().requires_grad_(True)   # as bench_train
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


def host_report(step, args, go) -> None:
    """--host: the step's host time against the two ops', then torch.profiler's CPU table."""
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
    import cProfile
    import io
    import pstats

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=["mixtral_8x7b:32768", "qwen3_30b_a3b:8192"],
                   help="shape:T as in moe_ops.bench")
    p.add_argument("--top", type=int, default=16, help="kernels listed per cell")
    p.add_argument("--graph", action="store_true",
                   help="also the step captured in a CUDA graph (its replay), and its host time")
    p.add_argument("--rounds", type=int, default=3, help="--graph: alternating eager/graph rounds")
    p.add_argument("--host", action="store_true",
                   help="also the step's host time against the two ops', and the CPU profile")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_train_step.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from moe_ops import bench

    dev = torch.device("cuda")
    dt = torch.bfloat16
    rows = []
    for cell in a.cells:
        step, args, go = training_step(cell, dev, dt)
        with torch.no_grad():
            _, z = torch.ops.moe.dispatch_train(*args)
            fwd = lambda: torch.ops.moe.dispatch_train(*args)   # noqa: E731
            bwd = lambda: torch.ops.moe.dispatch_backward_saved(go, z, *args)   # noqa: E731
            t_f = triton.testing.do_bench(fwd)
            t_b = triton.testing.do_bench(bwd)
        step()
        t_s = triton.testing.do_bench(step)
        kt = bench.kernel_times_us(step, n=3, name_len=40)
        total = sum(kt.values()) / 1000.0
        print(f"\n== {cell}: step {t_s:.2f} ms | forward alone {t_f:.2f} + backward alone "
              f"{t_b:.2f} = {t_f + t_b:.2f} ms | kernels in the step {total:.2f} ms "
              f"(step - kernels = {t_s - total:.2f} ms of gaps)")
        for name, us in list(kt.items())[:a.top]:
            print(f"   {us / 1000.0:9.3f} ms  {name}")
        t_g = None
        if a.graph:
            replay = bench.capture_graph(step)[0].replay   # warmed up on a side stream
            # alternating rounds (the GPU's clocks drift over a run); medians of the rounds
            pairs = [(triton.testing.do_bench(step), triton.testing.do_bench(replay))
                     for _ in range(a.rounds)]
            t_s = sorted(e for e, _ in pairs)[len(pairs) // 2]
            t_g = sorted(g for _, g in pairs)[len(pairs) // 2]
            print("   eager step / its CUDA graph's replay, ms per round: " +
                  ", ".join(f"{e:.2f}/{g:.2f}" for e, g in pairs))
            print("   replay: host %.0f us, with GPU %.0f us per replay" % host_us(replay))
            kg = bench.kernel_times_us(replay, n=3, name_len=40)
            print(f"   kernels in the replay {sum(kg.values()) / 1000.0:.2f} ms:")
            for name, us in list(kg.items())[:a.top]:
                print(f"   {us / 1000.0:9.3f} ms  {name} (eager {kt.get(name, 0.0) / 1000.0:.3f})")
            replay = None
        if a.host:
            host_report(step, args, go)
        rows.append((cell, t_s, t_f, t_b, total, t_g))
        step = args = go = z = None   # free before the next cell
        torch.cuda.empty_cache()
    print("\ncell                   step ms  fwd ms  bwd ms  fwd+bwd  kernels  step-kernels  graph ms")
    for cell, t_s, t_f, t_b, total, t_g in rows:
        print(f"{cell:<22} {t_s:8.2f} {t_f:7.2f} {t_b:7.2f} {t_f + t_b:8.2f} {total:8.2f} "
              f"{t_s - total:12.2f}  " + ("-" if t_g is None else f"{t_g:8.2f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

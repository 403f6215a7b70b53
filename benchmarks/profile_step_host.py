"""Host time of one autograd training step of moe.dispatch against the two ops called directly,
then torch.profiler's CPU table of the step (not part of the test suite; benchmarks/NOTES.md
entry 49: at Qwen3 T=2048 the step spent ~1.1 ms of host time beyond the ops). Written in the
twentieth session; not yet run on a GPU.

    PYTHONPATH=. python benchmarks/profile_step_host.py [shape:T]   (default qwen3_30b_a3b:64)
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import moe_ops  # noqa: F401
from profile_train_step import training_step   # benchmarks/ (this script's folder)


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


def main() -> None:
    cell = sys.argv[1] if len(sys.argv) > 1 else "qwen3_30b_a3b:64"
    step, args, go = training_step(cell, torch.device("cuda"), torch.bfloat16)

    def ops():
        with torch.no_grad():
            _, z = torch.ops.moe.dispatch_train(*args)
            torch.ops.moe.dispatch_backward_saved(go, z, *args)

    for _ in range(3):
        print("autograd step: host %.0f us, with GPU %.0f us" % host_us(step),
              "| the two ops: host %.0f us, with GPU %.0f us" % host_us(ops))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()

"""Host-side cost per call of the ops and their pieces (no synchronisation inside the loop):
what eager mode pays before the GPU does any work (one GPU; not part of the test suite).

    PYTHONPATH=. python benchmarks/host_overhead.py
"""
import time

import torch

import moe_ops  # noqa: F401  (registers torch.ops.moe.*)
from moe_ops.launch.alignment import align_triton
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.launch.routing import route_triton
from moe_ops.ops.checks import check_dispatch
from moe_ops.ops.samples import make_dispatch_inputs


def per_call_us(f, n=300):
    f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


def main():
    x = torch.randn(512, 64, device="cuda")
    args = make_dispatch_inputs(512, 2048, 1024, 64, 8, dtype=torch.bfloat16, device="cuda",
                                weight_std=0.02)
    res = {
        "ops.route": per_call_us(lambda: torch.ops.moe.route(x, 8)),
        "route_triton": per_call_us(lambda: route_triton(x, 8, "softmax", True, None, 1, 1, 1.0)),
        "ops.dispatch": per_call_us(lambda: torch.ops.moe.dispatch(*args)),
        "dispatch_triton": per_call_us(lambda: dispatch_triton(*args)),
        "align_triton": per_call_us(lambda: align_triton(args[4], 64, 64)),
        "check_dispatch": per_call_us(lambda: check_dispatch(*args, "silu")),
        "torch.empty x1": per_call_us(lambda: torch.empty(512, 64, device="cuda")),
    }
    with torch.no_grad():
        res["ops.dispatch nograd"] = per_call_us(lambda: torch.ops.moe.dispatch(*args))
    for k, v in res.items():
        print(f"{k:22s} {v:8.1f} us/call (host)")


if __name__ == "__main__":
    main()

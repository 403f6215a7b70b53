"""Host-side cost per call of the ops and their pieces (no synchronisation inside the loop):
what eager mode pays before the GPU does any work. python benchmarks/host_overhead.py"""
import time

import torch

import moe_ops  # noqa: F401  (registers torch.ops.moe.*)
from moe_ops.launch.routing import route_triton
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.launch.alignment import align_triton
from moe_ops.ops.samples import make_dispatch_inputs
from moe_ops.ops.checks import check_dispatch
def t(f, n=300):
    f(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): f()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize(); return dt
x = torch.randn(512, 64, device="cuda")
args = make_dispatch_inputs(512, 2048, 1024, 64, 8, dtype=torch.bfloat16, device="cuda", weight_std=0.02)
res = {
 "ops.route": t(lambda: torch.ops.moe.route(x, 8)),
 "route_triton": t(lambda: route_triton(x, 8, "softmax", True, None, 1, 1, 1.0)),
 "ops.dispatch": t(lambda: torch.ops.moe.dispatch(*args)),
 "dispatch_triton": t(lambda: dispatch_triton(*args)),
 "align_triton": t(lambda: align_triton(args[4], 64, 64)),
 "check_dispatch": t(lambda: check_dispatch(*args, "silu")),
 "torch.empty x1": t(lambda: torch.empty(512, 64, device="cuda")),
}
with torch.no_grad():
    res["ops.dispatch nograd"] = t(lambda: torch.ops.moe.dispatch(*args))
for k, v in res.items(): print(f"{k:22s} {v:8.1f} us/call (host)")

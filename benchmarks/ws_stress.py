"""Stress test of the warp-specialised kernels on a shared GPU (not part of the test suite).

benchmarks/NOTES.md entry 27: with three pytest processes sharing the H200, the backward's
warp-specialised kernels (weight_grad_ws_kernel, rows_gemm_ws_kernel) twice wrote outputs that
held NaN (a few stale rows read), while the same cases alone, repeated 20 times on poisoned
memory, never did. This script tries to reproduce that on purpose and to tell the two readings
apart: it starts --procs worker processes (each its own CUDA context on the same GPU), each
running one case's backward in a loop for --seconds on poisoned memory with the WS kernels on
or off (the heuristics' configs with MOE_OPS_WARP_SPECIALIZE set to 1 or 0), and optionally --noise
processes that run matmuls of changing sizes and allocations. Each worker counts its runs, the
runs with a NaN in any gradient, and the runs not bitwise equal to its first.

    PYTHONPATH=. python benchmarks/ws_stress.py --case large_offsets --procs 3 --noise 1 --ws on
    PYTHONPATH=. python benchmarks/ws_stress.py ... --scratch fresh   # no scratch address reused

--scratch fresh gives every launch a Triton scratch buffer (where the kernels write their
tensor descriptors) that stays allocated for the rest of the run's last 4096 launches, so no
descriptor is written where an earlier launch's was: if the NaN goes away with it, stale
descriptors are the cause; if not, a synchronisation race in the kernels is more likely.
Environment knobs (NOTES.md entry 28's next experiments): WS_STRESS_NO_WS_PASS=1 (the WS kernels
compiled without the warp-specialisation pass), WS_STRESS_MAXNREG=N (Triton's maxnreg for them:
it decides the register reallocation between warp groups), WS_STRESS_FWD / WS_STRESS_BWD =
"field=int,..." (DispatchConfig / BackwardConfig fields replaced, e.g. "wg_n=128,dx_n=128" for
tiles that compile at maxnreg 128, "wg_m=64" for one consumer warp group).

Result on the H200 (NOTES.md entry 28): NaN in every run with WS on beside any other process
(fresh scratch included), none alone, none with WS_STRESS_NO_WS_PASS=1 (the same kernels
compiled without Triton's warp-specialisation pass) or with WS off.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import subprocess
import sys
import time

import torch

CASES = {   # name: (T, H, I, E, K), the two failing GPU tests' shapes and Qwen3 T=8192
    "large_offsets": (40000, 7168, 128, 8, 8),
    "deepseek64": (2048, 7168, 2048, 64, 8),
    "qwen3": (8192, 2048, 768, 128, 8),
}


def _poison(nbytes=1 << 30):
    torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").fill_(float("nan"))


def _fresh_scratch_allocator(keep=4096):
    import triton

    alive = collections.deque(maxlen=keep)

    def alloc(size, alignment, stream):
        buf = torch.empty(size, dtype=torch.int8, device="cuda")   # 512-byte aligned
        alive.append(buf)
        return buf

    triton.set_allocator(alloc)


def _fields(spec: str) -> dict:
    out = {}
    for item in filter(None, spec.split(",")):
        key, value = (x.strip() for x in item.split("="))
        out[key] = {"True": True, "False": False}[value] if value in ("True", "False") \
            else int(value)
    return out


def worker(case: str, seconds: float, ws: bool, scratch: str, path: str, seed: int,
           fwd_ws: bool = True) -> dict:
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.ops.samples import make_dispatch_inputs
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    if scratch == "fresh":
        _fresh_scratch_allocator()
    extra = {}   # extra launch arguments of the WS kernels
    if os.environ.get("WS_STRESS_NO_WS_PASS") == "1":   # the same kernels, not warp-specialised
        extra["WARP_SPECIALIZE"] = False
    if os.environ.get("WS_STRESS_MAXNREG"):   # Triton's maxnreg: decides register reallocation
        extra["maxnreg"] = int(os.environ["WS_STRESS_MAXNREG"])
    if extra:
        import moe_ops.launch.dispatch as ld
        import moe_ops.launch.dispatch_backward as ldb

        orig = ld.launch_ws
        ld.launch_ws = ldb.launch_ws = lambda *a, **kw: orig(*a, **extra, **kw)
    # the heuristics' own choice with the kernels allowed or not (the failing tests' configs)
    os.environ["MOE_OPS_WARP_SPECIALIZE"] = "1" if ws else "0"
    T, H, I, E, K = CASES[case]
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(seed)
    args = make_dispatch_inputs(T, H, I, E, K, dtype=dt, device="cuda", generator=g,
                                weight_std=0.02)
    go = torch.randn(T, H, device="cuda", dtype=dt, generator=g)
    cfg = dispatch_config(T, E, K, H, I, "cuda", dt)
    bc = backward_config(cfg, "cuda", dt, rows_per_expert=T * K / E, inter_size=I)
    # WS_STRESS_FWD / WS_STRESS_BWD="field=int,...": config fields replaced (e.g. wg_n=128)
    cfg = dataclasses.replace(cfg, **_fields(os.environ.get("WS_STRESS_FWD", "")))
    bc = dataclasses.replace(bc, **_fields(os.environ.get("WS_STRESS_BWD", "")))
    fcfg = cfg if fwd_ws else dataclasses.replace(cfg, down_ws=False)
    runs = nan_runs = differ = 0
    first = None
    where = []
    t_end = time.time() + seconds
    while time.time() < t_end:
        z = None
        if path == "saved":
            _poison()
            _, z = dispatch_triton(*args, config=fcfg, save_z=True)
        _poison()
        got = dispatch_backward_triton(go, *args, z=z, config=cfg, bwd_config=bc)
        nan = [int(torch.isnan(t).sum()) for t in got]
        runs += 1
        if any(nan):
            nan_runs += 1
            if len(where) < 5:
                where.append(nan)
        if first is None:
            first = [t.clone() for t in got]
        elif not all(torch.equal(a, b) for a, b in zip(first, got)):
            differ += 1
        del got, z
    return dict(case=case, ws=ws, scratch=scratch, path=path, down_ws=cfg.down_ws, extra=extra,
                wg_ws=bc.wg_ws, rows_ws=bc.rows_ws, runs=runs, nan_runs=nan_runs,
                differ=differ, nan_counts=where)


def noise(seconds: float) -> None:
    """Another CUDA context keeping the GPU busy with changing work (as other tests do); prints
    "ready" once its first matmul has run. Also the noise process of benchmarks/ws_repro.py and
    of the GPU test beside another process (`ws_stress.py --noise-worker --seconds S`)."""
    sizes = [1024, 3072, 8192, 5000]
    t_end = time.time() + seconds
    i = 0
    while time.time() < t_end:
        n = sizes[i % len(sizes)]
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        (a @ a).sum().item()
        torch.empty(1 << 26, device="cuda").fill_(float("nan"))
        if i == 0:
            print("ready", flush=True)
        i += 1


def start_noise(count: int, seconds: float, script: str = __file__) -> list:
    """`count` noise processes (this script's --noise-worker), returned once each has its CUDA
    context and has run a matmul."""
    procs = [subprocess.Popen([sys.executable, script, "--noise-worker", "--seconds",
                               str(seconds)], stdout=subprocess.PIPE, text=True)
             for _ in range(count)]
    for q in procs:
        if q.stdout.readline().strip() != "ready":
            raise RuntimeError("a noise process did not start")
    return procs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=list(CASES), default="large_offsets")
    p.add_argument("--procs", type=int, default=3, help="worker processes (separate contexts)")
    p.add_argument("--noise", type=int, default=1, help="extra processes running other work")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--ws", choices=["on", "off"], default="on")
    p.add_argument("--fwd-ws", choices=["on", "off"], default="on",
                   help="off: the training forward without its WS down GEMM (--path saved)")
    p.add_argument("--scratch", choices=["torch", "fresh"], default="torch")
    p.add_argument("--path", choices=["saved", "recompute"], default="saved")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--noise-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=14, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.case, a.seconds, a.ws == "on", a.scratch, a.path, a.seed,
                                      a.fwd_ws == "on")))
        return 0
    if a.noise_worker:
        noise(a.seconds)
        return 0
    if not torch.cuda.is_available():
        print("ws_stress.py needs a CUDA GPU", file=sys.stderr)
        return 2
    base = [sys.executable, __file__, "--case", a.case, "--seconds", str(a.seconds),
            "--ws", a.ws, "--scratch", a.scratch, "--path", a.path, "--fwd-ws", a.fwd_ws]
    noisy = start_noise(a.noise, a.seconds + 30)
    workers = [subprocess.Popen(base + ["--worker", "--seed", str(14 + i)],
                                stdout=subprocess.PIPE, text=True) for i in range(a.procs)]
    results = []
    for w in workers:
        out, _ = w.communicate()
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        results.append(json.loads(lines[-1]) if lines else {"error": f"exit {w.returncode}"})
    for n in noisy:
        n.kill()
    print(f"case {a.case}, WS {a.ws} (forward {a.fwd_ws}), scratch {a.scratch}, z {a.path}, {a.procs} workers + "
          f"{a.noise} noise, {a.seconds:.0f} s" + "".join(
              f", {k}={os.environ[k]}" for k in ("WS_STRESS_NO_WS_PASS", "WS_STRESS_MAXNREG",
                                                  "WS_STRESS_FWD", "WS_STRESS_BWD")
              if os.environ.get(k)))
    bad = 0
    for i, r in enumerate(results):
        if "error" in r:
            print(f"  worker {i}: {r['error']}")
            bad += 1
            continue
        print(f"  worker {i} (down_ws {r['down_ws']} wg_ws {r['wg_ws']} rows_ws {r['rows_ws']}"
              f"{', launch ' + str(r['extra']) if r['extra'] else ''}): "
              f"{r['runs']} runs, {r['nan_runs']} with NaN, {r['differ']} not "
              f"bitwise equal to the first; NaN counts (dx, dw13, dw2, ds) {r['nan_counts']}")
        bad += r["nan_runs"] + r["differ"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the eager host time of moe.route + moe.dispatch goes, per cell (one GPU; not part of the
test suite): the public ops, their launchers (route_triton, dispatch_triton, align_triton), the
argument checks, dispatch_triton with its launches stubbed out (moe_ops' own Python), and each
Triton launch: Triton's JIT, its argument binding + cache key alone, and the fast launch
(moe_ops.launch.fast). Optionally writes Triton's launch-path source and a cProfile to --dump.
(Replaces benchmarks/host_overhead.py, which timed the first few of these on one shape.)

    PYTHONPATH=. python benchmarks/host_profile.py [--cells qwen3_30b_a3b:1 ...] [--dump DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import inspect
import io
import os
import pstats
import time

import torch

import moe_ops  # noqa: F401  (registers torch.ops.moe.*)
from moe_ops import bench
from moe_ops.launch import alignment as align_mod
from moe_ops.launch import dispatch as dispatch_mod
from moe_ops.launch import routing as routing_mod
from moe_ops.launch.alignment import align_triton
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.launch.routing import route_triton
from moe_ops.ops.checks import check_dispatch
from moe_ops.tuning.heuristics import dispatch_config

MODULES = (dispatch_mod, align_mod, routing_mod)


def verified(f):
    """per_call_us with MOE_OPS_VERIFY_LAUNCH=1 (Triton's JIT asked on every fast launch)."""
    os.environ["MOE_OPS_VERIFY_LAUNCH"] = "1"
    try:
        return per_call_us(f)
    finally:
        del os.environ["MOE_OPS_VERIFY_LAUNCH"]


def per_call_us(f, n=200):
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


@contextlib.contextmanager
def patched_kernel_for(make):
    saved = [m.kernel_for for m in MODULES]
    for m in MODULES:
        m.kernel_for = make(m.kernel_for)
    try:
        yield
    finally:
        for m, k in zip(MODULES, saved):
            m.kernel_for = k


class _Stub:
    def __getitem__(self, grid):
        return lambda *a, **k: None


def stubbed(orig):
    return lambda kernel, device, key=None: _Stub()


def recorder(store):
    def make(orig):
        def kernel_for(kernel, device, key=None):
            k = orig(kernel, device, key)

            class Rec:
                def __getitem__(self, grid):
                    def launch(*a, **kw):
                        store.append((kernel, key, grid, a, kw))
                        return k[grid](*a, **kw)
                    return launch
            return Rec()
        return kernel_for
    return make


def launch_pieces(kernel, key, grid, args, kwargs):
    """us per call: Triton's JIT launch; its binding + cache key alone (warmup=True); the fast
    launch (moe_ops.launch.fast) with the launcher's key."""
    from moe_ops.launch.fast import FastLaunch

    res = {"jit": per_call_us(lambda: kernel[grid](*args, **kwargs)),
           "bind+key": per_call_us(lambda: kernel.run(*args, grid=grid, warmup=True, **kwargs))}
    if key is not None:
        res["fast"] = per_call_us(lambda: FastLaunch(kernel, key)[grid](*args, **kwargs))
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", nargs="+", default=["qwen3_30b_a3b:1", "qwen3_30b_a3b:8",
                                                  "mixtral_8x7b:1", "olmoe:128"])
    p.add_argument("--dump", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    for cell in args.cells:
        c = bench.cell_inputs(cell, dev, dt)
        s, wt = c.shape, c.weights
        logits = torch.randn(c.T, s.E, device=dev)
        d_args = (c.hidden, wt.w13, wt.w2, c.topk_weights, c.topk_ids)
        rows = {
            "ops.route": per_call_us(lambda: bench.route(s, logits, wt.bias)),
            "ops.route, verified fast launch": verified(lambda: bench.route(s, logits, wt.bias)),
            "route_triton": per_call_us(lambda: route_triton(
                logits, s.K, s.scoring, s.renormalize, wt.bias, s.num_groups, s.topk_groups,
                s.scale)),
            "ops.dispatch": per_call_us(lambda: torch.ops.moe.dispatch(*d_args)),
            "dispatch_triton": per_call_us(lambda: dispatch_triton(*d_args)),
            "check_dispatch": per_call_us(lambda: check_dispatch(*d_args, "silu")),
            "torch.empty [T, H]": per_call_us(lambda: torch.empty_like(c.hidden)),
        }
        cfg = dispatch_config(c.T, s.E, s.K, s.H, s.I, "cuda", dt)
        if not (cfg.direct and c.T == 1):
            rows["align_triton"] = per_call_us(lambda: align_triton(c.topk_ids, s.E, cfg.block_m))
        with patched_kernel_for(stubbed):
            rows["dispatch_triton, launches stubbed"] = per_call_us(lambda: dispatch_triton(*d_args))
        with torch.no_grad():
            rows["ops.dispatch no_grad"] = per_call_us(lambda: torch.ops.moe.dispatch(*d_args))
            rows["ops.dispatch no_grad, verified"] = verified(
                lambda: torch.ops.moe.dispatch(*d_args))
        fn = lambda: torch.ops.moe.dispatch(c.hidden, wt.w13, wt.w2, *bench.route(s, logits, wt.bias))  # noqa: E731
        rows["route+dispatch host"] = per_call_us(fn)
        import triton.testing

        rows["route+dispatch eager GPU (do_bench)"] = triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3
        print(f"\n== {cell}")
        for k, v in rows.items():
            print(f"  {k:40s} {v:8.1f} us")
        store = []
        with patched_kernel_for(recorder(store)):
            dispatch_triton(*d_args)
            bench.route(s, logits, wt.bias)
        for kernel, key, grid, a, kw in store:
            pieces = launch_pieces(kernel, key, grid, a, kw)
            print(f"  launch {kernel.fn.__name__:34s} " + "  ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in pieces.items()))
        if args.dump and cell == args.cells[0]:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(300):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            sio = io.StringIO()
            pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(35)
            with open(os.path.join(args.dump, "host_cprofile.txt"), "w") as f:
                f.write(sio.getvalue())
    if args.dump:
        import triton
        import triton.compiler.compiler as cc
        import triton.runtime.jit as jit

        parts = [f"# triton {triton.__version__}\n"]
        for obj in (jit.JITFunction.run, jit.create_function_from_signature, jit.compute_cache_key,
                    cc.CompiledKernel, jit.KernelParam):
            with contextlib.suppress(Exception):
                parts.append(inspect.getsource(obj))
        for name in ("specialize_impl", "mangle_type", "native_specialize_impl"):
            for mod in (jit,):
                obj = getattr(mod, name, None)
                if obj is not None:
                    with contextlib.suppress(Exception):
                        parts.append(inspect.getsource(obj))
        with contextlib.suppress(Exception):
            from triton.backends.nvidia import driver as nvd
            parts.append(inspect.getsource(nvd))
        with contextlib.suppress(Exception):
            from triton.tools import tensor_descriptor as tdm
            parts.append(inspect.getsource(tdm))
        with open(os.path.join(args.dump, "triton_launch_source.py.txt"), "w") as f:
            f.write("\n\n".join(parts))


if __name__ == "__main__":
    main()

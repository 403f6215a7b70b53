"""What Triton emits for sm_90 in the warp-specialised kernels (compiles only, no GPU needed):
per kernel and tile shape, the `setmaxnreg` instructions (register reallocation between warp
groups), the `.maxnreg` bound, whether the consumers wait for every wgmma (`wgmma.wait_group 0`)
before they release a shared-memory stage, and the tensormap fences. With --maxnreg N the
kernels are compiled with Triton's `maxnreg` option (a launch option too), which is what
decides whether Triton reallocates registers.

    python benchmarks/probe_ws_ptx.py [--maxnreg 128]
    PYTHONPATH=/path/to/triton-3.6-wheel:. python benchmarks/probe_ws_ptx.py   # the device's Triton

Why (benchmarks/NOTES.md entry 28): the WS kernels go wrong when another process shares the GPU;
the same loops compiled without the WS pass do not. Triton 3.6 (2026-12-02, on the CPU machine):
the consumers do wait for wgmma 0 before releasing a stage, and the kernels reallocate
registers on every tile-loop iteration (workers `dec 120` at the loop head, `inc 232` in the
consumer partitions; the default warp group `inc 256` at the start, `dec 40` as producer).
"""
from __future__ import annotations

import argparse
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_ops.kernels.expert_gemm import rows_gemm_ws_kernel
from moe_ops.kernels.expert_gemm_backward import weight_grad_ws_kernel

_ROWS_SIG = {**{n: "i32" for n in ("n_slots", "N", "K_red", "top_k", "max_rows", "n_experts",
                                   "stride_am", "stride_tw_t", "stride_tw_k", "stride_ym")},
             "a_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "weights_ptr": "*fp32",
             "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_rows_ptr": "*i32"}
_WG_SIG = {**{n: "i32" for n in ("M", "N", "E", "n_rows", "stride_lr", "stride_rr")},
           "l_ptr": "*bf16", "r_ptr": "*bf16", "o_ptr": "*bf16", "expert_ends_ptr": "*i32"}


def compile_ptx(kernel, sig, constexprs, options) -> str:
    sig = {**sig, **{k: "constexpr" for k in constexprs}}
    sig = {k: sig[k] for k in kernel.arg_names if k in sig}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options=options).asm["ptx"]


def summary(ptx: str) -> str:
    lines = [ln.strip() for ln in ptx.splitlines()]
    regs = [ln.split()[-1].rstrip(";") for ln in lines if ln.startswith("setmaxnreg")]
    kinds = [ln.split(".")[1] for ln in lines if ln.startswith("setmaxnreg")]
    maxnreg = [ln.split()[-1] for ln in lines if ln.startswith(".maxnreg")]
    waits = sorted({ln.split()[-1].rstrip(";") for ln in lines if ln.startswith("wgmma.wait_group")})
    fences = sum("fence.proxy.tensormap" in ln for ln in lines)
    realloc = ", ".join(f"{k} {r}" for k, r in zip(kinds, regs)) or "none"
    return (f".maxnreg {maxnreg[0] if maxnreg else '-'}; setmaxnreg: {realloc}; "
            f"wgmma.wait_group {'/'.join(waits) or '-'}; tensormap acquire fences {fences}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--maxnreg", type=int, default=None)
    a = p.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90, maxnreg {a.maxnreg}")
    cases = [("rows_gemm_ws 128x256x64 s3", rows_gemm_ws_kernel, _ROWS_SIG,
              dict(BLOCK_N=256, GROUP_M=8, W_LAYOUT=1, HAS_WEIGHTS=False), 3),
             ("rows_gemm_ws 128x128x64 s4", rows_gemm_ws_kernel, _ROWS_SIG,
              dict(BLOCK_N=128, GROUP_M=8, W_LAYOUT=1, HAS_WEIGHTS=False), 4),
             ("weight_grad_ws 128x256x64 s3", weight_grad_ws_kernel, _WG_SIG,
              dict(BLOCK_N=256), 3)]
    for name, kernel, sig, extra, stages in cases:
        c = dict(BLOCK_M=128, BLOCK_K=64, NUM_PROGRAMS=132, DOT_PRECISION="tf32",
                 WARP_SPECIALIZE=True, **extra)
        opts = {"num_warps": 4, "num_stages": stages}
        if a.maxnreg:
            opts["maxnreg"] = a.maxnreg
        try:
            print(f"{name:30s} {summary(compile_ptx(kernel, sig, c, opts))}")
        except Exception as exc:   # noqa: BLE001 - a failed compile is a result here
            print(f"{name:30s} did not compile: {str(exc).splitlines()[-1][:120]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

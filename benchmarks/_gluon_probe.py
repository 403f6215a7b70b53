"""What the Gluon warp-specialisation probes (probe_gluon_ws.py, probe_gluon_fp8.py,
probe_gluon_mxfp4.py) share: compiling a kernel's variants for sm_90 without a GPU, checking
repeated calls against a float64 reference and against the first call, and their command
line (--calls, --noise, --compile-only)."""
from __future__ import annotations

import argparse
from typing import Callable

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def grouped_tile(M, N, BMM: gl.constexpr, BNN: gl.constexpr, GROUP_M: gl.constexpr):
    """(off_m, off_n) of this program's output tile in grouped order: GROUP_M row tiles walk
    the N tiles together, so their B tiles are reused from L2 (moe_ops' kernels' order)."""
    pid = gl.program_id(0)
    n_n = gl.cdiv(N, BNN)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = gl.minimum(gl.cdiv(M, BMM) - first_m, GROUP_M)
    return (first_m + (pid % per_group) % size_m) * BMM, ((pid % per_group) // size_m) * BNN


def innermost(e: BaseException) -> BaseException:
    """The innermost error of a compile failure's chain (Triton wraps the cause)."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return e


def compile_variants(kernel, signature: dict, variants: list[tuple[str, dict]],
                     num_warps: int = 4) -> int:
    """Compile `kernel` (a @gluon.jit function) for sm_90 once per (label, constexprs) variant
    and print a line per variant with its warps, shared memory and the PTX's wgmma, TMA,
    mbarrier and setmaxnreg counts (tests/test_compile_sm90.py reads these lines). 0 if every
    variant compiled, 1 otherwise."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    rc = 0
    for label, consts in variants:
        try:
            k = triton.compile(GluonASTSource(kernel, signature, constexprs=consts),
                               target=GPUTarget("cuda", 90, 128), options={"num_warps": num_warps})
        except Exception as e:  # noqa: BLE001 - report the innermost error, go on
            e = innermost(e)
            print(f"{label}: compile failed: {type(e).__name__}: {str(e)[-2000:]}")
            rc = 1
            continue
        ptx = k.asm["ptx"]
        print(f"{label}: compiled, warps {k.metadata.num_warps}, shared {k.metadata.shared} B, "
              f"wgmma {ptx.count('wgmma.mma_async')}, wait_group {ptx.count('wgmma.wait_group')}, "
              f"tma {ptx.count('cp.async.bulk.tensor')}, mbarrier {ptx.count('mbarrier.')}, "
              f"setmaxnreg {ptx.count('setmaxnreg')}")
    return rc


def check_calls(call: Callable[[torch.Tensor], object], shape, dtype, ref: torch.Tensor,
                calls: int, bound: float) -> tuple[int, int, float]:
    """(calls whose relative L2 error against `ref` (float64) is above `bound` or not finite,
    calls whose output is not bitwise the first call's, the largest error) over `calls` calls
    of `call(out)`, each into a fresh output poisoned with NaN."""
    first, wrong, differ, err_max = None, 0, 0, 0.0
    for _ in range(calls):
        out = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
        call(out)
        torch.cuda.synchronize()
        err = float((out.double() - ref).norm() / ref.norm())
        err_max = max(err_max, err) if err == err else float("inf")
        wrong += not err <= bound
        if first is None:
            first = out
        elif not torch.equal(out, first):
            differ += 1
    return wrong, differ, err_max


def parser(doc: str, calls: int) -> argparse.ArgumentParser:
    """The probes' shared options; each adds its own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=calls)
    p.add_argument("--noise", action="store_true",
                   help="a second process runs bf16 matmuls on the GPU throughout")
    p.add_argument("--compile-only", action="store_true",
                   help="compile for sm_90 only (no GPU needed)")
    return p


def run_main(args, compile_only: Callable[[], int], run: Callable[[object], int]) -> int:
    """--compile-only, else `run(args)` (beside a GPU noise process with --noise)."""
    if args.compile_only:
        return compile_only()
    from moe_ops.tools._timing import gpu_noise

    with gpu_noise(args.noise):
        return run(args)

"""Where does Triton wait for a K step's wgmma when the product is scaled before it is added
(FP8 per-block promotion)? Compiles a small e4m3 GEMM loop for sm_90 (no GPU needed) in two
forms, promoted in the same step and promoted one step later (the product carried into the next
iteration), and prints each `wgmma.wait_group` with the count of float32 multiply-adds before
it. Triton 3.6: `wait_group 0` right after the commit in both forms, so the promotion never
overlaps an MMA in flight.

    PYTHONPATH=<triton 3.6 site> python benchmarks/probe_wgmma_waits.py
"""
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def promoted_loop(a_ptr, b_ptr, s_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, LAG: tl.constexpr):
    om = tl.arange(0, BM)
    on = tl.arange(0, BN)
    ok = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    p_prev = tl.zeros((BM, BN), tl.float32)
    s_prev = 0.0
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + om[:, None] * K + (k0 + ok)[None, :])
        b = tl.load(b_ptr + (k0 + ok)[:, None] * BN + on[None, :])
        s = tl.load(s_ptr + k0 // BK)
        p = tl.dot(a, b)
        if LAG:
            acc = acc + p_prev * s_prev
            p_prev = p
            s_prev = s
        else:
            acc = acc + p * s
    if LAG:
        acc = acc + p_prev * s_prev
    tl.store(c_ptr + om[:, None] * BN + on[None, :], acc)


def main():
    print(f"triton {triton.__version__}, sm_90, [64, 128] x [128, 256] e4m3 per K step, 4 warps")
    for lag in (0, 1):
        sig = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", s_ptr="*fp32", c_ptr="*fp32", K="i32",
                   BM="constexpr", BN="constexpr", BK="constexpr", LAG="constexpr")
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
        k = triton.compile(ASTSource(fn=promoted_loop, signature=sig,
                                     constexprs={(5,): 64, (6,): 256, (7,): 128, (8,): lag},
                                     attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4,
                                                                          num_stages=4))
        lines = k.asm["ptx"].splitlines()
        fma = [i for i, ln in enumerate(lines) if re.search(r"fma.rn.f32|mul.f32", ln)]
        print(f"promotion {'one step later' if lag else 'in the same step'}:")
        for i, ln in enumerate(lines):
            if re.search(r"wgmma\.(commit_group|wait_group)|Inner Loop|\sbra\s", ln):
                print(f"  line {i}: {ln.strip()[:48]:48s} float32 mul/fma before: "
                      f"{sum(1 for f in fma if f < i)}")


if __name__ == "__main__":
    main()

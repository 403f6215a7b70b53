"""Does this Triton's Gluon emit Hopper TMA multicast for a tile that a 2-CTA cluster shares?
(not a test; compiles for sm_90 only, no GPU needed). The lever benchmarks/NOTES.md entry 52
points to for the prefill and training GEMMs is operands shared across CTAs; this answers
whether the installed Triton can express it. Each case runs in a child process (a layout
Triton rejects can abort the process).

    python benchmarks/probe_gluon_multicast.py

Read on 2026-12-03: Triton 3.6.0 (the device's): a 2-CTA cluster compiles (.reqnctapercluster
2) with a tile replicated over both CTAs, but each CTA issues its own TMA load (no
.multicast::cluster); its Hopper `tma.async_copy_global_to_shared` has no multicast argument.
Triton 3.8.0: `tma.async_load(..., multicast=True)` exists (not compiled here yet).
"""
from __future__ import annotations

import subprocess
import sys

CASES = {"1 CTA": ([], 1), "2 CTAs, tile replicated": ([[0, 0]], 2)}


def compile_case(name: str) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    @gluon.jit
    def load_kernel(b_desc, out_ptr, BL: gl.constexpr):
        smem = gl.allocate_shared_memory(b_desc.dtype, b_desc.block_type.shape, b_desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(b_desc, [0, 0], bar, smem)
        mbarrier.wait(bar, 0)
        mbarrier.invalidate(bar)
        v = smem.load(BL)
        offs_m = gl.arange(0, b_desc.block_type.shape[0], layout=gl.SliceLayout(1, BL))
        offs_n = gl.arange(0, b_desc.block_type.shape[1], layout=gl.SliceLayout(0, BL))
        gl.store(out_ptr + offs_m[:, None] * b_desc.block_type.shape[1] + offs_n[None, :], v)

    cga, n_ctas = CASES[name]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2,
                                  cga_layout=cga)
    bl = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=cga)
    sig = {"b_desc": f"tensordesc<bf16[64,256],{layout!r}>", "out_ptr": "*bf16",
           "BL": "constexpr"}
    k = triton.compile(GluonASTSource(load_kernel, sig, {(2,): bl}, {}),
                       target=GPUTarget("cuda", 90, 128),
                       options=dict(num_warps=4, num_ctas=n_ctas))
    ptx = k.asm["ptx"]
    tma_lines = [ln.strip() for ln in ptx.splitlines() if "cp.async.bulk.tensor" in ln]
    cluster = [ln.strip() for ln in ptx.splitlines() if "reqnctapercluster" in ln]
    return (f"triton {triton.__version__}, {name}: compiled; TMA: {tma_lines[:1]}; multicast: "
            f"{'.multicast::cluster' in ptx}; cluster: {cluster}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:   # child: one case
        print(compile_case(argv[0]))
        return 0
    for name in CASES:
        r = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True,
                           timeout=300)
        out = (r.stdout.strip() or r.stderr.strip()[-600:])
        print(out if r.returncode == 0 else f"{name}: FAILED (rc {r.returncode}): {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does an explicitly warp-specialised Gluon GEMM compute correctly on this GPU, alone and beside
another process using it? Triton's automatic warp specialisation did not (docs/design.md, "Levers
that did not pay": NaN and stale tiles on Triton 3.6 and 3.9), which blocks the kernels that
would overlap MXFP4/FP8 decode or promotion work with the tensor cores. This probe answers the
question for Gluon's `gl.warp_specialize` with explicit partitions and mbarriers, in the two
forms such an MoE kernel would take:

- "tma": C = A @ B^T, bf16, one 1-warp partition issuing TMA loads of A and B into a ring of
  shared-memory stages, the default 4-warp partition running async wgmma and releasing stages;
- "regs": the same, but B is int8 codes with one float32 scale per row, loaded by a 4-warp
  partition with ordinary loads, decoded (code x scale -> bf16) in registers and stored into the
  shared stage (then fence_async_shared and an mbarrier arrive): the data path of a decode
  kernel feeding the tensor cores.

Each call writes a NaN-poisoned output; every call is compared with a float64 reference
(relative L2 and max abs) and bitwise with the first call. Prints one line per form and
condition, and a timing against torch.matmul on the same bf16 operands.

    PYTHONPATH=. python benchmarks/probe_gluon_ws.py [--calls 200] [--noise] [--size 4096]
    python benchmarks/probe_gluon_ws.py --compile-only     # compile for sm_90 on any machine

Exit status 1 if any call is wrong or differs from the first."""
from __future__ import annotations

import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # beside this file
from _gluon_probe import check_calls, compile_variants, parser, run_main  # noqa: E402

BM, BN, BK, STAGES = 128, 128, 64, 4
# Gluon's Hopper TMA load: async_copy_global_to_shared on Triton 3.6, async_load from 3.8
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _tma_loader(a_desc, b_desc, a_bufs, b_bufs, a_ready, b_ready, empty, code_ptr, scale_ptr,
                stride_cn, off_m, off_n, N, K, B_TMA: gl.constexpr):
    """1 warp: A (and with B_TMA, B) tiles by TMA into the stage ring."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BK: gl.constexpr = a_bufs.type.shape[2]
    for i in range(gl.cdiv(K, BK)):
        s = i % S
        ph = (i // S) & 1
        mbarrier.wait(empty.index(s), ph ^ 1)   # a fresh barrier's phase 1 counts as done
        if B_TMA:
            mbarrier.expect(a_ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [off_m, i * BK], a_ready.index(s), a_bufs.index(s))
            _tma_load(b_desc, [off_n, i * BK], a_ready.index(s), b_bufs.index(s))
        else:
            mbarrier.expect(a_ready.index(s), a_desc.block_type.nbytes)
            _tma_load(a_desc, [off_m, i * BK], a_ready.index(s), a_bufs.index(s))


@gluon.jit
def _decoder(a_desc, b_desc, a_bufs, b_bufs, a_ready, b_ready, empty, code_ptr, scale_ptr,
             stride_cn, off_m, off_n, N, K, B_TMA: gl.constexpr):
    """4 warps: B's int8 codes x row scale -> bf16, stored into the stage (no-op with B_TMA)."""
    if not B_TMA:
        S: gl.constexpr = b_bufs.type.shape[0]
        BNN: gl.constexpr = b_bufs.type.shape[1]
        BK: gl.constexpr = b_bufs.type.shape[2]
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        offs_n = off_n + gl.arange(0, BNN, layout=gl.SliceLayout(1, layout))
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
        n_mask = offs_n < N
        scale = gl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
        for i in range(gl.cdiv(K, BK)):
            s = i % S
            ph = (i // S) & 1
            k = i * BK + offs_k
            codes = gl.load(code_ptr + offs_n[:, None].to(gl.int64) * stride_cn + k[None, :],
                            mask=n_mask[:, None] & (k[None, :] < K), other=0)
            vals = (codes.to(gl.float32) * scale[:, None]).to(gl.bfloat16)
            mbarrier.wait(empty.index(s), ph ^ 1)
            b_bufs.index(s).store(vals)
            fence_async_shared()   # generic-proxy stores before the wgmma's async-proxy reads
            mbarrier.arrive(b_ready.index(s), count=1)


@gluon.jit
def _mma(a_bufs, b_bufs, a_ready, b_ready, empty, c_ptr, stride_cm, off_m, off_n, M, N, K,
         B_TMA: gl.constexpr):
    """The default partition (4 warps): async wgmma per stage, one group in flight; a stage is
    released once the wgmma that read it has completed."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    n_k = gl.cdiv(K, BK)
    for i in range(n_k):
        s = i % S
        ph = (i // S) & 1
        mbarrier.wait(a_ready.index(s), ph)
        if not B_TMA:
            mbarrier.wait(b_ready.index(s), ph)
        a_s = a_bufs.index(s)
        b_s = b_bufs.index(s)
        acc = warpgroup_mma(a_s, b_s.permute((1, 0)), acc, is_async=True)
        acc, a_s, b_s = warpgroup_mma_wait(1, deps=[acc, a_s, b_s])
        # the previous step's wgmma is complete: its stage may be refilled
        mbarrier.arrive(empty.index((i + S - 1) % S), count=1, pred=i > 0)
    acc = warpgroup_mma_wait(0, deps=[acc])
    offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    ptrs = c_ptr + offs_m[:, None].to(gl.int64) * stride_cm + offs_n[None, :]
    gl.store(ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@gluon.jit
def ws_gemm_kernel(a_desc, b_desc, code_ptr, scale_ptr, c_ptr, M, N, K, stride_cn, stride_cm,
                   BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                   B_TMA: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], b_desc.layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(b_ready.index(i), count=1)
        # released once per step, by the MMA partition only
        mbarrier.init(empty.index(i), count=1)
    n_tiles_n = gl.cdiv(N, BN)
    pid = gl.program_id(0)
    off_m = (pid // n_tiles_n) * BM
    off_n = (pid % n_tiles_n) * BN
    worker_args = (a_desc, b_desc, a_bufs, b_bufs, a_ready, b_ready, empty, code_ptr, scale_ptr,
                   stride_cn, off_m, off_n, N, K, B_TMA)
    gl.warp_specialize([
        (_mma, (a_bufs, b_bufs, a_ready, b_ready, empty, c_ptr, stride_cm, off_m, off_n, M, N, K,
                B_TMA)),
        (_tma_loader, worker_args),
        (_decoder, worker_args),
    ], [1, 4], [24, 112])


def ws_gemm(a, b_bf16, codes, scale, out, form):
    """out[M, N] (float32) = a @ B^T; B = b_bf16 (form "tma") or codes x scale (form "regs")."""
    M, K = a.shape
    N = scale.shape[0]
    la = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    lb = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    a_desc = TensorDescriptor.from_tensor(a, [BM, BK], la)
    b_desc = TensorDescriptor.from_tensor(b_bf16, [BN, BK], lb)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    ws_gemm_kernel[grid](a_desc, b_desc, codes, scale, out, M, N, K, codes.stride(0),
                         out.stride(0), BM, BN, BK, STAGES, form == "tma", num_warps=4)
    return out


def compile_only() -> int:
    """Compile both forms for sm_90 (no GPU needed): PTX instruction counts per form."""
    desc = "tensordesc<bf16[%d, %d],%s>"
    la = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    lb = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    sig = {"a_desc": desc % (BM, BK, la), "b_desc": desc % (BN, BK, lb),
           "code_ptr": "*i8", "scale_ptr": "*fp32", "c_ptr": "*fp32", "M": "i32",
           "N": "i32", "K": "i32", "stride_cn": "i32", "stride_cm": "i32",
           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "STAGES": "constexpr",
           "B_TMA": "constexpr"}
    return compile_variants(ws_gemm_kernel, sig, [
        (form, {"BM": BM, "BN": BN, "BK": BK, "STAGES": STAGES, "B_TMA": form == "tma"})
        for form in ("tma", "regs")])


def main() -> int:
    p = parser(__doc__, calls=200)
    p.add_argument("--size", type=int, default=4096)
    return run_main(p.parse_args(), compile_only, run)


def run(args) -> int:
    n = args.size
    M, N, K = n, n + 64, n - 64 + 8   # N, K not multiples of the tiles: masked edges
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    codes = torch.randint(-8, 8, (N, K), device="cuda", generator=g, dtype=torch.int8)
    scale = torch.rand(N, device="cuda", generator=g) * 0.25 + 0.01
    b = (codes.float() * scale[:, None]).bfloat16()   # the decoded weights, exactly
    ref = a.double() @ b.double().T
    worst = 0
    cond = "beside a matmul process" if args.noise else "alone"
    for form in ("tma", "regs"):
        # float32 sums over ~4k products (~1e-6); stale tiles and NaN are O(1)
        wrong, differ, err_max = check_calls(
            lambda out: ws_gemm(a, b, codes, scale, out, form), (M, N), torch.float32, ref,
            args.calls, 1e-4)
        out = torch.empty((M, N), device="cuda")
        us = triton.testing.do_bench(lambda: ws_gemm(a, b, codes, scale, out, form)) * 1e3
        us_ref = triton.testing.do_bench(lambda: a @ b.T) * 1e3
        flops = 2 * M * N * K
        print(f"{form} ({cond}): {args.calls} calls, wrong {wrong}, differing from the first "
              f"{differ}, max rel L2 {err_max:.2e}; {us:.1f} us ({flops / us / 1e6:.0f} TFLOP/s) "
              f"vs torch.matmul bf16 {us_ref:.1f} us", flush=True)
        worst = max(worst, wrong + differ)
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())

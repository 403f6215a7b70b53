"""Can warps that decode MXFP4 weights keep Hopper's tensor cores fed? A Gluon GEMM with explicit
warp specialisation, C[M, N] = A[M, K] (bf16) @ W[N, K]^T with W in MXFP4 (e2m1 codes, two per
byte, and one e8m0 scale per 32 values along K), against the same GEMM on W decoded to bf16
ahead of time (torch.matmul), in one run. This is the question behind issue 42's MXFP4 prefill
target (>= 1.0x of bf16 moe_ops): moe_ops' MXFP4 kernels decode in the warps that also issue
the MMAs, and lose to bf16 by the decode's issue slots (docs/design.md).

Partitions (gl.warp_specialize): one warp issues the TMA loads of A's tiles and of the packed
codes into a ring of stages; one or two 4-warp decode partitions (alternate K steps) turn each
stage's codes into bf16 tiles in shared memory (the bit placement of moe_ops' decode:
quant_gemm.mxfp4_tile_bits, the same values); the default 4-warp partition runs the wgmmas.
The decoders write a K step's low nibbles (even k) and high nibbles (odd k) as two [BN, BK / 2]
tiles, so A is passed with each BK block's columns deinterleaved the same way (even k first):
in an MoE kernel the gather of A's rows can write that order at no cost.

    PYTHONPATH=. python benchmarks/probe_gluon_mxfp4.py [--shape 8192 5760 2880] [--calls 20] [--noise]
    python benchmarks/probe_gluon_mxfp4.py --compile-only

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
from _gluon_probe import check_calls, compile_variants, grouped_tile, parser, run_main  # noqa: E402

BM, BN, BK = 128, 128, 64
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _loader(a_desc, c_desc, a_lo, a_hi, codes, b_lo, b_hi, ready, empty, dec_ready, dec_empty,
            scale_ptr, out_ptr, M, N, K, stride_sn, stride_om, off_m, off_n):
    """1 warp: A's two half tiles and the codes' tile by TMA into stage i % S."""
    S: gl.constexpr = a_lo.type.shape[0]
    HK: gl.constexpr = a_lo.type.shape[2]
    for i in range(gl.cdiv(K, 2 * HK)):
        s = i % S
        mbarrier.wait(empty.index(s), ((i // S) & 1) ^ 1)
        mbarrier.expect(ready.index(s), 2 * a_desc.block_type.nbytes + c_desc.block_type.nbytes)
        _tma_load(a_desc, [off_m, 2 * HK * i], ready.index(s), a_lo.index(s))
        _tma_load(a_desc, [off_m, 2 * HK * i + HK], ready.index(s), a_hi.index(s))
        _tma_load(c_desc, [off_n, HK * i], ready.index(s), codes.index(s))


@gluon.jit
def _decode(a_lo, a_hi, codes, b_lo, b_hi, ready, empty, dec_ready, dec_empty, scale_ptr, N, K,
            stride_sn, off_n, FIRST: gl.constexpr, EVERY: gl.constexpr):
    """4 warps: K steps FIRST, FIRST + EVERY, ... Codes -> bf16 by bit placement (value times
    2^-126), times 2^126 and 2^(s - 127) (two bf16 factors, one rounding), into the stage's two
    decoded tiles; then a fence (generic -> async proxy) and the arrivals."""
    S: gl.constexpr = codes.type.shape[0]
    BNN: gl.constexpr = codes.type.shape[1]
    HK: gl.constexpr = codes.type.shape[2]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    offs_n = off_n + gl.arange(0, BNN, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HK, layout=gl.SliceLayout(0, layout))
    n_mask = offs_n < N
    for i in range(FIRST, gl.cdiv(K, 2 * HK), EVERY):
        s = i % S
        ph = (i // S) & 1
        # byte j of the step holds k = 2j (low nibble) and 2j + 1: e8m0 group (2j) // 32
        sc = gl.load(scale_ptr + offs_n[:, None].to(gl.int64) * stride_sn
                     + (i * (2 * HK) // 32 + cols // 16)[None, :],
                     mask=n_mask[:, None], other=0)
        f2 = gl.maximum(sc.to(gl.int16) << 7, 0x40).to(gl.int16).to(gl.bfloat16, bitcast=True)
        f1 = gl.full([BNN, HK], 8.507059173023462e37, gl.bfloat16, layout)
        mbarrier.wait(ready.index(s), ph)
        p = codes.index(s).load(layout).to(gl.int16)
        lo = (((p & 7) << 6) | ((p & 8) << 12)).to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (((p & 0x70) << 2) | ((p & 0x80) << 8)).to(gl.int16).to(gl.bfloat16, bitcast=True)
        fence_async_shared()   # these generic reads before the next TMA write of the slot
        mbarrier.arrive(empty.index(s), count=1)   # the codes' slot is read
        lo = (lo * f1) * f2
        hi = (hi * f1) * f2
        mbarrier.wait(dec_empty.index(s), ph ^ 1)   # the MMA is done with this decoded slot
        b_lo.index(s).store(lo)
        b_hi.index(s).store(hi)
        fence_async_shared()
        mbarrier.arrive(dec_ready.index(s), count=1)


@gluon.jit
def _decoder0(a_desc, c_desc, a_lo, a_hi, codes, b_lo, b_hi, ready, empty, dec_ready, dec_empty,
              scale_ptr, out_ptr, M, N, K, stride_sn, stride_om, off_m, off_n):
    _decode(a_lo, a_hi, codes, b_lo, b_hi, ready, empty, dec_ready, dec_empty, scale_ptr, N, K,
            stride_sn, off_n, 0, 2)


@gluon.jit
def _decoder1(a_desc, c_desc, a_lo, a_hi, codes, b_lo, b_hi, ready, empty, dec_ready, dec_empty,
              scale_ptr, out_ptr, M, N, K, stride_sn, stride_om, off_m, off_n):
    _decode(a_lo, a_hi, codes, b_lo, b_hi, ready, empty, dec_ready, dec_empty, scale_ptr, N, K,
            stride_sn, off_n, 1, 2)


@gluon.jit
def _decoder_all(a_desc, c_desc, a_lo, a_hi, codes, b_lo, b_hi, ready, empty, dec_ready, dec_empty,
                 scale_ptr, out_ptr, M, N, K, stride_sn, stride_om, off_m, off_n):
    _decode(a_lo, a_hi, codes, b_lo, b_hi, ready, empty, dec_ready, dec_empty, scale_ptr, N, K,
            stride_sn, off_n, 0, 1)


@gluon.jit
def _mma(a_lo, a_hi, b_lo, b_hi, ready, empty, dec_ready, dec_empty, out_ptr, M, N, K, stride_om,
         off_m, off_n):
    """Default partition (4 warps): per K step two async wgmmas (low and high halves), one step
    in flight; a step's slots are released once its wgmmas completed."""
    S: gl.constexpr = a_lo.type.shape[0]
    BMM: gl.constexpr = a_lo.type.shape[1]
    HK: gl.constexpr = a_lo.type.shape[2]
    BNN: gl.constexpr = b_lo.type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BNN, 16])
    acc = gl.zeros([BMM, BNN], gl.float32, acc_layout)
    n_k = gl.cdiv(K, 2 * HK)
    for i in range(n_k):
        s = i % S
        ph = (i // S) & 1
        mbarrier.wait(ready.index(s), ph)
        mbarrier.wait(dec_ready.index(s), ph)
        al = a_lo.index(s)
        ah = a_hi.index(s)
        bl = b_lo.index(s)
        bh = b_hi.index(s)
        acc = warpgroup_mma(al, bl.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(ah, bh.permute((1, 0)), acc, is_async=True)
        acc, al, ah, bl, bh = warpgroup_mma_wait(2, deps=[acc, al, ah, bl, bh])
        # the previous step's two wgmmas are complete: release its slots
        prev = (i + S - 1) % S
        mbarrier.arrive(empty.index(prev), count=1, pred=i > 0)
        mbarrier.arrive(dec_empty.index(prev), count=1, pred=i > 0)
    acc = warpgroup_mma_wait(0, deps=[acc])
    offs_m = off_m + gl.arange(0, BMM, layout=gl.SliceLayout(1, acc_layout))
    offs_n = off_n + gl.arange(0, BNN, layout=gl.SliceLayout(0, acc_layout))
    ptrs = out_ptr + offs_m[:, None].to(gl.int64) * stride_om + offs_n[None, :]
    gl.store(ptrs, acc.to(gl.bfloat16), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@gluon.jit
def mxfp4_gemm_ws(a_desc, c_desc, scale_ptr, out_ptr, M, N, K, stride_sn, stride_om,
                  STAGES: gl.constexpr, DECODERS: gl.constexpr, GROUP_M: gl.constexpr,
                  DEC_REGS: gl.constexpr):
    HK: gl.constexpr = a_desc.block_type.shape[1]
    BMM: gl.constexpr = a_desc.block_type.shape[0]
    BNN: gl.constexpr = c_desc.block_type.shape[0]
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BNN, HK], gl.bfloat16)
    a_lo = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BMM, HK], a_desc.layout)
    a_hi = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BMM, HK], a_desc.layout)
    codes = gl.allocate_shared_memory(gl.uint8, [STAGES, BNN, HK], c_desc.layout)
    b_lo = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BNN, HK], b_layout)
    b_hi = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BNN, HK], b_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dec_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dec_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)      # the decoder (codes read) and the MMA
        mbarrier.init(dec_ready.index(i), count=1)
        mbarrier.init(dec_empty.index(i), count=1)
    off_m, off_n = grouped_tile(M, N, BMM, BNN, GROUP_M)
    args = (a_desc, c_desc, a_lo, a_hi, codes, b_lo, b_hi, ready, empty, dec_ready, dec_empty,
            scale_ptr, out_ptr, M, N, K, stride_sn, stride_om, off_m, off_n)
    mma_args = (a_lo, a_hi, b_lo, b_hi, ready, empty, dec_ready, dec_empty, out_ptr, M, N, K,
                stride_om, off_m, off_n)
    if DECODERS == 2:
        gl.warp_specialize([(_mma, mma_args), (_loader, args), (_decoder0, args),
                            (_decoder1, args)], [1, 4, 4], [24, DEC_REGS, DEC_REGS])
    else:
        gl.warp_specialize([(_mma, mma_args), (_loader, args), (_decoder_all, args)], [1, 4],
                           [24, DEC_REGS])


def deinterleave_k(a):
    """A's columns in each 64-column block reordered: the even k first, then the odd k (the
    order of the decoded tiles)."""
    M, K = a.shape
    return a.view(M, K // BK, BK // 2, 2).transpose(2, 3).reshape(M, K).contiguous()


def mxfp4_gemm(a_perm, codes, scales, out, stages=3, decoders=2, group_m=8, dec_regs=112):
    M, K = a_perm.shape
    N = codes.shape[0]
    la = gl.NVMMASharedLayout.get_default_for([BM, BK // 2], gl.bfloat16)
    lc = gl.NVMMASharedLayout.get_default_for([BN, BK // 2], gl.uint8)
    a_desc = TensorDescriptor.from_tensor(a_perm, [BM, BK // 2], la)
    c_desc = TensorDescriptor.from_tensor(codes, [BN, BK // 2], lc)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    mxfp4_gemm_ws[grid](a_desc, c_desc, scales, out, M, N, K, scales.stride(0), out.stride(0),
                        stages, decoders, group_m, dec_regs, num_warps=4)
    return out


def compile_only() -> int:
    la = gl.NVMMASharedLayout.get_default_for([BM, BK // 2], gl.bfloat16)
    lc = gl.NVMMASharedLayout.get_default_for([BN, BK // 2], gl.uint8)
    sig = {"a_desc": f"tensordesc<bf16[{BM}, {BK // 2}],{la}>",
           "c_desc": f"tensordesc<u8[{BN}, {BK // 2}],{lc}>", "scale_ptr": "*u8",
           "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_sn": "i32",
           "stride_om": "i32", "STAGES": "constexpr", "DECODERS": "constexpr",
           "GROUP_M": "constexpr", "DEC_REGS": "constexpr"}
    return compile_variants(mxfp4_gemm_ws, sig, [
        (f"decoders {d}", {"STAGES": 3, "DECODERS": d, "GROUP_M": 8, "DEC_REGS": 112})
        for d in (1, 2)])


def main() -> int:
    p = parser(__doc__, calls=20)
    p.add_argument("--shape", nargs=3, type=int, default=[8192, 5760, 2880], metavar=("M", "N", "K"),
                   help="default: gpt-oss-20b's gate+up GEMM for 8192 rows")
    p.add_argument("--variants", nargs="+", default=["3,2,112", "3,1,152", "4,2,96"],
                   help="stages,decoders,decoder registers per variant")
    return run_main(p.parse_args(), compile_only, run)


def run(args) -> int:
    from moe_ops.reference.quant import dequantize_mxfp4

    M, N, K = args.shape
    if K % BK:
        raise SystemExit(f"--shape: K must be a multiple of {BK}")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    codes = torch.randint(0, 256, (N, K // 2), device="cuda", generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 124, (N, K // 32), device="cuda", generator=g, dtype=torch.uint8)
    w = dequantize_mxfp4(codes, scales)   # float32 [N, K], exact in bf16 at these scales
    ref = a.double() @ w.double().T
    a_perm = deinterleave_k(a)
    w16 = w.bfloat16()
    flops = 2 * M * N * K
    us_bf16 = triton.testing.do_bench(lambda: a @ w16.T) * 1e3
    cond = "beside a matmul process" if args.noise else "alone"
    print(f"M={M} N={N} K={K} ({cond}): bf16 matmul on the decoded weights {us_bf16:.1f} us "
          f"({flops / us_bf16 / 1e6:.0f} TFLOP/s)", flush=True)
    worst = 0
    for v in args.variants:
        stages, decoders, regs = (int(x) for x in v.split(","))
        wrong, differ, err_max = check_calls(
            lambda out: mxfp4_gemm(a_perm, codes, scales, out, stages, decoders, 8, regs),
            (M, N), torch.bfloat16, ref, args.calls, 1e-2)
        out = torch.empty((M, N), device="cuda", dtype=torch.bfloat16)
        us = triton.testing.do_bench(
            lambda: mxfp4_gemm(a_perm, codes, scales, out, stages, decoders, 8, regs)) * 1e3
        print(f"gluon ws mxfp4 stages={stages} decoders={decoders} regs={regs}: {args.calls} calls,"
              f" wrong {wrong}, differing {differ}, max rel L2 {err_max:.2e}; {us:.1f} us "
              f"({flops / us / 1e6:.0f} TFLOP/s, {us_bf16 / us:.2f}x of bf16)", flush=True)
        worst = max(worst, wrong + differ)
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())

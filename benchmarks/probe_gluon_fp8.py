"""What a warp-specialised Gluon kernel buys the FP8 block-scaled GEMM (W8A8, DeepSeek-V3's
128x128 weight blocks, activations scaled per row and 128 columns) on this GPU. moe_ops' FP8
prefill kernels reach ~55% of the FP8 ceiling in gate+up because Triton waits for every K step's
wgmma before its per-block promotion (docs/design.md, "FP8 prefill"); here a 1-warp partition
keeps TMA loads of both operands in flight and two consumer warpgroups (64 rows each, in two
partitions so that they synchronise only through the stage barriers) run the wgmma + promotion,
so one group's promotion can overlap the other's products on the tensor cores (DeepGEMM's form).

C[M, N] (bf16) = sum over K blocks of (A_q[:, kb] @ B_q[:, kb]^T) * a_scale[:, kb] * b_scale[nb, kb]
with A_q [M, K] and B_q [N, K] float8_e4m3fn, a_scale [K / 128, M] float32 (transposed: a step's
row scales are contiguous), b_scale [N / 128, K / 128] float32.

Checks every call against float64 on the dequantized operands (relative L2) and bitwise against
the first call; times it (do_bench median) against torch._scaled_mm (rowwise scales: the FP8
ceiling of the run) and a bf16 matmul of the same size.

    PYTHONPATH=. python benchmarks/probe_gluon_fp8.py [--shape 8192 4096 7168] [--calls 50] [--noise]
    python benchmarks/probe_gluon_fp8.py --compile-only

Exit status 1 if any call is wrong or differs from the first."""
from __future__ import annotations

import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # beside this file
from _gluon_probe import check_calls, compile_variants, grouped_tile, parser, run_main  # noqa: E402

BM, BN, BK = 128, 128, 128
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, a_scale_ptr, b_scale_ptr, c_ptr, M, N,
            K, off_m, off_n, stride_cm):
    """1 warp: both operands' tiles by TMA into the ring of stages."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BKK: gl.constexpr = a_bufs.type.shape[2]
    for i in range(gl.cdiv(K, BKK)):
        s = i % S
        mbarrier.wait(empty.index(s), ((i // S) & 1) ^ 1)   # a fresh barrier's phase 1 is done
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        _tma_load(a_desc, [off_m, i * BKK], ready.index(s), a_bufs.index(s))
        _tma_load(b_desc, [off_n, i * BKK], ready.index(s), b_bufs.index(s))


@gluon.jit
def _consume(a_bufs, b_bufs, ready, empty, a_scale_ptr, b_scale_ptr, c_ptr, M, N, K, off_m,
             off_n, stride_cm, WG: gl.constexpr):
    """One consumer warpgroup: rows [64 WG, 64 WG + 64) of the tile. Per K step: wait for the
    stage, its wgmma into a fresh product, wait for it, release the stage, promote (product x
    row scale x block scale, added in float32). The two groups synchronise only through the
    stage barriers, so one's promotion can run beside the other's products."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BMM: gl.constexpr = a_bufs.type.shape[1] // 2
    BKK: gl.constexpr = a_bufs.type.shape[2]
    BNN: gl.constexpr = b_bufs.type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BNN, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    offs_m = off_m + WG * BMM + gl.arange(0, BMM, layout=row_layout)
    m_mask = offs_m < M
    acc = gl.zeros([BMM, BNN], gl.float32, acc_layout)
    part = gl.zeros([BMM, BNN], gl.float32, acc_layout)
    n_k = gl.cdiv(K, BKK)
    for i in range(n_k):
        s = i % S
        # the step's scales, loaded before the wait so that their latency hides behind it
        sa = gl.load(a_scale_ptr + i * M + offs_m, mask=m_mask, other=0.0)
        sb = gl.load(b_scale_ptr + (off_n // BNN) * n_k + i)
        mbarrier.wait(ready.index(s), (i // S) & 1)
        a_s = a_bufs.index(s).slice(WG * BMM, BMM)
        b_s = b_bufs.index(s)
        part = warpgroup_mma(a_s, b_s.permute((1, 0)), part, use_acc=False, is_async=True)
        part, a_s, b_s = warpgroup_mma_wait(0, deps=[part, a_s, b_s])
        mbarrier.arrive(empty.index(s), count=1)
        acc += part * (sa * sb)[:, None]
    offs_n = off_n + gl.arange(0, BNN, layout=gl.SliceLayout(0, acc_layout))
    ptrs = c_ptr + offs_m[:, None].to(gl.int64) * stride_cm + offs_n[None, :]
    gl.store(ptrs, acc.to(gl.bfloat16), mask=m_mask[:, None] & (offs_n[None, :] < N))


@gluon.jit
def _consumer0(a_desc, b_desc, a_bufs, b_bufs, ready, empty, a_scale_ptr, b_scale_ptr, c_ptr, M,
               N, K, off_m, off_n, stride_cm):
    _consume(a_bufs, b_bufs, ready, empty, a_scale_ptr, b_scale_ptr, c_ptr, M, N, K, off_m,
             off_n, stride_cm, 0)


@gluon.jit
def _consumer1(a_desc, b_desc, a_bufs, b_bufs, ready, empty, a_scale_ptr, b_scale_ptr, c_ptr, M,
               N, K, off_m, off_n, stride_cm):
    _consume(a_bufs, b_bufs, ready, empty, a_scale_ptr, b_scale_ptr, c_ptr, M, N, K, off_m,
             off_n, stride_cm, 1)


@gluon.jit
def fp8_block_gemm_ws(a_desc, b_desc, a_scale_ptr, b_scale_ptr, c_ptr, M, N, K, stride_cm,
                      STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Default partition: consumer warpgroup 0 (num_warps = 4); workers: consumer warpgroup 1
    (4 warps) and the TMA loader (1 warp). A stage is free once both consumers released it."""
    BMM: gl.constexpr = a_desc.block_type.shape[0]
    BKK: gl.constexpr = a_desc.block_type.shape[1]
    BNN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BMM, BKK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BNN, BKK], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    off_m, off_n = grouped_tile(M, N, BMM, BNN, GROUP_M)
    args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, a_scale_ptr, b_scale_ptr, c_ptr, M, N,
            K, off_m, off_n, stride_cm)
    gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_loader, args)], [4, 1],
                       [CONSUMER_REGS, 24])


def fp8_gemm(aq, a_scale_t, bq, b_scale, out, stages=4, group_m=8, consumer_regs=232):
    M, K = aq.shape
    N = bq.shape[0]
    la = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv)
    lb = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(aq, [BM, BK], la)
    b_desc = TensorDescriptor.from_tensor(bq, [BN, BK], lb)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    fp8_block_gemm_ws[grid](a_desc, b_desc, a_scale_t, b_scale, out, M, N, K, out.stride(0),
                            stages, group_m, consumer_regs, num_warps=4)
    return out


def compile_only() -> int:
    la = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv)
    lb = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv)
    sig = {"a_desc": f"tensordesc<fp8e4nv[{BM}, {BK}],{la}>",
           "b_desc": f"tensordesc<fp8e4nv[{BN}, {BK}],{lb}>", "a_scale_ptr": "*fp32",
           "b_scale_ptr": "*fp32", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
           "stride_cm": "i32", "STAGES": "constexpr", "GROUP_M": "constexpr",
           "CONSUMER_REGS": "constexpr"}
    return compile_variants(fp8_block_gemm_ws, sig, [
        (f"stages {st}", {"STAGES": st, "GROUP_M": 8, "CONSUMER_REGS": 232}) for st in (3, 4)])


def quantize_blocks(x, rows_per_block):
    """x float32 [R, C] -> (e4m3 [R, C], scales [ceil(R / rows_per_block), C / 128]) with one
    scale per rows_per_block x 128 block (amax / 448)."""
    R, C = x.shape
    rb = rows_per_block
    xp = torch.nn.functional.pad(x, (0, 0, 0, (-R) % rb))
    blocks = xp.view(-1, rb, C // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(-1, C)[:R].contiguous(), scale.contiguous()


def main() -> int:
    p = parser(__doc__, calls=50)
    p.add_argument("--shape", nargs=3, type=int, default=[8192, 4096, 7168], metavar=("M", "N", "K"))
    p.add_argument("--variants", nargs="+", default=["4,8", "3,8"],
                   help="stages,group_m per variant")
    return run_main(p.parse_args(), compile_only, run)


def run(args) -> int:
    M, N, K = args.shape
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, K, device="cuda", generator=g)
    b = torch.randn(N, K, device="cuda", generator=g) * 0.05
    aq, sa = quantize_blocks(a, 1)          # per row and 128 columns: sa [M, K / 128]
    bq, sb = quantize_blocks(b, 128)        # 128 x 128 blocks: sb [N / 128, K / 128]
    sa_t = sa.t().contiguous()              # [K / 128, M]
    a_deq = (aq.double().view(M, K // 128, 128) * sa.double()[:, :, None]).view(M, K)
    b_deq = (bq.double().view(-1, 128, K // 128, 128) * sb.double()[:, None, :, None]).view(-1, K)[:N]
    ref = a_deq @ b_deq.T
    worst = 0
    cond = "beside a matmul process" if args.noise else "alone"
    a16, b16 = a.bfloat16(), b.bfloat16()
    ones_m = torch.ones(M, 1, device="cuda")
    ones_n = torch.ones(1, N, device="cuda")
    bq_t = bq.t()
    us_scaled = triton.testing.do_bench(lambda: torch._scaled_mm(
        aq, bq_t, scale_a=ones_m, scale_b=ones_n, out_dtype=torch.bfloat16)) * 1e3
    us_bf16 = triton.testing.do_bench(lambda: a16 @ b16.T) * 1e3
    flops = 2 * M * N * K
    print(f"M={M} N={N} K={K} ({cond}): torch._scaled_mm rowwise {us_scaled:.1f} us "
          f"({flops / us_scaled / 1e6:.0f} TFLOP/s), bf16 matmul {us_bf16:.1f} us "
          f"({flops / us_bf16 / 1e6:.0f} TFLOP/s)", flush=True)
    for v in args.variants:
        stages, group_m = (int(x) for x in v.split(","))
        # bf16 output rounding (~2e-3); stale tiles and NaN are O(1)
        wrong, differ, err_max = check_calls(
            lambda out: fp8_gemm(aq, sa_t, bq, sb, out, stages, group_m), (M, N), torch.bfloat16,
            ref, args.calls, 1e-2)
        out = torch.empty((M, N), device="cuda", dtype=torch.bfloat16)
        us = triton.testing.do_bench(lambda: fp8_gemm(aq, sa_t, bq, sb, out, stages, group_m)) * 1e3
        print(f"gluon ws stages={stages} group_m={group_m}: {args.calls} calls, wrong {wrong}, "
              f"differing {differ}, max rel L2 {err_max:.2e}; {us:.1f} us "
              f"({flops / us / 1e6:.0f} TFLOP/s, {us_scaled / us:.2f}x of _scaled_mm's rate)",
              flush=True)
        worst = max(worst, wrong + differ)
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())

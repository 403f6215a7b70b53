"""Decode: both expert GEMMs in one kernel (DispatchConfig.fuse_down).

fused_experts_kernel: program (row block, I tile j) computes act = SwiGLU(x W13_e^T) for its
  rows and the I columns of tile j (as gate_up_kernel does), keeps it in registers (rounded to
  the input dtype, as the two-kernel path stores it) and multiplies it by the matching I columns
  of W2_e, walking H in BLOCK_H steps: the partial down products part[j, slot] = act_j W2_e[:,
  j]^T are float32 rows per slot. Each program streams its W13 strip and then its W2 strip, so
  the down GEMM needs no launch of its own and no [rows, I] activation round trip; the price is
  the [n_j, T*K, H] float32 partials (small at decode sizes: the heuristic turns this on only
  there).
combine_partials_kernel: out[t] = sum over k = 0..K-1 of topk_weight[t, k] * sum over j of
  part[j, t*K + k] for valid ids, in float32, in a fixed order (deterministic, no atomics).
Rows come from the alignment's block table, or with DIRECT (T == 1) row block k is slot k."""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moe_ops.kernels.expert_gemm import gate_up_tile, row_block


@triton.jit
def fused_experts_kernel(
    x_ptr, w13_ptr, w2_ptr, part_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr,
    n_slots, H, I, top_k,
    stride_xt, stride_xh, stride_w13e, stride_w13n, stride_w13k,
    stride_w2e, stride_w2h, stride_w2i, stride_pj, stride_ps, n_j,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
    w13_desc=None, USE_TMA: tl.constexpr = False, TMA_PAIR: tl.constexpr = False,
    w2_desc=None, W2_TMA: tl.constexpr = False,
    ids_ptr=None, stride_ik=0, n_experts=0, DIRECT: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    """Programs are ordered row block first (pid = block * n_j + j), so the blocks past the
    device-side row count, which exit at once, come last. W2_TMA: `w2_desc` over the [E, H, I]
    weight with block [1, BLOCK_H, BLOCK_N]; else pointer loads with masks (odd sizes)."""
    pid = tl.program_id(0)
    pid_m = pid // n_j
    pid_n = pid % n_j
    if USE_PDL:
        gdc_wait()
    if not DIRECT:
        num_rows = tl.load(num_rows_ptr)
        if pid_m * BLOCK_M >= num_rows:
            return
    e, rows, slots, row_valid = row_block(pid_m, sorted_ptr, block_expert_ptr, n_slots, ids_ptr,
                                          stride_ik, n_experts, BLOCK_M, DIRECT, BLOCK_M)
    tok = tl.where(row_valid, slots // top_k, 0).to(tl.int64)
    acc_g, acc_u = gate_up_tile(x_ptr, w13_ptr, tok, row_valid, e, pid_n, H, I,
                                stride_xt, stride_xh, stride_w13e, stride_w13n, stride_w13k,
                                BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, w13_desc, USE_TMA,
                                TMA_PAIR)
    if USE_PDL:
        # The combine may start launching; its gdc_wait still waits for this whole grid.
        gdc_launch_dependents()
    # Columns past I are zero (their weights are zero-filled or masked), so they add nothing.
    act = (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(x_ptr.dtype.element_ty)
    n0 = pid_n * BLOCK_N
    offs_i = n0 + tl.arange(0, BLOCK_N)
    i_mask = offs_i < I
    offs_h = tl.arange(0, BLOCK_H)
    e32 = e.to(tl.int32)
    b_ptrs = (w2_ptr + e * stride_w2e + offs_h[None, :].to(tl.int64) * stride_w2h
              + offs_i[:, None] * stride_w2i)
    p_ptrs = (part_ptr + pid_n.to(tl.int64) * stride_pj
              + slots.to(tl.int64)[:, None] * stride_ps + offs_h[None, :])
    for h0 in range(0, H, BLOCK_H):
        h_mask = offs_h < H - h0
        if W2_TMA:
            b = tl.trans(tl.reshape(w2_desc.load([e32, h0, n0]), (BLOCK_H, BLOCK_N)))
        else:
            b = tl.load(b_ptrs, mask=i_mask[:, None] & h_mask[None, :], other=0.0)
        p = tl.dot(act, b, input_precision=DOT_PRECISION)
        tl.store(p_ptrs, p, mask=row_valid[:, None] & h_mask[None, :])
        b_ptrs += BLOCK_H * stride_w2h
        p_ptrs += BLOCK_H


@triton.jit
def combine_partials_kernel(
    part_ptr, weights_ptr, ids_ptr, out_ptr, H, E, n_j,
    stride_pj, stride_ps, stride_wt, stride_wk, stride_it, stride_ik, stride_ot, stride_oh,
    TOP_K: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """One token and BLOCK_H columns per program. For each k in order (unrolled: the K loads
    are independent), the n_j partial rows of slot t*K + k as one [BLOCK_J, BLOCK_H] tile,
    summed over j (a fixed reduction tree), times the routing weight in float32."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    js = tl.arange(0, BLOCK_J)
    acc = tl.zeros((BLOCK_H,), tl.float32)
    if USE_PDL:
        gdc_wait()
    for k in tl.static_range(TOP_K):
        # slot k's id and weight, per column (vectors: the masks stay boolean tensors)
        e = tl.load(ids_ptr + t * stride_it + k * stride_ik + offs_h * 0)
        valid = h_mask & (e >= 0) & (e < E)
        w = tl.load(weights_ptr + t * stride_wt + k * stride_wk + offs_h * 0, mask=valid,
                    other=0.0).to(tl.float32)
        p = tl.load(part_ptr + js.to(tl.int64)[:, None] * stride_pj + (t * TOP_K + k) * stride_ps
                    + offs_h[None, :], mask=(js < n_j)[:, None] & valid[None, :], other=0.0)
        acc += w * tl.sum(p, axis=0)
    tl.store(out_ptr + t * stride_ot + offs_h * stride_oh, acc.to(out_ptr.dtype.element_ty),
             mask=h_mask)

"""One-token (T == 1) expert kernels: matrix-vector products on the CUDA cores.

At T == 1 each of the K experts sees one row, so a tensor-core tile pads that row to 16 and the
work is a weight stream. These kernels give each program a few output columns of one product and
reduce over the whole input row with elementwise multiplies and sums (float32), and they need no
alignment: slot k is expert topk_ids[0, k].

gemv_gate_up_kernel: act[k] = silu(x @ w13[e_k, :I].T) * (x @ w13[e_k, I:].T), grid (K, I tiles);
  with SAVE_Z also the pre-activation z[k] = [g | u] for the backward.
gemv_down_combine_kernel: out = sum over k in order 0..K-1 of topk_weight[k] * (act[k] @ w2[e_k].T)
  for valid ids, grid (H tiles,): the down product and the combine in one launch, the K partial
  rows summed in float32 in a fixed order (deterministic, no atomics).
Slots whose id is < 0 or >= E are skipped (their loads are masked off: no weight traffic)."""
import triton
import triton.language as tl


@triton.jit
def gemv_gate_up_kernel(
    x_ptr, w_ptr, ids_ptr, act_ptr, z_ptr, H, I, E,
    stride_xh, stride_ik, stride_we, stride_wn, stride_wk, stride_am, stride_z,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SAVE_Z: tl.constexpr,
):
    k = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + k * stride_ik).to(tl.int64)
    if (e < 0) | (e >= E):
        return   # a dropped slot: its act/z rows are never read
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = offs_k < H - k0
        x = tl.load(x_ptr + (k0 + offs_k) * stride_xh, mask=k_mask, other=0.0).to(tl.float32)
        m = n_mask[:, None] & k_mask[None, :]
        wg = tl.load(g_ptrs, mask=m, other=0.0)
        wu = tl.load(u_ptrs, mask=m, other=0.0)
        acc_g += wg.to(tl.float32) * x[None, :]
        acc_u += wu.to(tl.float32) * x[None, :]
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + k * stride_am + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_mask)
    if SAVE_Z:
        z_row = z_ptr + k * stride_z
        tl.store(z_row + offs_n, g.to(z_ptr.dtype.element_ty), mask=n_mask)
        tl.store(z_row + I + offs_n, u.to(z_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_slot(acc, act_ptr, w_ptr, weights_ptr, ids_ptr, k, offs_n, n_mask, I, E,
               stride_am, stride_we, stride_wn, stride_wk, stride_tw_k, stride_ik,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.load(ids_ptr + k * stride_ik).to(tl.int64)
    valid = (e >= 0) & (e < E)
    e = tl.where(valid, e, 0)
    tw = tl.load(weights_ptr + k * stride_tw_k).to(tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
    a_ptrs = act_ptr + k * stride_am + offs_k
    part = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    lim = tl.where(valid, I, 0)   # a dropped slot loads nothing
    for k0 in range(0, I, BLOCK_K):
        k_mask = offs_k < lim - k0
        a = tl.load(a_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        part += w.to(tl.float32) * a[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    return acc + tl.where(valid, tw, 0.0) * tl.sum(part, axis=1)


@triton.jit
def gemv_down_combine_kernel(
    act_ptr, w_ptr, weights_ptr, ids_ptr, out_ptr, H, I, E,
    stride_am, stride_we, stride_wn, stride_wk, stride_tw_k, stride_ik, stride_oh,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    acc = tl.zeros((BLOCK_N,), tl.float32)
    if TOP_K <= 32:   # unrolled: the K slots' loads can be in flight together
        for k in tl.static_range(TOP_K):
            acc = _down_slot(acc, act_ptr, w_ptr, weights_ptr, ids_ptr, k, offs_n, n_mask, I, E,
                             stride_am, stride_we, stride_wn, stride_wk, stride_tw_k, stride_ik,
                             BLOCK_N, BLOCK_K)
    else:
        for k in range(TOP_K):
            acc = _down_slot(acc, act_ptr, w_ptr, weights_ptr, ids_ptr, k, offs_n, n_mask, I, E,
                             stride_am, stride_we, stride_wn, stride_wk, stride_tw_k, stride_ik,
                             BLOCK_N, BLOCK_K)
    tl.store(out_ptr + offs_n * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=n_mask)

"""Backward of the expert computation over the forward's aligned rows.

For a row (slot t*K+k with expert e and routing weight s), z = [g | u] = W13_e x_t,
a = silu(g) * u, out_t += s * W2_e a:
  dA = dO_t W2_e                         (the gradient reaching s*a, [I])
  ds = <dA, a>,  da = s * dA
  dg = da * u * sig(g) * (1 + g (1 - sig(g))),  du = da * silu(g)
  dW2_e  = sum_rows dO_t^T (s a)          dW13_e = sum_rows dz^T x_t
  dx_t   = sum_k dz_tk W13_e
hidden and grad_out are first gathered into aligned-row order (gather_rows_kernel, zero padding
  rows), so no GEMM below indexes rows through the slot table inside its reduction loop.
dA: the forward's row GEMM (down_kernel) on the gathered dO and W2_e, float32 per slot (the
  input dtype with BackwardConfig.da_half, opt-in).
swiglu_grad_kernel: from dA and z (saved by the forward, or recomputed by the forward's gate+up
  kernel) writes dz (gate and up halves) and s*a per row and ds per slot. (A fused version, the
  dA tile and the elementwise part in one kernel, reached 37% of its floor on Mixtral and was
  2.1 ms slower per layer there: docs/design.md.)
Weight gradients: weight_grad_kernel, one program per (expert, output tile), walking that
  expert's padded rows in order: float32 accumulation, no atomics, bitwise reproducible;
  weight_grad_persistent_kernel (the 16-bit default on the GPU) makes the same sums with one
  program per SM walking the output tiles.
dx: the forward's down_kernel shape of work (dz @ W13_e per row, per slot) then combine_kernel.
"""
import triton
import triton.language as tl

from moe_ops.kernels.expert_gemm import tanh_f32


@triton.jit
def swiglu_grad_kernel(
    da_ptr, z_ptr, weights_ptr, sorted_ptr, num_rows_ptr, dz_ptr, sa_ptr, dweights_ptr,
    n_slots, I, top_k, stride_da, stride_z, stride_tw_t, stride_tw_k, stride_dz, stride_sa,
    stride_dw_t, stride_dw_k,
    BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """The elementwise half of the split activation gradient, per aligned row (slot s of expert
    e): from dA[slot] = dO_t W2_e (the dA GEMM: float32, or the input dtype, read as float32)
    and z[slot] = [g | u] it writes
    dz[row] = [dg | du], sa[row] = s*a (zeros on padding rows) and d topk_weights[slot] =
    <dA, a>, summed over I in a fixed order (deterministic, no atomics)."""
    pid = tl.program_id(0)
    num_rows = tl.load(num_rows_ptr)
    if pid * BLOCK_R >= num_rows:
        return
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < num_rows
    slots = tl.load(sorted_ptr + rows, mask=in_range, other=n_slots)
    valid = in_range & (slots < n_slots)
    slots64 = slots.to(tl.int64)
    rows64 = rows.to(tl.int64)
    s = tl.load(weights_ptr + (slots64 // top_k) * stride_tw_t + (slots64 % top_k) * stride_tw_k,
                mask=valid, other=0.0).to(tl.float32)
    ds = tl.zeros((BLOCK_R,), tl.float32)
    for i0 in range(0, I, BLOCK_I):
        offs = i0 + tl.arange(0, BLOCK_I)
        i_mask = offs < I
        m = valid[:, None] & i_mask[None, :]
        dA = tl.load(da_ptr + slots64[:, None] * stride_da + offs[None, :], mask=m,
                     other=0.0).to(tl.float32)
        z_ptrs = z_ptr + slots64[:, None] * stride_z + offs[None, :]
        g = tl.load(z_ptrs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(z_ptrs + I, mask=m, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        silu = g * sig
        act = silu * u
        ds += tl.sum(dA * act, axis=1)
        da = dA * s[:, None]
        # padding rows: dA, g, u and s are 0, so every value stored below is 0
        m_store = in_range[:, None] & i_mask[None, :]
        dz_ptrs = dz_ptr + rows64[:, None] * stride_dz + offs[None, :]
        tl.store(dz_ptrs, (da * u * sig * (1.0 + g * (1.0 - sig))).to(dz_ptr.dtype.element_ty),
                 mask=m_store)
        tl.store(dz_ptrs + I, (da * silu).to(dz_ptr.dtype.element_ty), mask=m_store)
        tl.store(sa_ptr + rows64[:, None] * stride_sa + offs[None, :],
                 (act * s[:, None]).to(sa_ptr.dtype.element_ty), mask=m_store)
    tl.store(dweights_ptr + (slots64 // top_k) * stride_dw_t + (slots64 % top_k) * stride_dw_k,
             ds.to(dweights_ptr.dtype.element_ty), mask=valid)


@triton.jit
def gather_rows_kernel(src_ptr, sorted_ptr, num_rows_ptr, dst_ptr, n_slots, top_k, H,
                       stride_s, stride_sh, stride_d,
                       BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, weights_ptr=None,
                       stride_tw_t=0, stride_tw_k=0, SCALED: tl.constexpr = False):
    """dst[row] = src[slot // top_k] for the aligned rows below num_rows; zeros for padding.
    SCALED: times the slot's routing weight (weights_on_input: the experts' input s x)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    num_rows = tl.load(num_rows_ptr)
    if tl.program_id(0) * BLOCK_R >= num_rows:
        return
    in_range = rows < num_rows
    slots = tl.load(sorted_ptr + rows, mask=in_range, other=n_slots)
    valid = slots < n_slots
    tok = slots.to(tl.int64) // top_k
    rows64 = rows.to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < H
        v = tl.load(src_ptr + tok[:, None] * stride_s + offs_h[None, :] * stride_sh,
                    mask=valid[:, None] & h_mask[None, :], other=0.0)
        if SCALED:
            slots64 = slots.to(tl.int64)
            sc = tl.load(weights_ptr + tok * stride_tw_t + (slots64 % top_k) * stride_tw_k,
                         mask=valid, other=0.0).to(tl.float32)
            v = (v.to(tl.float32) * sc[:, None]).to(dst_ptr.dtype.element_ty)
        tl.store(dst_ptr + rows64[:, None] * stride_d + offs_h[None, :], v,
                 mask=in_range[:, None] & h_mask[None, :])


@triton.jit
def weight_grad_kernel(
    l_ptr, r_ptr, out_ptr, expert_ends_ptr, M, N, E,
    stride_lr, stride_rr, stride_oe, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TRIM: tl.constexpr = True,
):
    """out[e] = sum over expert e's aligned rows of L[row]^T R[row] ([M, N]), rows walked in
    order. L and R are in aligned-row order with zero padding rows, and BLOCK_K divides the
    alignment's block_m, so the row loop needs no masks and no indirection. The loop stops at
    the first BLOCK_K step past the expert's valid rows (valid ends sit E entries after the
    padded ends): the padding rows it skips are zeros, so the sum is bitwise the same. TRIM=False
    walks every padded row."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    e = pid // (n_m * n_n)
    pid_m = (pid % (n_m * n_n)) // n_n
    pid_n = pid % n_n
    row_start = tl.load(expert_ends_ptr + e - 1, mask=e > 0, other=0)
    if TRIM:
        valid_end = tl.load(expert_ends_ptr + E + e)
        row_end = row_start + tl.cdiv(valid_end - row_start, BLOCK_K) * BLOCK_K
    else:   # every padded row (the pre-trim loop, kept for A/B timing)
        row_end = tl.load(expert_ends_ptr + e)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    l_ptrs = l_ptr + (row_start + offs_k).to(tl.int64)[None, :] * stride_lr + offs_m[:, None]
    r_ptrs = r_ptr + (row_start + offs_k).to(tl.int64)[:, None] * stride_rr + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(row_start, row_end, BLOCK_K):
        lt = tl.load(l_ptrs, mask=m_mask[:, None], other=0.0)      # [BLOCK_M, BLOCK_K]
        r = tl.load(r_ptrs, mask=n_mask[None, :], other=0.0)       # [BLOCK_K, BLOCK_N]
        acc = tl.dot(lt.to(r.dtype), r, acc, input_precision=DOT_PRECISION)
        l_ptrs += BLOCK_K * stride_lr
        r_ptrs += BLOCK_K * stride_rr
    tl.store(out_ptr + e.to(tl.int64) * stride_oe + offs_m[:, None].to(tl.int64) * stride_om
             + offs_n[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _column_halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """x[:, :COLS // 2], x[:, COLS // 2:]"""
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, COLS // 2)), (0, 2, 1)))


@triton.jit
def _store_slice(o_desc, x, e, m0, n0, ROWS: tl.constexpr, COLS: tl.constexpr):
    o_desc.store([e, m0, n0], tl.reshape(x.to(o_desc.dtype), (1, ROWS, COLS)))


@triton.jit
def _expert_span(expert_ends_ptr, e, E, mask):
    """First row and valid end of experts `e` (from the [2, E] ends buffer: row ends, then
    valid-row ends); 0 and 0 where `mask` is off."""
    start = tl.load(expert_ends_ptr + e - 1, mask=mask & (e > 0), other=0)
    valid_end = tl.load(expert_ends_ptr + E + e, mask=mask, other=0)
    return start, valid_end


@triton.jit
def _expert_rows(expert_ends_ptr, e, E):
    """Valid rows of experts `e`; -1 for lanes past E."""
    start, valid_end = _expert_span(expert_ends_ptr, e, E, e < E)
    return tl.where(e < E, valid_end - start, -1)


@triton.jit
def _expert_order(expert_ends_ptr, order_row, E, BLOCK_E: tl.constexpr,
                  SORT: tl.constexpr = True, MIN_SKEW: tl.constexpr = 2):
    """If the routing is skewed (the largest expert's valid rows > MIN_SKEW x the mean):
    order_row[r] = the expert of rank r by valid rows, largest first, ties by expert index
    (lanes past E rank last); else (or SORT=False, for measurements) the identity. Then a
    barrier: the program's own loads of order_row follow. Returns whether it was skewed."""
    FB: tl.constexpr = 32 if BLOCK_E > 32 else BLOCK_E
    ex = tl.arange(0, BLOCK_E)
    rows_e = _expert_rows(expert_ends_ptr, ex, E)
    total = tl.sum(tl.maximum(rows_e, 0).to(tl.int64), axis=0)
    skewed = tl.max(rows_e, axis=0).to(tl.int64) * E > MIN_SKEW * total
    rank = ex
    if SORT:
        if skewed:   # a runtime branch: near-uniform routing skips the ranking
            rank = tl.zeros((BLOCK_E,), tl.int32)
            for f0 in range(0, BLOCK_E, FB):
                f = f0 + tl.arange(0, FB)
                rows_f = _expert_rows(expert_ends_ptr, f, E)
                before = (rows_f[None, :] > rows_e[:, None]) | (
                    (rows_f[None, :] == rows_e[:, None]) & (f[None, :] < ex[:, None]))
                rank += tl.sum(before.to(tl.int32), axis=1)
    tl.store(order_row + rank, ex)
    tl.debug_barrier()
    return skewed


@triton.jit
def weight_grad_persistent_kernel(
    l_desc, r_desc, o_desc, expert_ends_ptr, M, N, E, n_rows,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr, SPLIT: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, order_ptr=None, LPT: tl.constexpr = False,
    BLOCK_E: tl.constexpr = 1, LPT_SORT: tl.constexpr = True, LPT_SNAKE: tl.constexpr = True,
    LPT_MIN_SKEW: tl.constexpr = 2,
):
    """weight_grad_kernel's sums (the same rows in the same order, the same tile shape, so the
    same float32 sums) with NUM_PROGRAMS programs, each walking output tiles pid,
    pid + NUM_PROGRAMS, ... (order: expert, output row block, column block) in a flat loop of
    BLOCK_K-row steps, so the software pipeliner overlaps a tile's last products, its epilogue and
    its tensor-memory store with the loads of the next tile, which a program per tile cannot do:
    weight gradients have few reduction steps per tile (4-8 at T = 8192) and a large output.
    L ([rows, M]), R ([rows, N]) and out ([E, M, N]) come through tensor descriptors (blocks
    [BLOCK_K, BLOCK_M], [BLOCK_K, BLOCK_N], [1, BLOCK_M, BLOCK_N // SPLIT]: edges zero-filled on
    load, clipped on store).
    Bookkeeping stays out of the product loop: a program takes its tiles CHUNK at a time (CHUNK
    <= 32, a power of two); each tile's expert, output block, first row and step count (BLOCK_K
    steps up to the first past the expert's valid rows, at least one) are computed once per
    chunk into [CHUNK] int32 vectors (the divisions and expert-end loads there), and each step
    reads its tile's fields with one in-warp reduction apiece: every warp holds the whole vector,
    so there is no shared-memory round trip or barrier per step (a lookup over one lane per
    expert, [E] wide, took four barriers and two integer divisions per step: docs/design.md
    ). A global load inside the loop would stop Triton from pipelining it. The pipeline
    refills once per chunk. An expert without rows takes its one step at row n_rows, past the end
    of L and R, where the copies read zeros, and stores a zero tile. SPLIT (1, 2 or 4): the tile
    is stored in SPLIT column slices through one staging buffer of 1/SPLIT of its size (room for
    another pipeline stage).
    LPT (longest processing time first; BLOCK_E >= E, a power of two): a tile's cost is its
    expert's step count, so under skewed routing the fixed assignment above gives some programs
    several tiles of hot experts and others none. With LPT the tiles are ordered by their
    expert's row count, largest first (ties by expert index), and dealt in rounds of
    NUM_PROGRAMS, snaking (program p takes position p of even rounds and NUM_PROGRAMS-1-p of odd
    ones), so every program's total is near the mean. Each program ranks the experts itself
    (an [BLOCK_E, 32] compare per 32 experts) and keeps the order in its row of `order_ptr`
    ([NUM_PROGRAMS, BLOCK_E] int32 scratch). The ranking and the snake apply only when the
    routing is skewed (the largest expert has more than LPT_MIN_SKEW times the mean rows, a
    runtime test in every program): on near-uniform routing the snaking deal cost 3-9% on the
    H200 for no balance to gain (docs/design.md), so there the order is the
    experts' own and the deal the fixed one, and the ranking and the per-chunk order load are
    skipped by runtime branches (with both, the path cost ~1.5% of the backward there).
    Each tile is still summed whole by one program in row order: the gradients are bitwise the
    same either way."""
    pid = tl.program_id(0)
    n_n = tl.cdiv(N, BLOCK_N)
    per_e = tl.cdiv(M, BLOCK_M) * n_n
    total = E * per_e
    my_tiles = tl.cdiv(total - pid, NUM_PROGRAMS)   # the fixed deal: tiles pid + r*NUM_PROGRAMS
    if LPT:
        order_row = order_ptr + pid * BLOCK_E
        skewed = _expert_order(expert_ends_ptr, order_row, E, BLOCK_E, LPT_SORT, LPT_MIN_SKEW)
        # skewed: every program visits each round (a snaked position may be past the end)
        my_tiles = tl.where(skewed, tl.cdiv(total, NUM_PROGRAMS), my_tiles)
    lanes = tl.arange(0, CHUNK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for c0 in range(0, my_tiles, CHUNK):
        rnd = c0 + lanes
        t = rnd * NUM_PROGRAMS + pid
        if LPT and LPT_SNAKE:   # odd rounds in reverse where skewed
            t = tl.where(skewed & (rnd % 2 == 1), t + NUM_PROGRAMS - 1 - 2 * pid, t)
        valid = t < total
        pos = tl.where(valid, t // per_e, 0)   # the expert's place in the order
        e_v = pos                              # (the experts' own order)
        if LPT:
            if skewed:   # else no dependent load before the expert ends'
                e_v = tl.load(order_row + pos, mask=valid, other=0)
        rem = t - pos * per_e
        mn_v = ((rem // n_n) << 16) | (rem % n_n)
        start, valid_end = _expert_span(expert_ends_ptr, e_v, E, valid)
        steps_v = tl.where(valid, tl.maximum(tl.cdiv(valid_end - start, BLOCK_K), 1), 0)
        # an expert without rows takes its one step at row n_rows, past the end: zeros
        first_v = tl.where(valid_end > start, start, n_rows)
        j = 0
        step = 0
        for _ in range(tl.sum(steps_v)):
            here = lanes == j
            e = tl.sum(tl.where(here, e_v, 0))
            mn = tl.sum(tl.where(here, mn_v, 0))
            row = tl.sum(tl.where(here, first_v, 0)) + step * BLOCK_K
            last = step + 1 == tl.sum(tl.where(here, steps_v, 0))
            m0 = (mn >> 16) * BLOCK_M
            n0 = (mn & 0xFFFF) * BLOCK_N
            lt = l_desc.load([row, m0])          # [BLOCK_K, BLOCK_M]
            r = r_desc.load([row, n0])           # [BLOCK_K, BLOCK_N]
            acc = tl.dot(tl.trans(lt), r, acc, input_precision=DOT_PRECISION)
            if last:
                # zeroed after the store (not before the product): keeps a product in flight
                if SPLIT == 2:
                    a0, a1 = _column_halves(acc, BLOCK_M, BLOCK_N)
                    _store_slice(o_desc, a0, e, m0, n0, BLOCK_M, BLOCK_N // 2)
                    _store_slice(o_desc, a1, e, m0, n0 + BLOCK_N // 2, BLOCK_M, BLOCK_N // 2)
                elif SPLIT == 4:
                    a0, a1 = _column_halves(acc, BLOCK_M, BLOCK_N)
                    b0, b1 = _column_halves(a0, BLOCK_M, BLOCK_N // 2)
                    b2, b3 = _column_halves(a1, BLOCK_M, BLOCK_N // 2)
                    _store_slice(o_desc, b0, e, m0, n0, BLOCK_M, BLOCK_N // 4)
                    _store_slice(o_desc, b1, e, m0, n0 + BLOCK_N // 4, BLOCK_M, BLOCK_N // 4)
                    _store_slice(o_desc, b2, e, m0, n0 + BLOCK_N // 2, BLOCK_M, BLOCK_N // 4)
                    _store_slice(o_desc, b3, e, m0, n0 + 3 * (BLOCK_N // 4), BLOCK_M,
                                 BLOCK_N // 4)
                else:
                    _store_slice(o_desc, acc, e, m0, n0, BLOCK_M, BLOCK_N)
                acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            j = tl.where(last, j + 1, j)
            step = tl.where(last, 0, step + 1)


@triton.jit
def activate_grad(g, u, ACT: tl.constexpr, alpha, limit):
    """(a, da/dg, da/du) of expert_gemm.activate, in float32. Clamps pass the gradient inside
    the closed interval (torch.clamp's convention); relu's derivative at 0 is 0."""
    if ACT == 0:
        sig = 1.0 / (1.0 + tl.exp(-g))
        f = g * sig
        df = sig * (1.0 + g * (1.0 - sig))
        a = f * u
        dadg = u * df
        dadu = f
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        f = g * cdf
        df = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
        a = f * u
        dadg = u * df
        dadu = f
    elif ACT == 2:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
        f = 0.5 * g * (1.0 + t)
        df = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (
            1.0 + 0.134145 * g * g)
        a = f * u
        dadg = u * df
        dadu = f
    elif ACT == 3:
        f = tl.maximum(g, 0.0)
        a = f * u
        dadg = tl.where(g > 0.0, u, 0.0)
        dadu = f
    elif ACT == 5:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        sig = 1.0 / (1.0 + tl.exp(-gc))
        f = gc * sig
        a = f * uc
        dadg = tl.where(g <= limit, uc * sig * (1.0 + gc * (1.0 - sig)), 0.0)
        dadu = tl.where((u >= -limit) & (u <= limit), f, 0.0)
    elif ACT == 6:
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        sig = 1.0 / (1.0 + tl.exp(-g))
        f = g * sig
        fc = tl.minimum(f, limit)
        a = fc * uc
        dadg = tl.where(f <= limit, uc * sig * (1.0 + g * (1.0 - sig)), 0.0)
        dadu = tl.where((u >= -limit) & (u <= limit), fc, 0.0)
    elif ACT == 7:
        tg = tanh_f32(g / alpha)
        tu = tanh_f32(u / limit)
        sig = 1.0 / (1.0 + tl.exp(-g))
        gf = alpha * tg * sig
        uc = limit * tu
        a = gf * uc
        dadg = uc * ((1.0 - tg * tg) * sig + alpha * tg * sig * (1.0 - sig))
        dadu = gf * (1.0 - tu * tu)
    else:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        sg = 1.0 / (1.0 + tl.exp(-alpha * gc))
        glu = gc * sg
        a = (uc + 1.0) * glu
        dadg = tl.where(g <= limit, (uc + 1.0) * (sg + alpha * gc * sg * (1.0 - sg)), 0.0)
        dadu = tl.where((u >= -limit) & (u <= limit), glu, 0.0)
    return a, dadg, dadu


@triton.jit
def act_grad_kernel(
    da_ptr, z_ptr, weights_ptr, sorted_ptr, num_rows_ptr, block_expert_ptr, dz_ptr, sa_ptr,
    dweights_ptr, b13_ptr, b2_ptr, gos_ptr,
    n_slots, I, H, top_k, stride_da, stride_z, stride_tw_t, stride_tw_k, stride_dz, stride_sa,
    stride_dw_t, stride_dw_k, stride_b13e, stride_b13n, stride_b2e, stride_b2n, stride_gos,
    alpha, limit,
    BLOCK_M: tl.constexpr, ACT: tl.constexpr, HAS_B13: tl.constexpr, HAS_B2: tl.constexpr,
    WEIGHTS_ON_INPUT: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """swiglu_grad_kernel for every variant of moe.dispatch. Per aligned row (slot with expert e,
    weight s): z = W13_e x (raw, w13's row order: gate column c_g and up column c_u of i are i
    and I + i, or 2i and 2i + 1 when INTERLEAVED), h = (s z if WEIGHTS_ON_INPUT else z) + b13_e,
    a = act(h_g, h_u). Writes dz[row] = dh (w13's row order), sa[row] = s*a (a with
    WEIGHTS_ON_INPUT, whose output is not weighted) and d s per slot:
      weights on the output: ds = <dA, a> + <dO, b2_e>, da = s dA
      weights on the input:  ds = <dh, z>,              da = dA
    (dO: grad_out gathered in row order, read only for the w2 bias term). Padding rows get zeros
    (their loads are masked to 0 and every activation maps (0, 0) to 0 with finite slopes)."""
    pid = tl.program_id(0)
    num_rows = tl.load(num_rows_ptr)
    if pid * BLOCK_R >= num_rows:
        return
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < num_rows
    slots = tl.load(sorted_ptr + rows, mask=in_range, other=n_slots)
    valid = in_range & (slots < n_slots)
    slots64 = slots.to(tl.int64)
    rows64 = rows.to(tl.int64)
    e = tl.load(block_expert_ptr + rows // BLOCK_M, mask=in_range, other=0).to(tl.int64)
    s = tl.load(weights_ptr + (slots64 // top_k) * stride_tw_t + (slots64 % top_k) * stride_tw_k,
                mask=valid, other=0.0).to(tl.float32)
    ds = tl.zeros((BLOCK_R,), tl.float32)
    for i0 in range(0, I, BLOCK_I):
        offs = i0 + tl.arange(0, BLOCK_I)
        i_mask = offs < I
        m = valid[:, None] & i_mask[None, :]
        dA = tl.load(da_ptr + slots64[:, None] * stride_da + offs[None, :], mask=m,
                     other=0.0).to(tl.float32)
        if INTERLEAVED:
            g_col = 2 * offs
            u_col = g_col + 1
        else:
            g_col = offs
            u_col = offs + I
        z_row = z_ptr + slots64[:, None] * stride_z
        zg = tl.load(z_row + g_col[None, :], mask=m, other=0.0).to(tl.float32)
        zu = tl.load(z_row + u_col[None, :], mask=m, other=0.0).to(tl.float32)
        if WEIGHTS_ON_INPUT:
            g = zg * s[:, None]
            u = zu * s[:, None]
        else:
            g = zg
            u = zu
        if HAS_B13:
            b_row = b13_ptr + e[:, None] * stride_b13e
            g += tl.load(b_row + g_col[None, :] * stride_b13n, mask=m, other=0.0).to(tl.float32)
            u += tl.load(b_row + u_col[None, :] * stride_b13n, mask=m, other=0.0).to(tl.float32)
        act, dadg, dadu = activate_grad(g, u, ACT, alpha, limit)
        if WEIGHTS_ON_INPUT:
            da = dA
            sa = act
        else:
            ds += tl.sum(dA * act, axis=1)
            da = dA * s[:, None]
            sa = act * s[:, None]
        dg = da * dadg
        du = da * dadu
        if WEIGHTS_ON_INPUT:
            ds += tl.sum(dg * zg + du * zu, axis=1)
        m_store = in_range[:, None] & i_mask[None, :]
        dz_row = dz_ptr + rows64[:, None] * stride_dz
        tl.store(dz_row + g_col[None, :], dg.to(dz_ptr.dtype.element_ty), mask=m_store)
        tl.store(dz_row + u_col[None, :], du.to(dz_ptr.dtype.element_ty), mask=m_store)
        tl.store(sa_ptr + rows64[:, None] * stride_sa + offs[None, :],
                 sa.to(sa_ptr.dtype.element_ty), mask=m_store)
    if HAS_B2 and not WEIGHTS_ON_INPUT:
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mh = valid[:, None] & (offs_h < H)[None, :]
            dO = tl.load(gos_ptr + rows64[:, None] * stride_gos + offs_h[None, :], mask=mh,
                         other=0.0).to(tl.float32)
            b2 = tl.load(b2_ptr + e[:, None] * stride_b2e + offs_h[None, :] * stride_b2n, mask=mh,
                         other=0.0).to(tl.float32)
            ds += tl.sum(dO * b2, axis=1)
    tl.store(dweights_ptr + (slots64 // top_k) * stride_dw_t + (slots64 % top_k) * stride_dw_k,
             ds.to(dweights_ptr.dtype.element_ty), mask=valid)


@triton.jit
def expert_colsum_kernel(
    src_ptr, out_ptr, expert_ends_ptr, sorted_ptr, weights_ptr, n_slots, top_k, N, E,
    stride_src, stride_oe, stride_on, stride_tw_t, stride_tw_k,
    SCALED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[e, n] = sum over expert e's valid aligned rows of (s_row *) src[row, n] (the bias
    gradients: d b13_e = sum dz, d b2_e = sum s dO), rows in order in float32: deterministic, no
    atomics. One program per (expert, column block); SCALED: s_row is the row's routing weight."""
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < N
    start = tl.load(expert_ends_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(expert_ends_ptr + E + e)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        r_mask = rows < end
        v = tl.load(src_ptr + rows.to(tl.int64)[:, None] * stride_src + cols[None, :],
                    mask=r_mask[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        if SCALED:
            slots = tl.load(sorted_ptr + rows, mask=r_mask, other=n_slots).to(tl.int64)
            ok = r_mask & (slots < n_slots)
            sc = tl.load(weights_ptr + (slots // top_k) * stride_tw_t + (slots % top_k) * stride_tw_k,
                         mask=ok, other=0.0).to(tl.float32)
            v = v * sc[:, None]
        acc += tl.sum(v, axis=0)
    tl.store(out_ptr + e.to(tl.int64) * stride_oe + cols * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=c_mask)

"""Expert GEMMs over the aligned rows.

gate_up_kernel: act[row] = silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T), gathering token rows
  through sorted_slots (no permuted copy of hidden); SwiGLU in float32 registers. With SAVE_Z
  (training) it also stores the pre-activation z[slot] = [g | u] for the backward.
down_kernel: y[slot] = topk_weight[slot] * (act[row] @ w2[e].T), written per slot (also the
  backward's dx rows, dz[row] @ w13[e], with HAS_WEIGHTS=False).
down_combine_one_token_kernel: T == 1 with direct rows: the down GEMM and the combine in one launch
  (slot k's partial product in accumulator row k, the weighted sum over rows in the epilogue).
combine_kernel: out[t] = sum over k in order 0..K-1 of y[t*K + k] for valid ids: deterministic,
  no atomics.
zero_dropped_z_kernel: the training forward's z rows of slots without an expert (ids < 0 or
  >= E), which gate_up never writes, set to zero.
Row blocks at or past the device-side num_rows exit at once (the grid is sized from shapes).
USE_PDL (programmatic dependent launch, launched with launch_pdl=True): the kernel may start while
its predecessor is finishing; it waits for it (gdc_wait) before its first memory access and lets
its own successor start launching once its main loop is done (gdc_launch_dependents).
HALF_TAIL (BLOCK_M 128): a row block whose second half is all padding (the tail block of an
expert: valid rows come first) runs a BLOCK_M/2-row tile, halving the tensor-core work of the
blocks that hold an expert's last few rows."""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moe_ops.kernels.alignment import load_ids


@triton.jit
def grouped_tile(pid, n_row_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, N tile) of program `pid` in grouped order: GROUP_M row blocks walk the N tiles
    together, so their weight tiles and gathered rows are reused from L2."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(n_row_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def gate_up_tile(x_ptr, w_ptr, tok, row_valid, e, pid_n, H, I,
                 stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, w_desc=None, USE_TMA: tl.constexpr = False,
                 TMA_PAIR: tl.constexpr = False, INTERLEAVED: tl.constexpr = False,
                 TMA_TRANS: tl.constexpr = False, w3_ptr=None, stride_w3e=0, stride_w3n=0,
                 stride_w3k=0, HAS_W3: tl.constexpr = False, SAME_W3: tl.constexpr = False):
    """(gate, up) pre-activations [BLOCK_M, BLOCK_N] of the rows of tokens `tok` for expert `e`
    and columns pid_n*BLOCK_N.. of I, accumulated in float32 over H. Pointer path: one
    [BLOCK_K, 2*BLOCK_N] weight tile per step, gate columns n0..n0+BN then the matching up columns
    I+n0..: a single N=2*BLOCK_N product (wgmma's widest shape) instead of two. TMA path
    (USE_TMA, `w_desc` a [E, 2I, H] descriptor with block [1, BLOCK_N, BLOCK_K]): the gate and up
    tiles come by tensor-memory copies, no address arithmetic or masks (out-of-range rows and
    columns are zero-filled, or belong to columns >= I that the caller never stores), two
    products. TMA pair path (USE_TMA and TMA_PAIR, `w_desc` a [E, 2, I, H] view with block
    [1, 2, BLOCK_N, BLOCK_K]): gate and up tiles in one copy (each zero-filled past I) and one
    N=2*BLOCK_N product, as on the pointer path. INTERLEAVED: gate row of column n is 2n and its
    up row 2n+1 (the pointer path, or the pair path over a [E, 2, I, H] view with strides
    [E, 1, 2, H]-rows; never the two-copy TMA path). TMA transposed path (USE_TMA and TMA_TRANS:
    w13 a transposed view of [E, H, 2I] storage, gpt-oss's checkpoint layout): `w_desc` is over
    that storage, block [1, BLOCK_K, 2*BLOCK_N] at columns 2*n0 (INTERLEAVED: gate and up
    columns alternate) or a [E, H, 2, I] view with block [1, BLOCK_K, 2, BLOCK_N] (gate-first):
    one [BLOCK_K, 2*BLOCK_N] tile and one product per step, zero-filled past H and 2I.
    HAS_W3 (pointer loads only; the launcher takes no descriptor then): the gate rows n come
    from `w_ptr` (w13 [E, I, H]) and the up rows n from `w3_ptr` ([E, I, H]), each with its own
    strides: two [BLOCK_K, BLOCK_N] tiles and two products per step. SAME_W3 (with HAS_W3: w3 is
    w13, the same view; ungated ReLU-squared experts as relu(h) * h): one tile and one product
    per step, and up = gate."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh
    # One branch per path (compile-time): code after a `return` under a constexpr `if` is
    # still compiled, so the 3-offset TMA loads must not follow the 4-D pair descriptor.
    if USE_TMA and TMA_TRANS:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), tl.float32)
        n0 = pid_n * BLOCK_N
        e32 = e.to(tl.int32)
        for k0 in range(0, H, BLOCK_K):
            k_mask = offs_k < H - k0
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0)
            if INTERLEAVED:
                b = tl.reshape(w_desc.load([e32, k0, 2 * n0]), (BLOCK_K, 2 * BLOCK_N))
            else:
                b = tl.reshape(w_desc.load([e32, k0, 0, n0]), (BLOCK_K, 2 * BLOCK_N))
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_xh
        if INTERLEAVED:
            acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        else:
            acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)),
                                               (0, 2, 1)))
    elif USE_TMA and TMA_PAIR:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), tl.float32)
        n0 = pid_n * BLOCK_N
        e32 = e.to(tl.int32)
        for k0 in range(0, H, BLOCK_K):
            k_mask = offs_k < H - k0
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0)
            gu = tl.reshape(w_desc.load([e32, 0, n0, k0]), (2 * BLOCK_N, BLOCK_K))
            acc = tl.dot(a, tl.trans(gu), acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_xh
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    elif HAS_W3:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        rows_n = offs_n[None, :].to(tl.int64)
        g_ptrs = w_ptr + e * stride_we + rows_n * stride_wn + offs_k[:, None] * stride_wk
        u_ptrs = w3_ptr + e * stride_w3e + rows_n * stride_w3n + offs_k[:, None] * stride_w3k
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_mask = offs_k < H - k0
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0)
            b_mask = k_mask[:, None] & n_mask[None, :]
            g_w = tl.load(g_ptrs, mask=b_mask, other=0.0)
            acc_g = tl.dot(a, g_w, acc_g, input_precision=DOT_PRECISION)
            if not SAME_W3:
                u_w = tl.load(u_ptrs, mask=b_mask, other=0.0)
                acc_u = tl.dot(a, u_w, acc_u, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_xh
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_w3k
        if SAME_W3:
            acc_u = acc_g
    elif USE_TMA:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        n0 = pid_n * BLOCK_N
        e32 = e.to(tl.int32)
        for k0 in range(0, H, BLOCK_K):
            k_mask = offs_k < H - k0
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0)
            g_w = tl.reshape(w_desc.load([e32, n0, k0]), (BLOCK_N, BLOCK_K))
            u_w = tl.reshape(w_desc.load([e32, I + n0, k0]), (BLOCK_N, BLOCK_K))
            acc_g = tl.dot(a, tl.trans(g_w), acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, tl.trans(u_w), acc_u, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_xh
    else:
        cols = tl.arange(0, 2 * BLOCK_N)
        is_up = cols >= BLOCK_N
        if INTERLEAVED:
            w_rows = 2 * (pid_n * BLOCK_N + tl.where(is_up, cols - BLOCK_N, cols)) + is_up.to(tl.int32)
        else:
            w_rows = pid_n * BLOCK_N + tl.where(is_up, cols - BLOCK_N + I, cols)
        w_mask = (pid_n * BLOCK_N + tl.where(is_up, cols - BLOCK_N, cols)) < I
        w_ptrs = (w_ptr + e * stride_we + w_rows[None, :].to(tl.int64) * stride_wn
                  + offs_k[:, None] * stride_wk)
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_mask = offs_k < H - k0
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None] & w_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_xh
            w_ptrs += BLOCK_K * stride_wk
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    return acc_g, acc_u


ACT_SILU, ACT_GELU, ACT_GELU_TANH, ACT_RELU, ACT_SWIGLU_OAI = 0, 1, 2, 3, 4
ACT_SILU_CLAMP, ACT_SILU_CLAMP_OUT, ACT_SWIGLU_SOFTCAP = 5, 6, 7
ACT_CODES = {"silu": ACT_SILU, "gelu": ACT_GELU, "gelu_tanh": ACT_GELU_TANH, "relu": ACT_RELU,
             "swiglu_oai": ACT_SWIGLU_OAI, "silu_clamp": ACT_SILU_CLAMP,
             "silu_clamp_out": ACT_SILU_CLAMP_OUT, "swiglu_softcap": ACT_SWIGLU_SOFTCAP}


@triton.jit
def tanh_f32(x):
    """tanh(x) in float32 to a few ulp: 2 sigmoid(2x) - 1 where |x| >= 0.25 (exact at the ends:
    exp overflows to inf, giving -1), the odd Taylor series to x^9 below, where the sigmoid
    form loses relative precision as x -> 0 (~1e-7 / |x|: 9e-4 at swiglu_softcap's outputs
    for hidden of scale 1e-3); the series' truncation error is below 1e-8 relative there."""
    x2 = x * x
    series = x + x * x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203)))
    return tl.where(tl.abs(x) < 0.25, series, 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0)


@triton.jit
def activate(g, u, ACT: tl.constexpr, alpha, limit):
    """a = act(g, u) in float32 (docs/contract.md): SwiGLU, GeGLU (erf or tanh), ReGLU,
    gpt-oss's clamped (u + 1) * g * sigmoid(alpha * g), or SwiGLU with the gate clamped before
    (silu_clamp) or after (silu_clamp_out) the SiLU and the up projection to [-limit, limit], or
    Inkling2's softcapped SwiGLU (alpha * tanh(g / alpha) * sigmoid(g) * limit * tanh(u / limit)).
    tanh by tanh_f32."""
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g)) * u
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476)) * u
    elif ACT == 2:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 / (1.0 + tl.exp(-2.0 * inner))) * u
    elif ACT == 3:
        a = tl.maximum(g, 0.0) * u
    elif ACT == 5:
        gc = tl.minimum(g, limit)
        a = gc / (1.0 + tl.exp(-gc)) * tl.minimum(tl.maximum(u, -limit), limit)
    elif ACT == 6:
        a = tl.minimum(g / (1.0 + tl.exp(-g)), limit) * tl.minimum(tl.maximum(u, -limit), limit)
    elif ACT == 7:
        tg = tanh_f32(g / alpha)
        tu = tanh_f32(u / limit)
        a = alpha * tg / (1.0 + tl.exp(-g)) * (limit * tu)
    else:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        a = (uc + 1.0) * gc / (1.0 + tl.exp(-alpha * gc))
    return a


@triton.jit
def gate_up_epilogue(acc_g, acc_u, e, slots, row_valid, offs_n, n_mask, I, top_k,
                     b_ptr, stride_be, stride_bn, tw_ptr, stride_tw_t, stride_tw_k,
                     HAS_BIAS: tl.constexpr, WEIGHTS_ON_INPUT: tl.constexpr,
                     INTERLEAVED: tl.constexpr, ACT: tl.constexpr, alpha, limit):
    """act = activate(s * [g | u] + b13_e) from the raw products (s: the slot's routing weight
    with WEIGHTS_ON_INPUT, since W13 (s x) = s (W13 x); applied before the bias)."""
    if WEIGHTS_ON_INPUT:
        slots64 = slots.to(tl.int64)
        tw = tl.load(tw_ptr + (slots64 // top_k) * stride_tw_t + (slots64 % top_k) * stride_tw_k,
                     mask=row_valid, other=0.0).to(tl.float32)
        acc_g = acc_g * tw[:, None]
        acc_u = acc_u * tw[:, None]
    if HAS_BIAS:
        if INTERLEAVED:
            g_col = 2 * offs_n
            u_col = g_col + 1
        else:
            g_col = offs_n
            u_col = offs_n + I
        b_row = b_ptr + e * stride_be
        acc_g += tl.load(b_row + g_col * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_row + u_col * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    return activate(acc_g, acc_u, ACT, alpha, limit)


@triton.jit
def row_block(pid_m, sorted_ptr, block_expert_ptr, n_slots, ids_ptr, stride_ik, n_experts,
              BLOCK_M: tl.constexpr, DIRECT: tl.constexpr, TILE_M: tl.constexpr):
    """(expert, rows, slots, row_valid) of the first TILE_M rows of row block pid_m. Aligned
    rows: the alignment's block expert and slot table (padding slots hold n_slots). DIRECT
    (T == 1, no alignment launch): block k is slot k alone, its expert topk_ids[0, k]; a dropped
    id gives no valid row (and expert 0's weights as harmless in-bounds operands)."""
    rows = pid_m * BLOCK_M + tl.arange(0, TILE_M)
    if DIRECT:
        e = tl.load(ids_ptr + pid_m * stride_ik).to(tl.int64)
        ok = (e >= 0) & (e < n_experts)
        slots = tl.where((tl.arange(0, TILE_M) == 0) & ok, pid_m, n_slots)
        e = tl.where(ok, e, 0)
    else:
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        slots = tl.load(sorted_ptr + rows)
    return e, rows, slots, slots < n_slots


@triton.jit
def half_tail(sorted_ptr, pid_m, n_slots, BLOCK_M: tl.constexpr):
    """Whether row block pid_m's valid rows all fit its first half: padding rows come last in an
    expert's range, so row BLOCK_M/2 holding the padding sentinel says so."""
    return tl.load(sorted_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= n_slots


@triton.jit
def gate_up_kernel(
    x_ptr, w_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr,
    n_slots, H, I, top_k,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_am,
    n_row_blocks, N, z_ptr, stride_z,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SAVE_Z: tl.constexpr = False, w_desc=None,
    USE_TMA: tl.constexpr = False, ids_ptr=None, stride_ik=0, n_experts=0,
    DIRECT: tl.constexpr = False, USE_PDL: tl.constexpr = False, TMA_PAIR: tl.constexpr = False,
    HALF_TAIL: tl.constexpr = False, counters_ptr=None, n_counters=0,
    BLOCK_C: tl.constexpr = 0, b_ptr=None, stride_be=0, stride_bn=0, tw_ptr=None, stride_tw_t=0,
    stride_tw_k=0, HAS_BIAS: tl.constexpr = False, WEIGHTS_ON_INPUT: tl.constexpr = False,
    INTERLEAVED: tl.constexpr = False, ACT: tl.constexpr = 0, alpha=1.702, limit=7.0,
    TMA_TRANS: tl.constexpr = False, w3_ptr=None, stride_w3e=0, stride_w3n=0, stride_w3k=0,
    HAS_W3: tl.constexpr = False, SAME_W3: tl.constexpr = False,
):
    """act[row] = activate(s * z + b13_e) with z = W13_e x (the variant arguments: HAS_BIAS,
    WEIGHTS_ON_INPUT, INTERLEAVED, ACT with alpha and limit; the defaults are SwiGLU on
    gate-first rows; HAS_W3: the up rows from w3_ptr, SAME_W3: w3 is w13, gate_up_tile). SAVE_Z stores z itself
    (raw, in w13's row order; with HAS_W3 [gate | up])."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), n_row_blocks, N, BLOCK_N, GROUP_M)
    if USE_PDL:
        gdc_wait()
    if BLOCK_C > 0:   # the down kernel's combine counters (T == 1), zeroed after the wait
        if tl.program_id(0) == 0:
            offs_c = tl.arange(0, BLOCK_C)
            tl.store(counters_ptr + offs_c, tl.zeros((BLOCK_C,), tl.int32), mask=offs_c < n_counters)
    if not DIRECT:
        num_rows = tl.load(num_rows_ptr)
        if pid_m * BLOCK_M >= num_rows:
            return
    # half: False unless HALF_TAIL (then a runtime flag: two tile heights). The local is a
    # runtime value either way, so the half-height branch is compiled (dead) without HALF_TAIL
    # too: harmless here; down_kernel, whose half branch needs a descriptor, tests in one if.
    half = False
    if HALF_TAIL and not DIRECT:
        half = half_tail(sorted_ptr, pid_m, n_slots, BLOCK_M)
    if half:
        gate_up_block(x_ptr, w_ptr, act_ptr, sorted_ptr, block_expert_ptr, pid_m, pid_n,
                      n_slots, H, I, top_k, stride_xt, stride_xh, stride_we, stride_wn,
                      stride_wk, stride_am, z_ptr, stride_z, BLOCK_M, BLOCK_N, BLOCK_K,
                      DOT_PRECISION, SAVE_Z, w_desc, USE_TMA, ids_ptr, stride_ik, n_experts,
                      DIRECT, USE_PDL, TMA_PAIR, BLOCK_M // 2, b_ptr, stride_be, stride_bn,
                      tw_ptr, stride_tw_t, stride_tw_k, HAS_BIAS, WEIGHTS_ON_INPUT, INTERLEAVED,
                      ACT, alpha, limit, TMA_TRANS, w3_ptr, stride_w3e, stride_w3n, stride_w3k,
                      HAS_W3, SAME_W3)
    else:
        gate_up_block(x_ptr, w_ptr, act_ptr, sorted_ptr, block_expert_ptr, pid_m, pid_n,
                      n_slots, H, I, top_k, stride_xt, stride_xh, stride_we, stride_wn,
                      stride_wk, stride_am, z_ptr, stride_z, BLOCK_M, BLOCK_N, BLOCK_K,
                      DOT_PRECISION, SAVE_Z, w_desc, USE_TMA, ids_ptr, stride_ik, n_experts,
                      DIRECT, USE_PDL, TMA_PAIR, BLOCK_M, b_ptr, stride_be, stride_bn,
                      tw_ptr, stride_tw_t, stride_tw_k, HAS_BIAS, WEIGHTS_ON_INPUT, INTERLEAVED,
                      ACT, alpha, limit, TMA_TRANS, w3_ptr, stride_w3e, stride_w3n, stride_w3k,
                      HAS_W3, SAME_W3)


@triton.jit
def gate_up_block(x_ptr, w_ptr, act_ptr, sorted_ptr, block_expert_ptr, pid_m, pid_n,
                  n_slots, H, I, top_k, stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
                  stride_am, z_ptr, stride_z, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, SAVE_Z: tl.constexpr,
                  w_desc, USE_TMA: tl.constexpr, ids_ptr, stride_ik, n_experts,
                  DIRECT: tl.constexpr, PDL_LATE: tl.constexpr, TMA_PAIR: tl.constexpr,
                  TILE_M: tl.constexpr, b_ptr, stride_be, stride_bn, tw_ptr, stride_tw_t,
                  stride_tw_k, HAS_BIAS: tl.constexpr, WEIGHTS_ON_INPUT: tl.constexpr,
                  INTERLEAVED: tl.constexpr, ACT: tl.constexpr, alpha, limit,
                  TMA_TRANS: tl.constexpr, w3_ptr, stride_w3e, stride_w3n, stride_w3k,
                  HAS_W3: tl.constexpr, SAME_W3: tl.constexpr = False):
    """gate_up_kernel's work on the first TILE_M rows of row block pid_m."""
    e, rows, slots, row_valid = row_block(pid_m, sorted_ptr, block_expert_ptr, n_slots, ids_ptr,
                                          stride_ik, n_experts, BLOCK_M, DIRECT, TILE_M)
    tok = tl.where(row_valid, slots // top_k, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    acc_g, acc_u = gate_up_tile(x_ptr, w_ptr, tok, row_valid, e, pid_n, H, I,
                                stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
                                TILE_M, BLOCK_N, BLOCK_K, DOT_PRECISION, w_desc, USE_TMA,
                                TMA_PAIR, INTERLEAVED, TMA_TRANS, w3_ptr, stride_w3e,
                                stride_w3n, stride_w3k, HAS_W3, SAME_W3)
    if PDL_LATE:
        gdc_launch_dependents()
    rows64 = rows.to(tl.int64)
    m2 = row_valid[:, None] & n_mask[None, :]
    if SAVE_Z:   # training: keep z = W13_e x per slot (in the input dtype) for the backward
        if INTERLEAVED:
            z_ptrs = z_ptr + slots.to(tl.int64)[:, None] * stride_z + 2 * offs_n[None, :]
            tl.store(z_ptrs, acc_g.to(z_ptr.dtype.element_ty), mask=m2)
            tl.store(z_ptrs + 1, acc_u.to(z_ptr.dtype.element_ty), mask=m2)
        else:
            z_ptrs = z_ptr + slots.to(tl.int64)[:, None] * stride_z + offs_n[None, :]
            tl.store(z_ptrs, acc_g.to(z_ptr.dtype.element_ty), mask=m2)
            tl.store(z_ptrs + I, acc_u.to(z_ptr.dtype.element_ty), mask=m2)
    act = gate_up_epilogue(acc_g, acc_u, e, slots, row_valid, offs_n, n_mask, I, top_k, b_ptr,
                           stride_be, stride_bn, tw_ptr, stride_tw_t, stride_tw_k, HAS_BIAS,
                           WEIGHTS_ON_INPUT, INTERLEAVED, ACT, alpha, limit)
    tl.store(act_ptr + rows64[:, None] * stride_am + offs_n[None, :],
             act.to(act_ptr.dtype.element_ty), mask=m2)


@triton.jit
def down_kernel(
    act_ptr, w_ptr, y_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr,
    n_slots, H, I, top_k,
    stride_am, stride_we, stride_wn, stride_wk, stride_tw_t, stride_tw_k, stride_ym,
    n_row_blocks, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_WEIGHTS: tl.constexpr = True, w_desc=None,
    TMA_LAYOUT: tl.constexpr = 0, ids_ptr=None, stride_ik=0, n_experts=0,
    DIRECT: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    HALF_TAIL: tl.constexpr = False, counters_ptr=None, out_ptr=None, stride_oh=0,
    COMBINE_K: tl.constexpr = 0, FENCE: tl.constexpr = False, a_desc=None, a_desc_half=None,
    A_TMA: tl.constexpr = False, b_ptr=None, stride_be=0, stride_bn=0,
    HAS_BIAS: tl.constexpr = False, w3_ptr=None, stride_w3e=0, stride_w3n=0, stride_w3k=0,
    K3=0, A3_OFF=0, HAS_W3: tl.constexpr = False,
):
    """TMA_LAYOUT 0: pointer loads of W_e. 1: `w_desc` over a [E, N, K] weight (K contiguous,
    block [1, BLOCK_N, BLOCK_K]; the forward's w2). 2: `w_desc` over a [E, K, N] weight (N
    contiguous, block [1, BLOCK_K, BLOCK_N]; w2 for dA, w13 for dx).
    A_TMA: the A rows (contiguous in aligned-row order) come through `a_desc` ([rows, K]
    storage, block [BLOCK_M, BLOCK_K]; `a_desc_half` with BLOCK_M // 2 rows for half-height
    tails) instead of masked pointer loads. Unmasked: padding rows may hold anything, but a
    product's output row depends on its own A row alone and those rows are never stored;
    columns past K and rows past the end read zeros.
    COMBINE_K = K > 0 (T == 1 with direct rows): the combine happens here. Each of the K
    programs of an H tile stores its slot's row, then counts itself in counters[pid_n] (zeroed by
    this call's gate_up kernel); the one that counts last sums the K rows in order 0..K-1 in
    float32 into out, exactly as combine_kernel does (bitwise the same result, whichever program
    is last).
    HAS_BIAS: y[slot] = (weight *) (a W_e^T + b[e]): the bias (w2_bias [E, N]) before the
    routing weight.
    HAS_W3 (pointer loads; the backward's dx with a separate up projection): after the I
    columns of A against W_e, A's K3 columns from A3_OFF on are multiplied by W3_e
    (W3_e[n, k] = w3_ptr[e*stride_w3e + n*stride_w3n + k*stride_w3k]) into the same
    accumulator: dx = dz_gate W13_e + dz_up W3_e in one float32 sum."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), n_row_blocks, N, BLOCK_N, GROUP_M)
    if USE_PDL:
        gdc_wait()
    if not DIRECT:
        num_rows = tl.load(num_rows_ptr)
        if pid_m * BLOCK_M >= num_rows:
            return
    # (a local `half = False` would be a runtime value whose branch is compiled too, with
    # a_desc_half None: the half-height tile is only compiled under HALF_TAIL)
    if HALF_TAIL and not DIRECT and half_tail(sorted_ptr, pid_m, n_slots, BLOCK_M):
        down_block(act_ptr, w_ptr, y_ptr, weights_ptr, sorted_ptr, block_expert_ptr, pid_m,
                   pid_n, n_slots, H, I, top_k, stride_am, stride_we, stride_wn, stride_wk,
                   stride_tw_t, stride_tw_k, stride_ym, BLOCK_M, BLOCK_N, BLOCK_K,
                   DOT_PRECISION, HAS_WEIGHTS, w_desc, TMA_LAYOUT, ids_ptr, stride_ik,
                   n_experts, DIRECT, USE_PDL, BLOCK_M // 2, a_desc_half, A_TMA, b_ptr,
                   stride_be, stride_bn, HAS_BIAS, w3_ptr, stride_w3e, stride_w3n, stride_w3k,
                   K3, A3_OFF, HAS_W3)
    else:
        down_block(act_ptr, w_ptr, y_ptr, weights_ptr, sorted_ptr, block_expert_ptr, pid_m,
                   pid_n, n_slots, H, I, top_k, stride_am, stride_we, stride_wn, stride_wk,
                   stride_tw_t, stride_tw_k, stride_ym, BLOCK_M, BLOCK_N, BLOCK_K,
                   DOT_PRECISION, HAS_WEIGHTS, w_desc, TMA_LAYOUT, ids_ptr, stride_ik,
                   n_experts, DIRECT, USE_PDL, BLOCK_M, a_desc, A_TMA, b_ptr, stride_be,
                   stride_bn, HAS_BIAS, w3_ptr, stride_w3e, stride_w3n, stride_w3k, K3, A3_OFF,
                   HAS_W3)
    if COMBINE_K > 0:
        combine_last(y_ptr, ids_ptr, counters_ptr, out_ptr, pid_n, H, n_experts, stride_ik,
                     stride_ym, stride_oh, BLOCK_N, COMBINE_K, FENCE)


@triton.jit
def combine_last(y_ptr, ids_ptr, counters_ptr, out_ptr, pid_n, H, n_experts, stride_ik, stride_ym,
                 stride_oh, BLOCK_N: tl.constexpr, TOP_K: tl.constexpr, FENCE: tl.constexpr):
    """The single token's combine for H tile pid_n, done by the last of its TOP_K down programs.
    Every thread fences its row stores at GPU scope (FENCE: compiled code; the interpreter runs
    programs one after another), the barrier orders them before the count (one acq_rel atomic at
    GPU scope), and the last program reads the rows through L2 (.cg), never a stale L1 line."""
    if FENCE:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r,r",
                                  [tl.full((1,), 0, tl.int32)], dtype=tl.int32, is_pure=False,
                                  pack=1)
    tl.debug_barrier()
    seen = tl.atomic_add(counters_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if seen == TOP_K - 1:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for k in tl.static_range(TOP_K):
            e = tl.load(ids_ptr + k * stride_ik + offs_n * 0)   # slot k's id, per column
            valid = n_mask & (e >= 0) & (e < n_experts)
            y = tl.load(y_ptr + k * stride_ym + offs_n, mask=valid, other=0.0,
                        cache_modifier=".cg")
            acc += y.to(tl.float32)
        tl.store(out_ptr + offs_n * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def down_block(act_ptr, w_ptr, y_ptr, weights_ptr, sorted_ptr, block_expert_ptr, pid_m, pid_n,
               n_slots, H, I, top_k, stride_am, stride_we, stride_wn, stride_wk, stride_tw_t,
               stride_tw_k, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
               w_desc, TMA_LAYOUT: tl.constexpr, ids_ptr, stride_ik, n_experts,
               DIRECT: tl.constexpr, PDL_LATE: tl.constexpr, TILE_M: tl.constexpr,
               a_desc, A_TMA: tl.constexpr, b_ptr, stride_be, stride_bn,
               HAS_BIAS: tl.constexpr, w3_ptr=None, stride_w3e=0, stride_w3n=0, stride_w3k=0,
               K3=0, A3_OFF=0, HAS_W3: tl.constexpr = False):
    """down_kernel's work on the first TILE_M rows of row block pid_m (A_TMA: A tiles through
    `a_desc`, whose block is [TILE_M, BLOCK_K])."""
    e, rows, slots, row_valid = row_block(pid_m, sorted_ptr, block_expert_ptr, n_slots, ids_ptr,
                                          stride_ik, n_experts, BLOCK_M, DIRECT, TILE_M)
    rows64 = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows64[:, None] * stride_am + offs_k[None, :]
    b_ptrs = (w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
              + offs_k[:, None] * stride_wk)
    acc = tl.zeros((TILE_M, BLOCK_N), tl.float32)
    n0 = pid_n * BLOCK_N
    e32 = e.to(tl.int32)
    for k0 in range(0, I, BLOCK_K):
        k_mask = offs_k < I - k0
        if A_TMA:
            a = a_desc.load([pid_m * BLOCK_M, k0])
        else:
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0)
        if TMA_LAYOUT == 1:
            b = tl.trans(tl.reshape(w_desc.load([e32, n0, k0]), (BLOCK_N, BLOCK_K)))
        elif TMA_LAYOUT == 2:
            b = tl.reshape(w_desc.load([e32, k0, n0]), (BLOCK_K, BLOCK_N))
        else:
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wk
    if HAS_W3:
        a3_ptrs = act_ptr + rows64[:, None] * stride_am + A3_OFF + offs_k[None, :]
        b3_ptrs = (w3_ptr + e * stride_w3e + offs_n[None, :].to(tl.int64) * stride_w3n
                   + offs_k[:, None] * stride_w3k)
        for k0 in range(0, K3, BLOCK_K):
            k_mask = offs_k < K3 - k0
            a = tl.load(a3_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b3_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a3_ptrs += BLOCK_K
            b3_ptrs += BLOCK_K * stride_w3k
    if PDL_LATE:
        gdc_launch_dependents()
    slots64 = slots.to(tl.int64)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * stride_be + offs_n * stride_bn, mask=n_mask,
                       other=0.0).to(tl.float32)[None, :]
    if HAS_WEIGHTS:
        tw = tl.load(weights_ptr + (slots64 // top_k) * stride_tw_t + (slots64 % top_k) * stride_tw_k,
                     mask=row_valid, other=0.0).to(tl.float32)
        acc = acc * tw[:, None]
    tl.store(y_ptr + slots64[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=row_valid[:, None] & n_mask[None, :])


@triton.jit
def _combine_slot(acc, y_ptr, ids_ptr, toks, t_mask, offs_h, h_mask, k, E, stride_it, stride_ik,
                  stride_ym, TOP_K: tl.constexpr):
    ids = tl.load(ids_ptr + toks * stride_it + k * stride_ik, mask=t_mask, other=-1)
    valid = t_mask & (ids >= 0) & (ids < E)
    y = tl.load(y_ptr + (toks * TOP_K + k)[:, None] * stride_ym + offs_h[None, :],
                mask=valid[:, None] & h_mask[None, :], other=0.0)
    return acc + y.to(tl.float32)


@triton.jit
def zero_dropped_z_kernel(
    z_ptr, ids_ptr, n_slots, n_cols, E, stride_z, stride_it, stride_ik,
    TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """z[slot] = 0 for the slots whose id is < 0 or >= E: gate_up writes z only for slots with
    an expert, so without this those rows of moe.dispatch_train's z would be whatever the
    allocator left there (the reference has zeros; the backward never reads them). A block of
    slots without such an id returns after loading its ids."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    in_range = rows < n_slots
    ids = tl.load(ids_ptr + (rows // TOP_K) * stride_it + (rows % TOP_K) * stride_ik,
                  mask=in_range, other=0)
    dropped = in_range & ((ids < 0) | (ids >= E))
    if tl.sum(dropped.to(tl.int32), axis=0) > 0:
        zero = tl.zeros((BLOCK_R, BLOCK_C), dtype=z_ptr.dtype.element_ty)
        for c0 in range(0, n_cols, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            tl.store(z_ptr + rows[:, None] * stride_z + cols[None, :], zero,
                     mask=dropped[:, None] & (cols < n_cols)[None, :])


@triton.jit
def combine_kernel(
    y_ptr, ids_ptr, out_ptr, T, H, E,
    stride_it, stride_ik, stride_ym, stride_ot, stride_oh,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """out[t] = sum over k = 0..TOP_K-1, in that order, of y[t*TOP_K + k] for valid ids. Up to
    K = 32 the k loop is unrolled (TOP_K is a compile-time constant) so that the K independent
    id and row loads are in flight together: a runtime loop issued them one dependent pair at a
    time, 2*K memory latencies per program (14 us at T=8 with K=8). Larger K keeps a runtime loop (an unrolled body per k would make a slow compile)."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    toks = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    t_mask = toks < T
    h_mask = offs_h < H
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    if USE_PDL:
        gdc_wait()
    if TOP_K <= 32:
        for k in tl.static_range(TOP_K):
            acc = _combine_slot(acc, y_ptr, ids_ptr, toks, t_mask, offs_h, h_mask, k, E,
                                stride_it, stride_ik, stride_ym, TOP_K)
    else:
        for k in range(TOP_K):
            acc = _combine_slot(acc, y_ptr, ids_ptr, toks, t_mask, offs_h, h_mask, k, E,
                                stride_it, stride_ik, stride_ym, TOP_K)
    tl.store(out_ptr + toks[:, None] * stride_ot + offs_h[None, :] * stride_oh,
             acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & h_mask[None, :])


@triton.jit
def down_combine_one_token_kernel(
    act_ptr, w_ptr, weights_ptr, ids_ptr, out_ptr, H, I, E,
    stride_am, stride_we, stride_wn, stride_wk, stride_tw_k, stride_ik, stride_oh,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, w_desc=None, USE_TMA: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, b_ptr=None, stride_be=0, stride_bn=0,
    HAS_BIAS: tl.constexpr = False, WEIGHTS_ON_INPUT: tl.constexpr = False,
):
    """out[0, n-tile] = sum over k in order of topk_weight[k] * act[k*BLOCK_M] @ w2[e_k, n-tile].T
    (HAS_BIAS: + w2_bias[e_k] before the weight; WEIGHTS_ON_INPUT: no weight here, the gate_up
    kernel applied it to the input)
    (T == 1, direct rows: slot k's activation row is row block k's first row). The slots with a
    valid id (0 <= id < E) are compacted first, in order: the c-th of them is accumulator row c.
    One loop over (valid slot, I step) pairs, so it is software-pipelined across slots: step
    (c, k0) multiplies an A tile whose only nonzero row is c (that slot's activation) by its
    expert's weight tile, so accumulator row c collects that slot's product alone. The expert
    and activation row come from register vectors (no dependent load inside the loop). TOP_K <=
    BLOCK_M. Dropped ids contribute nothing and their weights are never read: every tile the
    loop multiplies (by zeros in all rows but one) belongs to an expert the token uses, so an
    unused expert's non-finite weights cannot reach the output as 0 * inf; with no valid id the
    output row is zeros."""
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    rows = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    if USE_PDL:
        gdc_wait()
    ids, valid = load_ids(ids_ptr + rows * stride_ik, rows < TOP_K, E)
    # compaction: slot[c] = the row of the c-th valid slot, ids_c[c] its expert
    rank = tl.cumsum(valid.to(tl.int32), axis=0) - 1
    pick = (rank[None, :] == rows[:, None]) & valid[None, :]       # [c, row]
    slot = tl.sum(tl.where(pick, rows[None, :], 0), axis=1)
    ids_c = tl.sum(tl.where(pick, ids[None, :], 0), axis=1)
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    n_k = tl.cdiv(I, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    a_rows = act_ptr + (slot * BLOCK_M).to(tl.int64)[:, None] * stride_am
    for j in range(0, n_valid * n_k):
        k = j // n_k
        k0 = (j - k * n_k) * BLOCK_K
        e = tl.sum(tl.where(rows == k, ids_c, 0))
        row_on = rows == k
        k_mask = offs_k < I - k0
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=row_on[:, None] & k_mask[None, :],
                    other=0.0)
        if USE_TMA:
            b = tl.trans(tl.reshape(w_desc.load([e, n0, k0]), (BLOCK_N, BLOCK_K)))
        else:
            b_ptrs = (w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
                      + (k0 + offs_k)[:, None] * stride_wk)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    on = rows < n_valid
    if HAS_BIAS:
        acc += tl.load(b_ptr + ids_c.to(tl.int64)[:, None] * stride_be + offs_n[None, :] * stride_bn,
                       mask=on[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    if WEIGHTS_ON_INPUT:
        tw = tl.where(on, 1.0, 0.0)
    else:
        tw = tl.load(weights_ptr + slot * stride_tw_k, mask=on, other=0.0).to(tl.float32)
    y = tl.sum(acc * tw[:, None], axis=0)
    tl.store(out_ptr + offs_n * stride_oh, y.to(out_ptr.dtype.element_ty), mask=n_mask)

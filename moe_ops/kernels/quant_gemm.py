"""Expert GEMMs over the aligned rows with quantized weights (issue 42).

WFMT 1, FP8 block-scaled: w [E, N, K] float8_e4m3fn with a float32 scale per [bn, bk] block
(s [E, ceil(N/bn), ceil(K/bk)]); BLOCK_K == bk, so every K step reads one scale per weight row.
  QUANT_A (W8A8): the A tile is quantized in registers per row over its bk columns
  (q = e4m3(a * 448 / amax), scale amax / 448), the product is an fp8 tl.dot in float32 and
  each K step's partial product is scaled and added in float32 (promotion per K block, as
  DeepGEMM does: Hopper's FP8 MMA accumulates with fewer bits than float32). The down GEMM's
  A (the activation) is quantized the same way in the gate+up kernel's epilogue, from float32,
  once (its tile width is bk): the down kernel reads e4m3 act and its scales [rows, I/bk].
  Without QUANT_A (W8A16): the fp8 tile is converted exactly to A's dtype, the product is a
  16-bit dot, scaled by the weight scale per K step.
WFMT 2, MXFP4: w [E, N, K//2] uint8, two e2m1 values per byte (low nibble first), uint8 e8m0
scale per 32 values (s [E, N, K//32]); the tile is decoded in registers to A's dtype (exact for
bf16) and multiplied with a 16-bit dot accumulating in float32.
WFMT 3, MXFP4 through tl.dot_scaled (bf16/fp16 A): the packed bytes and scales go to Triton's
scaled dot as they are (on Hopper it upcasts to bf16 MMAs itself, after the pipelined copies of
the packed bytes); launch.quant.has_dot_scaled() decides whether this Triton has it.

quant_gate_up_kernel: act[row] = activation(gate, up) of W13_e x (+ bias), rows gathered
through the slot table, the gate/up rows split (first/second half, or even/odd rows when
INTERLEAVED). quant_down_kernel: y[slot] = (w *) (W2_e act[row] + bias), per slot; the
deterministic combine (expert_gemm.combine_kernel) sums the slots.

EMULATE (Triton's interpreter, CPU): its fp8 casts round wrongly (measured: ~15% of random
float32 values differ from torch's .to(float8_e4m3fn), mantissa carries lost, no saturation)
and its fp8 and bf16 dots are unreliable, so there the fp8 weights come as their uint8 bits
and are decoded by arithmetic, activations are rounded to e4m3 by integer arithmetic and every
dot runs in float32 on the same values."""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moe_ops.kernels.expert_gemm import activate, grouped_tile, row_block

FP8_MAX = tl.constexpr(448.0)
ACT_AMAX_FLOOR = tl.constexpr(1e-30)   # moe_ops.reference.quant.ACT_AMAX_FLOOR


@triton.jit
def e4m3_round(x):
    """float32 -> float32 holding the nearest float8_e4m3fn value (ties to even, saturating at
    +-448 like cvt.rn.satfinite), by integer arithmetic (the interpreter's fp8 cast is wrong)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    ax = tl.abs(x)
    mag = ax.to(tl.int32, bitcast=True)
    # normal range: keep 3 mantissa bits, half to even; the carry may reach the exponent
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # subnormal range (|x| < 2^-6): multiples of 2^-9, rounded by the 1.5 * 2^23 trick
    sub = ((ax * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    # (NaN stays NaN, as with the GPU cast: tl.minimum would return 448 for it by default)
    r = tl.minimum(tl.where(ax < 0.015625, sub, normal), FP8_MAX,
                   propagate_nan=tl.PropagateNan.ALL)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_decode(bits):
    """float8_e4m3fn bits (uint8) -> float32 (the interpreter's fp8 loads read 0x7F as 480)."""
    b = bits.to(tl.int32)
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    mag = tl.where((e == 15) & ((b & 7) == 7), float("nan"), mag)
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def e2m1_decode(nib):
    """e2m1 codes (int32 0..15: sign bit 3, exponent bits 2-1, mantissa bit 0) -> float32,
    built as float32 bits: 2^(e-1) * (1 + m/2) for e > 0, m/2 for e == 0."""
    e = (nib >> 1) & 3
    m = nib & 1
    mag = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    return (mag | ((nib & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_decode(s):
    """e8m0 scale bytes -> 2^(s - 127) as float32 (exponent bits; s == 0 is the subnormal
    2^-127, s == 255 gives inf as transformers' ldexp does)."""
    s32 = s.to(tl.int32)
    return tl.where(s32 == 0, 1 << 22, s32 << 23).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_bf16_factors(sc):
    """The two bf16 factors whose product scales a bit-placed e2m1 value (the code times
    2^-126) by its e8m0 byte s: the constant 2^126, which restores the code exactly, then
    2^(s - 127), whose bits are s << 7 (s == 0: the subnormal 2^-127, bits 0x40; s == 255: inf,
    as e8m0_decode). The product is the code times 2^(s - 127) rounded once, as any split of
    2^(s - 1) in two bf16 factors gives: two integer operations per scale byte."""
    s16 = sc.to(tl.int16)
    f2 = tl.maximum(s16 << 7, 0x40).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.full(f2.shape, 8.507059173023462e37, tl.bfloat16), f2


@triton.jit
def e8m0_bf16_factor(sc):
    """2^(s - 1) in bf16 for e8m0 bytes s <= 128 (exact: 2^-1 .. 2^127): the one factor that
    scales a bit-placed e2m1 value (the code times 2^-126) by 2^(s - 127), the product rounded
    once as with e8m0_bf16_factors' two (whose second is 1 for s <= 128)."""
    return ((sc.to(tl.int16) + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def scales_at_most_128(s_rows, wmask, K, stride_sk, GB: tl.constexpr):
    """Whether every e8m0 byte of the weight rows whose scales start at `s_rows` (masked by
    wmask), over the K // 32 groups of the reduction, is <= 128, so that one factor per value
    (e8m0_bf16_factor) scales exactly. One pass over the program's scale rows before its K
    loop (GB groups per load); a scalar, the same for every thread of the program."""
    offs_g = tl.arange(0, GB)
    n_groups = K // 32
    m = tl.zeros((s_rows.shape[0], GB), tl.int32)
    for g0 in range(0, n_groups, GB):
        sc = tl.load(s_rows[:, None] + (g0 + offs_g)[None, :] * stride_sk,
                     mask=wmask[:, None] & (g0 + offs_g < n_groups)[None, :], other=0)
        m = tl.maximum(m, sc.to(tl.int32))
    return tl.max(tl.max(m, axis=1), axis=0) <= 128


@triton.jit
def per_value(f, BN: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BN, BLOCK_K // 32] per-group factors broadcast to the tile's [BN, BLOCK_K] values."""
    return tl.reshape(tl.broadcast_to(f[:, :, None], (BN, BLOCK_K // 32, 32)), (BN, BLOCK_K))


@triton.jit
def mxfp4_tile_bits(p, sc, BN: tl.constexpr, BLOCK_K: tl.constexpr, OP_DTYPE: tl.constexpr):
    """[BN, BLOCK_K] bf16 values of packed e2m1 bytes p [BN, BLOCK_K // 2] (low nibble first) and
    their e8m0 scale bytes sc [BN, BLOCK_K // 32], by bit placement (GPU, bfloat16 operands):
    the code's exponent and mantissa bits placed at bf16's lowest exponent bits give the value
    times 2^-126 (code 1, 0.5, lands on the subnormal 2^-127: exact), and the multiplication by
    2^126 * 2^(s - 127) = 2^(s - 1), split in two factors that bf16 can hold
    (e8m0_bf16_factors), rounds once, as the reference's float32 product then cast does (s ==
    255: inf). Six integer operations and two multiplications per pair of values instead of the
    arithmetic decode's float32 detour."""
    p16 = p.to(tl.int16)
    # Triton promotes int16 op Python-int to int32: every value is cut back to 16 bits before
    # the bitcast (the truncation keeps the bit pattern, sign bit included)
    lo = (((p16 & 7) << 6) | ((p16 & 8) << 12)).to(tl.int16)
    hi = (((p16 & 0x70) << 2) | ((p16 & 0x80) << 8)).to(tl.int16)
    v = tl.reshape(tl.join(lo.to(tl.bfloat16, bitcast=True), hi.to(tl.bfloat16, bitcast=True)),
                   (BN, BLOCK_K // 32, 32))
    # (s == 255 scales to inf, 0 * inf = NaN, as e8m0_decode and the reference do)
    f1, f2 = e8m0_bf16_factors(sc)
    v = v * f1[:, :, None]
    v = v * f2[:, :, None]
    return tl.reshape(v, (BN, BLOCK_K)).to(OP_DTYPE)


# One packed byte (given twice, as the 16-bit pair of the joined tile) -> its two values as a
# bf16x2 register (low nibble in the low half: the k pair the MMA operand holds in one
# register), scaled by the bf16x2 factors $2 and $3: the byte is spread to a nibble per 16-bit
# half (x = b * 0x00010010: the low nibble at bits 4-7 of the low half, the high nibble at bits
# 4-7 of the high half), each nibble's exponent and mantissa bits moved to bf16's bits 6-8 and
# its sign to bit 15, then two packed multiplications.
_MXFP4_PAIR_DECODE = """{
.reg .b32 t, x, y, z;
cvt.u32.u16 t, $1;
mul.lo.u32 x, t, 65552;
shl.b32 y, x, 2;
shl.b32 z, x, 8;
and.b32 z, z, 0x80008000;
and.b32 y, y, 0x01C001C0;
or.b32 y, y, z;
"""
_MXFP4_PAIR_ASM = tl.constexpr(_MXFP4_PAIR_DECODE + """mul.rn.bf16x2 y, y, $2;
mul.rn.bf16x2 $0, y, $3;
}""")
# the same with one factor $2 (e8m0_bf16_factor)
_MXFP4_PAIR1_ASM = tl.constexpr(_MXFP4_PAIR_DECODE + """mul.rn.bf16x2 $0, y, $2;
}""")


@triton.jit
def mxfp4_tile_asm(p, sc, BN: tl.constexpr, BLOCK_K: tl.constexpr, ONE: tl.constexpr = False):
    """mxfp4_tile_bits' values and arithmetic (bf16 only), in inline PTX over bf16x2 pairs:
    one byte gives one register of the MMA operand, with packed multiplications. ONE (every
    scale byte <= 128: scales_at_most_128): one multiplication per pair by 2^(s - 1)
    (e8m0_bf16_factor) instead of two, the same products (the second factor is 1 there)."""
    p2 = tl.reshape(tl.join(p, tl.zeros_like(p)), (BN, BLOCK_K))
    if ONE:
        v = tl.inline_asm_elementwise(_MXFP4_PAIR1_ASM, "=r,h,r",
                                      [p2, per_value(e8m0_bf16_factor(sc), BN, BLOCK_K)],
                                      dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        f1, f2 = e8m0_bf16_factors(sc)
        v = tl.inline_asm_elementwise(_MXFP4_PAIR_ASM, "=r,h,r,r",
                                      [p2, per_value(f1, BN, BLOCK_K), per_value(f2, BN, BLOCK_K)],
                                      dtype=tl.bfloat16, is_pure=True, pack=2)
    return v


# Four bf16x2 registers from one 32-bit word of the mma layout (moe_ops.mxfp4_layout: eight
# codes at bf16 bit positions, times 2^-126): $0 and $1 the first two bytes' pairs, $2 and $3 the
# last two's; shifts and masks only.
_MXFP4_MMA_WORD_ASM = tl.constexpr("""{
.reg .b32 b, c, d<7>;
and.b32 $0, $4, 0x81C081C0;
shl.b32 b, $4, 3;
and.b32 $1, b, 0x81C081C0;
shl.b32 c, $4, 6;
and.b32 $2, c, 0x81C081C0;
shl.b32 d0, $4, 1;
and.b32 d1, d0, 0x80008000;
shr.b32 d2, $4, 3;
and.b32 d3, d2, 0x01800180;
or.b32 d4, d1, d3;
shr.b32 d5, $4, 7;
and.b32 d6, d5, 0x00400040;
or.b32 $3, d4, d6;
}""")

# v * f1 * f2 over bf16x2 pairs (two packed multiplications, rounded in that order)
_BF16X2_MUL2_ASM = tl.constexpr("""{
.reg .b32 t;
mul.rn.bf16x2 t, $1, $2;
mul.rn.bf16x2 $0, t, $3;
}""")


# v * f over bf16x2 pairs (one packed multiplication)
_BF16X2_MUL1_ASM = tl.constexpr("mul.rn.bf16x2 $0, $1, $2;")


@triton.jit
def _mma_words_f32(p, R: tl.constexpr, W: tl.constexpr):
    """The interpreter's form of _MXFP4_MMA_WORD_ASM: [R, 4W] bytes -> [R, 8W] float32 values of
    the codes times 2^-126, in the asm's output order."""
    b = tl.reshape(p.to(tl.uint32), (R, W, 4))
    x = tl.sum(b << (tl.arange(0, 4) * 8).to(tl.uint32)[None, None, :], axis=2)
    m = 0x81C081C0
    q0 = x & m
    q1 = (x << 3) & m
    q2 = (x << 6) & m
    q3 = ((x << 1) & 0x80008000) | ((x >> 3) & 0x01800180) | ((x >> 7) & 0x00400040)
    q = tl.permute(tl.join(tl.join(q0, q1), tl.join(q2, q3)), (0, 1, 3, 2))   # [R, W, j, i]
    lo = (q << 16).to(tl.float32, bitcast=True)
    hi = ((q >> 16) << 16).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (R, 8 * W))


@triton.jit
def mxfp4_mma_tile(p, sc, BN: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
                   ONE: tl.constexpr = False):
    """[BN, BLOCK_K] values of a weight tile in the mma layout (moe_ops.mxfp4_layout):
    p [BN // 4, 2 * BLOCK_K] its storage bytes (each row four tile rows of one 16-row group, each
    128-byte chunk 64 values), sc [BN, BLOCK_K // 32] the e8m0 bytes. ASM (GPU, bfloat16): the
    words decoded by shifts and masks in inline PTX and scaled by two packed multiplications,
    the same values and roundings as mxfp4_tile_asm; else float32 arithmetic (the interpreter).
    The reshape and permutation that restore the tile order move no data when each thread's
    loaded bytes are its MMA operand registers, which the layout is made for. ONE (ASM, every
    scale byte <= 128): one multiplication by 2^(s - 1) (e8m0_bf16_factor) instead of two, the
    same products."""
    R: tl.constexpr = BN // 4
    if ASM:
        r0, r1 = tl.inline_asm_elementwise(_MXFP4_MMA_WORD_ASM, "=r,=r,=r,=r,r", [p],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                           pack=4)
        u = tl.permute(tl.reshape(tl.join(r0, r1), (R, BLOCK_K // 2, 4, 2)), (0, 1, 3, 2))
        u = tl.reshape(u, (R, 4 * BLOCK_K))
    else:
        u = _mma_words_f32(p, R, BLOCK_K // 2) * 8.507059173023462e37   # 2^126
    # storage (a, b | c, d, e, f, g, h) -> tile rows (a, g, b, d), values (c, f, e, h)
    u = tl.reshape(u, (BN // 16, 4, BLOCK_K // 64, 2, 4, 8, 2, 2))
    v = tl.reshape(tl.permute(u, (0, 6, 1, 3, 2, 5, 4, 7)), (BN, BLOCK_K))
    if ASM:
        if ONE:
            v = tl.inline_asm_elementwise(_BF16X2_MUL1_ASM, "=r,r,r",
                                          [v, per_value(e8m0_bf16_factor(sc), BN, BLOCK_K)],
                                          dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            f1, f2 = e8m0_bf16_factors(sc)
            v = tl.inline_asm_elementwise(_BF16X2_MUL2_ASM, "=r,r,r,r",
                                          [v, per_value(f1, BN, BLOCK_K),
                                           per_value(f2, BN, BLOCK_K)],
                                          dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        v = tl.reshape(tl.reshape(v, (BN, BLOCK_K // 32, 32)) * e8m0_decode(sc)[:, :, None],
                       (BN, BLOCK_K))
    return v


@triton.jit
def quantize_rows(a, EMULATE: tl.constexpr):
    """(q, scale) of a float32 [M, BLOCK_K] tile quantized per row (one bk group): amax over
    the row (at least ACT_AMAX_FLOOR), q = e4m3(a * (448 / amax)) (fp8, or its float32 value
    under EMULATE), scale = amax / 448. Both divisions correctly rounded (div_rn), as the
    reference computes them."""
    amax = tl.maximum(tl.max(tl.abs(a), axis=1), ACT_AMAX_FLOOR)
    inv = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    x = a * inv[:, None]
    if EMULATE:
        q = e4m3_round(x)
    else:
        q = x.to(tl.float8e4nv)
    return q, scale


@triton.jit
def k_in_range(offs, rem, EVEN_K: tl.constexpr):
    """offs < rem, the K tail's mask; EVEN_K (the reduction length is a multiple of the K
    step): a constant true mask, which the compiler folds out of every load."""
    if EVEN_K:
        m = tl.full(offs.shape, 1, tl.int1)
    else:
        m = offs < rem
    return m


@triton.jit
def mxfp4_scales(s_rows, wmask, k0, K, stride_sk, BLOCK_K: tl.constexpr):
    """The e8m0 scale bytes [BN, BLOCK_K // 32] of reduction columns k0..k0+BLOCK_K of the
    weight rows whose scales start at `s_rows` (0 past K: k0 >= K gives an all-masked load, so
    the kernels prefetch the next K step's scales with it). The kernels load these one K step
    ahead: a checkpoint's scale rows (K / 32 bytes, 90 at gpt-oss's shapes) are not 4-byte
    aligned, so Triton's pipeliner cannot move this load into its asynchronous copies, and a
    load issued in the step that uses it stalls that step for the memory latency."""
    offs_g = tl.arange(0, BLOCK_K // 32)
    g_mask = offs_g < (K - k0) // 32
    return tl.load(s_rows[:, None] + (k0 // 32 + offs_g)[None, :] * stride_sk,
                   mask=wmask[:, None] & g_mask[None, :], other=0)


@triton.jit
def step_scales(s_rows, wmask, k0, K, stride_sk, BLOCK_K: tl.constexpr, WFMT: tl.constexpr,
                SCALAR_SCALE: tl.constexpr):
    """The weight scales of the K step at k0: FP8, the [bn, bk] blocks' float32 scale (a scalar
    with SCALAR_SCALE, else one per row); MXFP4, mxfp4_scales; the dot_scaled form loads its
    own (0 here). k0 may be past K (the kernels load the next step's ahead): MXFP4 gives 0s
    there, FP8 the last step's scale, both unused. With PREFETCH_SCALES the kernels load them
    a step ahead: Triton's pipeliner makes asynchronous copies of the tiles only, so a scale
    loaded in the step that uses it stalls that step for the memory latency."""
    sc = 0
    if WFMT == 1:   # (past K: the last step's scale again, unused)
        kb = tl.minimum(k0, K - 1) // BLOCK_K
        if SCALAR_SCALE:
            sc = tl.load(s_rows + kb * stride_sk)
        else:
            sc = tl.load(s_rows + kb * stride_sk, mask=wmask, other=0.0)
    elif WFMT == 2:
        sc = mxfp4_scales(s_rows, wmask, k0, K, stride_sk, BLOCK_K)
    return sc


@triton.jit
def scales_at_step(s_rows, wmask, s_prev, k0, K, stride_sk, BLOCK_K: tl.constexpr,
                   WFMT: tl.constexpr, SCALAR_SCALE: tl.constexpr,
                   PREFETCH_SCALES: tl.constexpr):
    """(the K step at k0's weight scales, the value to carry to the next step) of one weight
    path: with PREFETCH_SCALES s_prev (loaded a step earlier) and the next step's loaded now;
    else loaded now."""
    nxt = s_prev
    if PREFETCH_SCALES:
        now = s_prev
        nxt = step_scales(s_rows, wmask, k0 + BLOCK_K, K, stride_sk, BLOCK_K, WFMT, SCALAR_SCALE)
    else:
        now = step_scales(s_rows, wmask, k0, K, stride_sk, BLOCK_K, WFMT, SCALAR_SCALE)
    return now, nxt


@triton.jit
def group_scales(scale_rows, row_valid, k0, K, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr):
    """W8A8 activation scales of each row for the K step at k0 (scale_rows: each row's
    [ceil(K / BLOCK_K)] group scales): that step's, or with AHEAD the next step's (clamped to
    the last group: the last step's prefetch is unused)."""
    if AHEAD:
        group = tl.minimum(k0 + BLOCK_K, K - 1) // BLOCK_K
    else:
        group = k0 // BLOCK_K
    return tl.load(scale_rows + group, mask=row_valid, other=0.0)


@triton.jit
def weight_tile(w_rows, s_rows, wmask, k0, K, stride_wk, stride_sk, OP_DTYPE: tl.constexpr,
                WFMT: tl.constexpr, QUANT_A: tl.constexpr, EMULATE: tl.constexpr,
                BLOCK_K: tl.constexpr, SCALAR_SCALE: tl.constexpr = False,
                BIT_DECODE: tl.constexpr = False, SWAP_AB: tl.constexpr = False,
                EVEN_K: tl.constexpr = False, sc=0, MMA_LAYOUT: tl.constexpr = False,
                ONE: tl.constexpr = False):
    """(b [BLOCK_K, BLOCK_N], per-column scale [BLOCK_N] float32) of reduction columns
    k0..k0+BLOCK_K of the weight rows starting at the pointers `w_rows` (masked by wmask), whose
    scales start at `s_rows` (FP8: the row's [bn, bk] block row; MXFP4: the row's scales). FP8:
    b is the fp8 tile (QUANT_A) or its exact conversion to OP_DTYPE, the scale the block's
    (SCALAR_SCALE: every row of the tile is in one block row, `s_rows` is that row's scalar
    pointer and the scale a scalar); MXFP4: b the decoded tile in OP_DTYPE (scales applied;
    BIT_DECODE: by mxfp4_tile_bits), the column scale 1; SWAP_AB (MXFP4): b is returned as
    [BLOCK_N, BLOCK_K], the left operand of the transposed product (mma_step). `sc`
    (FP8, MXFP4): the step's weight scales, loaded by the caller (step_scales). MMA_LAYOUT
    (MXFP4, SWAP_AB, contiguous weights in moe_ops.mxfp4_layout's order): `w_rows` are the
    BN // 4 storage rows of the tile (mma_rows) and wmask theirs; decoded by mxfp4_mma_tile.
    ONE (MXFP4, inline PTX decode, every scale byte <= 128): as mxfp4_mma_tile's."""
    if WFMT == 1:
        offs_k = tl.arange(0, BLOCK_K)
        k_mask = k_in_range(offs_k, K - k0, EVEN_K)
        if SWAP_AB:   # [BN, BLOCK_K], the left operand of the transposed product
            b = tl.load(w_rows[:, None] + (k0 + offs_k)[None, :] * stride_wk,
                        mask=wmask[:, None] & k_mask[None, :], other=0.0)
        else:
            b = tl.load(w_rows[None, :] + (k0 + offs_k)[:, None] * stride_wk,
                        mask=k_mask[:, None] & wmask[None, :], other=0.0)
        scale = sc   # (step_scales)
        if EMULATE:
            b = e4m3_decode(b)
        elif not QUANT_A:
            b = b.to(OP_DTYPE)
    elif WFMT == 2 and MMA_LAYOUT:
        # [BN // 4, 2 * BLOCK_K] storage bytes (128 per 64 values) -> [BN, BLOCK_K] values
        BN4: tl.constexpr = w_rows.shape[0]
        offs_c = tl.arange(0, 2 * BLOCK_K)
        c_mask = k_in_range((offs_c // 128) * 64, K - k0, EVEN_K)
        p = tl.load(w_rows[:, None] + (2 * k0 + offs_c)[None, :],
                    mask=wmask[:, None] & c_mask[None, :], other=0)
        b = mxfp4_mma_tile(p, sc, 4 * BN4, BLOCK_K, BIT_DECODE == 2,
                           ONE).to(OP_DTYPE)
        if not SWAP_AB:
            b = tl.trans(b)
        scale = tl.full((4 * BN4,), 1.0, tl.float32)
    elif WFMT == 2:
        # [BN, BLOCK_K // 2] packed bytes -> [BN, BLOCK_K] values, low nibble first
        BN: tl.constexpr = w_rows.shape[0]
        offs_p = tl.arange(0, BLOCK_K // 2)
        p_mask = k_in_range(offs_p, (K - k0) // 2, EVEN_K)
        p = tl.load(w_rows[:, None] + (k0 // 2 + offs_p)[None, :] * stride_wk,
                    mask=wmask[:, None] & p_mask[None, :], other=0)
        if BIT_DECODE == 2:
            v = mxfp4_tile_asm(p, sc, BN, BLOCK_K, ONE)
        elif BIT_DECODE:
            v = mxfp4_tile_bits(p, sc, BN, BLOCK_K, OP_DTYPE)
        else:
            p = p.to(tl.int32)
            v = tl.reshape(tl.join(e2m1_decode(p & 15), e2m1_decode(p >> 4)), (BN, BLOCK_K))
            v = tl.reshape(tl.reshape(v, (BN, BLOCK_K // 32, 32)) * e8m0_decode(sc)[:, :, None],
                           (BN, BLOCK_K)).to(OP_DTYPE)
        if SWAP_AB:
            b = v
        else:
            b = tl.trans(v)
        scale = tl.full((BN,), 1.0, tl.float32)
    else:
        # WFMT 3 (MXFP4 through tl.dot_scaled): the packed tile as it is, [BLOCK_K // 2, BN]
        # (k pairs down, low nibble = even k), and its e8m0 bytes [BN, BLOCK_K // 32]
        offs_p = tl.arange(0, BLOCK_K // 2)
        p_mask = k_in_range(offs_p, (K - k0) // 2, EVEN_K)
        b = tl.load(w_rows[None, :] + (k0 // 2 + offs_p)[:, None] * stride_wk,
                    mask=p_mask[:, None] & wmask[None, :], other=0)
        offs_g = tl.arange(0, BLOCK_K // 32)
        g_mask = k_in_range(offs_g, (K - k0) // 32, EVEN_K)
        scale = tl.load(s_rows[:, None] + (k0 // 32 + offs_g)[None, :] * stride_sk,
                        mask=wmask[:, None] & g_mask[None, :], other=0)
    return b, scale


@triton.jit
def per_row(v, SWAP_AB: tl.constexpr):
    """A per-row vector (one value per row of the rows' tile) broadcast over mma_step's
    product: down its rows, or along its columns when the product is transposed."""
    if SWAP_AB:
        return v[None, :]
    else:
        return v[:, None]


@triton.jit
def per_col(v, SWAP_AB: tl.constexpr):
    """A per-column vector (one value per weight row) broadcast over mma_step's product."""
    if SWAP_AB:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def mma_step(acc, a, a_scale, b, b_scale, WFMT: tl.constexpr, QUANT_A: tl.constexpr,
             DOT_PRECISION: tl.constexpr, SCALAR_SCALE: tl.constexpr = False,
             SWAP_AB: tl.constexpr = False):
    """acc + this K step's product (see the module docstring for each format; SCALAR_SCALE: the
    FP8 weight scale is one scalar for the tile, so the promotion is one multiply-add per
    element; SWAP_AB: acc is the transposed [BLOCK_N, BLOCK_M] accumulator and the weight tile
    b [BLOCK_N, BLOCK_K] the left operand (MXFP4: decoded in registers, where the MMA can read
    it; FP8: the rows become the MMA's N, 16 columns at decode instead of 64 padded rows);
    per_row / per_col broadcast the scales either way). (One return: code after a return under
    a compile-time `if` is still compiled.)"""
    if WFMT == 1:
        if SWAP_AB:
            # the transposed product [BLOCK_N, BLOCK_M] (the rows are the MMA's N, so a decode
            # tile of 1..16 rows multiplies 16 columns instead of 64 rows); each element is
            # promoted by the same float32 operations in the same order either way
            part = tl.dot(b, tl.trans(a), input_precision=DOT_PRECISION, out_dtype=tl.float32)
        else:
            part = tl.dot(a, b, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        if SCALAR_SCALE:
            if QUANT_A:
                acc = acc + part * per_row(a_scale * b_scale, SWAP_AB)
            else:
                acc = acc + part * b_scale
        elif QUANT_A:
            acc = acc + part * per_row(a_scale, SWAP_AB) * per_col(b_scale, SWAP_AB)
        else:
            acc = acc + part * per_col(b_scale, SWAP_AB)
    elif WFMT == 2:
        if SWAP_AB:
            acc = tl.dot(b, tl.trans(a), acc, input_precision=DOT_PRECISION,
                         out_dtype=tl.float32)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    else:   # MXFP4 through tl.dot_scaled (b packed e2m1, b_scale its e8m0 bytes)
        if a.dtype == tl.bfloat16:
            acc = tl.dot_scaled(a, None, "bf16", b, b_scale, "e2m1", acc)
        else:
            acc = tl.dot_scaled(a, None, "fp16", b, b_scale, "e2m1", acc)
    return acc


@triton.jit
def load_a(a_ptrs, row_valid, k_mask, tw, QUANT_A: tl.constexpr, SCALE_ROWS: tl.constexpr,
           OP_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """The A operand of a K step: the rows (times their routing weight when SCALE_ROWS, in
    float32), quantized per row (QUANT_A: the fp8 tile and its row scales) or in OP_DTYPE
    (scales: ones, unused)."""
    a = tl.load(a_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0)
    if SCALE_ROWS:
        a = a.to(tl.float32) * tw[:, None]
    if QUANT_A:
        q, a_scale = quantize_rows(a.to(tl.float32), EMULATE)
    else:
        q = a.to(OP_DTYPE)
        a_scale = tl.full((q.shape[0],), 1.0, tl.float32)
    return q, a_scale


@triton.jit
def mma_rows(w_e, row0, offs_j, n_valid, stride_wn):
    """(pointers, mask) of the storage rows offs_j of the mma-layout tile whose first logical row
    is row0 (a multiple of 16; moe_ops.mxfp4_layout: storage row row0 / 4 + j holds four rows of
    the 16-row group j // 4, 4 * stride_wn bytes each); a group is valid when its first row is
    below row0 + n_valid."""
    rows = (row0 // 4 + offs_j).to(tl.int64)
    return w_e + rows * (4 * stride_wn), (offs_j // 4) * 16 < n_valid


@triton.jit
def _rows(pid_m, sorted_ptr, block_expert_ptr, n_slots, ids_ptr, stride_ik, n_experts,
          BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
    """(expert, rows, slots, row_valid) of row block pid_m (expert_gemm.row_block: the
    alignment's tables, or DIRECT at T == 1: block k is slot k, no alignment launch), offsets
    in int64."""
    e, rows, slots, row_valid = row_block(pid_m, sorted_ptr, block_expert_ptr, n_slots, ids_ptr,
                                          stride_ik, n_experts, BLOCK_M, DIRECT, BLOCK_M)
    return e, rows.to(tl.int64), slots.to(tl.int64), row_valid


@triton.jit
def gate_up_k_loop(acc_g, acc_u, a_ptrs, g_w, g_s, g_wm, g_mask, u_w, u_s, u_wm, n_mask, offs_k,
                   row_valid, tok, tw, xs_ptr, stride_xs, H, stride_xh, stride_wk, stride_sk,
                   WFMT: tl.constexpr, QUANT_A: tl.constexpr, WEIGHTS_ON_INPUT: tl.constexpr,
                   EMULATE: tl.constexpr, OP_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   BLOCK_K: tl.constexpr, A_PREQUANT: tl.constexpr, SCALAR_SCALE: tl.constexpr,
                   BIT_DECODE: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr,
                   PREFETCH_SCALES: tl.constexpr, STACK_GU: tl.constexpr,
                   MMA_LAYOUT: tl.constexpr, ONE: tl.constexpr):
    """quant_gate_up_kernel's K loop: (acc_g, acc_u) after every K step of H (acc_u unchanged
    with STACK_GU). ONE: the MXFP4 decode's one-factor form (weight_tile). The weight scales
    (and W8A8's activation scales) of each K step are loaded one step ahead with
    PREFETCH_SCALES (step_scales)."""
    sc_g = 0
    sc_u = 0
    xs = 0
    if PREFETCH_SCALES:
        sc_g = step_scales(g_s, g_mask, 0, H, stride_sk, BLOCK_K, WFMT, SCALAR_SCALE)
        if not STACK_GU:
            sc_u = step_scales(u_s, n_mask, 0, H, stride_sk, BLOCK_K, WFMT, SCALAR_SCALE)
        if A_PREQUANT:
            xs = group_scales(xs_ptr + tok * stride_xs, row_valid, 0, H, BLOCK_K, False)
    for k0 in range(0, H, BLOCK_K):
        k_mask = k_in_range(offs_k, H - k0, EVEN_K)
        sc_g_now, sc_g = scales_at_step(g_s, g_mask, sc_g, k0, H, stride_sk, BLOCK_K, WFMT,
                                        SCALAR_SCALE, PREFETCH_SCALES)
        sc_u_now = sc_u
        if not STACK_GU:
            sc_u_now, sc_u = scales_at_step(u_s, n_mask, sc_u, k0, H, stride_sk, BLOCK_K,
                                            WFMT, SCALAR_SCALE, PREFETCH_SCALES)
        if A_PREQUANT:
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0)
            if PREFETCH_SCALES:
                a_scale = xs
                xs = group_scales(xs_ptr + tok * stride_xs, row_valid, k0, H, BLOCK_K, True)
            else:
                a_scale = group_scales(xs_ptr + tok * stride_xs, row_valid, k0, H, BLOCK_K, False)
        else:
            a, a_scale = load_a(a_ptrs, row_valid, k_mask, tw, QUANT_A, WEIGHTS_ON_INPUT,
                                OP_DTYPE, EMULATE)
        bg, sg = weight_tile(g_w, g_s, g_wm, k0, H, stride_wk, stride_sk, OP_DTYPE, WFMT,
                             QUANT_A, EMULATE, BLOCK_K, SCALAR_SCALE, BIT_DECODE, SWAP_AB, EVEN_K,
                             sc_g_now, MMA_LAYOUT, ONE)
        acc_g = mma_step(acc_g, a, a_scale, bg, sg, WFMT, QUANT_A, DOT_PRECISION, SCALAR_SCALE,
                         SWAP_AB)
        if not STACK_GU:
            bu, su = weight_tile(u_w, u_s, u_wm, k0, H, stride_wk, stride_sk, OP_DTYPE, WFMT,
                                 QUANT_A, EMULATE, BLOCK_K, SCALAR_SCALE, BIT_DECODE, SWAP_AB,
                                 EVEN_K, sc_u_now, MMA_LAYOUT, ONE)
            acc_u = mma_step(acc_u, a, a_scale, bu, su, WFMT, QUANT_A, DOT_PRECISION,
                             SCALAR_SCALE, SWAP_AB)
        a_ptrs += BLOCK_K * stride_xh
    return acc_g, acc_u


@triton.jit
def quant_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, tw_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr,
    n_slots, H, I, top_k, n_row_blocks, scale_bn, alpha, limit,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_be, stride_bn, stride_tw_t, stride_tw_k, stride_am, act_scale_ptr, stride_as,
    ids_ptr, stride_ik, n_experts, xs_ptr, stride_xs,
    WFMT: tl.constexpr, QUANT_A: tl.constexpr, ACTIVATION: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHTS_ON_INPUT: tl.constexpr,
    EMULATE: tl.constexpr, OP_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DIRECT: tl.constexpr, A_PREQUANT: tl.constexpr = False, SCALAR_SCALE: tl.constexpr = False,
    BIT_DECODE: tl.constexpr = False, SWAP_AB: tl.constexpr = False,
    ACT_F32: tl.constexpr = False, EVEN_K: tl.constexpr = False,
    PREFETCH_SCALES: tl.constexpr = False, STACK_GU: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, MMA_LAYOUT: tl.constexpr = False,
    ONE_FACTOR: tl.constexpr = False,
):
    """ONE_FACTOR (MXFP4, inline PTX decode): the program reads its scale rows once before the
    K loop (scales_at_most_128) and, where every byte is <= 128, scales each decoded pair by one
    multiplication instead of two; the same values.
    MMA_LAYOUT (MXFP4 with SWAP_AB; with INTERLEAVED only stacked): w13 in
    moe_ops.mxfp4_layout's order, each tile read by storage rows (mma_rows).
    STACK_GU (MXFP4 with SWAP_AB): the tile's gate and up rows are one [2 * BLOCK_N,
    BLOCK_K] decoded tile (with gate_up_interleaved, 2 * BLOCK_N consecutive rows of w13) and
    one MMA chain per K step instead of two; the accumulator is split back into gate and up
    before the epilogue. Each output element is the same sum over the same K steps.
    A_PREQUANT (W8A8): x_ptr is hidden already quantized per token and bk columns by
    quantize_groups_kernel (e4m3, scales at xs_ptr [T, H / bk]): the same values load_a would
    compute, once per token instead of once per program. SWAP_AB (MXFP4): the products are
    computed transposed (weights x rows^T, accumulators [BLOCK_N, BLOCK_M]) and turned back
    once, before the epilogue. ACT_F32 (W8A8): act is stored unquantized in float32 and the down
    kernel quantizes it in its gather (QUANT_GATHER), so BLOCK_N need not be one bk group.
    USE_PDL (programmatic dependent launch, launched with launch_pdl=True): the program waits
    for its predecessor (gdc_wait) before its first memory access and lets its successor
    launch (gdc_launch_dependents) once its K loop is done."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), n_row_blocks, I, BLOCK_N, GROUP_M)
    if USE_PDL:
        gdc_wait()
    if not DIRECT:
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
    e, rows, slots, row_valid = _rows(pid_m, sorted_ptr, block_expert_ptr, n_slots, ids_ptr,
                                      stride_ik, n_experts, BLOCK_M, DIRECT)
    tok = tl.where(row_valid, slots // top_k, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_n64 = offs_n.to(tl.int64)
    if INTERLEAVED:
        g_rows = 2 * offs_n64
        u_rows = 2 * offs_n64 + 1
    else:
        g_rows = offs_n64
        u_rows = offs_n64 + I
    tw = tl.zeros((BLOCK_M,), tl.float32)
    if WEIGHTS_ON_INPUT:
        tw = tl.load(tw_ptr + (slots // top_k) * stride_tw_t + (slots % top_k) * stride_tw_k,
                     mask=row_valid, other=0.0).to(tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    g_w, u_w = w_e + g_rows * stride_wn, w_e + u_rows * stride_wn
    if SCALAR_SCALE:   # the tile's gate rows are in one [bn, bk] block row, its up rows too
        n0 = pid_n * BLOCK_N
        g_s, u_s = s_e + (n0 // scale_bn) * stride_sn, s_e + ((I + n0) // scale_bn) * stride_sn
    elif WFMT == 1:   # the scale row of each weight row: its [bn, bk] block's
        g_s, u_s = s_e + (g_rows // scale_bn) * stride_sn, s_e + (u_rows // scale_bn) * stride_sn
    else:
        g_s, u_s = s_e + g_rows * stride_sn, s_e + u_rows * stride_sn
    g_mask = n_mask
    if STACK_GU:   # the gate path walks the stacked tile; the up path is not used
        offs_j = tl.arange(0, 2 * BLOCK_N)
        if INTERLEAVED:
            st_rows = 2 * pid_n.to(tl.int64) * BLOCK_N + offs_j
            g_mask = pid_n * BLOCK_N + offs_j // 2 < I
        else:
            n_j = pid_n * BLOCK_N + offs_j % BLOCK_N
            st_rows = tl.where(offs_j >= BLOCK_N, n_j.to(tl.int64) + I, n_j.to(tl.int64))
            g_mask = n_j < I
        g_w = w_e + st_rows * stride_wn
        g_s = s_e + st_rows * stride_sn
        acc_g = tl.zeros((2 * BLOCK_N, BLOCK_M), tl.float32)
    elif SWAP_AB:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    g_wm = g_mask   # the weight loads' masks (the storage rows' with MMA_LAYOUT)
    u_wm = n_mask
    if MMA_LAYOUT:
        n0 = pid_n * BLOCK_N
        if STACK_GU:
            offs_q = tl.arange(0, BLOCK_N // 2)
            if INTERLEAVED:   # 2 * BLOCK_N consecutive rows
                g_w, g_wm = mma_rows(w_e, 2 * n0, offs_q, 2 * (I - n0), stride_wn)
            else:   # the gate slab's storage rows, then the up slab's
                slab0 = tl.where(offs_q >= BLOCK_N // 4, I + n0, n0)
                g_w, g_wm = mma_rows(w_e, slab0, offs_q % (BLOCK_N // 4), I - n0, stride_wn)
        else:
            offs_q = tl.arange(0, BLOCK_N // 4)
            g_w, g_wm = mma_rows(w_e, n0, offs_q, I - n0, stride_wn)
            u_w, u_wm = mma_rows(w_e, I + n0, offs_q, I - n0, stride_wn)
    if STACK_GU:
        acc_u = acc_g   # (a placeholder: the stacked loop leaves it unchanged)
    k2 = H   # the two-factor loop's K length: all of H, or none after the one-factor loop
    if ONE_FACTOR:   # the one-factor loop where every scale byte is <= 128, chosen once per
        # program; the two loops run one after the other, so their buffers share shared memory
        one = scales_at_most_128(g_s, g_mask, H, stride_sk, 32)
        if not STACK_GU:
            one = one & scales_at_most_128(u_s, n_mask, H, stride_sk, 32)
        k1 = tl.where(one, H, 0)   # its steps: all or none
        acc_g, acc_u = gate_up_k_loop(
            acc_g, acc_u, a_ptrs, g_w, g_s, g_wm, g_mask, u_w, u_s, u_wm, n_mask, offs_k,
            row_valid, tok, tw, xs_ptr, stride_xs, k1, stride_xh, stride_wk, stride_sk, WFMT,
            QUANT_A, WEIGHTS_ON_INPUT, EMULATE, OP_DTYPE, DOT_PRECISION, BLOCK_K,
            A_PREQUANT, SCALAR_SCALE, BIT_DECODE, SWAP_AB, EVEN_K, PREFETCH_SCALES,
            STACK_GU, MMA_LAYOUT, True)
        k2 = H - k1
    else:
        tl.assume(H > 0)   # (the launcher guarantees it; see gate_up_k_loop)
    acc_g, acc_u = gate_up_k_loop(
        acc_g, acc_u, a_ptrs, g_w, g_s, g_wm, g_mask, u_w, u_s, u_wm, n_mask, offs_k,
        row_valid, tok, tw, xs_ptr, stride_xs, k2, stride_xh, stride_wk, stride_sk, WFMT,
        QUANT_A, WEIGHTS_ON_INPUT, EMULATE, OP_DTYPE, DOT_PRECISION, BLOCK_K,
        A_PREQUANT, SCALAR_SCALE, BIT_DECODE, SWAP_AB, EVEN_K, PREFETCH_SCALES,
        STACK_GU, MMA_LAYOUT, False)
    if USE_PDL:
        gdc_launch_dependents()
    if STACK_GU:
        acc_t = tl.trans(acc_g)
        if INTERLEAVED:
            acc_g, acc_u = tl.split(tl.reshape(acc_t, (BLOCK_M, BLOCK_N, 2)))
        else:
            acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc_t, (BLOCK_M, 2, BLOCK_N)),
                                               (0, 2, 1)))
    elif SWAP_AB:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    if HAS_BIAS:
        b_base = bias_ptr + e * stride_be
        acc_g += tl.load(b_base + g_rows * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_base + u_rows * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    act = activate(acc_g, acc_u, ACTIVATION, alpha, limit)   # codes: ACTIVATIONS' order
    if QUANT_A and not ACT_F32:
        # the down GEMM's A, quantized here once (BLOCK_N == bk: this tile is one bk group of
        # each row), from the float32 values: e4m3 act (its float32 value under EMULATE) and
        # one scale per row and group
        act, act_scale = quantize_rows(tl.where(n_mask[None, :], act, 0.0), EMULATE)
        tl.store(act_scale_ptr + rows * stride_as + pid_n, act_scale, mask=row_valid)
    tl.store(act_ptr + rows[:, None] * stride_am + offs_n[None, :],
             act.to(act_ptr.dtype.element_ty), mask=row_valid[:, None] & n_mask[None, :])


@triton.jit
def down_k_loop(acc, a_ptrs, w_n, s_n, w_m, n_mask, offs_k, rows, row_valid, tw, act_scale_ptr,
                stride_as, I, stride_wk, stride_sk, WFMT: tl.constexpr, QUANT_A: tl.constexpr,
                EMULATE: tl.constexpr, OP_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_K: tl.constexpr, SCALAR_SCALE: tl.constexpr, BIT_DECODE: tl.constexpr,
                SWAP_AB: tl.constexpr, QUANT_GATHER: tl.constexpr, EVEN_K: tl.constexpr,
                PREFETCH_SCALES: tl.constexpr, MMA_LAYOUT: tl.constexpr, ONE: tl.constexpr):
    """quant_down_kernel's K loop: acc after every K step of I. Each K step's scales are loaded
    one step ahead with PREFETCH_SCALES (step_scales). ONE: as gate_up_k_loop's."""
    sc = 0
    xs = 0
    if PREFETCH_SCALES:
        sc = step_scales(s_n, n_mask, 0, I, stride_sk, BLOCK_K, WFMT, SCALAR_SCALE)
        if QUANT_A and not QUANT_GATHER:
            xs = group_scales(act_scale_ptr + rows * stride_as, row_valid, 0, I, BLOCK_K, False)
    for k0 in range(0, I, BLOCK_K):
        k_mask = k_in_range(offs_k, I - k0, EVEN_K)
        sc_now, sc = scales_at_step(s_n, n_mask, sc, k0, I, stride_sk, BLOCK_K, WFMT,
                                    SCALAR_SCALE, PREFETCH_SCALES)
        if QUANT_GATHER:   # float32 act, quantized here
            a, a_scale = load_a(a_ptrs, row_valid, k_mask, tw, True, False, OP_DTYPE, EMULATE)
        elif QUANT_A:   # act was quantized by the gate+up kernel: e4m3 tile and row scales
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0)
            if PREFETCH_SCALES:
                a_scale = xs
                xs = group_scales(act_scale_ptr + rows * stride_as, row_valid, k0, I, BLOCK_K,
                                  True)
            else:
                a_scale = group_scales(act_scale_ptr + rows * stride_as, row_valid, k0, I,
                                       BLOCK_K, False)
        else:
            a, a_scale = load_a(a_ptrs, row_valid, k_mask, tw, False, False, OP_DTYPE, EMULATE)
        b, sb = weight_tile(w_n, s_n, w_m, k0, I, stride_wk, stride_sk, OP_DTYPE, WFMT,
                            QUANT_A, EMULATE, BLOCK_K, SCALAR_SCALE, BIT_DECODE, SWAP_AB, EVEN_K,
                            sc_now, MMA_LAYOUT, ONE)
        acc = mma_step(acc, a, a_scale, b, sb, WFMT, QUANT_A, DOT_PRECISION, SCALAR_SCALE,
                       SWAP_AB)
        a_ptrs += BLOCK_K
    return acc


@triton.jit
def quant_down_kernel(
    act_ptr, w_ptr, s_ptr, bias_ptr, tw_ptr, y_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr,
    n_slots, H, I, top_k, n_row_blocks, scale_bn,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_be, stride_bn, stride_tw_t, stride_tw_k, stride_ym, act_scale_ptr, stride_as,
    ids_ptr, stride_ik, n_experts,
    WFMT: tl.constexpr, QUANT_A: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr, EMULATE: tl.constexpr, OP_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DIRECT: tl.constexpr,
    SCALAR_SCALE: tl.constexpr = False, BIT_DECODE: tl.constexpr = False,
    SWAP_AB: tl.constexpr = False, QUANT_GATHER: tl.constexpr = False,
    EVEN_K: tl.constexpr = False, PREFETCH_SCALES: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, MMA_LAYOUT: tl.constexpr = False,
    ONE_FACTOR: tl.constexpr = False,
):
    """MMA_LAYOUT, ONE_FACTOR: as quant_gate_up_kernel's (w2 in moe_ops.mxfp4_layout's order).
    QUANT_GATHER (W8A8): act is the gate+up kernel's float32 output (ACT_F32), quantized
    here per row and bk columns (BLOCK_K == bk) by the epilogue's arithmetic: the same e4m3
    values and scales, computed once per N tile instead of once per row. USE_PDL: as
    quant_gate_up_kernel's."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), n_row_blocks, H, BLOCK_N, GROUP_M)
    if USE_PDL:
        gdc_wait()
    if not DIRECT:
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
    e, rows, slots, row_valid = _rows(pid_m, sorted_ptr, block_expert_ptr, n_slots, ids_ptr,
                                      stride_ik, n_experts, BLOCK_M, DIRECT)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_n64 = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * stride_am + offs_k[None, :]
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    tw = tl.zeros((BLOCK_M,), tl.float32)
    w_n = w_ptr + e * stride_we + offs_n64 * stride_wn
    if SCALAR_SCALE:   # the tile's rows are in one [bn, bk] block row
        s_n = s_ptr + e * stride_se + ((pid_n * BLOCK_N) // scale_bn) * stride_sn
    elif WFMT == 1:
        s_n = s_ptr + e * stride_se + (offs_n64 // scale_bn) * stride_sn
    else:
        s_n = s_ptr + e * stride_se + offs_n64 * stride_sn
    w_m = n_mask   # the weight loads' pointers and mask: the storage rows' with MMA_LAYOUT
    if MMA_LAYOUT:
        w_n, w_m = mma_rows(w_ptr + e * stride_we, pid_n * BLOCK_N, tl.arange(0, BLOCK_N // 4),
                            H - pid_n * BLOCK_N, stride_wn)
    k2 = I   # (as in quant_gate_up_kernel)
    if ONE_FACTOR:
        one = scales_at_most_128(s_n, n_mask, I, stride_sk, 32)
        k1 = tl.where(one, I, 0)
        acc = down_k_loop(acc, a_ptrs, w_n, s_n, w_m, n_mask, offs_k, rows, row_valid, tw,
            act_scale_ptr, stride_as, k1, stride_wk, stride_sk, WFMT, QUANT_A, EMULATE,
            OP_DTYPE, DOT_PRECISION, BLOCK_K, SCALAR_SCALE, BIT_DECODE, SWAP_AB,
            QUANT_GATHER, EVEN_K, PREFETCH_SCALES, MMA_LAYOUT, True)
        k2 = I - k1
    else:
        tl.assume(I > 0)   # (the launcher guarantees it; see gate_up_k_loop)
    acc = down_k_loop(acc, a_ptrs, w_n, s_n, w_m, n_mask, offs_k, rows, row_valid, tw,
        act_scale_ptr, stride_as, k2, stride_wk, stride_sk, WFMT, QUANT_A, EMULATE,
        OP_DTYPE, DOT_PRECISION, BLOCK_K, SCALAR_SCALE, BIT_DECODE, SWAP_AB,
        QUANT_GATHER, EVEN_K, PREFETCH_SCALES, MMA_LAYOUT, False)
    if USE_PDL:
        gdc_launch_dependents()
    if SWAP_AB:
        acc = tl.trans(acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + offs_n64 * stride_bn, mask=n_mask,
                       other=0.0).to(tl.float32)[None, :]
    if HAS_WEIGHTS:
        tw = tl.load(tw_ptr + (slots // top_k) * stride_tw_t + (slots % top_k) * stride_tw_k,
                     mask=row_valid, other=0.0).to(tl.float32)
        acc = acc * tw[:, None]
    tl.store(y_ptr + slots[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=row_valid[:, None] & n_mask[None, :])


@triton.jit
def quantize_groups_kernel(x_ptr, q_ptr, s_ptr, T, H, stride_xt, stride_xh, stride_qt, stride_st,
                           EMULATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
    """hidden quantized per token and BLOCK_K (= bk) columns, once, for the W8A8 gate+up GEMM
    at large T: q [T, H] e4m3 (its float32 value under EMULATE) and s [T, cdiv(H, bk)] float32,
    by load_a's and quantize_rows' arithmetic (so the GEMM computes what it would compute
    quantizing in its gather). Grid (cdiv(T, BLOCK_T), cdiv(H, BLOCK_K)). USE_PDL: waits for
    its predecessor, then lets its successor launch at once."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r_mask = rows < T
    mask = r_mask[:, None] & (cols < H)[None, :]
    rows64 = rows.to(tl.int64)
    a = tl.load(x_ptr + rows64[:, None] * stride_xt + cols[None, :] * stride_xh, mask=mask,
                other=0.0)
    q, scale = quantize_rows(a.to(tl.float32), EMULATE)
    tl.store(q_ptr + rows64[:, None] * stride_qt + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=mask)
    tl.store(s_ptr + rows64 * stride_st + tl.program_id(1), scale, mask=r_mask)


@triton.jit
def mxfp4_dequant_kernel(w_ptr, s_ptr, d_ptr, N, K, stride_we, stride_wn, stride_wk, stride_se,
                         stride_sn, stride_sk, stride_de, stride_dn,
                         OP_DTYPE: tl.constexpr, EMULATE: tl.constexpr, BN: tl.constexpr,
                         BLOCK_K: tl.constexpr, BIT_DECODE: tl.constexpr,
                         EVEN_K: tl.constexpr, MMA_LAYOUT: tl.constexpr):
    """MXFP4 weights [E, N, K/2] (plain or mma layout) and their e8m0 scales -> d [E, N, K] in
    d's dtype, decoded by the GEMM kernels' own tile decode (weight_tile, transposed form: the
    same functions, so the same values as the fused kernels multiply). Grid (cdiv(N, BN),
    cdiv(K, BLOCK_K), E)."""
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    e = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    offs_n64 = offs_n.to(tl.int64)
    w_e = w_ptr + e * stride_we
    s_rows = s_ptr + e * stride_se + offs_n64 * stride_sn
    sc = mxfp4_scales(s_rows, n_mask, k0, K, stride_sk, BLOCK_K)
    if MMA_LAYOUT:
        w_rows, w_m = mma_rows(w_e, pid_n * BN, tl.arange(0, BN // 4), N - pid_n * BN, stride_wn)
    else:
        w_rows, w_m = w_e + offs_n64 * stride_wn, n_mask
    b, _ = weight_tile(w_rows, s_rows, w_m, k0, K, stride_wk, stride_sk, OP_DTYPE, 2, False,
                       EMULATE, BLOCK_K, False, BIT_DECODE, True, EVEN_K, sc, MMA_LAYOUT)
    if EMULATE and d_ptr.dtype.element_ty == tl.bfloat16:
        # the float32 values are bf16 values (at most two significant bits): their top 16
        # bits, as the interpreter's own conversion loses float32 subnormals (scale byte 0)
        b = (b.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(d_ptr + e * stride_de + offs_n64[:, None] * stride_dn + offs_k[None, :],
             b.to(d_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_k < K)[None, :])

"""Host side of moe.dispatch with quantized expert weights (FP8 block-scaled, MXFP4; issue 42):
checks, config, buffers sized from shapes, launches. The flow is the bf16 op's: align the slots
by expert (align_triton), gate+up GEMM with the activation fused (act [max_rows, I] in hidden's
dtype; W8A8: e4m3 and its scales), down GEMM with bias and routing weight fused (y per slot), deterministic combine. No
dequantized weight is ever materialised: tiles are decoded in registers. Nothing syncs with the
host."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton.language as tl

from moe_ops import _features
from moe_ops._runtime import cdiv, next_pow2
from moe_ops.kernels.quant_gemm import (
    mxfp4_dequant_kernel,
    quant_down_kernel,
    quant_gate_up_kernel,
    quantize_groups_kernel,
)
from moe_ops.launch._common import kernel_for, pdl_args
from moe_ops.launch.alignment import align_triton
from moe_ops.launch.dispatch import DirectRows, combine_triton
from moe_ops.launch.fast import launch_key, optional_tensor_key, tensor_key
from moe_ops.ops.quant_checks import ACTIVATIONS, check_quantized_dispatch

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@dataclass(frozen=True, kw_only=True)
class QuantDispatchConfig:
    """Tiles of the quantized expert GEMMs. block_k: the K step (FP8: equal to the block
    shape's bk, one weight scale per step; MXFP4: a multiple of 32). block_n1 counts columns of
    I (the gate+up kernel computes a gate and an up tile of that width)."""
    block_m: int
    block_n1: int
    block_n2: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # MXFP4 through tl.dot_scaled instead of the kernels' own decode (bf16/fp16 activations,
    # where has_dot_scaled()); off: 0.59-0.86x of the bit-placement decode on the H200 (design.md)
    mxfp4_dot_scaled: bool = False
    # MXFP4 decoded by bit placement (quant_gemm.mxfp4_tile_bits; GPU, bfloat16 activations)
    mxfp4_bit_decode: bool = True
    # the bit-placement decode written in inline PTX over bf16x2 pairs (quant_gemm.mxfp4_tile_asm:
    # one byte gives one MMA operand register, packed multiplications); with mxfp4_bit_decode,
    # where _features.inline_ptx (sm_90+). H100: 1.07-1.21x at gpt-oss-20b/120b T=1..8192
    # (docs/design.md)
    mxfp4_asm_decode: bool = True
    # MXFP4 products computed transposed (decoded weights x rows^T): the decoded tile is the
    # MMA's left operand, which Hopper's wgmma reads from registers (no trip through shared
    # memory); the row block becomes the MMA's N (8..256), so decode tiles stay small
    mxfp4_swap_ab: bool = False
    # FP8: one scalar weight scale per K step when every row of a tile is in one [bn, bk] block
    # row (gate+up: bn and I multiples of block_n1, not interleaved; down: bn a multiple of
    # block_n2)
    scalar_weight_scale: bool = True
    # each K step's weight scales (FP8 block scales, MXFP4 e8m0 bytes) and W8A8 activation
    # scales loaded one step ahead (quant_gemm.step_scales): Triton's pipeliner copies the
    # tiles asynchronously but leaves these loads (scalars, gathers, MXFP4's scale rows that
    # are not 4-byte aligned) synchronous in the step that uses them
    prefetch_scales: bool = True
    # W8A8: hidden quantized once per token (quantize_groups_kernel) instead of in every gate+up
    # program's gather (not with weights_on_input, whose rows are scaled per slot first);
    # 1.02-1.48x on the H200 (docs/design.md)
    prequantize_hidden: bool = True
    # W8A8: the gate+up GEMM stores the activation in float32 and the down GEMM quantizes it in
    # its gather (the same e4m3 values and scales as the epilogue's quantization), so block_n1
    # need not be bk: at decode, narrower gate+up tiles give more programs
    act_quant_in_down: bool = False
    # MXFP4 with mxfp4_swap_ab: the gate and up rows of a tile decoded as one [2 * block_n1,
    # block_k] tile and multiplied by one MMA chain per K step (quant_gemm: STACK_GU); the same
    # sums (bit-equal). The heuristic turns it on with block_n1 32 at <= 64 slots (decode).
    mxfp4_stacked_gate_up: bool = False
    # FP8: the products computed transposed (weight tile x rows^T): the row block becomes the
    # MMA's N, so a decode tile of 16 rows runs a 16-wide wgmma instead of a 64-row one whose
    # rows are mostly padding; the same promotion arithmetic per element
    fp8_swap_ab: bool = False
    # programmatic dependent launch (sm_90+): each kernel of the call may launch while its
    # predecessor finishes and waits for it before its first memory access. H100, graph
    # replay: FP8 Qwen3-30B-A3B T=1 36.2 -> 32.8 us (1.10x), T=8 1.03x, DeepSeek-V3 1.00-1.01x;
    # MXFP4 gpt-oss-20b T=1 75.8 -> 79.7 us (0.95x), T=8..2048 1.00x: the MXFP4 heuristics
    # turn it off
    dependent_launch: bool = True
    # MXFP4 at prefill: from this many slots per expert (T * K / E; 0: never), the call decodes
    # the experts' weights once into a 16-bit buffer (mxfp4_dequant_kernel: the GEMM kernels'
    # own tile decode, so the same values) and runs the bf16/fp16 expert kernels on it
    # (launch.dispatch.dispatch_triton) instead of decoding every weight tile once per row
    # block. Skipped where that buffer would pass MXFP4_DEQUANT_MAX_BYTES. An opt-in only: the
    # buffer is the dequantized copy of the weights that the default path never allocates
    # (docs/design.md)
    mxfp4_dequant_rows: int = 0
    # MXFP4 with the inline-PTX decode: each GEMM program reads its scale rows once before its K
    # loop and, where every e8m0 byte is <= 128 (block scales up to 2), scales
    # each decoded pair by one packed multiplication (2^(s - 1)) instead of two; the same values.
    # Off until measured on a GPU
    mxfp4_one_factor: bool = False


# The largest buffer of decoded MXFP4 weights QuantDispatchConfig.mxfp4_dequant_rows allocates
# (gpt-oss-20b's 32 experts in bf16: 1.6 GB)
MXFP4_DEQUANT_MAX_BYTES = 2 << 30


def has_dot_scaled() -> bool:
    """Whether this Triton has tl.dot_scaled with an e2m1 right operand and a bf16/fp16 left one
    (3.6 and 3.9 do: both compile it for sm_90 to bf16 wgmma); moe_ops._features decides."""
    return _features.dot_scaled()


def quant_dispatch_config(T: int, E: int, K: int, H: int, I: int, fmt: str, bk: int,
                          device_type: str, quant_a: bool = False) -> QuantDispatchConfig:
    """Heuristic tiles (not tuned yet). Row blocks from the mean rows per expert (decode: 16,
    so few padding rows are multiplied); K step bk for FP8, 128 values (64 packed bytes) for
    MXFP4. The interpreter gets the smallest tiles tl.dot takes (runtime grows with tile area)."""
    if device_type != "cuda":
        return QuantDispatchConfig(block_m=16, block_n1=bk if quant_a else 16, block_n2=32,
                                   block_k=bk if fmt == "fp8" else 32 if H <= 32 or I <= 32 else 64,
                                   group_m=4, num_warps=1, num_stages=1)
    rows = T * K / max(E, 1)
    block_m = 16 if rows <= 16 else 32 if rows <= 48 else 64
    block_k = bk if fmt == "fp8" else 128
    if fmt == "mxfp4" and rows >= 128:
        # prefill: 128-row blocks decode each weight tile for twice the rows, the products
        # computed transposed with 4 warps, 64-wide K steps: 1.07-1.15x of the same with
        # 128-wide steps and 1.12-1.54x of 64-row blocks at gpt-oss-20b/120b T=512..8192 on
        # the H100 (docs/design.md). From 128 rows per expert: at 64 (gpt-oss-20b T=512,
        # gpt-oss-120b T=2048) half of each 128-row block is padding, and the 64-row tiles
        # below measure 1.05-1.06x (H100: 611.6 -> 580.5 us, 2268.6 -> 2139.8 us, bit-equal);
        # at 256 rows they are 0.85-0.87x.
        return QuantDispatchConfig(block_m=128, block_n1=64, block_n2=128, block_k=64,
                                   group_m=8, num_warps=4, num_stages=3, mxfp4_swap_ab=True,
                                   dependent_launch=False)
    if fmt == "mxfp4":
        # Below 64 rows per expert: transposed too, 64-wide weight tiles, so that every T runs
        # wgmma (64 weight rows as the MMA's M); mma.sync sums the decoded tile in another order
        # (relative difference 3e-5..1e-4), which made a token's output depend on the batch.
        # H100, against the earlier untransposed 32/64-wide tiles: gpt-oss-20b T=1 76.8 -> 85.0
        # us (0.90x), T=8/32/128 1.02/1.03/1.04x; 64-wide K steps from T=32 on (1.03-1.05x;
        # at T=1 0.77x).
        # With at most 64 slots (T * K; few experts hit, a few hundred programs), gate and up
        # rows are decoded as one [64, block_k] tile of 32 gate + 32 up rows (the MMA's M
        # stays 64, the same sums: bit-equal), which gives twice the programs at 80 registers
        # instead of 171 (ptxas, sm_90, the launch at T=1 and 8). H100, graph replay:
        # gpt-oss-20b T=1 81.7 -> 75.5 us (1.08x), T=8 253.2 -> 232.0 (1.09x); at 512 slots
        # (T=128) 0.97x.
        # At <= 4 slots (gpt-oss T=1), 256-value K steps: half the K steps, the same MMA chain
        # (bit-equal). H200, graph replay: gpt-oss-20b and -120b T=1 74.6 -> 68.7 us (1.09x);
        # at 8 slots (T=2) 0.92-0.93x, so not beyond 4.
        stacked = T * K <= 64
        block_k = 256 if T * K <= 4 else 64 if T >= 32 else 128
        return QuantDispatchConfig(block_m=block_m, block_n1=32 if stacked else 64, block_n2=64,
                                   block_k=block_k, group_m=8, num_warps=4,
                                   num_stages=3, mxfp4_swap_ab=True,
                                   mxfp4_stacked_gate_up=stacked, dependent_launch=False)
    if fmt == "fp8":
        # wgmma tiles and 8 warps at every T: Hopper's FP8 wgmma (64-row tiles) and mma.sync
        # (16/32-row tiles) round their float32 sums differently (relative difference 5e-3 on
        # the H100), so one MMA kind at every T keeps a token's output independent of the batch;
        # at decode this costs 0-3% (H100: Qwen3-30B-A3B T=1/8/128 41.9/120.5/252.8 ->
        # 41.8/124.5/260.0 us, DeepSeek-V3 T=1/128 155.9/3861 -> 153.6/3872). The gate+up tile
        # is one bk group of the activation it quantizes (128 columns: two [64, 128] float32
        # accumulators). Four stages: one more K step in flight, the same sums (bit-equal);
        # H100, two runs: Qwen3-30B-A3B T=1 40.5 -> 37.8 us, T=8 1.02x, T=2048 1.04x, T=8192
        # 1.01x; DeepSeek-V3 T=1 1.01x, T=2048 4752 -> 4585 us. From 256 rows per expert,
        # 128-row blocks (two 64-row wgmma halves, the same sums: outputs bit-equal to the
        # 64-row tiles): each weight tile is read for twice the rows. H100, same run:
        # DeepSeek-V3 T=8192 (256 rows) 1.14x, Qwen3-30B-A3B T=8192 (512 rows) 1.06x; at 64
        # and 128 rows (DeepSeek-V3 / Qwen3 T=2048) 1.00x / 0.98x, so not below 256. W8A8 only
        # (the weight-only path's 128-row tiles are not measured).
        # At <= 8 rows per expert (W8A8), the products transposed (fp8_swap_ab) with 16-row
        # blocks: the rows are the wgmma's N (m64n16k32) instead of a 64-row tile of padding;
        # the same sums (bit-equal to the 64-row tiles at T = 1..2048 on the H200, so the
        # same class). H200, graph replay: Qwen3-30B-A3B T=1/8/128 1.04/1.08/1.08x,
        # DeepSeek-V3 T=1/8/128 1.01/1.03/1.02x; at 16 rows per expert (DeepSeek-V3 T=512)
        # 0.94x (H100), at 128 rows 0.44-0.48x.
        if quant_a and rows <= 8:
            return QuantDispatchConfig(block_m=16, block_n1=bk, block_n2=128, block_k=block_k,
                                       group_m=8, num_warps=4, num_stages=4, fp8_swap_ab=True)
        return QuantDispatchConfig(block_m=128 if quant_a and rows >= 256 else 64,
                                   block_n1=bk if quant_a else 64, block_n2=128,
                                   block_k=block_k, group_m=8, num_warps=8, num_stages=4)
    return QuantDispatchConfig(block_m=block_m, block_n1=64, block_n2=128, block_k=block_k,
                               group_m=8, num_warps=4 if block_m < 64 else 8,
                               num_stages=3)


def _interpreted(device: torch.device) -> bool:
    """Whether this call runs Triton's interpreter (the EMULATE kernels: CPU tensors) rather
    than compiled kernels (moe_ops.tools.compile_check swaps it to capture the compiled
    launches of CPU tensors)."""
    return device.type != "cuda"


def dispatch_quantized(hidden, w13, w2, topk_weights, topk_ids, *, activation="silu",
                       w13_bias=None, w2_bias=None, alpha=1.702, limit=7.0,
                       gate_up_interleaved=False, weights_on_input=False, w13_scale=None,
                       w2_scale=None, block_shape=None, quantize_activations=True,
                       mxfp4_layout="plain", config=None, out=None, check=True):
    """moe.dispatch's output [T, H] (hidden's dtype) with FP8 block-scaled or MXFP4 w13/w2 (the
    semantics of moe.dispatch's extended schema). CUDA tensors run the compiled kernels, CPU
    tensors Triton's interpreter (the EMULATE form of the kernels). `out` (tests poison it):
    a fresh [T, H] buffer. mxfp4_layout "mma": MXFP4 w13/w2 in moe_ops.mxfp4_layout's order
    (contiguous per expert; H and I multiples of 64), read by the kernels' MMA_LAYOUT path (the
    products transposed, interleaved gate/up rows stacked, 64-value multiples per K step)."""
    if check:
        fmt, H, I, bn, bk = check_quantized_dispatch(
            hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
            gate_up_interleaved, weights_on_input, w13_scale, w2_scale, block_shape,
            quantize_activations, mxfp4_layout)
    else:
        from moe_ops.ops.quant_checks import normalize_block_shape
        from moe_ops.reference.quant import weight_format

        fmt = weight_format(w13)
        H = hidden.shape[1]
        I = w2.shape[2] * (2 if fmt == "mxfp4" else 1)
        bn, bk = normalize_block_shape(block_shape) if fmt == "fp8" else (1, 32)
    T = hidden.shape[0]
    E = w13.shape[0]
    K = topk_ids.shape[1]
    dev = hidden.device
    if out is None:
        out = torch.empty(T, H, dtype=hidden.dtype, device=dev)
    if T == 0:
        return out
    emulate = _interpreted(dev)
    quant_a = fmt == "fp8" and bool(quantize_activations)
    cfg = config or quant_dispatch_config(T, E, K, H, I, fmt, bk,
                                          "cpu" if emulate else "cuda", quant_a)
    if fmt == "fp8" and cfg.block_k != bk:
        raise ValueError(f"config.block_k must equal the FP8 block_shape's bk = {bk}, got "
                         f"{cfg.block_k}")
    act_f32 = quant_a and cfg.act_quant_in_down
    if quant_a and not act_f32 and cfg.block_n1 != bk:
        raise ValueError(f"config.block_n1 must equal bk = {bk} for W8A8 (the gate+up tile is "
                         f"one activation group of the down GEMM) unless act_quant_in_down, "
                         f"got {cfg.block_n1}")
    mma = mxfp4_layout == "mma"
    if mma:
        # the layout's path: transposed products (the decoded tile is the MMA's register
        # operand), interleaved gate/up rows as one stacked tile, whole 64-value chunks per step
        cfg = replace(cfg, mxfp4_swap_ab=True, mxfp4_dot_scaled=False,
                      mxfp4_stacked_gate_up=cfg.mxfp4_stacked_gate_up or gate_up_interleaved,
                      block_k=max(64, cfg.block_k))
        if cfg.block_k % 64 or cfg.block_n1 % 16 or cfg.block_n2 % 16:
            raise ValueError(f"config: the mma layout needs block_k % 64 == 0 and block_n1, "
                             f"block_n2 multiples of 16, got {cfg}")
    if fmt == "mxfp4" and cfg.block_k % 32:
        raise ValueError(f"config.block_k must be a multiple of 32 for MXFP4, got {cfg.block_k}")
    # dot_scaled: GPU with 16-bit activations, or the interpreter with float16 ones (its bf16
    # dots are unreliable)
    scaled = (fmt == "mxfp4" and cfg.mxfp4_dot_scaled and has_dot_scaled()
              and (hidden.dtype == torch.float16
                   or (hidden.dtype == torch.bfloat16 and not emulate)))
    wfmt = 1 if fmt == "fp8" else 3 if scaled else 2
    if (wfmt == 2 and cfg.mxfp4_dequant_rows > 0 and T * K >= cfg.mxfp4_dequant_rows * E
            and hidden.dtype in (torch.bfloat16, torch.float16)
            and 3 * E * H * I * hidden.element_size() <= MXFP4_DEQUANT_MAX_BYTES):
        return _dispatch_dequantized(
            hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, cfg, mma, emulate,
            out, activation=activation, w13_bias=w13_bias, w2_bias=w2_bias, alpha=alpha,
            limit=limit, gate_up_interleaved=gate_up_interleaved,
            weights_on_input=weights_on_input)
    # Fast launch (moe_ops.launch.fast): every argument of this call's launches is a function
    # of these and of the buffers allocated below (their alignment: launch_key).
    key = (cfg, fmt, bn, bk, quant_a, scaled, mma, activation, float(alpha), float(limit),
           bool(gate_up_interleaved), bool(weights_on_input), tensor_key(hidden),
           tensor_key(w13), tensor_key(w2), optional_tensor_key(w13_scale),
           optional_tensor_key(w2_scale), tensor_key(topk_weights), tensor_key(topk_ids),
           tensor_key(out), optional_tensor_key(w13_bias),
           optional_tensor_key(w2_bias)) if not emulate else None
    # The interpreter decodes fp8 weights from their bits (its fp8 loads read NaN as 480).
    w13_k = w13.view(torch.uint8) if emulate and fmt == "fp8" else w13
    w2_k = w2.view(torch.uint8) if emulate and fmt == "fp8" else w2
    op_dtype = tl.float32 if emulate and not scaled else _TL_DTYPE[hidden.dtype]
    dot_precision = "ieee" if op_dtype == tl.float32 else "tf32"
    n_slots = T * K
    # One token: row block k is slot k (its K experts are distinct), no alignment launch.
    direct = T == 1
    pdl = pdl_args(cfg.dependent_launch, dev)
    al = (DirectRows(topk_ids, cfg.block_m) if direct
          else align_triton(topk_ids, E, cfg.block_m, pdl=bool(pdl)))
    n_blocks = al.max_rows // cfg.block_m
    rows_args = dict(ids_ptr=topk_ids, stride_ik=topk_ids.stride(1), n_experts=E)
    # The interpreter rounds float32 -> bfloat16 stores by truncation (about half of random
    # values differ from torch's rounding): bf16 intermediates stay float32 there.
    inter = torch.float32 if emulate and hidden.dtype == torch.bfloat16 else hidden.dtype
    if act_f32:   # float32 act, quantized by the down GEMM's gather
        act = torch.empty(al.max_rows, I, dtype=torch.float32, device=dev)
        act_scale = act
    elif quant_a:   # e4m3 act (its float32 values in the interpreter) and a scale per bk group
        act = torch.empty(al.max_rows, I, device=dev,
                          dtype=torch.float32 if emulate else torch.float8_e4m3fn)
        act_scale = torch.empty(al.max_rows, cdiv(I, bk), dtype=torch.float32, device=dev)
    else:
        act = torch.empty(al.max_rows, I, dtype=inter, device=dev)
        act_scale = act
    y = torch.empty(n_slots, H, dtype=inter, device=dev)
    b13 = w13_bias if w13_bias is not None else act
    b2 = w2_bias if w2_bias is not None else act
    # direct rows: every slot walks the column tiles together (their weight tiles differ)
    group_m = max(cfg.group_m, next_pow2(n_blocks)) if direct else cfg.group_m
    bit_decode = wfmt == 2 and _mxfp4_bit_decode(cfg, op_dtype, emulate, dev)
    one_factor = bit_decode == 2 and cfg.mxfp4_one_factor
    common = dict(WFMT=wfmt, QUANT_A=quant_a, EMULATE=emulate, OP_DTYPE=op_dtype,
                  DOT_PRECISION=dot_precision, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
                  GROUP_M=group_m, DIRECT=direct, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, BIT_DECODE=bit_decode,
                  SWAP_AB=(wfmt == 2 and cfg.mxfp4_swap_ab) or (wfmt == 1 and cfg.fp8_swap_ab),
                  PREFETCH_SCALES=wfmt in (1, 2) and cfg.prefetch_scales, **pdl)
    scalar13 = (fmt == "fp8" and cfg.scalar_weight_scale and not gate_up_interleaved
                and bn % cfg.block_n1 == 0 and I % cfg.block_n1 == 0)
    scalar2 = fmt == "fp8" and cfg.scalar_weight_scale and bn % cfg.block_n2 == 0
    x, xs = hidden, act_scale
    prequant = quant_a and cfg.prequantize_hidden and not weights_on_input
    if prequant:   # e4m3 hidden (float32 values in the interpreter) and its group scales
        x = torch.empty(T, H, device=dev, dtype=torch.float32 if emulate else torch.float8_e4m3fn)
        xs = torch.empty(T, cdiv(H, bk), dtype=torch.float32, device=dev)
        block_t = 16 if emulate else 32
        fk = launch_key(key and (key, "quantize"), x, xs)
        kernel_for(quantize_groups_kernel, dev, fk)[(cdiv(T, block_t), cdiv(H, bk))](
            hidden, x, xs, T, H, hidden.stride(0), hidden.stride(1), x.stride(0), xs.stride(0),
            EMULATE=emulate, BLOCK_T=block_t, BLOCK_K=bk, num_warps=4, **pdl)
    bufs = (act, act_scale, y) + (() if direct else (al.sorted_slots, al.block_expert,
                                                     al.num_rows))
    fk = launch_key(key and (key, "gate_up"), x, xs, *bufs)
    kernel_for(quant_gate_up_kernel, dev, fk)[(n_blocks * cdiv(I, cfg.block_n1),)](
        x, w13_k, w13_scale, b13, topk_weights, act, al.sorted_slots, al.block_expert,
        al.num_rows, n_slots, H, I, K, n_blocks, bn, float(alpha), float(limit),
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        w13_scale.stride(0), w13_scale.stride(1), w13_scale.stride(2),
        b13.stride(0), b13.stride(1), topk_weights.stride(0), topk_weights.stride(1),
        act.stride(0), act_scale, act_scale.stride(0), *rows_args.values(), xs, xs.stride(0),
        ACTIVATION=ACTIVATIONS.index(activation), INTERLEAVED=bool(gate_up_interleaved),
        HAS_BIAS=w13_bias is not None, WEIGHTS_ON_INPUT=bool(weights_on_input),
        BLOCK_N=cfg.block_n1, A_PREQUANT=prequant, SCALAR_SCALE=scalar13, ACT_F32=act_f32,
        EVEN_K=H % cfg.block_k == 0,
        STACK_GU=bool(common["SWAP_AB"] and cfg.mxfp4_stacked_gate_up), MMA_LAYOUT=mma,
        ONE_FACTOR=one_factor, **common,
    )
    fk = launch_key(key and (key, "down"), *bufs)
    kernel_for(quant_down_kernel, dev, fk)[(n_blocks * cdiv(H, cfg.block_n2),)](
        act, w2_k, w2_scale, b2, topk_weights, y, al.sorted_slots, al.block_expert, al.num_rows,
        n_slots, H, I, K, n_blocks, bn,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2),
        w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2),
        b2.stride(0), b2.stride(1), topk_weights.stride(0), topk_weights.stride(1), y.stride(0),
        act_scale, act_scale.stride(0), *rows_args.values(),
        HAS_BIAS=w2_bias is not None, HAS_WEIGHTS=not weights_on_input,
        BLOCK_N=cfg.block_n2, SCALAR_SCALE=scalar2, QUANT_GATHER=act_f32,
        EVEN_K=I % cfg.block_k == 0, MMA_LAYOUT=mma, ONE_FACTOR=one_factor,
        **common,
    )
    if inter != out.dtype:
        out32 = torch.empty(T, H, dtype=inter, device=dev)
        combine_triton(y, topk_ids, out32, E, pdl=bool(pdl))
        return out.copy_(out32)
    combine_triton(y, topk_ids, out, E, pdl=bool(pdl), key=key)
    return out


def _mxfp4_bit_decode(cfg: QuantDispatchConfig, op_dtype, emulate: bool, dev):
    """The MXFP4 decode the kernels run: False arithmetic, True bit placement, 2 its inline
    PTX."""
    bit_decode = bool(cfg.mxfp4_bit_decode and not emulate and op_dtype == tl.bfloat16)
    if bit_decode and cfg.mxfp4_asm_decode and _features.inline_ptx(dev):
        bit_decode = 2
    return bit_decode


def dequantize_mxfp4_triton(w, scale, dtype, mma: bool = False,
                            config: QuantDispatchConfig | None = None):
    """MXFP4 blocks w [E, N, K/2] (mxfp4_layout "plain", or "mma" with mma) and their e8m0
    scales [E, N, K/32] -> [E, N, K] in dtype (bfloat16, float16 or float32), decoded by the expert
    GEMMs' own tile decode (the config's: bit placement / inline PTX on the GPU), so the values
    are those the fused kernels multiply: code * 2^(s - 127), exact in bfloat16."""
    E, N, K = w.shape[0], w.shape[1], 2 * w.shape[2]
    dev = w.device
    emulate = _interpreted(dev)
    cfg = config or QuantDispatchConfig(block_m=16, block_n1=16, block_n2=16, block_k=64)
    d = torch.empty(E, N, K, dtype=dtype, device=dev)
    if d.numel() == 0:
        return d
    op_dtype = tl.float32 if emulate else _TL_DTYPE[dtype]
    bn, block_k = 64, 64
    kernel_for(mxfp4_dequant_kernel, dev)[(cdiv(N, bn), cdiv(K, block_k), E)](
        w, scale, d, N, K, w.stride(0), w.stride(1), w.stride(2), scale.stride(0),
        scale.stride(1), scale.stride(2), d.stride(0), d.stride(1), OP_DTYPE=op_dtype,
        EMULATE=emulate, BN=bn, BLOCK_K=block_k,
        BIT_DECODE=_mxfp4_bit_decode(cfg, op_dtype, emulate, dev),
        EVEN_K=K % block_k == 0, MMA_LAYOUT=bool(mma), num_warps=4)
    return d


def _dispatch_dequantized(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, cfg,
                          mma, emulate, out, **variant):
    """QuantDispatchConfig.mxfp4_dequant_rows: the experts decoded once into hidden's dtype,
    then the 16-bit expert kernels (dispatch_triton) with the same variant arguments."""
    from moe_ops.launch.dispatch import dispatch_triton

    # the interpreter's 16-bit tl.dot is wrong (moe_ops.ops.dispatch): float32 copies there; the
    # decoded values are exact in float32 as in the 16-bit types
    dtype = torch.float32 if emulate else hidden.dtype
    d13 = dequantize_mxfp4_triton(w13, w13_scale, dtype, mma, cfg)
    d2 = dequantize_mxfp4_triton(w2, w2_scale, dtype, mma, cfg)
    if emulate:
        variant = {k: v.float() if torch.is_tensor(v) else v for k, v in variant.items()}
        return out.copy_(dispatch_triton(hidden.float(), d13, d2, topk_weights, topk_ids,
                                         **variant))
    return dispatch_triton(hidden, d13, d2, topk_weights, topk_ids, out=out, **variant)

"""Host side of moe.dispatch with quantized expert weights (FP8 block-scaled, MXFP4; issue 42):
checks, config, buffers sized from shapes, launches. The flow is the bf16 op's: align the slots
by expert (align_triton), gate+up GEMM with the activation fused (act [max_rows, I] in hidden's
dtype; W8A8: e4m3 and its scales), down GEMM with bias and routing weight fused (y per slot), deterministic combine. No
dequantized weight is ever materialised: tiles are decoded in registers. Nothing syncs with the
host."""
from __future__ import annotations

from dataclasses import replace

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
from moe_ops.tuning.configs import QuantDispatchConfig
from moe_ops.tuning.heuristics import quant_dispatch_config, quant_heuristic_config  # noqa: F401

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


# The largest buffer of decoded MXFP4 weights QuantDispatchConfig.mxfp4_dequant_rows allocates
# (gpt-oss-20b's 32 experts in bf16: 1.6 GB)
MXFP4_DEQUANT_MAX_BYTES = 2 << 30


def has_dot_scaled() -> bool:
    """Whether this Triton has tl.dot_scaled with an e2m1 right operand and a bf16/fp16 left one
    (3.6 and 3.9 do: both compile it for sm_90 to bf16 wgmma); moe_ops._features decides."""
    return _features.dot_scaled()


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
    if H == 0 or I == 0:
        # no reduction to run: the kernels' K loops assume a positive length (tl.assume, which
        # lets ptxas pipeline the wgmma chain of the MXFP4 K step); the reference gives the
        # output, 0 or the bias terms alone
        from moe_ops.reference.quant import quantized_dispatch_reference

        return out.copy_(quantized_dispatch_reference(
            hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, alpha, limit,
            gate_up_interleaved, weights_on_input, w13_scale, w2_scale, block_shape,
            quantize_activations, mxfp4_layout=mxfp4_layout))
    emulate = _interpreted(dev)
    quant_a = fmt == "fp8" and bool(quantize_activations)
    cfg = config or quant_dispatch_config(T, E, K, H, I, fmt, bk,
                                          "cpu" if emulate else "cuda", quant_a,
                                          dtype=hidden.dtype, mma=mxfp4_layout == "mma", bn=bn)
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
    # mxfp4_one_factor where the GPU tests found it bit-equal to the default decode: the plain
    # layout, and the mma layout with 16-row blocks; with the mma layout and 128-row blocks
    # (gpt-oss-20b T = 2048) its outputs differed, so those calls keep the two-factor loop
    one_factor = (bit_decode == 2 and cfg.mxfp4_one_factor
                  and (not mma or cfg.block_m <= 16))
    common = dict(WFMT=wfmt, QUANT_A=quant_a, EMULATE=emulate, OP_DTYPE=op_dtype,
                  DOT_PRECISION=dot_precision, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
                  GROUP_M=group_m, DIRECT=direct, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, BIT_DECODE=bit_decode,
                  SWAP_AB=(wfmt == 2 and cfg.mxfp4_swap_ab) or (wfmt == 1 and cfg.fp8_swap_ab),
                  PREFETCH_SCALES=_prefetch_scales(cfg, wfmt, mma), **pdl)
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


def _prefetch_scales(cfg: QuantDispatchConfig, wfmt: int, mma: bool) -> bool:
    """cfg.prefetch_scales where the kernels take it (FP8 and the MXFP4 bit decode), except for
    MXFP4's plain layout on a Triton whose compiled K loop was not bitwise repeatable with it
    (_features.mxfp4_plain_scale_prefetch_safe)."""
    if wfmt == 2 and not mma and not _features.mxfp4_plain_scale_prefetch_safe():
        return False
    return wfmt in (1, 2) and cfg.prefetch_scales


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

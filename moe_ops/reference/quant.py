"""Quantized expert weights (FP8 block-scaled, MXFP4): dequantization, the float64 references
and the W8A8 reference (activations quantized per token and per bk-column group).

Layouts (moe.dispatch's, issue 42):
- FP8: w [E, N, K] float8_e4m3fn (logical; any strides) with float32 scale
  [E, ceil(N/bn), ceil(K/bk)] (DeepSeek-V3's `weight_scale_inv`): weight = fp8 value x scale of
  its [bn, bk] block.
- MXFP4: w [E, N, K//2] uint8, two e2m1 values per byte along the reduction dim K, low nibble
  first (value 2j in bits 0-3 of byte j), with uint8 e8m0 scale [E, N, K//32]: weight = e2m1
  value x 2^(scale - 127), as transformers' gpt-oss loader (integrations/mxfp4.py,
  convert_moe_packed_tensors) dequantizes them.

The dense computation (`dense_dispatch_reference`) follows moe.dispatch's extended schema
(activations, biases, interleaved gate/up, weights on input) in float64."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_ops.reference.dispatch import activate

# e2m1 code -> value (sign bit 3, exponent bits 2-1, mantissa bit 0), as transformers' FP4_VALUES
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_MAX = 448.0            # largest finite float8_e4m3fn
# Activation groups whose amax is below this are scaled as if it were this (a zero group then
# quantizes to zeros instead of 0 * inf = NaN; 448 / 1e-30 is still finite in float32).
ACT_AMAX_FLOOR = 1e-30
DEFAULT_BLOCK_SHAPE = (128, 128)


def weight_format(w: torch.Tensor) -> str | None:
    """'fp8' (float8_e4m3fn), 'mxfp4' (uint8) or None (unquantized)."""
    if w.dtype == torch.float8_e4m3fn:
        return "fp8"
    if w.dtype == torch.uint8:
        return "mxfp4"
    return None


def dequantize_fp8_block(w: torch.Tensor, scale: torch.Tensor, block_shape=DEFAULT_BLOCK_SHAPE,
                         dtype=torch.float32) -> torch.Tensor:
    """[E, N, K] (or [N, K]) float8_e4m3fn with scale [.., ceil(N/bn), ceil(K/bk)] -> `dtype`."""
    bn, bk = block_shape
    N, K = w.shape[-2:]
    s = scale.to(dtype).repeat_interleave(bn, dim=-2)[..., :N, :]
    s = s.repeat_interleave(bk, dim=-1)[..., :K]
    return w.to(dtype) * s


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """[.., N, K//2] uint8 blocks with [.., N, K//32] uint8 e8m0 scales -> [.., N, K] `dtype`
    (bit for bit transformers' convert_moe_packed_tensors before its transpose)."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    lo = lut[(blocks & 0x0F).long()]
    hi = lut[(blocks >> 4).long()]
    vals = torch.stack((lo, hi), dim=-1).flatten(-2)            # [.., N, K]
    exp = scales.to(torch.int32) - 127
    vals = vals.unflatten(-1, (scales.shape[-1], 32))
    return torch.ldexp(vals, exp[..., None].to(dtype)).flatten(-2)


def dequantize_weights(w, scale, block_shape=None, dtype=torch.float32):
    """Dense [E, N, K] of a quantized weight (any of the two formats), or `w` itself as `dtype`."""
    fmt = weight_format(w)
    if fmt == "fp8":
        return dequantize_fp8_block(w, scale, block_shape or DEFAULT_BLOCK_SHAPE, dtype)
    if fmt == "mxfp4":
        return dequantize_mxfp4(w, scale, dtype)
    return w.to(dtype)


class LazyDequantized:
    """A quantized [E, N, K] weight that dequantizes one expert when indexed (`w[e]`): the
    references never hold every expert dequantized (DeepSeek-V3's w13 in float64 is 60 GB)."""

    def __init__(self, w, scale, block_shape, dtype, mxfp4_layout="plain"):
        self.w, self.scale, self.block_shape, self.dtype = w, scale, block_shape, dtype
        self.mma = mxfp4_layout == "mma"   # MXFP4 in moe_ops.mxfp4_layout's order
        E, N, K = w.shape
        self.shape = (E, N, 2 * K if weight_format(w) == "mxfp4" else K)

    def __getitem__(self, e):
        w = self.w[e]
        if self.mma:
            from moe_ops.mxfp4_layout import unswizzle_mxfp4

            w = unswizzle_mxfp4(w[None])[0]
        return dequantize_weights(w, self.scale[e], self.block_shape, self.dtype)


def quantize_fp8_block(w: torch.Tensor, block_shape=DEFAULT_BLOCK_SHAPE):
    """(float8_e4m3fn weight, float32 scale) of a float [E, N, K] (or [N, K]) weight, scale =
    block amax / 448 (DeepSeek-V3's weight_scale_inv; an all-zero block gets scale 1): for tests
    and for quantizing a model at load."""
    bn, bk = block_shape
    N, K = w.shape[-2:]
    nb, kb = -(-N // bn), -(-K // bk)
    wf = w.float()
    pad = F.pad(wf, (0, kb * bk - K, 0, nb * bn - N))
    blocks = pad.unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn))     # [.., nb, bn, kb, bk]
    amax = blocks.abs().amax(dim=(-3, -1))                           # [.., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = dequantize_fp8_block(torch.ones_like(wf), scale, block_shape)  # the scale per element
    return (wf / q).to(torch.float8_e4m3fn), scale


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (float32) rounded to the nearest float8_e4m3fn value (ties to even, saturating at 448
    as the GPU's cvt.rn.satfinite does), as float32."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def quantize_activation_groups(x: torch.Tensor, bk: int) -> torch.Tensor:
    """Activations as the W8A8 kernels see them: per row and per group of bk columns, amax =
    max(|x|) over the group (at least ACT_AMAX_FLOOR), q = e4m3(x * (448 / amax)) and the value
    q * (amax / 448). Computed in float32 (the kernels' arithmetic, both divisions correctly
    rounded); returns float64."""
    x = x.float()
    T, K = x.shape
    kb = -(-K // bk)
    g = F.pad(x, (0, kb * bk - K)).view(T, kb, bk)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp_min(ACT_AMAX_FLOOR)
    # tensor / tensor: torch computes `scalar / t` and `t / scalar` through a reciprocal (not
    # correctly rounded: 1133 of 4096 random 448 / amax differ by an ulp), which moves values
    # that sit next to an e4m3 rounding tie across it
    fp8_max = torch.full_like(amax, FP8_MAX)
    inv = fp8_max / amax
    scale = amax / fp8_max
    q = round_to_e4m3(g * inv)
    return (q.double() * scale.double()).view(T, kb * bk)[:, :K]


def apply_activation(g, u, activation="silu", alpha=1.702, limit=7.0):
    """a from the gate and up halves (moe.dispatch's activations: reference.dispatch.activate)."""
    return activate(g, u, activation, alpha, limit)


def dense_dispatch_reference(hidden, w13, w2, topk_weights, topk_ids, activation="silu",
                             w13_bias=None, w2_bias=None, alpha=1.702, limit=7.0,
                             gate_up_interleaved=False, weights_on_input=False,
                             quantize_act_bk=None, act_dtype=None, compute_dtype=torch.float64):
    """moe.dispatch on dense [E, 2I, H] / [E, H, I] weights (any float dtype), slot by slot in
    `compute_dtype`. quantize_act_bk: the W8A8 reference: the input of each GEMM (x, and a)
    quantized per token and per bk columns (quantize_activation_groups) first; act_dtype: the
    dtype the kernels store a in between (a is rounded to it before being quantized)."""
    T, H = hidden.shape
    E, I = w2.shape[0], w2.shape[2]
    cd = compute_dtype
    out = torch.zeros(T, H, dtype=cd, device=hidden.device)
    flat = topk_ids.reshape(-1).long()
    K = topk_ids.shape[1]
    weights = topk_weights.reshape(-1).to(cd)
    for e in flat[(flat >= 0) & (flat < E)].unique().tolist():
        slots = (flat == e).nonzero().flatten()
        tok = torch.div(slots, K, rounding_mode="floor")
        x = hidden[tok].to(cd)
        if weights_on_input:
            # the kernels scale x in float32 before quantizing it
            x = (hidden[tok].float() * topk_weights.reshape(-1)[slots, None].float()).to(cd)
        if quantize_act_bk is not None:
            x = quantize_activation_groups(x, quantize_act_bk).to(cd)
        z = x @ w13[e].to(cd).t()
        if w13_bias is not None:
            z = z + w13_bias[e].to(cd)
        if gate_up_interleaved:
            g, u = z[:, 0::2], z[:, 1::2]
        else:
            g, u = z[:, :I], z[:, I:]
        a = apply_activation(g, u, activation, alpha, limit)
        if act_dtype is not None:
            a = a.to(act_dtype).to(cd)
        if quantize_act_bk is not None:
            a = quantize_activation_groups(a, quantize_act_bk).to(cd)
        y = a @ w2[e].to(cd).t()
        if w2_bias is not None:
            y = y + w2_bias[e].to(cd)
        if not weights_on_input:
            y = y * weights[slots, None]
        out.index_add_(0, tok, y)
    return out


def quantized_dispatch_reference(hidden, w13, w2, topk_weights, topk_ids, activation="silu",
                                 w13_bias=None, w2_bias=None, alpha=1.702, limit=7.0,
                                 gate_up_interleaved=False, weights_on_input=False,
                                 w13_scale=None, w2_scale=None, block_shape=None,
                                 quantize_activations=True, emulate_kernel=True,
                                 compute_dtype=torch.float64, act_dtype=None,
                                 mxfp4_layout="plain"):
    """moe.dispatch with quantized weights, dequantized in `compute_dtype` ([T, H], that dtype).
    emulate_kernel (FP8 with quantize_activations): the W8A8 reference, activations quantized
    as the kernels do (a from its float32 value: the kernels quantize it in the gate+up
    epilogue); else
    unquantized activations (the float64 computation on the dequantized weights, the issue's
    accuracy anchor). act_dtype: a dtype a is rounded to before its quantization (None: none,
    as the kernels). mxfp4_layout "mma": MXFP4 weights in moe_ops.mxfp4_layout's order. This is
    also moe.dispatch's CPU kernel (emulate_kernel=True, compute_dtype float32, the result cast
    to hidden's dtype)."""
    fmt = weight_format(w13)
    bs = tuple(block_shape) if block_shape is not None else DEFAULT_BLOCK_SHAPE
    w13f = LazyDequantized(w13, w13_scale, bs, compute_dtype, mxfp4_layout)
    w2f = LazyDequantized(w2, w2_scale, bs, compute_dtype, mxfp4_layout)
    qa = fmt == "fp8" and quantize_activations and emulate_kernel
    return dense_dispatch_reference(
        hidden, w13f, w2f, topk_weights, topk_ids, activation, w13_bias, w2_bias, alpha, limit,
        gate_up_interleaved, weights_on_input, quantize_act_bk=bs[1] if qa else None,
        act_dtype=act_dtype if qa else None, compute_dtype=compute_dtype)


def quantized_dispatch_backward_reference(grad_out, hidden, w13, w2, topk_weights, topk_ids,
                                          activation="silu", w13_bias=None, w2_bias=None,
                                          alpha=1.702, limit=7.0, gate_up_interleaved=False,
                                          weights_on_input=False, w13_scale=None, w2_scale=None,
                                          block_shape=None, quantize_activations=True,
                                          compute_dtype=torch.float32, mxfp4_layout="plain"):
    """Gradients through frozen quantized experts: (d hidden, d topk_weights, d w13_bias,
    d w2_bias) (None for an absent bias), the weights dequantized one expert at a time. The
    activations' quantization (W8A8) counts as the identity (a straight-through estimator: its
    derivative is zero almost everywhere), so this is the gradient of the computation on the
    dequantized weights with unquantized activations. Each expert's slots are differentiated
    by autograd on their own small float graph (compute_dtype)."""
    T, H = hidden.shape
    cd = compute_dtype
    bs = tuple(block_shape) if block_shape is not None else DEFAULT_BLOCK_SHAPE
    w13f = LazyDequantized(w13, w13_scale, bs, cd, mxfp4_layout)
    w2f = LazyDequantized(w2, w2_scale, bs, cd, mxfp4_layout)
    E, I = w2f.shape[0], w2f.shape[2]
    K = topk_ids.shape[1]
    dev = hidden.device
    dx = torch.zeros(T, H, dtype=cd, device=dev)
    dw = torch.zeros(topk_ids.numel(), dtype=cd, device=dev)
    db13 = None if w13_bias is None else torch.zeros(w13_bias.shape, dtype=cd, device=dev)
    db2 = None if w2_bias is None else torch.zeros(w2_bias.shape, dtype=cd, device=dev)
    flat = topk_ids.reshape(-1).long()
    go = grad_out.to(cd)
    with torch.enable_grad():
        for e in flat[(flat >= 0) & (flat < E)].unique().tolist():
            slots = (flat == e).nonzero().flatten()
            tok = torch.div(slots, K, rounding_mode="floor")
            x = hidden[tok].detach().to(cd).requires_grad_(True)
            s = topk_weights.reshape(-1)[slots].detach().to(cd)[:, None].requires_grad_(True)
            b13 = None if w13_bias is None else w13_bias[e].detach().to(cd).requires_grad_(True)
            b2 = None if w2_bias is None else w2_bias[e].detach().to(cd).requires_grad_(True)
            z = (x * s if weights_on_input else x) @ w13f[e].t()
            if b13 is not None:
                z = z + b13
            g, u = (z[:, 0::2], z[:, 1::2]) if gate_up_interleaved else (z[:, :I], z[:, I:])
            y = apply_activation(g, u, activation, alpha, limit) @ w2f[e].t()
            if b2 is not None:
                y = y + b2
            if not weights_on_input:
                y = y * s
            inputs = [t for t in (x, s, b13, b2) if t is not None]
            grads = torch.autograd.grad(y, inputs, go[tok])
            dx.index_add_(0, tok, grads[0])
            dw[slots] = grads[1][:, 0]
            i = 2
            if b13 is not None:
                db13[e] = grads[i]
                i += 1
            if b2 is not None:
                db2[e] = grads[i]
    return (dx.to(hidden.dtype), dw.view(topk_weights.shape).to(topk_weights.dtype),
            None if db13 is None else db13.to(w13_bias.dtype),
            None if db2 is None else db2.to(w2_bias.dtype))

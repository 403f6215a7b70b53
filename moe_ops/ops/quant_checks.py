"""Argument checks of moe.dispatch with quantized expert weights (issue 42). Shapes and dtypes
only (no data is read: no host sync)."""
from __future__ import annotations

import torch

from moe_ops.reference.quant import DEFAULT_BLOCK_SHAPE, weight_format

# moe.dispatch's activations, in the kernels' code order (moe_ops.kernels.expert_gemm.ACT_CODES,
# quant_gemm's constants); moe_ops.ops.checks uses this list too.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "swiglu_oai", "silu_clamp", "silu_clamp_out",
               "swiglu_softcap")
QUANT_HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MXFP4_GROUP = 32   # e2m1 values per e8m0 scale
MXFP4_LAYOUTS = ("plain", "mma")   # moe.dispatch's mxfp4_layout (moe_ops.mxfp4_layout)


def _same_device(**tensors):
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if first is None:
            first = (name, t.device)
        elif t.device != first[1]:
            raise ValueError(f"all tensors must be on one device: {first[0]} is on {first[1]}, "
                             f"{name} is on {t.device}")


def is_quantized(w13, w2=None) -> bool:
    """Whether moe.dispatch takes its quantized path: w13 (or w2) float8_e4m3fn or uint8."""
    return any(isinstance(w, torch.Tensor) and weight_format(w) is not None for w in (w13, w2))


def _cdiv(a, b):
    return -(-a // b)


def _shape(name, t, shape, what):
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {what} = {list(shape)}, got {list(t.shape)}")


def normalize_block_shape(block_shape) -> tuple[int, int]:
    """[bn, bk] as a tuple of ints (default [128, 128]). bk is the kernels' K tile (one weight
    scale per K step), so it must be a power of two >= 16 (tl.dot's smallest K)."""
    if block_shape is None:
        return DEFAULT_BLOCK_SHAPE
    try:
        bs = [int(v) for v in block_shape]
    except TypeError:
        raise TypeError(f"block_shape must be a list of two ints [bn, bk], got {block_shape!r}") \
            from None
    if len(bs) != 2 or any(isinstance(v, bool) for v in block_shape):
        raise ValueError(f"block_shape must be [bn, bk] (two ints), got {list(block_shape)}")
    bn, bk = bs
    if bn < 1:
        raise ValueError(f"block_shape[0] (bn) must be >= 1, got {bn}")
    if bk < 16 or bk > 512 or bk & (bk - 1):
        raise ValueError(f"block_shape[1] (bk) must be a power of two in [16, 512] (the kernels' "
                         f"K tile), got {bk}")
    return bn, bk


def check_quantized_dispatch(hidden, w13, w2, topk_weights, topk_ids, activation="silu",
                             w13_bias=None, w2_bias=None, gate_up_interleaved=False,
                             weights_on_input=False, w13_scale=None, w2_scale=None,
                             block_shape=None, quantize_activations=True,
                             mxfp4_layout="plain"):
    """Checks moe.dispatch's arguments when w13/w2 are quantized; returns (format, H, I, bn, bk)
    with format 'fp8' or 'mxfp4' (bn, bk: the FP8 block shape; for MXFP4, (1, 32))."""
    check_mxfp4_layout_value(mxfp4_layout)
    for name, x in (("hidden", hidden), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights),
                    ("topk_ids", topk_ids)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    for name, x, rank, what in (("hidden", hidden, 2, "[T, H]"), ("w13", w13, 3, "[E, 2I, H]"),
                                ("w2", w2, 3, "[E, H, I]"), ("topk_weights", topk_weights, 2, "[T, K]"),
                                ("topk_ids", topk_ids, 2, "[T, K]")):
        if x.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {what}, got shape {list(x.shape)}")
    if hidden.dtype not in QUANT_HIDDEN_DTYPES:
        raise TypeError(f"hidden must be bfloat16, float16 or float32 with quantized expert "
                        f"weights (activations are quantized by the kernels), got {hidden.dtype}")
    fmt = weight_format(w13)
    if fmt is None or weight_format(w2) != fmt:
        raise TypeError(f"w13 and w2 must both be float8_e4m3fn (FP8 block-scaled) or both uint8 "
                        f"(MXFP4), got w13 {w13.dtype} and w2 {w2.dtype}")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if s is None:
            raise ValueError(f"{name} is required with {fmt} weights ({w13.dtype}): "
                             + ("float32 [E, ceil(N/bn), ceil(K/bk)] block scales" if fmt == "fp8"
                                else "uint8 e8m0 [E, N, K/32] scales"))
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
        if s.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {list(s.shape)}")
        want = torch.float32 if fmt == "fp8" else torch.uint8
        if s.dtype != want:
            raise TypeError(f"{name} must be {want} with {fmt} weights, got {s.dtype}")
    T, H = hidden.shape
    E = w13.shape[0]
    if fmt == "fp8":
        bn, bk = normalize_block_shape(block_shape)
        I = w2.shape[2]
        _shape("w13", w13, (E, 2 * I, H), "[E, 2I, H] (I = w2.shape[2], H = hidden.shape[1])")
        _shape("w2", w2, (E, H, I), "[E, H, I]")
        _shape("w13_scale", w13_scale, (E, _cdiv(2 * I, bn), _cdiv(H, bk)),
               f"[E, ceil(2I/bn), ceil(H/bk)] with block_shape [{bn}, {bk}]")
        _shape("w2_scale", w2_scale, (E, _cdiv(H, bn), _cdiv(I, bk)),
               f"[E, ceil(H/bn), ceil(I/bk)] with block_shape [{bn}, {bk}]")
    else:
        if block_shape is not None:
            raise ValueError(f"block_shape applies to FP8 weights only (MXFP4 scales one group "
                             f"of 32 values along the reduction dim), got {list(block_shape)}")
        bn, bk = 1, MXFP4_GROUP
        if H % MXFP4_GROUP:
            raise ValueError(f"MXFP4 weights need H = hidden.shape[1] to be a multiple of "
                             f"{MXFP4_GROUP} (one e8m0 scale per 32 values), got H = {H}")
        I = 2 * w2.shape[2]
        if I % MXFP4_GROUP:
            raise ValueError(f"MXFP4 w2 must be [E, H, I/2] uint8 with I a multiple of 32, got "
                             f"w2.shape = {list(w2.shape)} (I = {I})")
        _shape("w13", w13, (E, 2 * I, H // 2),
               "[E, 2I, H/2] (MXFP4 blocks, I = 2 * w2.shape[2])")
        _shape("w2", w2, (E, H, I // 2), "[E, H, I/2] (MXFP4 blocks)")
        _shape("w13_scale", w13_scale, (E, 2 * I, H // MXFP4_GROUP), "[E, 2I, H/32]")
        _shape("w2_scale", w2_scale, (E, H, I // MXFP4_GROUP), "[E, H, I/32]")
    if mxfp4_layout == "mma":
        check_mma_layout(fmt, H, I, w13, w2)
    if gate_up_interleaved and (2 * I) % 2:
        raise ValueError("gate_up_interleaved needs an even 2I")
    if topk_weights.dtype not in (torch.float32, hidden.dtype):
        raise TypeError(f"topk_weights must be float32 or hidden's dtype {hidden.dtype}, got "
                        f"{topk_weights.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.shape[0] != T:
            raise ValueError(f"{name} must have shape [T, K] with T = hidden.shape[0] = {T}, "
                             f"got {list(t.shape)}")
    if tuple(topk_ids.shape) != tuple(topk_weights.shape):
        raise ValueError(f"topk_ids must have topk_weights' shape {list(topk_weights.shape)}, "
                         f"got {list(topk_ids.shape)}")
    if topk_ids.shape[1] > E:
        raise ValueError(f"K = topk_ids.shape[1] = {topk_ids.shape[1]} must be at most E = {E}")
    for name, b, shape, what in (("w13_bias", w13_bias, (E, 2 * I), "[E, 2I]"),
                                 ("w2_bias", w2_bias, (E, H), "[E, H]")):
        if b is None:
            continue
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(b).__name__}")
        _shape(name, b, shape, what)
        if b.dtype not in (torch.float32, hidden.dtype):
            raise TypeError(f"{name} must be float32 or hidden's dtype {hidden.dtype}, got {b.dtype}")
    _same_device(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights,
                      topk_ids=topk_ids, w13_scale=w13_scale, w2_scale=w2_scale,
                      w13_bias=w13_bias, w2_bias=w2_bias)
    if hidden.device.type == "cuda" and torch.cuda.get_device_capability(hidden.device) < (8, 9) \
            and fmt == "fp8" and quantize_activations:
        raise ValueError("FP8 W8A8 (quantize_activations=True) needs a GPU with FP8 tensor cores "
                         "(sm_89+); pass quantize_activations=False for W8A16")
    return fmt, H, I, bn, bk


def check_mxfp4_layout_value(mxfp4_layout):
    if mxfp4_layout not in MXFP4_LAYOUTS:
        raise ValueError(f"mxfp4_layout must be 'plain' (transformers' blocks) or 'mma' "
                         f"(moe_ops.swizzle_mxfp4's order), got {mxfp4_layout!r}")


def reject_mma_layout(w13):
    """mxfp4_layout='mma' given with weights that are not MXFP4."""
    raise ValueError(f"mxfp4_layout='mma' applies to MXFP4 (uint8) weights only, got "
                     f"{str(w13.dtype).replace('torch.', '')} weights")


def check_mma_layout(fmt, H, I, w13, w2):
    """mxfp4_layout='mma' (moe_ops.mxfp4_layout): MXFP4 weights, H and I multiples of 64, each
    expert's [N, K/2] bytes contiguous (as swizzle_mxfp4 returns them)."""
    if fmt != "mxfp4":
        reject_mma_layout(w13)
    if H % 64 or I % 64:
        raise ValueError(f"mxfp4_layout='mma' needs H and I multiples of 64, got H={H}, I={I}")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.stride(2) != 1 or w.stride(1) != w.shape[2]:
            raise ValueError(f"{name}: the mma layout is read as contiguous [N, K/2] rows per "
                             f"expert (moe_ops.swizzle_mxfp4's output), got strides "
                             f"{tuple(w.stride())}")


def reject_scale_grad(w13_scale, w2_scale):
    """With grad mode on: quantized expert weights and their scales are frozen, so a scale that
    requires grad (a float32 nn.Parameter left trainable) is refused by name instead of
    getting a silently missing gradient. (Under no_grad / inference_mode it is read as is.)"""
    for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if isinstance(s, torch.Tensor) and s.requires_grad:
            raise ValueError(f"{name} requires grad: quantized expert weights are frozen (no "
                             f"gradient for them or their scales); pass {name}.detach() or "
                             f"set requires_grad_(False) on it")


def reject_quantized_grad():
    """The internal backward ops (moe.dispatch_backward / _saved) compute weight gradients and
    do not take quantized weights: moe.dispatch's autograd differentiates through frozen
    quantized experts itself (moe_ops.ops.quant_autograd)."""
    raise NotImplementedError(
        "moe.dispatch_backward does not take quantized (FP8/MXFP4) expert weights: they are "
        "frozen; moe.dispatch's autograd gives gradients for hidden, topk_weights and the biases")

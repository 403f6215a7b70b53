"""Eager-mode argument validation shared by the real and fake implementations."""
from __future__ import annotations

import math

import torch

from moe_ops._runtime import checks_enabled
from moe_ops.ops.quant_checks import (ACTIVATIONS, check_mxfp4_layout_value, check_quantized_dispatch,
                                      reject_mma_layout)

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_tensor_args(**tensors):
    for name, x in tensors.items():
        _tensor(name, x)


def _rank(name, x, rank, what):
    if x.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {what}, got shape {tuple(x.shape)}")


def _dtypes_ok(dtype, device_type):
    # float64 runs the reference only (CPU): it exists for gradcheck and oracles.
    return dtype in FLOAT_DTYPES or (dtype == torch.float64 and device_type == "cpu")


def check_same_device(**tensors):
    first_name = first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if first is None:
            first_name, first = name, t.device
        elif t.device != first:
            raise ValueError(f"all tensors must be on one device: {first_name} is on {first}, "
                             f"{name} is on {t.device}")


def check_route(router_logits, top_k, scoring, renormalize, bias, num_groups, topk_groups, scale):
    _tensor("router_logits", router_logits)
    _rank("router_logits", router_logits, 2, "[T, E]")
    if not router_logits.dtype.is_floating_point:
        raise TypeError(f"router_logits must be a float tensor, got {router_logits.dtype}")
    E = router_logits.shape[1]
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, E={E}], got {top_k}")
    if num_groups < 1 or E % num_groups != 0:
        raise ValueError(f"num_groups must be >= 1 and divide E={E}, got {num_groups}")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups must be in [1, num_groups={num_groups}], got {topk_groups}")
    if top_k > topk_groups * (E // num_groups):
        raise ValueError(
            f"top_k={top_k} exceeds the experts in the topk_groups={topk_groups} allowed groups "
            f"({topk_groups * (E // num_groups)})")
    # (a symbolic float under torch.compile is left alone: it has no value to check)
    if isinstance(scale, (int, float)) and not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}: every weight would be NaN or inf")
    if bias is not None:
        _tensor("bias", bias)
        if tuple(bias.shape) != (E,):
            raise ValueError(f"bias must have shape [E] = [{E}], got {tuple(bias.shape)}")
        if not bias.dtype.is_floating_point:
            raise TypeError(f"bias must be a float tensor, got {bias.dtype}")
        check_same_device(router_logits=router_logits, bias=bias)


QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.uint8)
# Strides the kernels address as 32-bit element offsets within a tile step (larger ones would
# need a copy of the weight, which the op never makes).
_MAX_STRIDE = 2**31 - 1


def _is_float(x) -> bool:
    return isinstance(x, (float, int, torch.SymFloat, torch.SymInt)) and not isinstance(x, bool)


def check_variant_types(activation="silu", w13_bias=None, w2_bias=None, alpha=1.702, limit=7.0,
                        gate_up_interleaved=False, weights_on_input=False, w13_scale=None,
                        w2_scale=None, block_shape=None, quantize_activations=True, w3=None,
                        mxfp4_layout="plain"):
    """The variant arguments' Python types (the dispatcher would raise a RuntimeError without
    the argument's name) and values that need no tensor."""
    if not isinstance(mxfp4_layout, str):
        raise TypeError(f"mxfp4_layout must be a str ('plain' or 'mma'), got "
                        f"{type(mxfp4_layout).__name__}")
    check_mxfp4_layout_value(mxfp4_layout)
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a str (one of {', '.join(ACTIVATIONS)}), "
                        f"got {type(activation).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, "
                         f"got {activation!r}")
    for name, t in (("w13_bias", w13_bias), ("w2_bias", w2_bias), ("w13_scale", w13_scale),
                    ("w2_scale", w2_scale), ("w3", w3)):
        if t is not None:
            _tensor(name, t)
    for name, x in (("alpha", alpha), ("limit", limit)):
        if not _is_float(x):
            raise TypeError(f"{name} must be a float, got {type(x).__name__}")
        # (a symbolic float under torch.compile has no value to check)
        if isinstance(x, (int, float)) and not math.isfinite(x):
            raise ValueError(f"{name} must be finite, got {x}")
    if isinstance(limit, (int, float)) and limit <= 0:
        raise ValueError(f"limit must be > 0 (swiglu_oai, silu_clamp and silu_clamp_out clamp "
                         f"the gate to <= limit and the up projection to [-limit, limit]; "
                         f"swiglu_softcap caps the up projection at limit), got {limit}")
    if activation == "swiglu_softcap" and isinstance(alpha, (int, float)) and alpha <= 0:
        raise ValueError(f"alpha must be > 0 with activation='swiglu_softcap' (the gate's "
                         f"softcap), got {alpha}")
    for name, x in (("gate_up_interleaved", gate_up_interleaved),
                    ("weights_on_input", weights_on_input),
                    ("quantize_activations", quantize_activations)):
        if not isinstance(x, bool):
            raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    if block_shape is not None:
        if (not isinstance(block_shape, (list, tuple)) or len(block_shape) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) for b in block_shape)):
            raise TypeError(f"block_shape must be a list of two ints [bn, bk], got {block_shape!r}")


def check_weight_layout(name, w):
    """Any strides are read as they are (a transposed checkpoint layout is a view, never
    copied); what the kernels cannot address raises instead of being copied."""
    if w.layout != torch.strided:
        raise TypeError(f"{name} must be a strided (dense) tensor, got layout {w.layout}: the "
                        "kernels would need a dense copy of it, which moe.dispatch never makes")
    if any(st < 0 or st > _MAX_STRIDE for st in w.stride()):
        raise ValueError(f"{name} has strides {tuple(w.stride())} the kernels cannot address "
                         f"(each must be in [0, 2^31)): a non-view copy would be needed "
                         f"({name}.contiguous()), which moe.dispatch never makes")


def _check_bias(name, b, shape, what, hidden):
    _tensor(name, b)
    if tuple(b.shape) != shape:
        raise ValueError(f"{name} must have shape {what} = {list(shape)}, got {tuple(b.shape)}")
    if b.dtype not in (hidden.dtype, torch.float32):
        raise TypeError(f"{name} must be float32 or hidden's dtype {hidden.dtype}, got {b.dtype}")
    check_same_device(hidden=hidden, **{name: b})


def check_dispatch(hidden, w13, w2, topk_weights, topk_ids, activation="silu", w13_bias=None,
                   w2_bias=None, alpha=1.702, limit=7.0, gate_up_interleaved=False,
                   weights_on_input=False, w13_scale=None, w2_scale=None, block_shape=None,
                   quantize_activations=True, w3=None, mxfp4_layout="plain"):
    for name, x in (("hidden", hidden), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights),
                    ("topk_ids", topk_ids)):
        _tensor(name, x)
    _rank("hidden", hidden, 2, "[T, H]")
    _rank("w13", w13, 3, "[E, I, H] (the gate, with w3)" if w3 is not None else "[E, 2I, H]")
    _rank("w2", w2, 3, "[E, H, I]")
    _rank("topk_weights", topk_weights, 2, "[T, K]")
    _rank("topk_ids", topk_ids, 2, "[T, K]")
    check_variant_types(activation, w13_bias, w2_bias, alpha, limit, gate_up_interleaved,
                        weights_on_input, w13_scale, w2_scale, block_shape, quantize_activations,
                        w3, mxfp4_layout)
    if w3 is not None:
        _rank("w3", w3, 3, "[E, I, H] (the up projection)")
        if gate_up_interleaved:
            raise ValueError("w3 (a separate up projection) cannot be combined with "
                             "gate_up_interleaved=True: with w3, w13 holds the gate rows only")
        if w13.dtype in QUANTIZED_DTYPES or w2.dtype in QUANTIZED_DTYPES \
                or w3.dtype in QUANTIZED_DTYPES:
            raise ValueError("w3 (a separate up projection) is not supported with quantized "
                             "(FP8 / MXFP4) expert weights: pass the gate and up rows as one w13")
    for name, s, w in (("w13_scale", w13_scale, w13), ("w2_scale", w2_scale, w2),
                       ("block_shape", block_shape, w13)):
        if s is not None and w.dtype not in QUANTIZED_DTYPES:
            raise TypeError(f"{name} given with {str(w.dtype).replace('torch.', '')} weights: "
                            "scales and block_shape apply to quantized weights only "
                            "(float8_e4m3fn, or uint8 holding MXFP4)")
    if w13.dtype in QUANTIZED_DTYPES or w2.dtype in QUANTIZED_DTYPES:
        check_quantized_dispatch(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias,
                                 w2_bias, gate_up_interleaved, weights_on_input, w13_scale,
                                 w2_scale, block_shape, quantize_activations, mxfp4_layout)
        check_weight_layout("w13", w13)
        check_weight_layout("w2", w2)
        return
    if mxfp4_layout != "plain":
        reject_mma_layout(w13)
    check_same_device(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    dev = hidden.device.type
    if not _dtypes_ok(hidden.dtype, dev):
        cpu_only = f" on {dev} (float64 runs on the CPU only)" if hidden.dtype == torch.float64 else ""
        raise TypeError(f"hidden must be bfloat16, float16 or float32{cpu_only}, got {hidden.dtype}")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != hidden.dtype:
            raise TypeError(f"{name} must have hidden's dtype {hidden.dtype}, got {w.dtype}")
    if topk_weights.dtype not in (torch.float32, hidden.dtype):
        raise TypeError(
            f"topk_weights must be float32 or hidden's dtype {hidden.dtype}, got {topk_weights.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    check_weight_layout("w13", w13)
    check_weight_layout("w2", w2)
    T, H = hidden.shape
    E, two_i, H13 = w13.shape
    E2, H2, I = w2.shape
    if w3 is not None:
        _check_w3(w3, w13, hidden, E, I, H)
        two_i *= 2   # (w13 holds the I gate rows, w3 the I up rows)
    if gate_up_interleaved and two_i % 2:
        raise ValueError(f"gate_up_interleaved=True needs an even w13.shape[1] (gate rows 2i, up "
                         f"rows 2i+1), got {two_i}")
    if w3 is not None and w13.shape[1] != I:
        raise ValueError(f"w13 must have shape [E, I, H] with I = w2.shape[2] = {I} when w3 is "
                         f"given (w13 holds the gate rows only), got w13.shape[1] = {w13.shape[1]}")
    if two_i != 2 * I:
        raise ValueError(
            f"w13 must have shape [E, 2I, H] with 2I = 2 * w2.shape[2] = {2 * I}, got w13.shape[1] = {two_i}")
    if H13 != H:
        raise ValueError(f"w13 must have shape [E, 2I, H] with H = hidden.shape[1] = {H}, got {H13}")
    if H2 != H:
        raise ValueError(f"w2 must have shape [E, H, I] with H = hidden.shape[1] = {H}, got {H2}")
    if E2 != E:
        raise ValueError(f"w2 must have E = w13.shape[0] = {E} experts, got {E2}")
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.shape[0] != T:
            raise ValueError(f"{name} must have shape [T, K] with T = hidden.shape[0] = {T}, "
                             f"got {tuple(t.shape)}")
    if tuple(topk_ids.shape) != tuple(topk_weights.shape):
        raise ValueError(
            f"topk_ids must have topk_weights' shape {tuple(topk_weights.shape)}, got {tuple(topk_ids.shape)}")
    K = topk_ids.shape[1]
    if K > E:
        raise ValueError(f"K = topk_ids.shape[1] = {K} must be at most E = {E}")
    if w13_bias is not None:
        _check_bias("w13_bias", w13_bias, (E, two_i), "[E, 2I]", hidden)
    if w2_bias is not None:
        _check_bias("w2_bias", w2_bias, (E, H), "[E, H]", hidden)


def _check_w3(w3, w13, hidden, E, I, H):
    """w3, the up projection given apart from the gate (w13 [E, I, H]): [E, I, H], hidden's
    dtype and device, any strides the kernels can address."""
    if w3.dtype != hidden.dtype:
        raise TypeError(f"w3 must have hidden's dtype {hidden.dtype}, got {w3.dtype}")
    check_same_device(hidden=hidden, w3=w3)
    check_weight_layout("w3", w3)
    if tuple(w3.shape) != (E, I, H):
        raise ValueError(f"w3 must have shape [E, I, H] = {[E, I, H]} (E = w13.shape[0], I = "
                         f"w2.shape[2], H = hidden.shape[1]), got {tuple(w3.shape)}")


def check_dispatch_backward(grad_out, z, hidden, w13, w2, topk_weights, topk_ids, **variant):
    """The internal backward ops (moe.dispatch_backward, moe.dispatch_backward_saved): the
    forward's arguments, grad_out [T, H] and (saved) z [T*K, 2I], both in hidden's dtype on
    its device. moe.dispatch's autograd always passes such tensors; a direct call with others
    would read out of bounds in the kernels."""
    check_dispatch(hidden, w13, w2, topk_weights, topk_ids, **variant)
    extra = (("grad_out", grad_out, tuple(hidden.shape), "[T, H]"),)
    if z is not None:
        extra += (("z", z, (topk_ids.shape[0] * topk_ids.shape[1], 2 * w2.shape[2]),
                   "[T*K, 2I]"),)
    for name, t, shape, what in extra:
        _tensor(name, t)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {what} = {list(shape)}, got {tuple(t.shape)}")
        if t.dtype != hidden.dtype:
            raise TypeError(f"{name} must have hidden's dtype {hidden.dtype}, got {t.dtype}")
        check_same_device(hidden=hidden, **{name: t})


def check_ids_in_range(topk_ids, num_experts):
    """Data check (host sync): only when MOE_OPS_CHECK=1 and on real tensors."""
    if not checks_enabled() or topk_ids.numel() == 0:
        return
    hi = int(topk_ids.max())
    if hi >= num_experts:
        raise ValueError(f"topk_ids holds expert id {hi}, must be < E = {num_experts} (ids < 0 are dropped)")

"""Eager-mode argument validation shared by the real and fake implementations."""
from __future__ import annotations

import math

import torch

from moe_ops._runtime import checks_enabled

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


def check_dispatch(hidden, w13, w2, topk_weights, topk_ids, activation):
    for name, x in (("hidden", hidden), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights),
                    ("topk_ids", topk_ids)):
        _tensor(name, x)
    _rank("hidden", hidden, 2, "[T, H]")
    _rank("w13", w13, 3, "[E, 2I, H]")
    _rank("w2", w2, 3, "[E, H, I]")
    _rank("topk_weights", topk_weights, 2, "[T, K]")
    _rank("topk_ids", topk_ids, 2, "[T, K]")
    if activation != "silu":
        raise ValueError(f"activation must be 'silu', got {activation!r}")
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
    T, H = hidden.shape
    E, two_i, H13 = w13.shape
    E2, H2, I = w2.shape
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


def check_dispatch_backward(grad_out, z, hidden, w13, w2, topk_weights, topk_ids, activation):
    """The internal backward ops (moe.dispatch_backward, moe.dispatch_backward_saved): the
    forward's arguments, grad_out [T, H] and (saved) z [T*K, 2I], both in hidden's dtype on
    its device. moe.dispatch's autograd always passes such tensors; a direct call with others
    would read out of bounds in the kernels."""
    check_dispatch(hidden, w13, w2, topk_weights, topk_ids, activation)
    extra = (("grad_out", grad_out, tuple(hidden.shape), "[T, H]"),)
    if z is not None:
        extra += (("z", z, (topk_ids.shape[0] * topk_ids.shape[1], w13.shape[1]), "[T*K, 2I]"),)
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

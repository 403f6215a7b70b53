"""moe::route: schema, fake, autograd, device dispatch."""
from __future__ import annotations

import numbers

import torch

from moe_ops._compat import after_autograd, below_autograd
from moe_ops._runtime import on_device, use_triton
from moe_ops.ops._registry import LIB, define, reject_forward_ad, reject_functorch
from moe_ops.ops.checks import check_route, check_tensor_args
from moe_ops.reference.routing import route_backward_reference, route_reference

ROUTE_SCHEMA = (
    'route(Tensor router_logits, int top_k, str scoring="softmax", bool renormalize=True, '
    "Tensor? bias=None, int num_groups=1, int topk_groups=1, float scale=1.0) "
    "-> (Tensor topk_weights, Tensor topk_ids)"
)
ROUTE = define(ROUTE_SCHEMA)
# logits / bias dtypes the Triton kernel loads itself; others are converted to float32 first
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.library.register_kernel(ROUTE, ("cpu", "cuda"))
def _route_impl(router_logits, top_k, scoring="softmax", renormalize=True, bias=None,
                num_groups=1, topk_groups=1, scale=1.0):
    check_route(router_logits, top_k, scoring, renormalize, bias, num_groups, topk_groups, scale)
    if router_logits.dtype not in _KERNEL_DTYPES:
        # The contract scores in float32 whatever the logits' dtype: float64 logits give what
        # their float32 rounding gives (the backward still runs in float64); the other float
        # dtypes (float8 variants) are converted exactly. The kernel loads only these: Triton's
        # interpreter has no float8_e8m0fnu, its CUDA backend no fnuz float8 (nor float8 at all
        # before sm_89).
        router_logits = router_logits.float()
    if bias is not None and bias.dtype not in _KERNEL_DTYPES:
        bias = bias.float()
    if use_triton(router_logits):
        from moe_ops.launch.routing import route_triton

        with on_device(router_logits):
            return route_triton(router_logits, top_k, scoring, renormalize, bias, num_groups,
                                topk_groups, scale)
    w, ids = route_reference(router_logits, top_k, scoring, renormalize, bias, num_groups,
                             topk_groups, scale)
    return w.to(torch.float32), ids


@torch.library.register_fake(ROUTE)
def _route_fake(router_logits, top_k, scoring="softmax", renormalize=True, bias=None,
                num_groups=1, topk_groups=1, scale=1.0):
    check_route(router_logits, top_k, scoring, renormalize, bias, num_groups, topk_groups, scale)
    T = router_logits.shape[0]
    return (router_logits.new_empty((T, top_k), dtype=torch.float32),
            router_logits.new_empty((T, top_k), dtype=torch.int32))


class _RouteFunction(torch.autograd.Function):
    """Autograd of moe.route: a gradient to router_logits only (the ids are selections; no
    gradient to the selection bias, the groups or the scale). A Python Autograd kernel like
    moe.dispatch's rather than torch.library.register_autograd, whose generic wrapper cost ~20
    us of host time per call even without gradients (docs/design.md)."""

    @staticmethod
    def forward(ctx, router_logits, top_k, scoring, renormalize, bias, num_groups, topk_groups,
                scale, keyset):
        with below_autograd():
            weights, ids = _ROUTE_OP.redispatch(keyset, router_logits, top_k, scoring,
                                                renormalize, bias, num_groups, topk_groups, scale)
        ctx.save_for_backward(router_logits, ids)
        ctx.scoring, ctx.renormalize, ctx.scale = scoring, renormalize, scale
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx, grad_weights, grad_ids):
        router_logits, topk_ids = ctx.saved_tensors
        grad_logits = route_backward_reference(grad_weights, router_logits, topk_ids, ctx.scoring,
                                               ctx.renormalize, None, 1, 1, ctx.scale)
        return grad_logits, None, None, None, None, None, None, None, None


_ROUTE_OP = torch.ops.moe.route.default


def _route_autograd(keyset, router_logits, top_k, scoring="softmax", renormalize=True,
                    bias=None, num_groups=1, topk_groups=1, scale=1.0):
    below = after_autograd(keyset)
    reject_forward_ad("moe.route", router_logits)
    if torch.is_grad_enabled() and router_logits.requires_grad:
        reject_functorch("moe.route")
        return _RouteFunction.apply(router_logits, top_k, scoring, renormalize, bias, num_groups,
                                    topk_groups, scale, below)
    with below_autograd():
        return _ROUTE_OP.redispatch(below, router_logits, top_k, scoring, renormalize, bias,
                                    num_groups, topk_groups, scale)


LIB.impl("route", _route_autograd, "Autograd", with_keyset=True)


def route(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax",
          renormalize: bool = True, bias: torch.Tensor | None = None, num_groups: int = 1,
          topk_groups: int = 1, scale: float = 1.0):
    """Python entry point of `torch.ops.moe.route` (same arguments, keyword-friendly). The
    scalar arguments' types are checked here: torch.ops.moe.route itself rejects a float top_k
    in the dispatcher with a RuntimeError and takes a bool as an int.

    Non-finite logits: -inf experts come last (a row with fewer finite scores than top_k
    still gets distinct ids); a NaN selection score ranks first, as torch.topk ranks NaN (ties
    with +inf by index), so a NaN logit shows up in the weights and the layer's output instead
    of being routed around. CPU reference and Triton kernel pick the same ids."""
    check_tensor_args(router_logits=router_logits)
    top_k = _scalar("top_k", top_k, numbers.Integral, torch.SymInt, int)
    num_groups = _scalar("num_groups", num_groups, numbers.Integral, torch.SymInt, int)
    topk_groups = _scalar("topk_groups", topk_groups, numbers.Integral, torch.SymInt, int)
    scale = _scalar("scale", scale, numbers.Real, torch.SymFloat, float)
    if not isinstance(scoring, str):
        raise TypeError(f"scoring must be a str ('softmax' or 'sigmoid'), got {type(scoring).__name__}")
    if not isinstance(renormalize, bool):
        kind = type(renormalize)
        if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):   # numpy.bool_
            renormalize = bool(renormalize)
        else:
            name = kind.__name__ if kind.__module__ == "builtins" else \
                f"{kind.__module__}.{kind.__qualname__}"
            raise TypeError(f"renormalize must be a bool, got {name}")
    if bias is not None:
        check_tensor_args(bias=bias)
    if torch.compiler.is_compiling():   # eager's exception types under torch.compile (see dispatch)
        check_route(router_logits, top_k, scoring, renormalize, bias, num_groups, topk_groups, scale)
    return torch.ops.moe.route(router_logits, top_k, scoring, renormalize, bias, num_groups,
                               topk_groups, scale)


def _scalar(name, v, kind, sym, cast):
    """v as a Python int/float (numpy scalars pass; symbolic sizes under torch.compile stay as
    they are), or a TypeError naming the argument (a bool is not taken as a number)."""
    if type(v) is cast:   # the common case, first (type(True) is bool, not int)
        return v
    if isinstance(v, sym):
        return v
    if not isinstance(v, kind) or isinstance(v, bool):
        raise TypeError(f"{name} must be {'an int' if cast is int else 'a float'}, "
                        f"got {type(v).__name__}")
    return cast(v)

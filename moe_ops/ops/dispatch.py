"""moe::dispatch (and the internal moe::dispatch_backward): schema, fake, autograd, device
dispatch."""
from __future__ import annotations

import torch

from moe_ops._runtime import use_triton
from moe_ops.ops._registry import define
from moe_ops.ops.checks import check_dispatch, check_ids_in_range, check_tensor_args
from moe_ops.reference.dispatch import dispatch_backward_reference, dispatch_reference

DISPATCH_SCHEMA = (
    "dispatch(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
    'str activation="silu") -> Tensor'
)
DISPATCH_BACKWARD_SCHEMA = (
    "dispatch_backward(Tensor grad_out, Tensor hidden, Tensor w13, Tensor w2, "
    'Tensor topk_weights, Tensor topk_ids, str activation="silu") '
    "-> (Tensor grad_hidden, Tensor grad_w13, Tensor grad_w2, Tensor grad_topk_weights)"
)
DISPATCH = define(DISPATCH_SCHEMA)
DISPATCH_BACKWARD = define(DISPATCH_BACKWARD_SCHEMA)


@torch.library.register_kernel(DISPATCH, ("cpu", "cuda"))
def _dispatch_impl(hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    check_dispatch(hidden, w13, w2, topk_weights, topk_ids, activation)
    check_ids_in_range(topk_ids, w13.shape[0])
    if use_triton(hidden) and hidden.dtype != torch.float64:
        from moe_ops.launch.dispatch import dispatch_triton

        if _interpreted_bf16(hidden):
            out = dispatch_triton(*_upcast(hidden, w13, w2, topk_weights), topk_ids, activation)
            return out.to(hidden.dtype)
        return dispatch_triton(hidden, w13, w2, topk_weights, topk_ids, activation)
    return dispatch_reference(hidden, w13, w2, topk_weights, topk_ids, activation)


def _interpreted_bf16(hidden):
    # Triton's interpreter computes bfloat16 tl.dot wrongly without raising (relative error ~1e11
    # measured with triton 3.9 here): interpreted bf16 runs the kernels on float32 copies.
    return hidden.device.type == "cpu" and hidden.dtype == torch.bfloat16


def _upcast(*tensors):
    return [t.float() if t.dtype == torch.bfloat16 else t for t in tensors]


@torch.library.register_fake(DISPATCH)
def _dispatch_fake(hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    check_dispatch(hidden, w13, w2, topk_weights, topk_ids, activation)
    return hidden.new_empty(hidden.shape)


@torch.library.register_kernel(DISPATCH_BACKWARD, ("cpu", "cuda"))
def _dispatch_backward_impl(grad_out, hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    if use_triton(hidden) and hidden.dtype != torch.float64:
        from moe_ops.launch.dispatch_backward import dispatch_backward_triton

        if _interpreted_bf16(hidden):
            grads = dispatch_backward_triton(*_upcast(grad_out, hidden, w13, w2, topk_weights),
                                             topk_ids, activation)
            return tuple(g.to(t.dtype) for g, t in zip(grads, (hidden, w13, w2, topk_weights)))
        return dispatch_backward_triton(grad_out, hidden, w13, w2, topk_weights, topk_ids,
                                        activation)
    return dispatch_backward_reference(grad_out, hidden, w13, w2, topk_weights, topk_ids, activation)


@torch.library.register_fake(DISPATCH_BACKWARD)
def _dispatch_backward_fake(grad_out, hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    return (hidden.new_empty(hidden.shape), w13.new_empty(w13.shape), w2.new_empty(w2.shape),
            topk_weights.new_empty(topk_weights.shape))


def _dispatch_setup_context(ctx, inputs, output):
    hidden, w13, w2, topk_weights, topk_ids, activation = inputs
    ctx.save_for_backward(hidden, w13, w2, topk_weights, topk_ids)
    ctx.activation = activation


def _dispatch_backward(ctx, grad_out):
    hidden, w13, w2, topk_weights, topk_ids = ctx.saved_tensors
    gx, g13, g2, gw = torch.ops.moe.dispatch_backward(
        grad_out.contiguous(), hidden, w13, w2, topk_weights, topk_ids, ctx.activation)
    need = ctx.needs_input_grad
    return (gx if need[0] else None, g13 if need[1] else None, g2 if need[2] else None,
            gw if need[3] else None, None, None)


torch.library.register_autograd(DISPATCH, _dispatch_backward, setup_context=_dispatch_setup_context)


def dispatch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu"):
    """Python entry point of `torch.ops.moe.dispatch`. Argument types are checked here too: a
    non-tensor given to torch.ops.moe.dispatch itself fails in the dispatcher with a RuntimeError."""
    check_tensor_args(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    return torch.ops.moe.dispatch(hidden, w13, w2, topk_weights, topk_ids, activation)

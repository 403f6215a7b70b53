"""moe::dispatch (and the internal moe::dispatch_train, moe::dispatch_backward,
moe::dispatch_backward_saved): schema, fake, autograd, device dispatch.

Autograd: with inputs that need gradients, moe.dispatch runs as moe.dispatch_train, which also
returns the SwiGLU pre-activation z [T*K, 2I] for moe.dispatch_backward_saved; with
set_recompute(True) it saves only its inputs and moe.dispatch_backward recomputes z."""
from __future__ import annotations

import torch

from moe_ops._compat import after_autograd, any_requires_grad, below_autograd
from moe_ops._runtime import on_device, recompute_enabled, use_triton
from moe_ops.ops._registry import LIB, define, reject_forward_ad, reject_functorch
from moe_ops.ops.checks import (check_dispatch, check_dispatch_backward, check_ids_in_range,
                                check_tensor_args)
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
DISPATCH_TRAIN_SCHEMA = (
    "dispatch_train(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
    'str activation="silu") -> (Tensor out, Tensor z)'
)
DISPATCH_BACKWARD_SAVED_SCHEMA = (
    "dispatch_backward_saved(Tensor grad_out, Tensor z, Tensor hidden, Tensor w13, Tensor w2, "
    'Tensor topk_weights, Tensor topk_ids, str activation="silu") '
    "-> (Tensor grad_hidden, Tensor grad_w13, Tensor grad_w2, Tensor grad_topk_weights)"
)
DISPATCH = define(DISPATCH_SCHEMA)
DISPATCH_BACKWARD = define(DISPATCH_BACKWARD_SCHEMA)
DISPATCH_TRAIN = define(DISPATCH_TRAIN_SCHEMA)
DISPATCH_BACKWARD_SAVED = define(DISPATCH_BACKWARD_SAVED_SCHEMA)


def _forward(hidden, w13, w2, topk_weights, topk_ids, activation, save_z):
    """moe.dispatch (save_z=False: out) and moe.dispatch_train (save_z=True: (out, z))."""
    check_dispatch(hidden, w13, w2, topk_weights, topk_ids, activation)
    check_ids_in_range(topk_ids, w13.shape[0])
    if use_triton(hidden) and hidden.dtype != torch.float64:
        from moe_ops.launch.dispatch import dispatch_triton

        if _interpreted_bf16(hidden):
            res = dispatch_triton(*_upcast(hidden, w13, w2, topk_weights), topk_ids, activation,
                                  save_z=save_z)
            return tuple(r.to(hidden.dtype) for r in res) if save_z else res.to(hidden.dtype)
        with on_device(hidden):
            return dispatch_triton(hidden, w13, w2, topk_weights, topk_ids, activation,
                                   save_z=save_z)
    return dispatch_reference(hidden, w13, w2, topk_weights, topk_ids, activation, return_z=save_z)


def _backward(grad_out, z, hidden, w13, w2, topk_weights, topk_ids, activation):
    """moe.dispatch_backward (z=None: recomputed) and moe.dispatch_backward_saved."""
    check_dispatch_backward(grad_out, z, hidden, w13, w2, topk_weights, topk_ids, activation)
    if use_triton(hidden) and hidden.dtype != torch.float64:
        from moe_ops.launch.dispatch_backward import dispatch_backward_triton

        if _interpreted_bf16(hidden):
            grads = dispatch_backward_triton(*_upcast(grad_out, hidden, w13, w2, topk_weights),
                                             topk_ids, activation,
                                             z=None if z is None else z.float())
            return tuple(g.to(t.dtype) for g, t in zip(grads, (hidden, w13, w2, topk_weights)))
        with on_device(hidden):
            return dispatch_backward_triton(grad_out, hidden, w13, w2, topk_weights, topk_ids,
                                            activation, z=z)
    # The reference recomputes z in float32/float64 (z is a cache of W13_e x).
    return dispatch_backward_reference(grad_out, hidden, w13, w2, topk_weights, topk_ids, activation)


@torch.library.register_kernel(DISPATCH, ("cpu", "cuda"))
def _dispatch_impl(hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    return _forward(hidden, w13, w2, topk_weights, topk_ids, activation, save_z=False)


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
    return _backward(grad_out, None, hidden, w13, w2, topk_weights, topk_ids, activation)


@torch.library.register_fake(DISPATCH_BACKWARD)
def _dispatch_backward_fake(grad_out, hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    check_dispatch_backward(grad_out, None, hidden, w13, w2, topk_weights, topk_ids, activation)
    return (hidden.new_empty(hidden.shape), w13.new_empty(w13.shape), w2.new_empty(w2.shape),
            topk_weights.new_empty(topk_weights.shape))


@torch.library.register_kernel(DISPATCH_TRAIN, ("cpu", "cuda"))
def _dispatch_train_impl(hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    return _forward(hidden, w13, w2, topk_weights, topk_ids, activation, save_z=True)


@torch.library.register_fake(DISPATCH_TRAIN)
def _dispatch_train_fake(hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    check_dispatch(hidden, w13, w2, topk_weights, topk_ids, activation)
    return (hidden.new_empty(hidden.shape),
            hidden.new_empty(hidden.shape[0] * topk_ids.shape[1], w13.shape[1]))


@torch.library.register_kernel(DISPATCH_BACKWARD_SAVED, ("cpu", "cuda"))
def _dispatch_backward_saved_impl(grad_out, z, hidden, w13, w2, topk_weights, topk_ids,
                                  activation="silu"):
    return _backward(grad_out, z, hidden, w13, w2, topk_weights, topk_ids, activation)


@torch.library.register_fake(DISPATCH_BACKWARD_SAVED)
def _dispatch_backward_saved_fake(grad_out, z, hidden, w13, w2, topk_weights, topk_ids,
                                  activation="silu"):
    check_dispatch_backward(grad_out, z, hidden, w13, w2, topk_weights, topk_ids, activation)
    return _dispatch_backward_fake(grad_out, hidden, w13, w2, topk_weights, topk_ids, activation)


class _NoSecondDerivative(torch.autograd.Function):
    """Passes moe.dispatch's gradients (the first n arguments) through, depending on the
    tensors after them; its backward raises (a double backward through moe.dispatch)."""

    @staticmethod
    def forward(ctx, n, *args):
        return tuple(None if g is None else g.view_as(g) for g in args[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "moe.dispatch has no second derivative: a double backward through it "
            "(create_graph=True with a loss on its gradients, autograd.functional.jvp / hvp / "
            "hessian) is not implemented")


class _DispatchFunction(torch.autograd.Function):
    """Autograd of moe.dispatch (see the module docstring). `keyset`: the dispatch keys below
    Autograd, to run the plain op's kernels when recomputing."""

    @staticmethod
    def forward(ctx, hidden, w13, w2, topk_weights, topk_ids, activation, keyset):
        with below_autograd():
            if recompute_enabled():
                out = _DISPATCH_OP.redispatch(keyset, hidden, w13, w2, topk_weights, topk_ids,
                                              activation)
                z = None
            else:
                out, z = torch.ops.moe.dispatch_train(hidden, w13, w2, topk_weights, topk_ids,
                                                      activation)
        ctx.save_for_backward(hidden, w13, w2, topk_weights, topk_ids, z)
        ctx.activation = activation
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        with torch.no_grad():
            grads = _DispatchFunction._backward(ctx, saved, grad_out)
        if torch.is_grad_enabled():
            # create_graph=True (a gradient penalty, autograd.functional.jvp / hvp): the
            # backward kernels have no derivative, so the gradients get a node, connected to
            # the inputs they depend on, that raises when a second backward reaches it; as
            # constants they gave silently wrong second derivatives. (torch's
            # once_differentiable looks at grad_out alone and so misses the dependence through
            # the saved inputs.)
            deps = [t for t in (grad_out, *saved[:4]) if t is not None and t.requires_grad]
            if deps:
                grads = _NoSecondDerivative.apply(len(grads), *grads, *deps)
        return grads

    @staticmethod
    def _backward(ctx, saved, grad_out):
        hidden, w13, w2, topk_weights, topk_ids, z = saved
        grad_out = grad_out.contiguous()
        if z is None:
            gx, g13, g2, gw = torch.ops.moe.dispatch_backward(
                grad_out, hidden, w13, w2, topk_weights, topk_ids, ctx.activation)
        else:
            gx, g13, g2, gw = torch.ops.moe.dispatch_backward_saved(
                grad_out, z, hidden, w13, w2, topk_weights, topk_ids, ctx.activation)
        need = ctx.needs_input_grad
        return (gx if need[0] else None, g13 if need[1] else None, g2 if need[2] else None,
                gw if need[3] else None, None, None, None)


_DISPATCH_OP = torch.ops.moe.dispatch.default


def _dispatch_autograd(keyset, hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    below = after_autograd(keyset)
    reject_forward_ad("moe.dispatch", hidden, w13, w2, topk_weights)
    if torch.is_grad_enabled() and any_requires_grad(hidden, w13, w2, topk_weights):
        reject_functorch("moe.dispatch")
        return _DispatchFunction.apply(hidden, w13, w2, topk_weights, topk_ids, activation, below)
    with below_autograd():
        return _DISPATCH_OP.redispatch(below, hidden, w13, w2, topk_weights, topk_ids, activation)


LIB.impl("dispatch", _dispatch_autograd, "Autograd", with_keyset=True)


def _not_differentiable(op):
    """Autograd kernel of an internal op that has no derivative (moe.dispatch's autograd calls
    it below Autograd): it re-invokes the op below Autograd, so that its outputs never require
    grad (a double backward through moe.dispatch, or a backward through a direct call, then
    fails with "does not require grad" instead of going through PyTorch's autograd fallback,
    which only warns)."""
    def kernel(keyset, *args, **kwargs):
        with below_autograd():
            return op.redispatch(after_autograd(keyset), *args, **kwargs)
    return kernel


for _name in ("dispatch_train", "dispatch_backward", "dispatch_backward_saved"):
    LIB.impl(_name, _not_differentiable(getattr(torch.ops.moe, _name).default), "Autograd",
              with_keyset=True)


def dispatch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu"):
    """Python entry point of `torch.ops.moe.dispatch`. Argument types are checked here too: a
    non-tensor given to torch.ops.moe.dispatch itself fails in the dispatcher with a RuntimeError."""
    check_tensor_args(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a str ('silu'), got {type(activation).__name__}")
    if torch.compiler.is_compiling():
        # A check that fails inside the op's fake implementation reaches the user as dynamo's
        # TorchRuntimeError; raised here, in traced Python, it is eager's ValueError/TypeError
        # (fullgraph=True reports it as an observed exception carrying the same message).
        check_dispatch(hidden, w13, w2, topk_weights, topk_ids, activation)
    return torch.ops.moe.dispatch(hidden, w13, w2, topk_weights, topk_ids, activation)

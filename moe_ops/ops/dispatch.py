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
                                check_tensor_args, check_variant_types,
                                check_weight_layout)
from moe_ops.ops.quant_checks import is_quantized, reject_quantized_grad, reject_scale_grad
from moe_ops.reference.dispatch import (dispatch_backward_reference, dispatch_reference,
                                        empty_grad)

# The expert variants (every argument optional, appended after activation; docs/contract.md):
# biases, the activation and its swiglu_oai constants, interleaved gate/up rows, the routing
# weight on the input, and the quantized weights' scales.
VARIANT_ARGS = (
    'str activation="silu", Tensor? w13_bias=None, Tensor? w2_bias=None, float alpha=1.702, '
    "float limit=7.0, bool gate_up_interleaved=False, bool weights_on_input=False, "
    "Tensor? w13_scale=None, Tensor? w2_scale=None, int[]? block_shape=None, "
    'bool quantize_activations=True, Tensor? w3=None, str mxfp4_layout="plain"'
)
# The internal backward ops also return the bias gradients ([E, 2I] and [E, H]) and the up
# weight's ([E, I, H], w3's strides) where the forward got that tensor, else an empty tensor.
_GRADS = ("(Tensor grad_hidden, Tensor grad_w13, Tensor grad_w2, Tensor grad_topk_weights, "
          "Tensor grad_w13_bias, Tensor grad_w2_bias, Tensor grad_w3)")
DISPATCH_SCHEMA = (
    "dispatch(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
    f"{VARIANT_ARGS}) -> Tensor"
)
DISPATCH_BACKWARD_SCHEMA = (
    "dispatch_backward(Tensor grad_out, Tensor hidden, Tensor w13, Tensor w2, "
    f"Tensor topk_weights, Tensor topk_ids, {VARIANT_ARGS}) -> {_GRADS}"
)
DISPATCH_TRAIN_SCHEMA = (
    "dispatch_train(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
    f"{VARIANT_ARGS}) -> (Tensor out, Tensor z)"
)
DISPATCH_BACKWARD_SAVED_SCHEMA = (
    "dispatch_backward_saved(Tensor grad_out, Tensor z, Tensor hidden, Tensor w13, Tensor w2, "
    f"Tensor topk_weights, Tensor topk_ids, {VARIANT_ARGS}) -> {_GRADS}"
)
DISPATCH = define(DISPATCH_SCHEMA)
DISPATCH_BACKWARD = define(DISPATCH_BACKWARD_SCHEMA)
DISPATCH_TRAIN = define(DISPATCH_TRAIN_SCHEMA)
DISPATCH_BACKWARD_SAVED = define(DISPATCH_BACKWARD_SAVED_SCHEMA)


def variant_args(activation="silu", w13_bias=None, w2_bias=None, alpha=1.702, limit=7.0,
                 gate_up_interleaved=False, weights_on_input=False, w13_scale=None,
                 w2_scale=None, block_shape=None, quantize_activations=True, w3=None,
                 mxfp4_layout="plain") -> dict:
    """The variant arguments of the dispatch ops (after topk_ids), by name, with the schema's
    defaults: the kernels below take them positionally or by keyword."""
    return dict(activation=activation, w13_bias=w13_bias, w2_bias=w2_bias, alpha=alpha,
                limit=limit, gate_up_interleaved=gate_up_interleaved,
                weights_on_input=weights_on_input, w13_scale=w13_scale, w2_scale=w2_scale,
                block_shape=block_shape, quantize_activations=quantize_activations, w3=w3,
                mxfp4_layout=mxfp4_layout)


VARIANT_NAMES = tuple(variant_args())
# What the float kernels compute from (the scales and block shape are the quantized weights';
# check_dispatch refuses them with float weights).
_COMPUTE_NAMES = ("activation", "w13_bias", "w2_bias", "alpha", "limit", "gate_up_interleaved",
                  "weights_on_input", "w3")


def _compute_kw(v: dict) -> dict:
    return {k: v[k] for k in _COMPUTE_NAMES}


def _has_bias(v: dict) -> bool:
    return v["w13_bias"] is not None or v["w2_bias"] is not None


def _forward(hidden, w13, w2, topk_weights, topk_ids, v, save_z):
    """moe.dispatch (save_z=False: out) and moe.dispatch_train (save_z=True: (out, z))."""
    check_dispatch(hidden, w13, w2, topk_weights, topk_ids, **v)
    check_ids_in_range(topk_ids, w13.shape[0])
    if is_quantized(w13, w2):
        return _forward_quantized(hidden, w13, w2, topk_weights, topk_ids, v, save_z)
    kw = _compute_kw(v)
    if use_triton(hidden) and hidden.dtype != torch.float64:
        from moe_ops.launch.dispatch import dispatch_triton

        if _interpreted_bf16(hidden):
            kw.update(w13_bias=_upcast1(kw["w13_bias"]), w2_bias=_upcast1(kw["w2_bias"]),
                      w3=_upcast1(kw["w3"]))
            res = dispatch_triton(*_upcast(hidden, w13, w2, topk_weights), topk_ids,
                                  save_z=save_z, **kw)
            return tuple(r.to(hidden.dtype) for r in res) if save_z else res.to(hidden.dtype)
        with on_device(hidden):
            return dispatch_triton(hidden, w13, w2, topk_weights, topk_ids, save_z=save_z, **kw)
    return dispatch_reference(hidden, w13, w2, topk_weights, topk_ids, return_z=save_z, **kw)


def _forward_quantized(hidden, w13, w2, topk_weights, topk_ids, v, save_z):
    """FP8 block-scaled or MXFP4 expert weights (issue 42): the quantized kernels on CUDA and
    in the interpreter, the W8A8 / dequantizing reference on the CPU otherwise."""
    v = {k: x for k, x in v.items() if k != "w3"}   # (None: check_dispatch refuses one)
    if save_z:
        raise NotImplementedError("moe.dispatch_train (the training forward) does not take "
                                  "quantized expert weights: they are frozen, and gradients "
                                  "through them are not implemented")
    if use_triton(hidden):
        from moe_ops.launch.quant import dispatch_quantized

        with on_device(hidden):
            return dispatch_quantized(hidden, w13, w2, topk_weights, topk_ids, **v, check=False)
    from moe_ops.reference.quant import quantized_dispatch_reference

    return quantized_dispatch_reference(hidden, w13, w2, topk_weights, topk_ids, **v,
                                        compute_dtype=torch.float32).to(hidden.dtype)


def _backward(grad_out, z, hidden, w13, w2, topk_weights, topk_ids, v):
    """moe.dispatch_backward (z=None: recomputed) and moe.dispatch_backward_saved: the seven
    gradients (the bias and w3 ones empty where the forward got no such tensor)."""
    check_dispatch_backward(grad_out, z, hidden, w13, w2, topk_weights, topk_ids, **v)
    if is_quantized(w13, w2):
        reject_quantized_grad()
    kw = _compute_kw(v)
    if use_triton(hidden) and hidden.dtype != torch.float64:
        from moe_ops.launch.dispatch_backward import dispatch_backward_triton

        if _interpreted_bf16(hidden):
            b13, b2, w3 = kw["w13_bias"], kw["w2_bias"], kw["w3"]
            kw.update(w13_bias=_upcast1(b13), w2_bias=_upcast1(b2), w3=_upcast1(w3))
            grads = dispatch_backward_triton(*_upcast(grad_out, hidden, w13, w2, topk_weights),
                                             topk_ids, z=None if z is None else z.float(), **kw)
            grads = tuple(None if g is None else g.to(t.dtype)
                          for g, t in zip(grads, (hidden, w13, w2, topk_weights, b13, b2, w3)))
            return _seven_grads(grads, hidden)
        with on_device(hidden):
            return _seven_grads(dispatch_backward_triton(grad_out, hidden, w13, w2, topk_weights,
                                                         topk_ids, z=z, **kw), hidden)
    # The reference recomputes z in float32/float64 (z is a cache of W13_e x).
    return _seven_grads(dispatch_backward_reference(grad_out, hidden, w13, w2, topk_weights,
                                                    topk_ids, **kw), hidden)


def _seven_grads(grads, hidden):
    """The backward functions return four gradients without biases or w3, six with a bias,
    seven with w3 (None for an absent bias or w3); the ops always return seven, an empty
    tensor for each absent one."""
    grads = tuple(grads) + (None,) * (7 - len(grads))
    # (one empty tensor each: outputs of an op must not alias)
    return grads[:4] + tuple(hidden.new_empty(0) if g is None else g for g in grads[4:])


@torch.library.register_kernel(DISPATCH, ("cpu", "cuda"))
def _dispatch_impl(hidden, w13, w2, topk_weights, topk_ids, *args, **kwargs):
    return _forward(hidden, w13, w2, topk_weights, topk_ids, variant_args(*args, **kwargs),
                    save_z=False)


def _interpreted_bf16(hidden):
    # Triton's interpreter computes bfloat16 tl.dot wrongly without raising (relative error ~1e11
    # measured with triton 3.9 here): interpreted bf16 runs the kernels on float32 copies.
    return hidden.device.type == "cpu" and hidden.dtype == torch.bfloat16


def _upcast(*tensors):
    return [_upcast1(t) for t in tensors]


def _upcast1(t):
    return t.float() if t is not None and t.dtype == torch.bfloat16 else t


@torch.library.register_fake(DISPATCH)
def _dispatch_fake(hidden, w13, w2, topk_weights, topk_ids, *args, **kwargs):
    check_dispatch(hidden, w13, w2, topk_weights, topk_ids, **variant_args(*args, **kwargs))
    return hidden.new_empty(hidden.shape)


def _grads_fake(hidden, w13, w2, topk_weights, v):
    b13, b2, w3 = v["w13_bias"], v["w2_bias"], v["w3"]
    return (hidden.new_empty(hidden.shape), empty_grad(w13), empty_grad(w2),
            topk_weights.new_empty(topk_weights.shape),
            hidden.new_empty(0) if b13 is None else b13.new_empty(b13.shape),
            hidden.new_empty(0) if b2 is None else b2.new_empty(b2.shape),
            hidden.new_empty(0) if w3 is None else empty_grad(w3))


@torch.library.register_kernel(DISPATCH_BACKWARD, ("cpu", "cuda"))
def _dispatch_backward_impl(grad_out, hidden, w13, w2, topk_weights, topk_ids, *args, **kwargs):
    return _backward(grad_out, None, hidden, w13, w2, topk_weights, topk_ids,
                     variant_args(*args, **kwargs))


@torch.library.register_fake(DISPATCH_BACKWARD)
def _dispatch_backward_fake(grad_out, hidden, w13, w2, topk_weights, topk_ids, *args, **kwargs):
    v = variant_args(*args, **kwargs)
    check_dispatch_backward(grad_out, None, hidden, w13, w2, topk_weights, topk_ids, **v)
    return _grads_fake(hidden, w13, w2, topk_weights, v)


@torch.library.register_kernel(DISPATCH_TRAIN, ("cpu", "cuda"))
def _dispatch_train_impl(hidden, w13, w2, topk_weights, topk_ids, *args, **kwargs):
    return _forward(hidden, w13, w2, topk_weights, topk_ids, variant_args(*args, **kwargs),
                    save_z=True)


@torch.library.register_fake(DISPATCH_TRAIN)
def _dispatch_train_fake(hidden, w13, w2, topk_weights, topk_ids, *args, **kwargs):
    check_dispatch(hidden, w13, w2, topk_weights, topk_ids, **variant_args(*args, **kwargs))
    # (z is [T*K, 2I]: w13's 2I rows, or with w3 the gate's I and the up projection's I)
    return (hidden.new_empty(hidden.shape),
            hidden.new_empty(hidden.shape[0] * topk_ids.shape[1], 2 * w2.shape[2]))


@torch.library.register_kernel(DISPATCH_BACKWARD_SAVED, ("cpu", "cuda"))
def _dispatch_backward_saved_impl(grad_out, z, hidden, w13, w2, topk_weights, topk_ids, *args,
                                  **kwargs):
    return _backward(grad_out, z, hidden, w13, w2, topk_weights, topk_ids,
                     variant_args(*args, **kwargs))


@torch.library.register_fake(DISPATCH_BACKWARD_SAVED)
def _dispatch_backward_saved_fake(grad_out, z, hidden, w13, w2, topk_weights, topk_ids, *args,
                                  **kwargs):
    v = variant_args(*args, **kwargs)
    check_dispatch_backward(grad_out, z, hidden, w13, w2, topk_weights, topk_ids, **v)
    return _grads_fake(hidden, w13, w2, topk_weights, v)


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
    Autograd, to run the plain op's kernels when recomputing; `v`: the variant arguments
    (variant_args) other than the biases and w3, which come as inputs (they get gradients)."""

    @staticmethod
    def forward(ctx, hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, w3, keyset, v):
        v = dict(v, w13_bias=w13_bias, w2_bias=w2_bias, w3=w3)
        args = tuple(v[k] for k in VARIANT_NAMES)
        with below_autograd():
            if recompute_enabled():
                out = _DISPATCH_OP.redispatch(keyset, hidden, w13, w2, topk_weights, topk_ids,
                                              *args)
                z = None
            else:
                out, z = torch.ops.moe.dispatch_train(hidden, w13, w2, topk_weights, topk_ids,
                                                      *args)
        ctx.save_for_backward(hidden, w13, w2, topk_weights, topk_ids, z, w13_bias, w2_bias, w3)
        ctx.variant = {k: x for k, x in v.items() if k not in _GRAD_VARIANTS}
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
            deps = [t for t in (grad_out, *saved[:4], *saved[6:])
                    if t is not None and t.requires_grad]
            if deps:
                grads = _NoSecondDerivative.apply(len(grads), *grads, *deps)
        return grads

    @staticmethod
    def _backward(ctx, saved, grad_out):
        hidden, w13, w2, topk_weights, topk_ids, z, w13_bias, w2_bias, w3 = saved
        v = dict(ctx.variant, w13_bias=w13_bias, w2_bias=w2_bias, w3=w3)
        args = tuple(v[k] for k in VARIANT_NAMES)
        grad_out = grad_out.contiguous()
        if z is None:
            gx, g13, g2, gw, gb13, gb2, g3 = torch.ops.moe.dispatch_backward(
                grad_out, hidden, w13, w2, topk_weights, topk_ids, *args)
        else:
            gx, g13, g2, gw, gb13, gb2, g3 = torch.ops.moe.dispatch_backward_saved(
                grad_out, z, hidden, w13, w2, topk_weights, topk_ids, *args)
        need = ctx.needs_input_grad
        return (gx if need[0] else None, g13 if need[1] else None, g2 if need[2] else None,
                gw if need[3] else None, None, gb13 if need[5] else None,
                gb2 if need[6] else None, g3 if need[7] else None, None, None)


# The variant arguments that are differentiable inputs of _DispatchFunction.
_GRAD_VARIANTS = ("w13_bias", "w2_bias", "w3")


_DISPATCH_OP = torch.ops.moe.dispatch.default


def _dispatch_autograd(keyset, hidden, w13, w2, topk_weights, topk_ids, *args, **kwargs):
    below = after_autograd(keyset)
    v = variant_args(*args, **kwargs)
    b13, b2, w3 = v["w13_bias"], v["w2_bias"], v["w3"]
    grad_inputs = [t for t in (hidden, w13, w2, topk_weights, b13, b2, w3) if t is not None]
    reject_forward_ad("moe.dispatch", *grad_inputs)
    if torch.is_grad_enabled() and is_quantized(w13, w2):
        reject_scale_grad(v["w13_scale"], v["w2_scale"])
    if torch.is_grad_enabled() and any_requires_grad(*grad_inputs):
        reject_functorch("moe.dispatch")
        if is_quantized(w13, w2):   # frozen experts: gradients for the other inputs only
            from moe_ops.ops.quant_autograd import QuantizedDispatchFunction

            rest = {k: x for k, x in v.items() if k not in ("w13_bias", "w2_bias")}
            return QuantizedDispatchFunction.apply(hidden, w13, w2, topk_weights, topk_ids,
                                                   b13, b2, below, rest, VARIANT_NAMES)
        rest = {k: x for k, x in v.items() if k not in _GRAD_VARIANTS}
        return _DispatchFunction.apply(hidden, w13, w2, topk_weights, topk_ids, b13, b2, w3,
                                       below, rest)
    with below_autograd():
        return _DISPATCH_OP.redispatch(below, hidden, w13, w2, topk_weights, topk_ids,
                                       *(v[k] for k in VARIANT_NAMES))


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
             topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu", *,
             w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
             alpha: float = 1.702, limit: float = 7.0, gate_up_interleaved: bool = False,
             weights_on_input: bool = False, w13_scale: torch.Tensor | None = None,
             w2_scale: torch.Tensor | None = None, block_shape: list[int] | None = None,
             quantize_activations: bool = True, w3: torch.Tensor | None = None,
             mxfp4_layout: str = "plain"):
    """Python entry point of `torch.ops.moe.dispatch` (the variant arguments by keyword; their
    meaning: docs/contract.md). Argument types are checked here too: a wrongly typed argument
    given to torch.ops.moe.dispatch itself fails in the dispatcher with a RuntimeError."""
    check_tensor_args(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    v = variant_args(activation, w13_bias, w2_bias, alpha, limit, gate_up_interleaved,
                     weights_on_input, w13_scale, w2_scale, block_shape, quantize_activations, w3,
                     mxfp4_layout)
    check_variant_types(**v)
    # (a sparse weight never reaches the op's kernels: the dispatcher has none for its layout)
    check_weight_layout("w13", w13)
    check_weight_layout("w2", w2)
    if w3 is not None:
        check_weight_layout("w3", w3)
    if torch.compiler.is_compiling():
        # A check that fails inside the op's fake implementation reaches the user as dynamo's
        # TorchRuntimeError; raised here, in traced Python, it is eager's ValueError/TypeError
        # (fullgraph=True reports it as an observed exception carrying the same message).
        check_dispatch(hidden, w13, w2, topk_weights, topk_ids, **v)
    return torch.ops.moe.dispatch(hidden, w13, w2, topk_weights, topk_ids, **v)


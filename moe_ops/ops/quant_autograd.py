"""Autograd of moe.dispatch with quantized (FP8 block-scaled / MXFP4) expert weights: the
experts are frozen (no gradient for w13, w2 or their scales); hidden, topk_weights and the
biases get gradients through them, computed by moe_ops.reference.quant's backward (the weights
dequantized one expert at a time, the activations' quantization taken as the identity). That
backward loops over the experts hit on the host: eager autograd, not for CUDA-graph capture or
a compiled backward (adapter fine-tuning of a quantized MoE is the use)."""
from __future__ import annotations

import torch

from moe_ops._compat import below_autograd


class QuantizedDispatchFunction(torch.autograd.Function):
    """apply(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, keyset, v, names): the
    op's output below Autograd; `v` holds the variant arguments other than the biases, `names`
    the op's variant argument names in schema order."""

    @staticmethod
    def forward(ctx, hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, keyset, v,
                names):
        full = dict(v, w13_bias=w13_bias, w2_bias=w2_bias)
        with below_autograd():
            out = torch.ops.moe.dispatch.default.redispatch(keyset, hidden, w13, w2, topk_weights, topk_ids,
                                          *(full[k] for k in names))
        ctx.save_for_backward(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias)
        ctx.variant = {k: x for k, x in v.items() if k != "w3"}   # (None: refused otherwise)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        from moe_ops.reference.quant import quantized_dispatch_backward_reference

        hidden, w13, w2, topk_weights, topk_ids, b13, b2 = ctx.saved_tensors
        dx, dw, db13, db2 = quantized_dispatch_backward_reference(
            grad_out, hidden, w13, w2, topk_weights, topk_ids, w13_bias=b13, w2_bias=b2,
            **ctx.variant)
        need = ctx.needs_input_grad
        return (dx if need[0] else None, None, None, dw if need[3] else None, None,
                db13 if need[5] else None, db2 if need[6] else None, None, None, None)

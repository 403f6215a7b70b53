"""Host side of moe.route: buffer allocation, block sizes, launch."""
from __future__ import annotations

import torch

from moe_ops._runtime import cdiv, kernel_for, next_pow2
from moe_ops.kernels.routing import route_kernel
from moe_ops.launch.fast import launch_key, tensor_key


def route_triton(router_logits, top_k, scoring, renormalize, bias, num_groups, topk_groups, scale,
                 out=None, block_t=None):
    """`out` (internal, for tests that poison outputs): (weights, ids) buffers to fill.
    `block_t` (internal, for benchmarks/ab_route.py): rows per program instead of the rule
    below (a power of two)."""
    T, E = router_logits.shape
    dev = router_logits.device
    if out is None:
        out = (torch.empty(T, top_k, dtype=torch.float32, device=dev),
               torch.empty(T, top_k, dtype=torch.int32, device=dev))
    weights, ids = out
    if T == 0:
        return weights, ids
    block_e = next_pow2(E)
    # Up to 128 tokens: one row per program and one warp (the T=1 kernel, on T programs). The
    # top-k loop is a chain of row reductions whose length does not shrink with more rows per
    # program, so rows are better spread over SMs (UNMEASURED: predicted Qwen3 T=8 16.4 -> ~7 us
    # in a graph, benchmarks/NOTES.md entry 13). Larger T: tiles of up to 64 rows.
    if block_t is None:
        block_t = 1 if T <= 128 else max(1, min(64, 4096 // block_e, next_pow2(T)))
    grid = (cdiv(T, block_t),)
    # fast launch (CUDA): every argument follows from these
    key = (tensor_key(router_logits), None if bias is None else tensor_key(bias),
           tensor_key(weights), tensor_key(ids), top_k, scoring, renormalize, num_groups,
           topk_groups, float(scale), block_t) if dev.type == "cuda" else None
    kernel_for(route_kernel, dev, launch_key(key))[grid](
        router_logits, bias if bias is not None else router_logits, weights, ids,
        T, E, router_logits.stride(0), router_logits.stride(1),
        bias.stride(0) if bias is not None else 0,   # any stride: a slice, an expanded scalar
        top_k, num_groups, E // num_groups, topk_groups, float(scale),
        SIGMOID=scoring == "sigmoid", HAS_BIAS=bias is not None, RENORMALIZE=renormalize,
        GROUPED=num_groups > 1,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_G=next_pow2(num_groups),
        BLOCK_K=next_pow2(top_k),
        num_warps=1 if block_t * block_e <= 1024 else 4,
    )
    return weights, ids

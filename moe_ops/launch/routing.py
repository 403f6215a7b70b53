"""Host side of moe.route: buffer allocation, block sizes, launch."""
from __future__ import annotations

import torch

from moe_ops._runtime import cdiv, next_pow2
from moe_ops.kernels.routing import route_kernel
from moe_ops.launch._common import kernel_for
from moe_ops.launch.fast import launch_key, tensor_key


def route_triton(router_logits, top_k, scoring, renormalize, bias, num_groups, topk_groups, scale,
                 out=None, block_t=None):
    """`out` (internal, for tests that poison outputs): (weights, ids) buffers to fill.
    `block_t` (internal, for tests and measurements): rows per program instead of the rule
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
    # Rows per program: one-warp programs of at most 256 scores (no cross-warp barriers in the
    # chain of row reductions the top-k picks make), one row each up to 512 tokens, then more
    # rows as T grows (one per 512 tokens, at most 16). Measured on the H200 in CUDA-graph
    # replay: the old rule of up to 64
    # rows on 4 warps at T > 128 took 14.5 us at Qwen3 T=512 where one row takes 7.6, 60.8 at
    # T=32768 where it takes 40.3; OLMoE T=8192 best at 4 rows (10.8 vs 13.0 at one), Mixtral
    # T=32768 at 16 (7.2 vs 25.3 at one).
    if block_t is None:
        block_t = max(1, min(16, 256 // block_e, next_pow2(T // 512 + 1) // 2))
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

"""The MoE block the compile and CUDA-graph tests trace: x + experts(route(router(rmsnorm(x)))).
`router="softmax"` is Mixtral's routing (softmax, top-k, renormalise); `"deepseek"` is
DeepSeek-V3's (sigmoid scores, selection bias, group-limited top-k over 4 groups keeping 2,
scale 2.5)."""
import torch
from torch import nn

import moe_ops


def route(logits, router, bias, top_k, api="ops"):
    fn = torch.ops.moe.route if api == "ops" else moe_ops.route
    if router == "softmax":
        return fn(logits, top_k)
    return fn(logits, top_k, "sigmoid", True, bias, 4, 2, 2.5)


class MoEBlock(nn.Module):
    """On [T, H] tokens; returns the output, and the chosen expert ids too if `return_ids`.
    `api="python"` calls the ops through `moe_ops.route` / `moe_ops.dispatch`."""

    def __init__(self, H, I, E, K, router="softmax", return_ids=False, eps=1e-6, api="ops"):
        super().__init__()
        self.api = api
        self.top_k = K
        self.router_kind = router
        self.return_ids = return_ids
        self.eps = eps
        self.norm_weight = nn.Parameter(1 + 0.1 * torch.randn(H))
        self.router = nn.Linear(H, E, bias=False)
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H) / H ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, I) / I ** 0.5)
        self.register_buffer("score_bias", 0.1 * torch.randn(E))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = (h * self.norm_weight).to(x.dtype)
        w, ids = route(self.router(h), self.router_kind, self.score_bias, self.top_k, self.api)
        dispatch = torch.ops.moe.dispatch if self.api == "ops" else moe_ops.dispatch
        out = x + dispatch(h, self.w13, self.w2, w, ids)
        return (out, ids) if self.return_ids else out

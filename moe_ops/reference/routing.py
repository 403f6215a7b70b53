"""Reference router: scores, optional bias, group-limited selection, top-k, renormalise, scale."""
from __future__ import annotations

import torch


def _stable_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, ties broken towards the lower index (the kernel's
    rule), in descending order."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def _nan_first(x: torch.Tensor) -> torch.Tensor:
    """NaN ranks as +inf: first, as torch.topk ranks it, so a NaN logit reaches the weights and
    the output instead of being routed around; NaN and +inf tie, broken by index (the kernel's
    rule, so both paths pick the same ids)."""
    return x.masked_fill(torch.isnan(x), float("inf"))


def selection_scores(logits, scoring, bias, num_groups, topk_groups):
    """(scores s, the values ranked), both in float32 or float64. Ranked: the logits themselves
    when there is no bias and no grouping (the same order as s, without rounding ties), else
    s + bias with masked-out groups at -inf."""
    cd = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(cd)
    s = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)
    if bias is None and num_groups == 1:
        # softmax and sigmoid are monotone, so ranking the logits ranks the scores without the
        # ties that rounding creates between close logits (e.g. sigmoid saturating at 1.0);
        # the Triton kernel ranks the same way, so CPU and GPU pick the same experts.
        return s, _nan_first(x)
    sel = _nan_first(s if bias is None else s + bias.to(cd))
    if num_groups > 1:
        T, E = sel.shape
        grouped = sel.view(T, num_groups, E // num_groups)
        top2 = min(2, E // num_groups)
        group_score = _nan_first(grouped.topk(top2, dim=-1).values.sum(-1))
        keep_groups = _stable_topk(group_score, topk_groups)
        keep = torch.zeros(T, num_groups, dtype=torch.bool, device=sel.device)
        keep.scatter_(1, keep_groups, True)
        keep = keep[:, :, None].expand(T, num_groups, E // num_groups).reshape(T, E)
        sel = sel.masked_fill(~keep, float("-inf"))
    return s, sel


def route_reference(router_logits, top_k, scoring="softmax", renormalize=True, bias=None,
                    num_groups=1, topk_groups=1, scale=1.0):
    s, sel = selection_scores(router_logits, scoring, bias, num_groups, topk_groups)
    ids = _stable_topk(sel, top_k)
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    w = w * scale
    out_dtype = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    # contiguous [T, K] as the kernel and the fake impl (a transposed logits view sorts into
    # column-major indices)
    return w.to(out_dtype).contiguous(), ids.to(torch.int32).contiguous()


def route_backward_reference(grad_w, router_logits, topk_ids, scoring, renormalize, bias,
                             num_groups, topk_groups, scale):
    """d(topk_weights)/d(router_logits) for fixed ids, written with torch ops so it traces."""
    cd = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    x = router_logits.to(cd)
    s = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)
    ids = topk_ids.long()
    p = s.gather(1, ids)
    g = grad_w.to(cd) * scale
    if renormalize:
        # d(p_i / D) / d p_j = (delta_ij - p_i / D) / D, in that order: D * D underflows in
        # float32 for sigmoid scores of logits below ~-46 (-inf gradients from ~-55)
        denom = p.sum(dim=-1, keepdim=True)
        g = (g - (g * (p / denom)).sum(dim=-1, keepdim=True)) / denom
    ds = torch.zeros_like(s).scatter_add(1, ids, g)
    if scoring == "softmax":
        dx = s * (ds - (ds * s).sum(dim=-1, keepdim=True))
    else:
        dx = ds * s * (1 - s)
    return dx.to(router_logits.dtype)

"""Reference expert computation (SwiGLU experts, weighted combine) and its backward.

Computes in float32 (float64 for float64 inputs) expert by expert; used as the CPU kernel and,
on float64 copies of the inputs, as the tests' oracle."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expert_slots(topk_ids: torch.Tensor, num_experts: int):
    """Yields (expert, slot indices, token indices) for every expert that receives a slot."""
    K = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    for e in flat[valid].unique().tolist():
        slots = (flat == e).nonzero().flatten()
        yield e, slots, torch.div(slots, K, rounding_mode="floor")


def dispatch_reference(hidden, w13, w2, topk_weights, topk_ids, activation="silu", return_z=False):
    """out [T, H]; with return_z also z = [g | u] per slot ([T*K, 2I], the input dtype, zeros for
    ids < 0), from the same per-expert products (moe.dispatch_train's CPU kernel)."""
    T, H = hidden.shape
    E, I = w2.shape[0], w2.shape[2]
    cd = _compute_dtype(hidden.dtype)
    out = torch.zeros(T, H, dtype=cd, device=hidden.device)
    z_all = (torch.zeros(topk_ids.numel(), 2 * I, dtype=hidden.dtype, device=hidden.device)
             if return_z else None)
    weights = topk_weights.reshape(-1).to(cd)
    for e, slots, tok in _expert_slots(topk_ids, E):
        x = hidden[tok].to(cd)
        z = x @ w13[e].to(cd).t()
        if return_z:
            z_all[slots] = z.to(hidden.dtype)
        a = F.silu(z[:, :I]) * z[:, I:]
        y = (a @ w2[e].to(cd).t()) * weights[slots, None]
        out.index_add_(0, tok, y)
    out = out.to(hidden.dtype)
    return (out, z_all) if return_z else out


def dispatch_z_reference(hidden, w13, topk_ids):
    """z = [g | u] = W13_e x_t per slot ([T*K, 2I], the input dtype; zeros for ids < 0): what
    the training forward saves for the backward. Computed on its own (the tests' oracle for
    dispatch_reference(return_z=True) and the Triton forward's z)."""
    T, H = hidden.shape
    E = w13.shape[0]
    cd = _compute_dtype(hidden.dtype)
    z = torch.zeros(topk_ids.numel(), w13.shape[1], dtype=cd, device=hidden.device)
    for e, slots, tok in _expert_slots(topk_ids, E):
        z[slots] = hidden[tok].to(cd) @ w13[e].to(cd).t()
    return z.to(hidden.dtype)


def dispatch_backward_reference(grad_out, hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    """(d hidden, d w13, d w2, d topk_weights) for `dispatch_reference`."""
    T, H = hidden.shape
    E, I = w2.shape[0], w2.shape[2]
    cd = _compute_dtype(hidden.dtype)
    dx = torch.zeros(T, H, dtype=cd, device=hidden.device)
    dw13 = torch.zeros(w13.shape, dtype=cd, device=w13.device)
    dw2 = torch.zeros(w2.shape, dtype=cd, device=w2.device)
    dweights = torch.zeros(topk_weights.numel(), dtype=cd, device=topk_weights.device)
    weights = topk_weights.reshape(-1).to(cd)
    go = grad_out.to(cd)
    for e, slots, tok in _expert_slots(topk_ids, E):
        x = hidden[tok].to(cd)
        W13, W2 = w13[e].to(cd), w2[e].to(cd)
        z = x @ W13.t()
        g, u = z[:, :I], z[:, I:]
        sg = torch.sigmoid(g)
        silu_g = g * sg
        a = silu_g * u
        s = weights[slots, None]
        dO = go[tok]
        dOW2 = dO @ W2                      # [n, I]
        dweights[slots] = (dOW2 * a).sum(-1)
        dw2[e] = (dO * s).t() @ a
        da = dOW2 * s
        dg = da * u * sg * (1 + g * (1 - sg))
        du = da * silu_g
        dz = torch.cat([dg, du], dim=1)
        dw13[e] = dz.t() @ x
        dx.index_add_(0, tok, dz @ W13)
    return (dx.to(hidden.dtype), dw13.to(w13.dtype), dw2.to(w2.dtype),
            dweights.view(topk_weights.shape).to(topk_weights.dtype))

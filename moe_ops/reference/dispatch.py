"""Reference expert computation (gated MLP experts, weighted combine) and its backward, for every
variant of moe.dispatch (biases, activations, interleaved gate/up rows, the routing weight on
the input, strided weights).

Computes in float32 (float64 for float64 inputs) expert by expert; used as the CPU kernel and,
on float64 copies of the inputs, as the tests' oracle. Per slot (token t, expert e, weight s):
z = W13_e x_t (w13's row order), h = (s z if weights_on_input else z) + b13_e, (g, u) = the
gate and up halves of h (rows [0, I) and [I, 2I), or even and odd rows when interleaved),
a = act(g, u), y = W2_e a + b2_e, out_t += y if weights_on_input else s y. With `w3` (the up
projection apart from the gate, [E, I, H]), w13 is the gate alone [E, I, H] and W13_e stands for
the rows of w13[e] then those of w3[e]."""
from __future__ import annotations

import math

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


def split_gate_up(h: torch.Tensor, interleaved: bool):
    """(gate, up) columns of h [n, 2I]: [0, I) and [I, 2I), or even and odd columns."""
    if interleaved:
        return h[:, 0::2], h[:, 1::2]
    I = h.shape[1] // 2
    return h[:, :I], h[:, I:]


def merge_gate_up(g: torch.Tensor, u: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The inverse of split_gate_up."""
    if interleaved:
        return torch.stack([g, u], dim=-1).reshape(g.shape[0], 2 * g.shape[1])
    return torch.cat([g, u], dim=1)


def activate(g, u, activation="silu", alpha=1.702, limit=7.0):
    """a = act(g, u) (docs/contract.md)."""
    if activation == "silu":
        return F.silu(g) * u
    if activation == "gelu":
        return F.gelu(g) * u
    if activation == "gelu_tanh":
        return F.gelu(g, approximate="tanh") * u
    if activation == "relu":
        return F.relu(g) * u
    if activation == "swiglu_oai":
        gc = g.clamp(max=limit)
        uc = u.clamp(-limit, limit)
        return (uc + 1) * gc * torch.sigmoid(alpha * gc)
    if activation == "silu_clamp":
        return F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)
    if activation == "silu_clamp_out":
        return F.silu(g).clamp(max=limit) * u.clamp(-limit, limit)
    if activation == "swiglu_softcap":
        return alpha * torch.tanh(g / alpha) * torch.sigmoid(g) * (limit * torch.tanh(u / limit))
    raise ValueError(f"unknown activation {activation!r}")


def activate_backward(g, u, da, activation="silu", alpha=1.702, limit=7.0):
    """(dg, du) for a = activate(g, u) and da = dL/da. Clamps pass the gradient where the
    value is inside the closed interval (torch.clamp's convention); relu's derivative at 0 is 0."""
    if activation == "swiglu_oai":
        gc = g.clamp(max=limit)
        uc = u.clamp(-limit, limit)
        sg = torch.sigmoid(alpha * gc)
        glu = gc * sg
        dglu = sg + alpha * gc * sg * (1 - sg)
        return (da * (uc + 1) * dglu * (g <= limit),
                da * glu * ((u >= -limit) & (u <= limit)))
    if activation == "swiglu_softcap":
        tg, tu, sg = torch.tanh(g / alpha), torch.tanh(u / limit), torch.sigmoid(g)
        dadg = limit * tu * ((1 - tg * tg) * sg + alpha * tg * sg * (1 - sg))
        return da * dadg, da * alpha * tg * sg * (1 - tu * tu)
    if activation in ("silu_clamp", "silu_clamp_out"):
        uc = u.clamp(-limit, limit)
        gc = g.clamp(max=limit) if activation == "silu_clamp" else g
        sg = torch.sigmoid(gc)
        f, df = gc * sg, sg * (1 + gc * (1 - sg))
        if activation == "silu_clamp":
            pass_g = g <= limit
        else:
            pass_g, f = f <= limit, f.clamp(max=limit)
        return da * uc * df * pass_g, da * f * ((u >= -limit) & (u <= limit))
    if activation == "silu":
        sg = torch.sigmoid(g)
        f, df = g * sg, sg * (1 + g * (1 - sg))
    elif activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(g / math.sqrt(2)))
        f, df = g * cdf, cdf + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
    elif activation == "gelu_tanh":
        k = math.sqrt(2 / math.pi)
        t = torch.tanh(k * (g + 0.044715 * g ** 3))
        f = 0.5 * g * (1 + t)
        df = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g)
    elif activation == "relu":
        f, df = F.relu(g), (g > 0).to(g.dtype)
    else:
        raise ValueError(f"unknown activation {activation!r}")
    return da * u * df, da * f


def dense_permuted(w: torch.Tensor) -> bool:
    """Whether w is a permutation of a contiguous tensor (a transposed view of dense storage)."""
    order = sorted(range(w.dim()), key=lambda d: w.stride(d), reverse=True)
    return w.permute(order).is_contiguous()


def empty_grad(w: torch.Tensor, dtype=None) -> torch.Tensor:
    """An uninitialised gradient buffer for weight w: w's strides where w is a permutation of
    dense storage (grad_like), else contiguous."""
    if not w.is_contiguous() and dense_permuted(w):
        return w.new_empty_strided(w.shape, w.stride(), dtype=dtype)
    return w.new_empty(w.shape, dtype=dtype)


def grad_like(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """g in w's dtype with w's strides where w is dense (a transposed view's gradient is the
    same transposed view of a dense buffer: autograd accumulates it without a copy), else
    contiguous."""
    return empty_grad(w).copy_(g)


def _w13(w13, w3, e, cd):
    """Expert e's gate+up rows [2I, H] in the compute dtype: w13[e], or with w3 the gate rows
    w13[e] then the up rows w3[e] (a per-expert float copy, as every reference product makes)."""
    if w3 is None:
        return w13[e].to(cd)
    return torch.cat([w13[e].to(cd), w3[e].to(cd)], dim=0)


def dispatch_reference(hidden, w13, w2, topk_weights, topk_ids, activation="silu", return_z=False,
                       *, w13_bias=None, w2_bias=None, alpha=1.702, limit=7.0,
                       gate_up_interleaved=False, weights_on_input=False, w3=None):
    """out [T, H]; with return_z also z = W13_e x per slot ([T*K, 2I] in w13's row order, before
    the bias and the input's weight; the input dtype, zeros for ids < 0), from the same
    per-expert products (moe.dispatch_train's CPU kernel)."""
    T, H = hidden.shape
    E = w2.shape[0]
    cd = _compute_dtype(hidden.dtype)
    out = torch.zeros(T, H, dtype=cd, device=hidden.device)
    z_all = (torch.zeros(topk_ids.numel(), 2 * w2.shape[2], dtype=hidden.dtype,
                         device=hidden.device) if return_z else None)
    weights = topk_weights.reshape(-1).to(cd)
    for e, slots, tok in _expert_slots(topk_ids, E):
        x = hidden[tok].to(cd)
        s = weights[slots, None]
        z = x @ _w13(w13, w3, e, cd).t()
        if return_z:
            z_all[slots] = z.to(hidden.dtype)
        h = s * z if weights_on_input else z
        if w13_bias is not None:
            h = h + w13_bias[e].to(cd)
        a = activate(*split_gate_up(h, gate_up_interleaved), activation, alpha, limit)
        y = a @ w2[e].to(cd).t()
        if w2_bias is not None:
            y = y + w2_bias[e].to(cd)
        out.index_add_(0, tok, y if weights_on_input else y * s)
    out = out.to(hidden.dtype)
    return (out, z_all) if return_z else out


def dispatch_z_reference(hidden, w13, topk_ids, w3=None):
    """z = W13_e x_t per slot ([T*K, 2I], w13's row order, the input dtype; zeros for ids < 0):
    what the training forward saves for the backward (before the bias and the input's routing
    weight). Computed on its own (the tests' oracle for dispatch_reference(return_z=True) and
    the Triton forward's z)."""
    T, H = hidden.shape
    E = w13.shape[0]
    cd = _compute_dtype(hidden.dtype)
    n = w13.shape[1] * (1 if w3 is None else 2)
    z = torch.zeros(topk_ids.numel(), n, dtype=cd, device=hidden.device)
    for e, slots, tok in _expert_slots(topk_ids, E):
        z[slots] = hidden[tok].to(cd) @ _w13(w13, w3, e, cd).t()
    return z.to(hidden.dtype)


def dispatch_backward_reference(grad_out, hidden, w13, w2, topk_weights, topk_ids,
                                activation="silu", *, w13_bias=None, w2_bias=None, alpha=1.702,
                                limit=7.0, gate_up_interleaved=False, weights_on_input=False,
                                w3=None):
    """(d hidden, d w13, d w2, d topk_weights) for `dispatch_reference`, and (d w13_bias,
    d w2_bias) after them (None for an absent bias) when a bias is given, then d w3 when w3 is
    given. The weight gradients have the weights' strides (grad_like)."""
    T, H = hidden.shape
    E = w2.shape[0]
    cd = _compute_dtype(hidden.dtype)
    dx = torch.zeros(T, H, dtype=cd, device=hidden.device)
    I = w2.shape[2]
    dw13 = torch.zeros(w13.shape[0], 2 * I, w13.shape[2], dtype=cd, device=w13.device)
    dw2 = torch.zeros(w2.shape, dtype=cd, device=w2.device)
    db13 = torch.zeros(w13.shape[0], 2 * I, dtype=cd, device=w13.device)
    db2 = torch.zeros(w2.shape[:2], dtype=cd, device=w2.device)
    dweights = torch.zeros(topk_weights.numel(), dtype=cd, device=topk_weights.device)
    weights = topk_weights.reshape(-1).to(cd)
    go = grad_out.to(cd)
    woi = weights_on_input
    for e, slots, tok in _expert_slots(topk_ids, E):
        x = hidden[tok].to(cd)
        W13, W2 = _w13(w13, w3, e, cd), w2[e].to(cd)
        s = weights[slots, None]
        z = x @ W13.t()
        h = s * z if woi else z
        if w13_bias is not None:
            h = h + w13_bias[e].to(cd)
        g, u = split_gate_up(h, gate_up_interleaved)
        a = activate(g, u, activation, alpha, limit)
        dO = go[tok]
        dOW2 = dO @ W2                      # [n, I]
        if woi:
            da = dOW2
            dw2[e] = dO.t() @ a
            db2[e] = dO.sum(0)
        else:
            ds = (dOW2 * a).sum(-1)
            if w2_bias is not None:
                ds = ds + dO @ w2_bias[e].to(cd)
            dweights[slots] = ds
            da = dOW2 * s
            dw2[e] = (dO * s).t() @ a
            db2[e] = (dO * s).sum(0)
        dh = merge_gate_up(*activate_backward(g, u, da, activation, alpha, limit),
                           gate_up_interleaved)
        db13[e] = dh.sum(0)
        if woi:
            dweights[slots] = (dh * z).sum(-1)
            dh = dh * s
        dw13[e] = dh.t() @ x
        dx.index_add_(0, tok, dh @ W13)
    grads = (dx.to(hidden.dtype), grad_like(w13, dw13 if w3 is None else dw13[:, :I]),
             grad_like(w2, dw2), dweights.view(topk_weights.shape).to(topk_weights.dtype))
    if w13_bias is None and w2_bias is None and w3 is None:
        return grads
    grads += (None if w13_bias is None else db13.to(w13_bias.dtype),
              None if w2_bias is None else db2.to(w2_bias.dtype))
    return grads if w3 is None else grads + (grad_like(w3, dw13[:, I:]),)

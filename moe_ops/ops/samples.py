"""Sample inputs for the ops (opcheck and tests): the edge cases the contract lists."""
from __future__ import annotations

import torch


def make_dispatch_inputs(T, H, I, E, K, *, dtype=torch.float32, device="cpu", routing="uniform",
                         weight_std=0.1, generator=None, requires_grad=False, ids_dtype=torch.int32):
    """Random (hidden, w13, w2, topk_weights, topk_ids). routing: "uniform" (K distinct experts per
    token), "one_expert" (every slot on expert 0; K must be 1 or ids repeat across k),
    "empty_experts" (only the first half of the experts receive tokens), "negative" (about a
    quarter of the ids are -1), "skewed" (Zipf-like load)."""
    g = generator
    kw = dict(device=device)
    hidden = torch.randn(T, H, generator=g, **kw).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g, **kw) * weight_std).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g, **kw) * weight_std).to(dtype)
    topk_weights = torch.rand(T, K, generator=g, **kw)
    if routing == "one_expert":
        ids = torch.zeros(T, K, dtype=torch.long, device=device)
    elif routing == "empty_experts":
        hot = max(K, E // 2)
        ids = torch.rand(T, hot, generator=g, **kw).argsort(-1)[:, :K]
    elif routing == "skewed":
        p = 1.0 / torch.arange(1, E + 1, device=device, dtype=torch.float64) ** 1.2
        ids = torch.multinomial(p.expand(max(T, 1), E).float(), K, generator=g)[:T]
    else:
        ids = torch.rand(T, E, generator=g, **kw).argsort(-1)[:, :K]
    if routing == "negative":
        drop = torch.rand(T, K, generator=g, **kw) < 0.25
        ids = ids.masked_fill(drop, -1)
    ids = ids.to(ids_dtype)
    if requires_grad:
        for t in (hidden, w13, w2, topk_weights):
            t.requires_grad_(True)
    return hidden, w13, w2, topk_weights, ids


def dispatch_samples(device="cpu", dtype=torch.float32, requires_grad=False):
    """(args, kwargs) pairs covering T=0, T=1, odd sizes, empty experts, one hot expert, ids < 0,
    non-contiguous hidden, int64 ids."""
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for T, H, I, E, K, routing in [(0, 8, 6, 4, 2, "uniform"), (1, 9, 5, 4, 2, "uniform"),
                                   (7, 13, 11, 6, 3, "empty_experts"), (6, 8, 6, 4, 1, "one_expert"),
                                   (9, 10, 7, 5, 2, "negative")]:
        out.append((make_dispatch_inputs(T, H, I, E, K, dtype=dtype, device=device, routing=routing,
                                         generator=g, requires_grad=requires_grad), {}))
    h, w13, w2, w, ids = make_dispatch_inputs(5, 12, 6, 4, 2, dtype=dtype, device=device,
                                              generator=g, ids_dtype=torch.int64)
    h = torch.randn(12, 5, generator=g, device=device).to(dtype).t()  # non-contiguous [T, H]
    if requires_grad:
        for t in (h, w13, w2, w):
            t.requires_grad_(True)
    out.append(((h, w13, w2, w, ids), {"activation": "silu"}))
    return out


def route_samples(device="cpu", requires_grad=False):
    g = torch.Generator(device=device).manual_seed(0)

    def logits(T, E, dtype=torch.float32):
        x = torch.randn(T, E, generator=g, device=device).to(dtype)
        return x.requires_grad_(requires_grad)

    bias = torch.randn(16, generator=g, device=device) * 0.1
    return [
        ((logits(0, 8), 2), {}),
        ((logits(1, 8), 2), {}),
        ((logits(7, 6), 3), {"renormalize": False}),
        ((logits(5, 16, torch.bfloat16), 4), {"scoring": "sigmoid", "bias": bias, "num_groups": 4,
                                                "topk_groups": 2, "scale": 2.5}),
        ((logits(9, 10), 10), {}),
        # a transposed view of the logits (the outputs are contiguous all the same)
        ((torch.randn(12, 6, generator=g, device=device).t().requires_grad_(requires_grad), 3),
         {"bias": bias[:12]}),
    ]


def make_variant_inputs(T, H, I, E, K, *, dtype=torch.float32, device="cpu", routing="uniform",
                        generator=None, requires_grad=False, w13_bias=False, w2_bias=False,
                        transpose_w13=False, transpose_w2=False, bias_dtype=None,
                        ids_dtype=torch.int32, weight_std=0.1):
    """make_dispatch_inputs' (hidden, w13, w2, topk_weights, topk_ids) and the biases (None
    unless asked for; [E, 2I] and [E, H]). transpose_w13 / transpose_w2: the weights as
    transposed views of [E, H, 2I] / [E, I, H] storage (the gpt-oss checkpoint layout)."""
    g = generator
    h, w13, w2, w, ids = make_dispatch_inputs(T, H, I, E, K, dtype=dtype, device=device,
                                              routing=routing, generator=g, ids_dtype=ids_dtype,
                                              weight_std=weight_std)
    if transpose_w13:
        w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
    if transpose_w2:
        w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    bd = bias_dtype or dtype
    b13 = (torch.randn(E, 2 * I, generator=g, device=device) * 0.5).to(bd) if w13_bias else None
    b2 = (torch.randn(E, H, generator=g, device=device) * 0.5).to(bd) if w2_bias else None
    if requires_grad:
        for t in (h, w13, w2, w, b13, b2):
            if t is not None:
                t.requires_grad_(True)
    return (h, w13, w2, w, ids), b13, b2


# (name, make_variant_inputs options, op keyword arguments): one case per variant, and the
# gpt-oss combination (biases, swiglu_oai with a small limit so that the clamps bind,
# interleaved rows, transposed weights)
VARIANTS = [
    ("gpt_oss", dict(w13_bias=True, w2_bias=True, transpose_w13=True, transpose_w2=True),
     dict(activation="swiglu_oai", alpha=1.702, limit=0.3, gate_up_interleaved=True)),
    ("bias_silu", dict(w13_bias=True, w2_bias=True), dict()),
    ("gelu", dict(w13_bias=True), dict(activation="gelu")),
    ("gelu_tanh", dict(w2_bias=True), dict(activation="gelu_tanh")),
    ("relu", dict(), dict(activation="relu")),
    ("interleaved", dict(transpose_w2=True), dict(gate_up_interleaved=True)),
    ("swiglu_oai", dict(transpose_w13=True), dict(activation="swiglu_oai", alpha=1.1,
                                                  limit=0.4)),
    ("weights_on_input", dict(w13_bias=True, w2_bias=True), dict(weights_on_input=True)),
    # DeepSeek-V4's clamped SwiGLU (gate clamped before the SiLU) and Step-3.7's (after it),
    # limits small enough to bind
    ("silu_clamp", dict(w13_bias=True), dict(activation="silu_clamp", limit=0.4)),
    ("silu_clamp_out", dict(transpose_w13=True), dict(activation="silu_clamp_out", limit=0.15)),
    # Inkling2's softcapped SwiGLU (alpha: the gate's softcap, limit: the up's), caps that bend
    ("swiglu_softcap", dict(w2_bias=True), dict(activation="swiglu_softcap", alpha=0.3, limit=0.2)),
]


def dispatch_variant_samples(device="cpu", dtype=torch.float32, requires_grad=False):
    """(args, kwargs) pairs: every variant of VARIANTS on a small odd shape with dropped ids,
    and the gpt-oss combination at T = 1 and with weights on the input."""
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for i, (_, opts, kw) in enumerate(VARIANTS):
        args, b13, b2 = make_variant_inputs(7, 9, 5, 4, 2, dtype=dtype, device=device,
                                            routing="negative" if i % 2 else "uniform",
                                            generator=g, requires_grad=requires_grad, **opts)
        out.append((args, dict(kw, w13_bias=b13, w2_bias=b2)))
    args, b13, b2 = make_variant_inputs(1, 10, 6, 5, 3, dtype=dtype, device=device, generator=g,
                                        requires_grad=requires_grad, **VARIANTS[0][1])
    out.append((args, dict(VARIANTS[0][2], w13_bias=b13, w2_bias=b2, weights_on_input=True)))
    return out


def quant_dispatch_samples(device="cpu", dtype=torch.float32):
    """(args, kwargs) of moe.dispatch with quantized expert weights (issue 42): FP8 block-scaled
    (W8A8 and W8A16; T = 0, T = 1, partial scale blocks, ids < 0, gpt-oss-style variants) and
    MXFP4 (gpt-oss's biases, swiglu_oai and interleaved rows)."""
    from moe_ops.reference.quant import quantize_fp8_block

    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for T, H, I, E, K, routing, bs, kw in [
            (0, 32, 16, 4, 2, "uniform", (16, 16), {}),
            (1, 40, 24, 4, 2, "uniform", (16, 16), {}),
            (9, 48, 40, 6, 3, "negative", (32, 16), {"quantize_activations": False}),
            (7, 32, 16, 4, 2, "uniform", (16, 16),
             {"activation": "swiglu_oai", "gate_up_interleaved": True, "alpha": 1.5,
              "limit": 5.0})]:
        h, w13, w2, tw, ids = make_dispatch_inputs(T, H, I, E, K, dtype=dtype, device=device,
                                                   routing=routing, generator=g)
        q13, s13 = quantize_fp8_block(w13, bs)
        q2, s2 = quantize_fp8_block(w2, bs)
        out.append(((h, q13, q2, tw, ids), dict(kw, w13_scale=s13, w2_scale=s2,
                                                block_shape=list(bs))))
    T, H, I, E, K = 6, 64, 32, 4, 2
    h, _, _, tw, ids = make_dispatch_inputs(T, H, 2, E, K, dtype=dtype, device=device,
                                            routing="negative", generator=g)
    kw = dict(device=device, generator=g, dtype=torch.uint8)
    b13 = torch.randint(0, 256, (E, 2 * I, H // 2), **kw)
    b2 = torch.randint(0, 256, (E, H, I // 2), **kw)
    s13 = torch.randint(119, 124, (E, 2 * I, H // 32), **kw)
    s2 = torch.randint(119, 124, (E, H, I // 32), **kw)
    out.append(((h, b13, b2, tw, ids), dict(
        w13_scale=s13, w2_scale=s2, activation="swiglu_oai", gate_up_interleaved=True,
        w13_bias=torch.randn(E, 2 * I, generator=g, device=device) * 0.1,
        w2_bias=torch.randn(E, H, generator=g, device=device) * 0.1)))
    return out

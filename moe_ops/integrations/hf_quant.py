"""transformers glue for quantized experts (issue 42): FineGrainedFP8 experts (DeepSeek-V3,
Qwen3-MoE FP8 checkpoints: transformers' `FP8Experts`) and gpt-oss MXFP4 experts, run through
`moe.dispatch` with the weights as stored (no dequantized copy).

- FP8: `FP8Experts` keeps `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] float8_e4m3fn with
  `gate_up_proj_scale_inv` / `down_proj_scale_inv` (float32 [E, ceil(N/bn), ceil(K/bk)], or
  float8_e8m0fnu with scale_fmt="ue8m0", read as float32 here) and `block_size` [bn, bk]:
  exactly moe.dispatch's FP8 layout. `fp8_experts_forward` is an experts function for
  transformers' FP8 experts interface (`register_fp8_experts_interface` adds it as "moe_ops",
  so `model.set_experts_implementation("moe_ops")` selects it for FP8 experts too).
- MXFP4: transformers' `Mxfp4GptOssExperts` swizzles the checkpoint's blocks into
  triton_kernels' Hopper layout at load and keeps no raw copy, so the raw `*_blocks` [E, N,
  K/32, 16] / `*_scales` [E, N, K/32] tensors of the checkpoint are attached to the experts
  module with `attach_mxfp4` (views, no copy), and `mxfp4_experts_forward` runs them with
  gpt-oss's interleaved gate/up rows, biases and clamped SwiGLU.
Both refuse (UnsupportedModelError) what moe.dispatch does not compute: static activation
scales, per-tensor scales, FP4 `expert_dtype`, ungated experts. A SiLU gate clamped to `limit`
before or after the SiLU (DeepSeek-V4, Step-3.7) runs `silu_clamp` / `silu_clamp_out`, a
softcapped SwiGLU (Inkling2) `swiglu_softcap`."""
from __future__ import annotations

import torch

from moe_ops.integrations._hf_layouts import UnsupportedModelError

FP8_IMPLEMENTATION = "moe_ops"


def fp8_experts_interface():
    """transformers' FP8 experts interface (ALL_FP8_EXPERTS_FUNCTIONS), or None."""
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    return ALL_FP8_EXPERTS_FUNCTIONS


def is_fp8_experts(module) -> bool:
    """A transformers FineGrainedFP8 experts module (`FP8Experts`, as replace_with_fp8_linear
    installs it for every `.experts` module of a quantized model)."""
    try:
        from transformers.integrations.finegrained_fp8 import FP8Experts
    except ImportError:
        return False
    return isinstance(module, FP8Experts)


def num_experts(module) -> int:
    """Expert count of a quantized experts module (FP8Experts or attach_mxfp4's)."""
    packed = getattr(module, "moe_ops_mxfp4", None)
    if packed is not None:
        return int(packed[0].shape[0])
    w = getattr(module, "gate_up_proj", None)
    return int(w.shape[0]) if w is not None else int(module.num_experts)


def fp8_dispatch_kwargs(experts) -> dict:
    """moe.dispatch's keyword arguments for a transformers `FP8Experts` module (raises
    UnsupportedModelError for what it does not cover)."""
    problems = []
    w13 = getattr(experts, "gate_up_proj", None)
    if not getattr(experts, "has_gate", True) or w13 is None:
        problems.append("ungated experts (has_gate=False)")
    if getattr(experts, "has_bias", False):
        problems.append("expert biases")
    if getattr(experts, "activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme={experts.activation_scheme!r} (static activation "
                        "scales; moe.dispatch quantizes activations dynamically)")
    if isinstance(w13, torch.Tensor) and w13.dtype != torch.float8_e4m3fn:
        problems.append(f"gate_up_proj dtype {w13.dtype} (FP4 expert_dtype or not quantized)")
    bs = getattr(experts, "block_size", None)
    if bs is None:
        problems.append("per-tensor scales (block_size=None)")
    act = type(getattr(experts, "act_fn", None)).__name__
    swiglu_alpha = getattr(experts, "swiglu_alpha", None)
    limit = getattr(experts, "limit", None)
    kw = {}
    gate_cap, up_cap = getattr(experts, "gate_softcap", None), getattr(experts, "up_softcap", None)
    if gate_cap is not None:   # FP8Experts._apply_gate: the softcapped SwiGLU (Inkling2)
        if not (isinstance(gate_cap, (int, float)) and isinstance(up_cap, (int, float))
                and gate_cap > 0 and up_cap > 0):
            problems.append(f"soft-capped gate with caps {gate_cap!r} / {up_cap!r} (two positive "
                            "floats expected)")
        else:
            kw.update(activation="swiglu_softcap", alpha=float(gate_cap), limit=float(up_cap))
    elif swiglu_alpha is not None:
        kw.update(activation="swiglu_oai", alpha=float(swiglu_alpha),
                  limit=float(limit if limit is not None else 7.0))
    elif act not in ("SiLUActivation", "SiLU"):
        problems.append(f"activation {act} (SiLU-gated experts only)")
    elif limit is not None:   # FP8Experts._apply_gate: the gate clamped before or after the SiLU
        kw.update(activation="silu_clamp_out" if getattr(experts, "limit_after_act", False)
                  else "silu_clamp", limit=float(limit))
    if problems:
        raise UnsupportedModelError(
            f"moe_ops: {type(experts).__name__} has quantized experts moe.dispatch does not "
            f"cover: {'; '.join(problems)}")
    # (detached: transformers registers the scales as trainable float32 Parameters)
    s13, s2 = experts.gate_up_proj_scale_inv.detach(), experts.down_proj_scale_inv.detach()
    if s13.dtype != torch.float32:     # ue8m0 (float8_e8m0fnu): powers of two, exact in float32
        s13, s2 = s13.float(), s2.float()
    # moe_ops_quantize_activations (set on the module): False runs W8A16 (bf16 activations)
    return dict(kw, w13_scale=s13, w2_scale=s2, block_shape=[int(b) for b in bs],
                quantize_activations=bool(getattr(experts, "moe_ops_quantize_activations", True)))


def _per_token(t, T):
    """[..., K] -> [T, K] (also for T = 0, where reshape(T, -1) raises)."""
    return t.reshape(T, t.shape[-1]) if t.dim() >= 2 else t.reshape(T, -1)


def _dispatch(self, w13, w2, hidden_states, top_k_index, top_k_weights, kw):
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    T = x.shape[0]
    ids = _per_token(top_k_index, T)
    weights = _per_token(top_k_weights, T)
    if weights.dtype not in (torch.float32, x.dtype):
        weights = weights.float()
    if getattr(self, "_is_expert_parallel", False):   # other ranks' experts: ids >= local E
        ids = torch.where(ids < w13.shape[0], ids, torch.full_like(ids, -1))
    out = torch.ops.moe.dispatch(x, w13, w2, weights, ids, **kw)
    return out.to(hidden_states.dtype).reshape(shape)


def fp8_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers experts function for `FP8Experts`: moe.dispatch on the FP8 weights and their
    block scales (W8A8: activations quantized per token and per 128 columns, as the
    checkpoints' dynamic activation scheme does)."""
    kw = fp8_dispatch_kwargs(self)
    return _dispatch(self, self.gate_up_proj, self.down_proj, hidden_states, top_k_index,
                     top_k_weights, kw)


def register_fp8_experts_interface() -> bool:
    """Adds "moe_ops" to transformers' FP8 experts interface (ALL_FP8_EXPERTS_FUNCTIONS), so
    that `set_experts_implementation("moe_ops")` also covers FineGrainedFP8 experts. Returns
    whether this transformers has that interface."""
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    ALL_FP8_EXPERTS_FUNCTIONS.register(FP8_IMPLEMENTATION, fp8_experts_forward)
    return True


def attach_mxfp4(experts, gate_up_blocks, gate_up_scales, down_blocks, down_scales,
                 layout="auto"):
    """Keeps gpt-oss's raw MXFP4 tensors on its experts module (`*_blocks` [E, N, K/32, 16]
    uint8 as in the checkpoint, or already [E, N, K/2]; `*_scales` [E, N, K/32] uint8 e8m0):
    gate_up rows are the checkpoint's (gate and up interleaved), packed along H; down rows are
    H, packed along I. layout "plain": the blocks as views; "mma": swizzle_mxfp4 copies of them
    (the byte order the decode kernels read fastest: moe.dispatch's mxfp4_layout="mma", the
    same outputs bit for bit; the caller drops the originals); "auto" (default): "mma" for CUDA
    tensors on sm_90+ whose H and I are multiples of 64 (gpt-oss: 2880), else "plain"."""
    from moe_ops.mxfp4_layout import swizzle_mxfp4

    def flat(b):
        return b.reshape(b.shape[0], b.shape[1], -1) if b.dim() == 4 else b

    b13, b2 = flat(gate_up_blocks), flat(down_blocks)
    if layout not in ("plain", "mma", "auto"):
        raise ValueError(f"layout must be 'plain', 'mma' or 'auto', got {layout!r}")
    if layout == "auto":
        H, I = 2 * b13.shape[2], 2 * b2.shape[2]
        hopper = b13.is_cuda and torch.cuda.get_device_capability(b13.device) >= (9, 0)
        layout = "mma" if hopper and H % 64 == 0 and I % 64 == 0 else "plain"
    if layout == "mma":
        b13, b2 = swizzle_mxfp4(b13), swizzle_mxfp4(b2)
    experts.moe_ops_mxfp4 = (b13, gate_up_scales, b2, down_scales)
    experts.moe_ops_mxfp4_layout = layout
    return experts


def mxfp4_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """gpt-oss experts on their MXFP4 weights (attach_mxfp4): interleaved gate/up rows, biases,
    swiglu_oai with the module's alpha and limit, the routing weight applied after the down
    bias, as GptOssExperts computes."""
    packed = getattr(self, "moe_ops_mxfp4", None)
    if packed is None:
        raise UnsupportedModelError(
            f"moe_ops: {type(self).__name__} has no raw MXFP4 tensors: transformers swizzles "
            "gpt-oss's blocks for triton_kernels at load; attach the checkpoint's *_blocks and "
            "*_scales with moe_ops.integrations.hf_quant.attach_mxfp4")
    b13, s13, b2, s2 = packed
    kw = dict(w13_scale=s13, w2_scale=s2, activation="swiglu_oai", gate_up_interleaved=True,
              alpha=float(getattr(self, "alpha", 1.702)), limit=float(getattr(self, "limit", 7.0)),
              w13_bias=getattr(self, "gate_up_proj_bias", None),
              w2_bias=getattr(self, "down_proj_bias", None),
              mxfp4_layout=getattr(self, "moe_ops_mxfp4_layout", "plain"))
    return _dispatch(self, b13, b2, hidden_states, top_k_index, top_k_weights, kw)


def patch_quantized_experts(model) -> int:
    """Runs every transformers `FP8Experts` module of `model` through moe.dispatch (its
    forward replaced on the instance by `fp8_experts_forward`; transformers' routers stay as
    they are), after checking each one (UnsupportedModelError names what is not covered), and
    every experts module that `attach_mxfp4` gave raw MXFP4 tensors through
    `mxfp4_experts_forward`. Returns the number of modules patched. (`apply_moe_ops(model)`
    patches the same modules, and the routers with them.)"""
    import types

    try:
        from transformers.integrations.finegrained_fp8 import FP8Experts
    except ImportError:
        FP8Experts = ()
    todo = []
    for name, mod in model.named_modules():
        if FP8Experts and isinstance(mod, FP8Experts):
            try:
                fp8_dispatch_kwargs(mod)
            except UnsupportedModelError as exc:
                raise UnsupportedModelError(f"{name}: {exc}") from None
            todo.append((mod, fp8_experts_forward))
        elif getattr(mod, "moe_ops_mxfp4", None) is not None:
            todo.append((mod, mxfp4_experts_forward))
    for mod, fn in todo:
        mod.forward = types.MethodType(fn, mod)
    return len(todo)

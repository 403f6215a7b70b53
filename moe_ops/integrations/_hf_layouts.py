"""How the experts of a transformers MoE family map onto `moe.dispatch`'s arguments, without
copying a weight: the layout of the expert tensors (transposed, interleaved, biased), the gating
activation, and the few families whose experts need their own module (Llama 4).

transformers' `@use_experts_implementation` decorator records a layout on each experts instance
(`has_gate`, `has_bias`, `is_transposed`, `is_concatenated`, `has_post_expert_norm`) and the
activation lives in `act_fn` (or in a class-level `_apply_gate`, e.g. gpt-oss's clamped SwiGLU).
`experts_layout()` reads them and either returns the dispatch arguments or raises
`UnsupportedModelError` naming what the op does not compute."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_ops.reference.dispatch import activate

__all__ = ["UnsupportedModelError", "ExpertsLayout", "activation_name", "experts_layout"]


class UnsupportedModelError(ValueError):
    """The model, or one of its MoE modules, has no moe_ops path (unknown family, or an experts
    layout the op does not compute: ungated experts other than ReLU squared, an activation other
    than the op's gates (SiLU/GELU/ReLU, gpt-oss's clamped SwiGLU, a SiLU clamped before or after,
    a softcapped SwiGLU), quantized weights outside FP8/MXFP4...)."""


# transformers.activations class names (ACT2FN values) and torch.nn modules, by the op's name.
_ACT_BY_CLASS = {
    "SiLUActivation": "silu",       # "silu"
    "SiLU": "silu",                 # "swish" (torch.nn.SiLU)
    "GELUActivation": "gelu",       # "gelu", "gelu_python": erf GELU
    "GELUTanh": "gelu_tanh",        # "gelu_pytorch_tanh", "gelu_python_tanh"
    "PytorchGELUTanh": "gelu_tanh",  # older name of GELUTanh
    "NewGELUActivation": "gelu_tanh",  # "gelu_new": the same tanh approximation
    "FastGELUActivation": "gelu_tanh",  # "gelu_fast": the same tanh approximation, refactored
    "ReLU": "relu",                 # "relu" (torch.nn.ReLU)
}
_ACT_BY_FUNCTION = {F.silu: "silu", F.gelu: "gelu", F.relu: "relu", torch.relu: "relu"}


def activation_name(act) -> str | None:
    """The op's activation name for a transformers `act_fn` (a module of transformers.activations
    or torch.nn, or a functional), or None if the op does not compute it."""
    if act in _ACT_BY_FUNCTION:
        return _ACT_BY_FUNCTION[act]
    if isinstance(act, torch.nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    cls = type(act)
    if not (cls.__module__.startswith("transformers.") or cls.__module__.startswith("torch.nn")):
        return None
    return _ACT_BY_CLASS.get(cls.__name__)


def _act_label(act) -> str:
    return getattr(act, "__name__", None) or type(act).__name__


@dataclass(frozen=True)
class ExpertsLayout:
    """The experts' arguments to `moe.dispatch` (besides hidden, weights and ids). `w13` / `w2`
    are the module's own tensors or transposed views of them."""
    w13: torch.Tensor
    w2: torch.Tensor
    activation: str = "silu"
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    alpha: float = 1.702
    limit: float = 7.0
    gate_up_interleaved: bool = False
    weights_on_input: bool = False
    # DBRX: the up projection apart from the gate (w13 [E, I, H] is then the gate alone)
    w3: torch.Tensor | None = None
    # MuseSpark: a norm applied to each expert's output before the routing weight
    # (has_post_expert_norm); not a moe.dispatch argument: the caller runs one row per route
    post_norm: torch.nn.Module | None = None

    def dispatch_kwargs(self) -> dict:
        """Only the arguments that differ from the op's defaults: a Mixtral-style layout calls
        moe.dispatch exactly as before the variants existed."""
        kw = {}
        if self.w13_bias is not None:
            kw["w13_bias"] = self.w13_bias
        if self.w2_bias is not None:
            kw["w2_bias"] = self.w2_bias
        if self.activation in _READS_ALPHA_LIMIT:
            kw["alpha"] = float(self.alpha)
            kw["limit"] = float(self.limit)
        if self.gate_up_interleaved:
            kw["gate_up_interleaved"] = True
        if self.weights_on_input:
            kw["weights_on_input"] = True
        if self.w3 is not None:
            kw["w3"] = self.w3
        return kw


_OK_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# the op's activations that read `limit` (swiglu_oai and swiglu_softcap also `alpha`)
_READS_ALPHA_LIMIT = ("swiglu_oai", "silu_clamp", "silu_clamp_out", "swiglu_softcap")
# what the op gates with, for the refusals of an unknown activation
_GATES = ("(moe.dispatch gates with SiLU, GELU (erf or tanh), ReLU, gpt-oss's clamped SwiGLU, SiLU "
          "clamped to a limit, or a softcapped SwiGLU)")

# (experts class, act_fn class, scalar settings, 2I) -> (activation, interleaved, alpha, limit) or a
# problem string:
# what a custom `_apply_gate` computes, found once by evaluating it (see _probe_custom_gate).
_GATE_CACHE: dict = {}


def _default_apply_gate():
    try:
        from transformers.integrations import moe as hf_moe
    except ImportError:
        return None
    return getattr(hf_moe, "_default_apply_gate", None)


def _swiglu_params(experts):
    for a, lim in (("alpha", "limit"), ("swiglu_alpha", "swiglu_limit")):
        alpha, limit = getattr(experts, a, None), getattr(experts, lim, None)
        if isinstance(alpha, (int, float)) and isinstance(limit, (int, float)):
            return float(alpha), float(limit)
    return None


def _limit_params(experts) -> list:
    """The clamp limits a custom gate may read (DeepSeek-V4's `limit`, HY-V4's `swiglu_limit`)."""
    out = []
    for name in ("limit", "swiglu_limit"):
        v = getattr(experts, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and float(v) not in out:
            out.append(float(v))
    return out


def _softcap_params(experts):
    """(gate softcap, up softcap) of a softcapped SwiGLU (Inkling2's act_fn modules, or
    FP8Experts' gate_softcap / up_softcap), or None."""
    act = getattr(experts, "act_fn", None)
    caps = []
    for name in ("gate_softcap", "up_softcap"):
        v = getattr(getattr(act, name, None), "softcap", None)
        if v is None:
            v = getattr(experts, name, None)
        caps.append(v)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in caps):
        return float(caps[0]), float(caps[1])
    return None


def _gated_reference(gu: torch.Tensor, activation: str, interleaved: bool, alpha=1.702, limit=7.0):
    if interleaved:
        g, u = gu[..., ::2], gu[..., 1::2]
    else:
        g, u = gu.chunk(2, dim=-1)
    return activate(g, u, activation, alpha, limit)


def _probe_custom_gate(experts, two_i: int, settings):
    """(activation, interleaved, alpha, limit) that a class-level `_apply_gate` computes, found by
    evaluating it on fixed values in [-R, R], R = max(12, 2 * limit + 2) over the module's clamp
    limits and softcaps (so that every clamp binds), against each candidate the op has; or a
    problem string. Done once per gate `settings` (_gate_settings) and width: the evaluation is a
    handful of float32 ops on the CPU, never traced."""
    params = _swiglu_params(experts)
    limits = _limit_params(experts)
    caps = _softcap_params(experts)
    key = (settings, two_i)
    if key in _GATE_CACHE:
        return _GATE_CACHE[key]
    gen = torch.Generator().manual_seed(0)
    reach = max([12.0] + [2.0 * lim + 2.0 for lim in limits + ([params[1]] if params else [])
                          + list(caps or ())])
    gu = (torch.rand(6, two_i, generator=gen) * 2.0 - 1.0) * reach
    try:
        with torch.no_grad():
            got = type(experts)._apply_gate(_ProbeSelf(experts), gu)
    except Exception as e:  # noqa: BLE001  (any failure means: not a gate the op knows)
        result = f"a custom {type(experts).__name__}._apply_gate that could not be evaluated ({e})"
        _GATE_CACHE[key] = result
        return result
    candidates = []
    if params is not None:
        candidates += [("swiglu_oai", il, *params) for il in (True, False)]
    for name in ("silu", "gelu", "gelu_tanh", "relu"):
        candidates += [(name, il, 1.702, 7.0) for il in (False, True)]
    for lim in limits:
        candidates += [(name, il, 1.702, lim) for name in ("silu_clamp", "silu_clamp_out")
                       for il in (False, True)]
    if caps is not None:
        candidates += [("swiglu_softcap", il, caps[0], caps[1]) for il in (False, True)]
    # the closest candidate within float32 rounding (silu_clamp and silu_clamp_out differ by
    # L * sigmoid(-L) at the limit L: a few ulps for a large one)
    result, best = None, None
    for activation, interleaved, alpha, limit in candidates:
        ref = _gated_reference(gu, activation, interleaved, alpha, limit)
        if got.shape == ref.shape and torch.allclose(got.float(), ref, rtol=1e-5, atol=1e-6):
            err = float((got.float() - ref).abs().max())
            if best is None or err < best:
                result, best = (activation, interleaved, alpha, limit), err
    if result is None:
        result = (f"custom gating {type(experts).__name__}._apply_gate (not one of SiLU/GELU/ReLU "
                  "gating, gpt-oss's clamped SwiGLU or a SwiGLU clamped to the module's limit "
                  "before or after the SiLU)")
    _GATE_CACHE[key] = result
    return result


class _ProbeSelf:
    """The experts module's attributes, seen from `_apply_gate` during the probe, but with the
    activation moved to the CPU (a module of transformers.activations holds no tensors anyway)."""

    def __init__(self, experts):
        self.__dict__["_m"] = experts

    def __getattr__(self, name):
        return getattr(self.__dict__["_m"], name)


def _gate_settings(experts):
    """What the gate's arithmetic depends on: the module's class, the activation module's class
    and softcaps, and the module's scalar settings (a clamp limit set on some layers only, e.g.
    Step3p7's; train/eval mode excluded)."""
    head = (type(experts), type(getattr(experts, "act_fn", None)), _softcap_params(experts))
    return head + tuple(sorted(
        (k, v) for k, v in vars(experts).items()
        if not k.startswith("_") and k != "training"
        and (v is None or isinstance(v, (bool, int, float, str)))))


def experts_layout(experts: torch.nn.Module, where: str | None = None) -> ExpertsLayout:
    """The dispatch arguments of an experts module, or `UnsupportedModelError` naming every
    difference the op does not compute."""
    if type(experts).__name__ == "Llama4TextExperts":
        return _llama4_layout(experts, where)
    if type(experts).__name__ == "DbrxExperts":
        return _dbrx_layout(experts, where)
    if not getattr(experts, "has_gate", True) and isinstance(getattr(experts, "up_proj", None),
                                                              torch.Tensor):
        return _ungated_layout(experts, where)
    problems = []
    w13 = getattr(experts, "gate_up_proj", None)
    w2 = getattr(experts, "down_proj", None)
    if not getattr(experts, "has_gate", True) or not isinstance(w13, torch.Tensor):
        problems.append("ungated experts (has_gate=False: up_proj then an activation, no gate); "
                        "moe.dispatch computes gated MLPs")
    if not isinstance(w2, torch.Tensor):
        problems.append("no down_proj tensor")
    post_norm = None
    if getattr(experts, "has_post_expert_norm", False):
        post_norm = getattr(experts, "post_expert_norm", None)
        if not isinstance(post_norm, torch.nn.Module):
            problems.append("has_post_expert_norm=True without a post_expert_norm module")
    transposed = bool(getattr(experts, "is_transposed", False)
                      or getattr(experts, "experts_are_transposed", False))
    activation, interleaved, alpha, limit = "silu", False, 1.702, 7.0
    # The gate's arithmetic is found once per module and setting (its probe imports
    # transformers' modules, which a torch.compile trace of the forward cannot do); a changed
    # setting (an activation or clamp limit set afterwards) finds it again.
    # Under torch.compile the cached arithmetic is taken as it is: torch 2.11's Dynamo cannot
    # trace vars() of a module (Unsupported method call), so a setting changed after the
    # first eager call is seen by eager calls only.
    cached = getattr(experts, "_moe_ops_gate", None)
    compiling = torch.compiler.is_compiling()
    settings = None if compiling and cached is not None else _gate_settings(experts)
    if not problems and cached is not None and (settings is None or cached[0] == settings):
        activation, interleaved, alpha, limit = cached[1]
    elif not problems:
        gate_fn = getattr(type(experts), "_apply_gate", None)
        two_i = w13.shape[2] if transposed else w13.shape[1]
        if gate_fn is not None and gate_fn is not _default_apply_gate():
            found = _probe_custom_gate(experts, int(two_i), settings)
            if isinstance(found, str):
                problems.append(found)
            else:
                activation, interleaved, alpha, limit = found
        else:
            # transformers' default gate: act_fn(first half) * second half.
            act = getattr(experts, "act_fn", None)
            name = activation_name(act) if act is not None else None
            if act is None:
                problems.append("no act_fn")
            elif name is None:
                problems.append(f"activation {_act_label(act)} {_GATES}")
            else:
                activation = name
        if not problems:
            experts._moe_ops_gate = (settings, (activation, interleaved, alpha, limit))
    b13 = getattr(experts, "gate_up_proj_bias", None)
    b2 = getattr(experts, "down_proj_bias", None)
    if getattr(experts, "has_bias", False) and not (isinstance(b13, torch.Tensor)
                                                    and isinstance(b2, torch.Tensor)):
        problems.append("has_bias=True without gate_up_proj_bias and down_proj_bias tensors")
    if problems:
        _raise(experts, where, problems)
    v13 = w13.transpose(1, 2) if transposed else w13
    v2 = w2.transpose(1, 2) if transposed else w2
    _check_weights(experts, where, v13, v2, interleaved,
                   b13 if isinstance(b13, torch.Tensor) else None,
                   b2 if isinstance(b2, torch.Tensor) else None)
    return ExpertsLayout(v13, v2, activation,
                         b13 if isinstance(b13, torch.Tensor) else None,
                         b2 if isinstance(b2, torch.Tensor) else None,
                         alpha, limit, interleaved, post_norm=post_norm)


def _llama4_layout(experts, where):
    """Llama 4: gate_up_proj [E, H, 2I] (gate columns first), down_proj [E, I, H], and the router
    weight multiplies the expert's input (Llama4TextMoe scales the tokens before the experts)."""
    act = getattr(experts, "act_fn", None)
    name = activation_name(act) if act is not None else None
    if name is None:
        _raise(experts, where, [f"activation {_act_label(act)} {_GATES}"])
    v13, v2 = experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2)
    _check_weights(experts, where, v13, v2, False, None, None)
    return ExpertsLayout(v13, v2, name, weights_on_input=True)


def _dbrx_layout(experts, where):
    """DBRX (DbrxExperts / DbrxExpertGLU): the gate `w1` and up `v1` projections are two
    [E*I, H] parameters and `w2` is [E*I, H] (down is its per-expert transpose). They are read
    in place as views: w13 = w1.view(E, I, H) (the gate alone), w3 = v1.view(E, I, H) and
    w2.view(E, I, H).transpose(1, 2) ([E, H, I]); DBRX's router stays transformers' code."""
    mlp = getattr(experts, "mlp", None)
    w1, v1, w2 = (getattr(mlp, n, None) for n in ("w1", "v1", "w2"))
    E = getattr(experts, "num_experts", None)
    I = getattr(experts, "ffn_hidden_size", None)
    H = getattr(experts, "hidden_size", None)
    if not all(isinstance(t, torch.Tensor) for t in (w1, v1, w2)) or not all(
            isinstance(n, int) for n in (E, I, H)):
        _raise(experts, where, ["no mlp.w1 / mlp.v1 / mlp.w2 tensors with num_experts, "
                                "ffn_hidden_size and hidden_size (the DbrxExpertGLU layout)"])
    problems = []
    for name, t in (("w1", w1), ("v1", v1), ("w2", w2)):
        if tuple(t.shape) != (E * I, H):
            problems.append(f"mlp.{name} {tuple(t.shape)} (expected [E*I, H] = {[E * I, H]})")
    if len({w1.dtype, v1.dtype, w2.dtype}) > 1:
        problems.append(f"mlp.w1 / v1 / w2 of different dtypes {w1.dtype} / {v1.dtype} / "
                        f"{w2.dtype}")
    act = getattr(mlp, "activation_fn", None)
    activation = activation_name(act) if act is not None else None
    if activation is None:
        problems.append(f"activation {_act_label(act)} {_GATES}")
    if problems:
        _raise(experts, where, problems)
    w13, w3 = w1.view(E, I, H), v1.view(E, I, H)
    v2 = w2.view(E, I, H).transpose(1, 2)
    _check_weights(experts, where, w13, v2, False, None, None, w3=w3)
    return ExpertsLayout(w13, v2, activation, w3=w3)


def _ungated_layout(experts, where):
    """Ungated experts (NemotronH: `up_proj` [E, I, H], an activation, `down_proj` [E, H, I]; or
    their transposes with is_transposed) whose activation is ReLU squared: relu(h)^2 = relu(h) * h
    exactly (relu(h) is h or 0), so moe.dispatch computes them as ReLU gating with the up
    projection as both gate (w13) and up (w3) rows, the same tensor, no copy: the gate+up kernel
    computes the product once (SAME_W3); gradients of the two uses add up in up_proj."""
    up, down = experts.up_proj, getattr(experts, "down_proj", None)
    act = getattr(experts, "act_fn", None)
    problems = []
    if not isinstance(down, torch.Tensor):
        problems.append("no down_proj tensor")
    if act is None or type(act).__name__ != "ReLUSquaredActivation":
        problems.append(f"ungated experts (has_gate=False) with activation "
                        f"{_act_label(act) if act is not None else None} (moe.dispatch computes "
                        "ungated experts with ReLU squared only, 'relu2')")
    if getattr(experts, "has_bias", False):
        problems.append("ungated experts with biases (has_bias=True)")
    if getattr(experts, "has_post_expert_norm", False):
        problems.append("a post-expert norm (has_post_expert_norm=True)")
    if problems:
        _raise(experts, where, problems)
    transposed = bool(getattr(experts, "is_transposed", False))
    v1 = up.transpose(1, 2) if transposed else up
    v2 = down.transpose(1, 2) if transposed else down
    _check_weights(experts, where, v1, v2, False, None, None, w3=v1,
                   names=("up_proj", "up_proj", "down_proj"))
    return ExpertsLayout(v1, v2, "relu", w3=v1)


def _check_weights(experts, where, v13, v2, interleaved, b13, b2, w3=None, names=None):
    problems = []
    rows = 2 if w3 is None else 1   # (with w3, v13 holds the gate rows alone)
    if v13.dim() != 3 or v2.dim() != 3:
        problems.append(f"weights of rank {v13.dim()}/{v2.dim()} (expected 3-D gate_up_proj and "
                        "down_proj)")
    elif not (v13.shape[0] == v2.shape[0] and v13.shape[1] == rows * v2.shape[2]
              and v13.shape[2] == v2.shape[1]):
        problems.append(f"gate_up_proj {tuple(v13.shape)} / down_proj {tuple(v2.shape)} (as "
                        "[E, 2I, H] / [E, H, I]) do not fit together")
    else:
        E, two_i, H = v13.shape
        if b13 is not None and tuple(b13.shape) != (E, two_i):
            problems.append(f"gate_up_proj_bias {tuple(b13.shape)} (expected {(E, two_i)})")
        if b2 is not None and tuple(b2.shape) != (E, H):
            problems.append(f"down_proj_bias {tuple(b2.shape)} (expected {(E, H)})")
    if w3 is None:
        named = (("gate_up_proj", v13), ("down_proj", v2))
    else:
        named = tuple(zip(names or ("w1", "v1", "w2"), (v13, w3, v2)))
    for name, w in named:
        if w.dtype not in _OK_DTYPES:
            problems.append(f"{name} dtype {w.dtype} (quantized experts are not covered)")
        elif w.dtype == torch.float64 and w.device.type not in ("cpu", "meta"):
            problems.append(
                f"{name} float64 on {w.device} (moe.dispatch runs float64 on the CPU only, "
                "through its reference; on the GPU use bfloat16, float16 or float32)")
    if problems:
        _raise(experts, where, problems)


def _raise(experts, where, problems):
    at = f" ({where})" if where else ""
    raise UnsupportedModelError(
        f"moe_ops: {type(experts).__name__}{at} has an experts layout that moe.dispatch does not "
        f"cover: {'; '.join(problems)}. moe.dispatch computes gated experts (gate_up_proj [E, 2I, H] "
        "or its transpose, gate/up concatenated or interleaved, optional biases) with SiLU, GELU, "
        "ReLU, gpt-oss's clamped SwiGLU, SiLU clamped to a limit or a softcapped SwiGLU, and "
        "ungated ReLU-squared experts.")

"""HuggingFace transformers integration: run the MoE layers of transformers models on
`torch.ops.moe.route` and `torch.ops.moe.dispatch`.

Every family whose experts class uses transformers' `@use_experts_implementation` is covered
through its recorded layout (`_hf_layouts.experts_layout`): `gate_up_proj` `[E, 2I, H]` or, where
the family stores it transposed (gpt-oss, Aria), `[E, H, 2I]` read as `gate_up_proj.transpose(1, 2)`
(a view, never a copy); gate/up halves concatenated or interleaved; optional biases; SiLU, GELU
(erf or tanh), ReLU, gpt-oss's clamped SwiGLU, a SiLU clamped before or after (DeepSeek-V4,
Step-3.7) or a softcapped SwiGLU (Inkling2). Llama 4's MoE block (router weight on the input),
DBRX's experts (gate `w1` and up `v1` as two tensors, passed as `w13` and `w3` views), ungated
ReLU-squared experts (NemotronH, Ergo: `w13 = w3 = up_proj`) and post-expert norms (MuseSpark:
one dispatch row per route) are covered too. Other ungated activations and custom gates and the
capacity-limited routers (NLLB-MoE, Switch) are refused with an `UnsupportedModelError` naming
the difference.

Two routes, both zero-copy:

* `model.set_experts_implementation("moe_ops")` (or `from_pretrained(...,
  experts_implementation="moe_ops")`): transformers' own router, experts through `moe.dispatch`.
  `import moe_ops` registers it (`register_experts_interface`).
* `apply_moe_ops(model)` patches every covered experts module of one model instance and, for the
  families whose routing is one `moe.route` call (`_hf_routers.ROUTER_KINDS`: softmax then top-k,
  top-k then softmax with gpt-oss's router bias, DeepSeek-V3/GLM-4-MoE sigmoid with groups and a
  correction bias, Llama 4's top-1 sigmoid...), their router; other routers (PhiMoE's sparsemixer,
  ERNIE 4.5's, DeepSeek-V2's group-limited greedy...) stay transformers' torch code. Blocks,
  shared experts and their gates stay transformers' code, so the recorded router logits and the
  auxiliary loss are unchanged. `apply_moe_ops()` (no model) patches the classes instead; a
  model's explicit `set_experts_implementation(...)` still takes effect under it. `revert_moe_ops`
  undoes either.

Works with transformers 5.x (tested with 5.17, the GPU machine's version, and 5.25).
"""
from __future__ import annotations

import functools
import importlib
import sys
import types
import warnings

import torch

import moe_ops.ops  # noqa: F401  (registers torch.ops.moe.*)

from . import _hf_routers, hf_quant
from ._hf_layouts import ExpertsLayout, UnsupportedModelError, experts_layout
from ._hf_routers import ROUTER_FUNCTIONS, router_forward_for

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "ExpertsLayout",
    "SUPPORTED_FAMILIES",
    "UnsupportedModelError",
    "apply_moe_ops",
    "check_experts_layout",
    "experts_layout",
    "is_patched",
    "moe_ops_experts_forward",
    "register_experts_interface",
    "revert_moe_ops",
]

EXPERTS_IMPLEMENTATION = "moe_ops"


# ----------------------------------------------------------------------------------------------
# Experts


def check_experts_layout(experts: torch.nn.Module, where: str | None = None) -> None:
    """Raises `UnsupportedModelError` unless `moe.dispatch` computes this experts module: gated
    experts with `gate_up_proj` `[E, 2I, H]` or transposed `[E, H, 2I]` (`is_transposed`), the
    gate/up halves concatenated or interleaved, optional biases, SiLU / GELU (erf or tanh) / ReLU
    gating or gpt-oss's clamped SwiGLU, float weights. The message names every difference."""
    experts_layout(experts, where)


def _per_token(t, T):
    """[..., K] -> [T, K]. Not reshape(T, -1): with no tokens (an empty batch, T = 0) that
    raises ("cannot reshape tensor of 0 elements"), where transformers' own experts return an
    empty [0, H]. (A flat [T*K] still goes through reshape(T, -1).)"""
    return t.reshape(T, t.shape[-1]) if t.dim() >= 2 else t.reshape(T, -1)


def _dispatch(layout: ExpertsLayout, x, weights, ids):
    return torch.ops.moe.dispatch(x, layout.w13, layout.w2, weights, ids, layout.activation,
                                  **layout.dispatch_kwargs())


def _dispatch_experts(self, hidden_states, top_k_index, top_k_weights, layout=None):
    if layout is None:
        layout = experts_layout(self)
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    if x.dtype != layout.w13.dtype:  # e.g. under autocast
        x = x.to(layout.w13.dtype)
    T = x.shape[0]
    E = layout.w13.shape[0]
    ids = _per_token(top_k_index, T)
    weights = _per_token(top_k_weights, T)
    if weights.shape[1] != ids.shape[1] and weights.shape[1] == E:
        # [T, E] dense routing weights (older DeepSeek-V2 style): pick the selected ones.
        weights = weights.gather(1, ids.long())
    if weights.dtype != torch.float32 and weights.dtype != x.dtype:
        weights = weights.float()
    if getattr(self, "_is_expert_parallel", False):
        # transformers' expert parallelism marks experts of other ranks with ids >= local E;
        # moe.dispatch's sentinel is any id < 0.
        ids = torch.where(ids < E, ids, torch.full_like(ids, -1))
    if layout.post_norm is not None:
        return _dispatch_post_norm(layout, x, weights, ids).to(hidden_states.dtype).reshape(shape)
    out = _dispatch(layout, x, weights, ids)
    return out.to(hidden_states.dtype).reshape(shape)


def _dispatch_post_norm(layout: ExpertsLayout, x, weights, ids):
    """Experts whose output is normed before the routing weight (MuseSpark's post_expert_norm):
    one moe.dispatch row per route (x repeated K times, top-1 ids, weight 1), the norm on each
    route's output, then the weighted sum over the K routes in float32. A dropped route (id < 0)
    gives a zero row, whose norm is zero."""
    T, K = ids.shape
    ones = torch.ones(T * K, 1, dtype=torch.float32, device=x.device)
    y = _dispatch(layout, x.repeat_interleave(K, dim=0), ones, ids.reshape(T * K, 1))
    y = layout.post_norm(y).reshape(T, K, -1)
    return (y.float() * weights.float().unsqueeze(-1)).sum(1)


def moe_ops_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The `"moe_ops"` experts implementation: `fn(experts_module, hidden_states [T, H],
    top_k_index [T, K], top_k_weights [T, K]) -> [T, H]` through `torch.ops.moe.dispatch`, reading
    the module's own expert tensors (transposed views where the module stores them transposed).
    Raises `UnsupportedModelError` naming the difference for layouts the op does not compute."""
    return _dispatch_experts(self, hidden_states, top_k_index, top_k_weights)


def _patched_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    # Installed by apply_moe_ops(model), which checked the layout once.
    return _dispatch_experts(self, hidden_states, top_k_index, top_k_weights)


def _llama4_moe_forward(self, hidden_states):
    """Llama4TextMoe: transformers' router (its top-1 sigmoid, recorded for output_router_logits)
    gives the logits; moe.route recomputes the selection from them (sigmoid scores, no
    renormalisation) and moe.dispatch scales each token by its weight before the experts
    (weights_on_input), as Llama 4 does; the shared expert is added as transformers adds it."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    _, router_logits = self.router(hidden_states)
    weights, ids = torch.ops.moe.route(router_logits.reshape(-1, router_logits.shape[-1]),
                                       int(self.top_k), "sigmoid", False, None, 1, 1, 1.0)
    layout = experts_layout(self.experts)
    x = hidden_states if hidden_states.dtype == layout.w13.dtype else hidden_states.to(layout.w13.dtype)
    # Llama 4 rounds the weight to the logits' dtype before scaling the tokens by it.
    routed = _dispatch(layout, x, weights.to(router_logits.dtype), ids)
    out = self.shared_expert(hidden_states)
    out.add_(routed.to(out.dtype))
    return out, router_logits


def register_experts_interface() -> bool:
    """Registers `"moe_ops"` in transformers' `ExpertsInterface`, so that
    `model.set_experts_implementation("moe_ops")` and `from_pretrained(...,
    experts_implementation="moe_ops")` work. Idempotent. Returns False (and does nothing) when the
    installed transformers has no experts interface."""
    try:
        from transformers.integrations import moe as hf_moe
    except ImportError:
        return False
    interface = getattr(hf_moe, "ExpertsInterface", None)
    if interface is None:
        return False
    mapping = getattr(interface, "_global_mapping", None)
    if isinstance(mapping, dict) and mapping.get(EXPERTS_IMPLEMENTATION) is moe_ops_experts_forward:
        return True
    if hasattr(interface, "register"):
        interface.register(EXPERTS_IMPLEMENTATION, moe_ops_experts_forward)
    elif isinstance(mapping, dict):
        mapping[EXPERTS_IMPLEMENTATION] = moe_ops_experts_forward
    else:
        return False
    return True


# ----------------------------------------------------------------------------------------------
# Families

# The families with the experts interface whose routers apply_moe_ops also replaces (README
# table); every other @use_experts_implementation family runs its experts on moe.dispatch under
# its own router, or is refused naming the difference.
SUPPORTED_FAMILIES = (
    "Mixtral", "MiniMax", "Qwen2-MoE", "Qwen3-MoE", "Qwen3-Next", "Qwen3.5-MoE", "Qwen3-VL-MoE",
    "Qwen3-Omni-MoE", "OLMoE", "FlexOlmo", "DeepSeek-V2", "DeepSeek-V3", "GLM-4-MoE", "gpt-oss",
    "Aria", "Llama 4", "GraniteMoE", "Jamba",
)

_LLAMA4_BLOCK = ("llama4", "Llama4TextMoe")


def _is_decorated_experts(module) -> bool:
    """An experts module of a `@use_experts_implementation` class (the decorator's __init__ sets
    these attributes on every instance)."""
    return (hasattr(module, "has_gate") and hasattr(module, "is_transposed")
            and hasattr(type(module), "_apply_gate"))


def _overrides_decorated_forward(module) -> bool:
    """A subclass of a `@use_experts_implementation` class that defines its own forward around
    the decorated one (Ergo's ErgoExperts: one row per route, `super().forward`, then a per-expert
    norm). Replacing its forward would drop that code; apply_moe_ops(model) instead gives the
    module a config view that picks "moe_ops" (_ExpertsConfigView)."""
    try:
        from transformers.integrations import moe as hf_moe
    except ImportError:
        return False
    fn = getattr(type(module), "forward", None)
    code = getattr(fn, "__code__", None)
    deco = getattr(hf_moe, "use_experts_implementation", None)
    if code is None or deco is None:
        return False
    return code.co_filename != deco.__code__.co_filename


class _ExpertsConfigView:
    """An experts module's config as apply_moe_ops(model) leaves it where the module's class
    overrides the decorated forward: `_experts_implementation` reads "moe_ops" (the decorated
    forward looks it up at every call), everything else, read or written, is the model's config."""

    _experts_implementation = EXPERTS_IMPLEMENTATION

    def __init__(self, config):
        object.__setattr__(self, "_moe_ops_config", config)

    def __getattr__(self, name):
        if name == "_moe_ops_config":   # (before __init__: copy / pickle)
            raise AttributeError(name)
        return getattr(self._moe_ops_config, name)

    def __setattr__(self, name, value):
        if name != "_experts_implementation":
            setattr(self._moe_ops_config, name, value)

    def __reduce__(self):
        return (_ExpertsConfigView, (self._moe_ops_config,))


def _is_llama4_block(module) -> bool:
    cls = type(module)
    return cls.__name__ == _LLAMA4_BLOCK[1] and cls.__module__.startswith("transformers.models.llama4")


def _quantized_experts_forward(module, where: str | None = None):
    """The moe_ops forward of a quantized experts module (transformers' FineGrainedFP8
    `FP8Experts`, or experts given raw MXFP4 tensors by `hf_quant.attach_mxfp4`), checked; None
    for any other module. Raises UnsupportedModelError naming the module for an FP8 variant
    moe.dispatch does not compute."""
    if getattr(module, "moe_ops_mxfp4", None) is not None:
        return hf_quant.mxfp4_experts_forward
    if not hf_quant.is_fp8_experts(module):
        return None
    try:
        hf_quant.fp8_dispatch_kwargs(module)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{e} ({where})" if where else str(e)) from None
    return hf_quant.fp8_experts_forward


# The functions apply_moe_ops(model) installs (as functools.partial(fn, module)).
_PATCH_FUNCTIONS = frozenset([_patched_experts_forward, _llama4_moe_forward, *ROUTER_FUNCTIONS,
                              hf_quant.fp8_experts_forward, hf_quant.mxfp4_experts_forward])


# ----------------------------------------------------------------------------------------------
# Instance patching

# Instance attribute of a patched module: (patched attribute name, its previous instance-level value
# or None). None, not a sentinel object, so that the record survives copy.deepcopy and pickling.
_SAVED = "_moe_ops_saved"


def _forward_attr(module: torch.nn.Module, where: str) -> str:
    """The instance attribute to patch: `forward`, or accelerate's `_old_forward` when an
    accelerate hook (device_map, offloading) wraps the module, so the hook keeps running."""
    d = module.__dict__
    if _SAVED in d:  # patched already
        return d[_SAVED][0]
    if "_hf_hook" in d and "_old_forward" in d:
        return "_old_forward"
    if "forward" in d and not _is_class_forward(d["forward"], module):
        raise UnsupportedModelError(
            f"moe_ops: {type(module).__name__} ({where}) already has an instance-level forward "
            "installed by another library (tensor/expert parallelism?); apply_moe_ops cannot patch "
            "it without bypassing that wrapper.")
    return "forward"


def _is_class_forward(fn, module) -> bool:
    """`fn` is the module's own class `forward` bound to it: what accelerate's
    `remove_hook_from_module` leaves behind as an instance attribute."""
    return (getattr(fn, "__self__", None) is module
            and getattr(fn, "__func__", None) is type(module).forward)


def _is_our_patch(fn, module) -> bool:
    return (isinstance(fn, functools.partial) and fn.func in _PATCH_FUNCTIONS
            and len(fn.args) == 1 and fn.args[0] is module)


def _patch_instance(module, fn, attr):
    if _SAVED in module.__dict__:
        return  # already patched: patching twice is harmless
    module.__dict__[_SAVED] = (attr, module.__dict__.get(attr))
    if attr == "config":   # (fn is None: _ExpertsConfigView)
        module.__dict__["config"] = _ExpertsConfigView(module.__dict__["config"])
        return
    # functools.partial of a module-level function, not a bound method: a bound method pickles
    # as getattr(module, fn.__name__), which the patched class does not have, so a patched model
    # saved with torch.save / pickle could not be loaded.
    module.__dict__[attr] = functools.partial(fn, module)


def _unpatch_instance(module):
    """Puts back what the patch replaced, wherever the patch is now: an accelerate hook added
    after `apply_moe_ops` moves it from `forward` to `_old_forward` (the hook stays and calls the
    restored forward); a hook removed after it moves it from `_old_forward` to `forward`."""
    d = module.__dict__
    attr, prev = d.pop(_SAVED)   # (the attribute patched then: the patch may have moved since)
    if attr == "config":
        if isinstance(d.get("config"), _ExpertsConfigView):
            d["config"] = prev
        return
    if prev is not None and _is_class_forward(prev, module):
        prev = None
    for name in ("forward", "_old_forward"):
        if not _is_our_patch(d.get(name), module):
            continue
        if prev is not None:
            d[name] = prev
        elif name == "forward":
            del d[name]
        else:  # a hook's wrapper calls module._old_forward: the class forward, bound
            d[name] = types.MethodType(type(module).forward, module)
        return


# MoE modules of transformers families outside the experts interface that moe.dispatch does not
# compute, with the difference.
_NOT_COVERED = {
    "DogeCDMoE": "Doge's DogeCDMoE retrieves single-neuron experts by product keys; it is not a "
                 "top-k over gated MLP experts",
    "JetMoeMoE": "JetMoe's JetMoeParallelExperts hold ungated per-expert linear maps (also used by "
                 "its mixture of attention heads), not [E, 2I, H] gated experts",
    "NllbMoeSparseMLP": "NllbMoe's NllbMoeSparseMLP routes with an expert capacity (tokens past it "
                        "are dropped) to ungated ReLU experts held as separate modules",
    "SwitchTransformersSparseMLP": "SwitchTransformers' SwitchTransformersSparseMLP routes with an "
                                   "expert capacity (tokens past it are dropped) to ungated "
                                   "experts held as separate modules",
    "VitPoseNaiveMoe": "VitPose's VitPoseNaiveMoe picks the expert by dataset index, not by "
                       "routing tokens",
}


def _plan(model):
    """[(module, forward attribute, patch function)] for every module apply_moe_ops(model)
    replaces; validates everything before anything is patched."""
    parents = {}
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            parents.setdefault(id(child), (module, f"{name}.{child_name}" if name else child_name))
    plan = []
    seen = set()
    for name, module in model.named_modules():
        where = name or type(module).__name__
        if _is_llama4_block(module):
            experts_layout(module.experts, f"{where}.experts")
            plan.append((module, _forward_attr(module, where), _llama4_moe_forward))
            seen.add(id(module.experts))
            continue
        if id(module) in seen:
            continue
        quantized_fn = _quantized_experts_forward(module, where)
        if quantized_fn is not None or type(module).__name__ == "DbrxExperts" \
                or _is_decorated_experts(module):
            if quantized_fn is not None:
                num_experts = hf_quant.num_experts(module)
                plan.append((module, _forward_attr(module, where), quantized_fn))
            else:
                num_experts = experts_layout(module, where).w13.shape[0]
                if _is_decorated_experts(module) and _overrides_decorated_forward(module):
                    if "config" not in module.__dict__:
                        raise UnsupportedModelError(
                            f"moe_ops: {type(module).__name__} ({where}) overrides the experts' "
                            "forward and has no config of its own to pick moe_ops with; use "
                            "set_experts_implementation('moe_ops').")
                    plan.append((module, "config", None))
                else:
                    plan.append((module, _forward_attr(module, where), _patched_experts_forward))
            parent = parents.get(id(module))
            if parent is None:
                continue
            block, block_where = parent[0], parent[1].rsplit(".", 1)[0] if "." in parent[1] else ""
            for attr in ("gate", "router"):
                router = getattr(block, attr, None)
                if not isinstance(router, torch.nn.Module) or router_forward_for(router) is None:
                    continue
                rwhere = f"{block_where}.{attr}" if block_where else attr
                if router.weight.shape[0] != num_experts:
                    raise UnsupportedModelError(
                        f"moe_ops: {where}: the router {rwhere} scores {router.weight.shape[0]} "
                        f"experts but the experts module holds {num_experts} (expert "
                        "parallelism is not covered by apply_moe_ops; use "
                        "set_experts_implementation('moe_ops')).")
                _hf_routers.prepare(type(router), _hf_routers.original_forward(router))
                plan.append((router, _forward_attr(router, rwhere), router_forward_for(router)))
                break
    if not plan:
        for m in model.modules():
            reason = _NOT_COVERED.get(type(m).__name__)
            if reason is not None and type(m).__module__.startswith("transformers."):
                raise UnsupportedModelError(
                    f"apply_moe_ops: {type(model).__name__} is not covered: {reason}.")
        moe_like = sorted({type(m).__name__ for m in model.modules()
                           if any(s in type(m).__name__.lower() for s in ("moe", "expert", "router"))})
        found = f" It has MoE-like modules {moe_like}, which moe_ops does not know." if moe_like else ""
        raise UnsupportedModelError(
            f"apply_moe_ops: {type(model).__name__} has no supported sparse MoE block.{found} "
            "moe_ops runs the experts of transformers' @use_experts_implementation classes (with "
            f"moe.route for the routers of {', '.join(SUPPORTED_FAMILIES)}) and Llama 4's "
            "Llama4TextMoe.")
    return plan


# ----------------------------------------------------------------------------------------------
# Class patching: apply_moe_ops() without a model.
#
# Routers: the listed router classes get the moe.route forward; Llama4TextMoe its block forward.
# Experts: the @use_experts_implementation classes already dispatch through transformers'
# ExpertsInterface at every call (`get_interface(config._experts_implementation, eager)`). The
# class route wraps that lookup instead of replacing the experts' forward, so that the model's
# own choice still counts: an implementation the user picked (set_experts_implementation, or
# experts_implementation= in from_pretrained / the config) while the patch is on runs as chosen,
# and otherwise (transformers' default) the experts run moe_ops, or transformers' default where
# moe.dispatch does not compute the layout (warned once per class).

_ABSENT = _hf_routers.ABSENT
_CLASS_SAVED = _hf_routers.CLASS_SAVED  # class -> its own previous `forward` (or _ABSENT)
_GLOBAL_SAVED: dict = {}  # (object, attribute) -> previous value (or _ABSENT)
_FELL_BACK: set = set()  # experts classes already warned about


def _patch_class(cls, fn):
    if cls in _CLASS_SAVED:
        return
    _CLASS_SAVED[cls] = cls.__dict__.get("forward", _ABSENT)
    cls.forward = fn


def _patch_attr(obj, attr, value):
    key = (id(obj), attr)
    if key in _GLOBAL_SAVED:
        return
    _GLOBAL_SAVED[key] = (obj, vars(obj).get(attr, _ABSENT))
    setattr(obj, attr, value)


def _revert_classes():
    for cls, prev in list(_CLASS_SAVED.items()):
        if prev is _ABSENT:
            delattr(cls, "forward")
        else:
            cls.forward = prev
        del _CLASS_SAVED[cls]
    for key, (obj, prev) in list(_GLOBAL_SAVED.items()):
        if prev is _ABSENT:
            delattr(obj, key[1])
        else:
            setattr(obj, key[1], prev)
        del _GLOBAL_SAVED[key]
    _FELL_BACK.clear()


class _ChosenImplementation(str):
    """An experts implementation name the user chose while the class route is on. It equals the
    plain name everywhere transformers compares or prints it; only the class route tells it apart
    from transformers' default. A str subclass survives the config copies from_pretrained makes
    (a registry keyed by the config object would not)."""

    __slots__ = ()


def _mark_choice(config) -> None:
    impl = getattr(config, "_experts_implementation_internal", None)
    if isinstance(impl, str) and not isinstance(impl, _ChosenImplementation):
        config._experts_implementation_internal = _ChosenImplementation(impl)


def _bf16_experts_route(self):
    layout = experts_layout(self)
    return functools.partial(_dispatch_experts, layout=layout)


def _fp8_experts_route(self):
    hf_quant.fp8_dispatch_kwargs(self)   # raises for what moe.dispatch does not cover
    return hf_quant.fp8_experts_forward


def _class_route(resolve, chosen_fn, impl, self, *args, **kwargs):
    """The class route's experts call: the chosen implementation where the user chose one,
    otherwise moe_ops (`resolve(self)` gives its forward, or raises UnsupportedModelError for a
    layout moe.dispatch does not compute: then transformers' implementation, warned once per
    class)."""
    if impl == EXPERTS_IMPLEMENTATION or isinstance(impl, _ChosenImplementation):
        return chosen_fn(self, *args, **kwargs)
    try:
        fn = resolve(self)
    except UnsupportedModelError as e:
        if type(self) not in _FELL_BACK:
            _FELL_BACK.add(type(self))
            warnings.warn(f"{e} apply_moe_ops() leaves these experts to transformers' "
                          f"{impl or 'eager'} implementation.", stacklevel=2)
        return chosen_fn(self, *args, **kwargs)
    return fn(self, *args, **kwargs)


def _wrap_get_interface(orig, resolve=_bf16_experts_route):
    def get_interface(experts_implementation, default):
        chosen_fn = orig(experts_implementation, default)
        return functools.partial(_class_route, resolve, chosen_fn, experts_implementation)
    return get_interface


def _wrap_set_experts_implementation(orig):
    @functools.wraps(orig)
    def set_experts_implementation(self, experts_implementation):
        configs = [m.config for m in self.modules()
                   if hasattr(m, "set_experts_implementation") and getattr(m, "config", None) is not None]
        # transformers switches implementations itself (generate() runs the decode on
        # "batched_mm" instead of "grouped_mm" on GPUs, then switches back): such a call keeps
        # each config's chosen-or-default status; only a call from outside transformers is a choice.
        caller = sys._getframe(1).f_globals.get("__name__", "")
        internal = caller == "transformers" or caller.startswith("transformers.")
        was_chosen = [isinstance(getattr(c, "_experts_implementation_internal", None),
                                 _ChosenImplementation) for c in configs]
        out = orig(self, experts_implementation)
        for cfg, chosen in zip(configs, was_chosen):
            if not internal or chosen:
                _mark_choice(cfg)
            else:
                impl = getattr(cfg, "_experts_implementation_internal", None)
                if isinstance(impl, _ChosenImplementation):
                    cfg._experts_implementation_internal = str(impl)
        return out
    return set_experts_implementation


def _wrap_config_property(prop):
    def fset(self, value):
        prop.fset(self, value)  # (recurses into the sub-configs through this same property)
        if value is not None:
            _mark_choice(self)
    return property(prop.fget, fset, prop.fdel, prop.__doc__)


def _patch_experts_classes() -> bool:
    try:
        from transformers import PretrainedConfig, PreTrainedModel
        from transformers.integrations import moe as hf_moe
    except ImportError:
        return False
    interface = getattr(hf_moe, "ALL_EXPERTS_FUNCTIONS", None)
    if interface is None or not hasattr(interface, "get_interface"):
        return False
    register_experts_interface()
    _patch_attr(interface, "get_interface", _wrap_get_interface(interface.get_interface))
    fp8_interface = hf_quant.fp8_experts_interface()
    if fp8_interface is not None and hasattr(fp8_interface, "get_interface"):
        hf_quant.register_fp8_experts_interface()
        _patch_attr(fp8_interface, "get_interface",
                    _wrap_get_interface(fp8_interface.get_interface, _fp8_experts_route))
    if hasattr(PreTrainedModel, "set_experts_implementation"):
        _patch_attr(PreTrainedModel, "set_experts_implementation",
                    _wrap_set_experts_implementation(PreTrainedModel.set_experts_implementation))
    prop = vars(PretrainedConfig).get("_experts_implementation")
    if isinstance(prop, property) and prop.fset is not None:
        _patch_attr(PretrainedConfig, "_experts_implementation", _wrap_config_property(prop))
    return True


def _router_classes():
    """[(router class, moe.route forward)] of the listed families this transformers has."""
    out = []
    for name, module in _hf_routers.ROUTER_MODULES.items():
        try:
            mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        except ImportError:
            continue
        cls = getattr(mod, name, None)
        if isinstance(cls, type):
            out.append((cls, _hf_routers.ROUTER_BY_NAME[name]))
    return out


# ----------------------------------------------------------------------------------------------
# Public API


def apply_moe_ops(model: torch.nn.Module | None = None, *, expert_parallel_group=None):
    """Runs the MoE layers on `moe.route` + `moe.dispatch`.

    With `model`: patches every experts module of that instance that transformers dispatches
    through its experts interface (and Llama 4's MoE blocks), plus the router of every family
    whose routing moe.route computes (any dtype or device, weights used in place, never copied),
    and returns the model. Raises `UnsupportedModelError` naming the model class if it has no MoE
    module moe_ops knows, or naming the module and the difference if one of its experts modules
    has a layout moe.dispatch does not compute; nothing is patched then. Patching twice is
    harmless.

    Without a model: patches the classes, for every model built before or after, until
    `revert_moe_ops()`: the listed routers run moe.route, and the experts run moe.dispatch unless
    the model's experts implementation was chosen explicitly (`set_experts_implementation`,
    `experts_implementation=`) while the patch is on, or the layout is one moe.dispatch does not
    compute (then transformers' implementation runs, with a warning). Returns None.

    `expert_parallel_group` (with a model; a torch.distributed ProcessGroup, or a
    `moe_ops.distributed.ExpertParallelConfig` for other options than the all-to-all default):
    every rank keeps only its shard of each experts module and runs it with
    `moe_ops.distributed.expert_parallel_dispatch` (see `moe_ops.distributed.shard_experts_module`).
    A collective: every rank of the group calls it. Expert parallelism covers the Mixtral layout
    (gate-first `[E, 2I, H]` SiLU experts without biases); other layouts are refused."""
    if model is None and expert_parallel_group is not None:
        raise ValueError("apply_moe_ops: expert_parallel_group needs a model instance")
    if model is None:
        try:
            import transformers
        except ImportError:
            raise ImportError("apply_moe_ops() patches transformers' MoE classes, and "
                              "transformers is not installed: pip install 'moe_ops[hf]' "
                              "(transformers >= 5.0)") from None
        if not _patch_experts_classes():
            raise UnsupportedModelError(
                f"apply_moe_ops: transformers {transformers.__version__} has no experts interface "
                "(transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS); moe_ops needs transformers "
                ">= 5.0.")
        for cls, fn in _router_classes():
            _hf_routers.prepare(cls, cls.__dict__.get("forward", cls.forward))
            _patch_class(cls, fn)
        try:
            mod = importlib.import_module("transformers.models.llama4.modeling_llama4")
            _patch_class(getattr(mod, _LLAMA4_BLOCK[1]), _llama4_moe_forward)
        except (ImportError, AttributeError):
            pass
        return None
    _check_module("apply_moe_ops", model)
    plan = _plan(model)
    if expert_parallel_group is not None:
        _check_expert_parallel(plan)
    for module, attr, fn in plan:
        _patch_instance(module, fn, attr)
    if expert_parallel_group is not None:
        from moe_ops.distributed import shard_experts_module

        for module, attr, fn in plan:
            if fn is _patched_experts_forward:
                shard_experts_module(module, expert_parallel_group, forward_attr=attr)
    return model


def _check_expert_parallel(plan) -> None:
    """moe_ops.distributed shards and dispatches gate_up_proj [E, 2I, H] / down_proj [E, H, I]
    SiLU experts: refuse every other layout before anything is patched."""
    for module, _, fn in plan:
        if fn is _llama4_moe_forward:
            raise UnsupportedModelError(
                f"apply_moe_ops: expert parallelism does not cover {type(module).__name__} "
                "(Llama 4: the routing weight multiplies the experts' input).")
        if fn in (hf_quant.fp8_experts_forward, hf_quant.mxfp4_experts_forward):
            raise UnsupportedModelError(
                f"apply_moe_ops: expert_parallel_group with quantized experts "
                f"({type(module).__name__}) is not covered; use "
                "moe_ops.distributed.expert_parallel_dispatch with the FP8 tensors directly.")
        if fn is None:
            raise UnsupportedModelError(
                f"apply_moe_ops: expert parallelism does not cover {type(module).__name__}, whose "
                "forward wraps the experts' (e.g. one row per route and a per-expert norm).")
        if fn is not _patched_experts_forward:
            continue
        layout = experts_layout(module)
        own = getattr(module, "gate_up_proj", None)
        if layout.post_norm is not None:
            raise UnsupportedModelError(
                f"apply_moe_ops: expert parallelism does not cover {type(module).__name__} "
                "(a norm on each expert's output, has_post_expert_norm).")
        if (layout.activation != "silu" or layout.dispatch_kwargs()
                or layout.w13 is not own):
            raise UnsupportedModelError(
                f"apply_moe_ops: expert parallelism covers gate-first [E, 2I, H] SiLU experts "
                f"without biases; {type(module).__name__} is {layout.activation}-gated"
                f"{', biased' if layout.w13_bias is not None else ''}"
                f"{', interleaved' if layout.gate_up_interleaved else ''}"
                f"{', ungated (ReLU squared)' if layout.w3 is layout.w13 else ''}"
                f"{', with separate gate and up tensors' if layout.w3 is not None and layout.w3 is not layout.w13 else ''}"
                f"{', transposed' if layout.w3 is None and layout.w13 is not own else ''}.")


def revert_moe_ops(model: torch.nn.Module | None = None):
    """Undoes `apply_moe_ops(model)` on that instance (returns the model), or, without a model,
    `apply_moe_ops()` on the classes (returns None). Reverting what was not patched does nothing."""
    if model is None:
        _revert_classes()
        return None
    _check_module("revert_moe_ops", model)
    for module in model.modules():
        if _SAVED in module.__dict__:
            _unpatch_instance(module)
    return model


def is_patched(model: torch.nn.Module | None = None) -> bool:
    """Whether `apply_moe_ops` is in effect for this model instance (or, without a model, for the
    classes)."""
    if model is None:
        return bool(_CLASS_SAVED) or bool(_GLOBAL_SAVED)
    _check_module("is_patched", model)
    return any(_SAVED in m.__dict__ for m in model.modules())


def _check_module(fn: str, model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn} expects a torch.nn.Module or None, got {type(model).__name__}")

"""HuggingFace transformers integration: run the MoE layers of transformers models on
`torch.ops.moe.route` and `torch.ops.moe.dispatch`.

Two routes, both zero-copy (the ops read the model's own `experts.gate_up_proj` `[E, 2I, H]` and
`experts.down_proj` `[E, H, I]`):

* `apply_moe_ops(model)` patches every supported sparse MoE block of one model instance: its router
  (`block.gate`) runs `moe.route` with the family's exact routing arguments and its experts
  (`block.experts`) run `moe.dispatch`. The block's own forward (shared experts, jitter noise,
  reshapes) is untouched, so its return value and the router outputs recorded for the auxiliary loss
  (`output_router_logits=True`) are those of transformers. `apply_moe_ops()` (no model) patches the
  classes instead, for every model of these families, built before or after. `revert_moe_ops`
  undoes either. Supported: Mixtral, Qwen2-MoE (sigmoid-gated shared expert), Qwen3-MoE, OLMoE,
  DeepSeek-V3 (sigmoid scores, `e_score_correction_bias`, group-limited top-k,
  `routed_scaling_factor`, shared experts; the first `first_k_dense_replace` dense layers are left
  alone).
* `model.set_experts_implementation("moe_ops")` (or `from_pretrained(...,
  experts_implementation="moe_ops")`): transformers' own router, experts through `moe.dispatch`, for
  every `@use_experts_implementation` model with the standard layout. `import moe_ops` registers it
  (`register_experts_interface`).

Works with transformers 5.x (checked against 5.17 and 5.24).
"""
from __future__ import annotations

import functools
import importlib
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import moe_ops.ops  # noqa: F401  (registers torch.ops.moe.*)

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "SUPPORTED_FAMILIES",
    "UnsupportedModelError",
    "apply_moe_ops",
    "check_experts_layout",
    "is_patched",
    "moe_ops_experts_forward",
    "register_experts_interface",
    "revert_moe_ops",
]

EXPERTS_IMPLEMENTATION = "moe_ops"


class UnsupportedModelError(ValueError):
    """The model, or one of its MoE modules, has no moe_ops path (unknown family or an experts
    layout outside the contract: transposed, interleaved, biased, non-SwiGLU, quantized...)."""


# ----------------------------------------------------------------------------------------------
# Experts


def _default_apply_gate():
    try:
        from transformers.integrations import moe as hf_moe
    except ImportError:
        return None
    return getattr(hf_moe, "_default_apply_gate", None)


def _is_silu(act) -> bool:
    if act is F.silu or isinstance(act, torch.nn.SiLU):
        return True
    # transformers.activations.SiLUActivation (ACT2FN["silu"]) computes F.silu.
    return type(act).__name__ == "SiLUActivation"


_OK_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_experts_layout(experts: torch.nn.Module, where: str | None = None) -> None:
    """Raises `UnsupportedModelError` unless `experts` holds the layout `moe.dispatch` computes:
    `gate_up_proj` `[E, 2I, H]` (gate rows first, not interleaved, not transposed), `down_proj`
    `[E, H, I]`, no biases, no post-expert norm, SiLU-gated (SwiGLU) experts, float weights."""
    problems = []
    w13 = getattr(experts, "gate_up_proj", None)
    w2 = getattr(experts, "down_proj", None)
    if not getattr(experts, "has_gate", True) or not isinstance(w13, torch.Tensor):
        problems.append("no fused gate_up_proj (ungated experts, has_gate=False)")
    if not isinstance(w2, torch.Tensor):
        problems.append("no down_proj tensor")
    if not getattr(experts, "is_concatenated", True):
        problems.append("interleaved gate/up rows (is_concatenated=False)")
    if getattr(experts, "is_transposed", False) or getattr(experts, "experts_are_transposed", False):
        problems.append("transposed expert weights (is_transposed=True)")
    if (getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None
            or getattr(experts, "down_proj_bias", None) is not None):
        problems.append("expert biases (has_bias=True)")
    if getattr(experts, "has_post_expert_norm", False):
        problems.append("a post-expert norm (has_post_expert_norm=True)")
    gate_fn = getattr(type(experts), "_apply_gate", None)
    if gate_fn is not None and gate_fn is not _default_apply_gate():
        problems.append(f"custom gating {type(experts).__name__}._apply_gate (e.g. GPT-OSS's clamped SwiGLU)")
    act = getattr(experts, "act_fn", None)
    if act is None:
        problems.append("no act_fn")
    elif not _is_silu(act):
        problems.append(f"activation {type(act).__name__} (only SiLU, i.e. SwiGLU experts)")
    if isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor):
        if w13.dim() != 3 or w2.dim() != 3:
            problems.append(
                f"weights of rank {w13.dim()}/{w2.dim()} (expected 3-D gate_up_proj and down_proj)")
        elif not (w13.shape[0] == w2.shape[0] and w13.shape[1] == 2 * w2.shape[2]
                  and w13.shape[2] == w2.shape[1]):
            problems.append(
                f"gate_up_proj {tuple(w13.shape)} / down_proj {tuple(w2.shape)} are not "
                "[E, 2I, H] / [E, H, I]")
        for name, w in (("gate_up_proj", w13), ("down_proj", w2)):
            if w.dtype not in _OK_DTYPES:
                problems.append(f"{name} dtype {w.dtype} (quantized experts are not covered)")
            elif w.dtype == torch.float64 and w.device.type not in ("cpu", "meta"):
                problems.append(
                    f"{name} float64 on {w.device} (moe.dispatch runs float64 on the CPU only, "
                    "through its reference; on the GPU use bfloat16, float16 or float32)")
    if problems:
        at = f" ({where})" if where else ""
        raise UnsupportedModelError(
            f"moe_ops: {type(experts).__name__}{at} has an experts layout that moe.dispatch does not "
            f"cover: {'; '.join(problems)}. moe.dispatch needs gate_up_proj [E, 2I, H] (gate rows "
            "first), down_proj [E, H, I], no biases and SiLU-gated (SwiGLU) experts.")


def _per_token(t, T):
    """[..., K] -> [T, K]. Not reshape(T, -1): with no tokens (an empty batch, T = 0) that
    raises ("cannot reshape tensor of 0 elements"), where transformers' own experts return an
    empty [0, H]. (A flat [T*K] still goes through reshape(T, -1).)"""
    return t.reshape(T, t.shape[-1]) if t.dim() >= 2 else t.reshape(T, -1)


def _dispatch_experts(self, hidden_states, top_k_index, top_k_weights):
    w13, w2 = self.gate_up_proj, self.down_proj
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    if x.dtype != w13.dtype:  # e.g. under autocast
        x = x.to(w13.dtype)
    T = x.shape[0]
    ids = _per_token(top_k_index, T)
    weights = _per_token(top_k_weights, T)
    if weights.shape[1] != ids.shape[1] and weights.shape[1] == w13.shape[0]:
        # [T, E] dense routing weights (older DeepSeek-V2 style): pick the selected ones.
        weights = weights.gather(1, ids.long())
    if weights.dtype != torch.float32 and weights.dtype != x.dtype:
        weights = weights.float()
    if getattr(self, "_is_expert_parallel", False):
        # transformers' expert parallelism marks experts of other ranks with ids >= local E;
        # moe.dispatch's sentinel is any id < 0.
        ids = torch.where(ids < w13.shape[0], ids, torch.full_like(ids, -1))
    out = torch.ops.moe.dispatch(x, w13, w2, weights, ids, "silu")
    return out.to(hidden_states.dtype).reshape(shape)


def moe_ops_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The `"moe_ops"` experts implementation: `fn(experts_module, hidden_states [T, H],
    top_k_index [T, K], top_k_weights [T, K]) -> [T, H]` through `torch.ops.moe.dispatch`, reading
    the module's `gate_up_proj` / `down_proj` in place. Raises `UnsupportedModelError` for layouts
    outside the contract (GPT-OSS: transposed, interleaved, biased, clamped SwiGLU)."""
    check_experts_layout(self)
    return _dispatch_experts(self, hidden_states, top_k_index, top_k_weights)


def _patched_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    # Installed by apply_moe_ops(model), which checked the layout once.
    return _dispatch_experts(self, hidden_states, top_k_index, top_k_weights)


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
# Routers: each returns what the transformers router returns, (router_logits, top-k weights,
# top-k ids), so the block's forward and the router-logits recording hooks see no difference.
# The ids come back int32 (moe.route's dtype; transformers' routers give int64).


def _mixtral_router_forward(self, hidden_states):
    # softmax (float32) -> top-k -> renormalise; weights stay float32.
    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    router_logits = F.linear(hidden_states, self.weight)
    weights, ids = torch.ops.moe.route(router_logits, int(self.top_k), "softmax", True, None, 1, 1, 1.0)
    return router_logits, weights, ids


def _qwen_router_forward(self, hidden_states):
    # Qwen2-MoE, Qwen3-MoE, OLMoE: softmax (float32) -> top-k -> renormalise only if
    # norm_topk_prob; weights cast back to the logits' dtype.
    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    router_logits = F.linear(hidden_states, self.weight)
    weights, ids = torch.ops.moe.route(router_logits, int(self.top_k), "softmax",
                                       bool(self.norm_topk_prob), None, 1, 1, 1.0)
    return router_logits, weights.to(router_logits.dtype), ids


def _deepseek_v3_router_forward(self, hidden_states):
    # float32 logits; sigmoid scores; selection on scores + e_score_correction_bias, limited to the
    # topk_group best of n_group groups (a group scores the sum of its two best); weights are the
    # unbiased scores, renormalised if norm_topk_prob, times routed_scaling_factor.
    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    num_groups = int(self.num_group or 1)
    topk_groups = int(self.topk_group or num_groups)
    weights, ids = torch.ops.moe.route(
        router_logits, int(self.top_k), "sigmoid", bool(self.norm_topk_prob),
        self.e_score_correction_bias, num_groups, topk_groups, float(self.routed_scaling_factor))
    return router_logits, weights, ids


@dataclass(frozen=True)
class _Family:
    name: str
    module: str  # transformers.models.<module>.modeling_<module>
    block: str
    router: str
    experts: str
    router_forward: Callable
    router_attrs: tuple

    def classes(self):
        """(block, router, experts) classes, or None where this transformers lacks them."""
        try:
            mod = importlib.import_module(f"transformers.models.{self.module}.modeling_{self.module}")
            return tuple(getattr(mod, n) for n in (self.block, self.router, self.experts))
        except (ImportError, AttributeError):
            return None


_SOFTMAX_ATTRS = ("weight", "top_k")
_QWEN_ATTRS = ("weight", "top_k", "norm_topk_prob")
_DSV3_ATTRS = ("weight", "top_k", "norm_topk_prob", "e_score_correction_bias", "num_group",
               "topk_group", "routed_scaling_factor")

_FAMILIES = (
    _Family("Mixtral", "mixtral", "MixtralSparseMoeBlock", "MixtralTopKRouter", "MixtralExperts",
            _mixtral_router_forward, _SOFTMAX_ATTRS),
    _Family("Qwen2-MoE", "qwen2_moe", "Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter",
            "Qwen2MoeExperts", _qwen_router_forward, _QWEN_ATTRS),
    _Family("Qwen3-MoE", "qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter",
            "Qwen3MoeExperts", _qwen_router_forward, _QWEN_ATTRS),
    _Family("OLMoE", "olmoe", "OlmoeSparseMoeBlock", "OlmoeTopKRouter", "OlmoeExperts",
            _qwen_router_forward, _QWEN_ATTRS),
    _Family("DeepSeek-V3", "deepseek_v3", "DeepseekV3MoE", "DeepseekV3TopkRouter",
            "DeepseekV3Experts", _deepseek_v3_router_forward, _DSV3_ATTRS),
)

SUPPORTED_FAMILIES = tuple(f.name for f in _FAMILIES)
# The functions apply_moe_ops(model) installs (as functools.partial(fn, module)).
_PATCH_FUNCTIONS = frozenset([_patched_experts_forward, *(f.router_forward for f in _FAMILIES)])


def _supported_blocks_text():
    return ", ".join(f"{f.name} ({f.block})" for f in _FAMILIES)


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
    # functools.partial of a module-level function, not a bound method: a bound method pickles
    # as getattr(module, fn.__name__), which the patched class does not have, so a patched model
    # saved with torch.save / pickle could not be loaded.
    module.__dict__[attr] = functools.partial(fn, module)


def _unpatch_instance(module):
    """Puts back what the patch replaced, wherever the patch is now: an accelerate hook added
    after `apply_moe_ops` moves it from `forward` to `_old_forward` (the hook stays and calls the
    restored forward); a hook removed after it moves it from `_old_forward` to `forward`."""
    d = module.__dict__
    _, prev = d.pop(_SAVED)   # (the attribute patched then: the patch may have moved since)
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


def _family_of(module, loaded):
    for fam, classes in loaded:
        if isinstance(module, classes[0]):
            return fam, classes
    return None


def _loaded_families():
    return [(fam, c) for fam in _FAMILIES if (c := fam.classes()) is not None]


def _plan(model):
    """[(router module, experts module, family)] for every supported block; validates everything
    before anything is patched."""
    loaded = _loaded_families()
    plan = []
    for name, block in model.named_modules():
        hit = _family_of(block, loaded)
        if hit is None:
            continue
        fam, (_, router_cls, experts_cls) = hit
        where = name or type(block).__name__
        router = getattr(block, "gate", None)
        experts = getattr(block, "experts", None)
        if not isinstance(router, router_cls) or not isinstance(experts, experts_cls):
            raise UnsupportedModelError(
                f"moe_ops: {fam.name} block {where} does not have the expected structure "
                f"(gate: {router_cls.__name__}, experts: {experts_cls.__name__}); found gate "
                f"{type(router).__name__}, experts {type(experts).__name__}.")
        missing = [a for a in fam.router_attrs if not hasattr(router, a)]
        if missing:
            raise UnsupportedModelError(
                f"moe_ops: {type(router).__name__} ({where}.gate) lacks {missing}; this transformers "
                "version's router is not the one moe_ops knows.")
        check_experts_layout(experts, f"{where}.experts")
        if router.weight.shape[0] != experts.gate_up_proj.shape[0]:
            raise UnsupportedModelError(
                f"moe_ops: {where}: the router scores {router.weight.shape[0]} experts but the experts "
                f"module holds {experts.gate_up_proj.shape[0]} (expert parallelism is not covered by "
                "apply_moe_ops; use set_experts_implementation('moe_ops')).")
        plan.append((router, _forward_attr(router, f"{where}.gate"), experts,
                     _forward_attr(experts, f"{where}.experts"), fam))
    if not plan:
        moe_like = sorted({type(m).__name__ for m in model.modules()
                           if any(s in type(m).__name__.lower() for s in ("moe", "expert", "router"))})
        found = f" It has MoE-like modules {moe_like}, which moe_ops does not know." if moe_like else ""
        raise UnsupportedModelError(
            f"apply_moe_ops: {type(model).__name__} has no supported sparse MoE block.{found} "
            f"Supported: {_supported_blocks_text()}. Models whose experts use transformers' "
            "@use_experts_implementation standard layout can use "
            "model.set_experts_implementation('moe_ops') instead.")
    return plan


# ----------------------------------------------------------------------------------------------
# Class patching

_ABSENT = object()
_CLASS_SAVED: dict = {}  # class -> its own previous `forward` (or _ABSENT)


def _patch_class(cls, fn):
    if cls in _CLASS_SAVED:
        return
    _CLASS_SAVED[cls] = cls.__dict__.get("forward", _ABSENT)
    cls.forward = fn


def _revert_classes():
    for cls, prev in list(_CLASS_SAVED.items()):
        if prev is _ABSENT:
            delattr(cls, "forward")
        else:
            cls.forward = prev
        del _CLASS_SAVED[cls]


# ----------------------------------------------------------------------------------------------
# Public API


def apply_moe_ops(model: torch.nn.Module | None = None, *, expert_parallel_group=None):
    """Runs the sparse MoE blocks on `moe.route` + `moe.dispatch`.

    With `model`: patches the router and experts of every supported block of that instance (any
    dtype or device, weights used in place) and returns the model. Raises `UnsupportedModelError`
    naming the model class if it has no supported block, or naming the module whose layout is not
    covered; nothing is patched then. Patching twice is harmless.

    Without a model: patches the router and experts classes of every supported family, so every
    model of these families (built before or after) uses moe_ops until `revert_moe_ops()`; the
    experts' layout is then checked at each call. Returns None.

    `expert_parallel_group` (with a model; a torch.distributed ProcessGroup, or a
    `moe_ops.distributed.ExpertParallelConfig` for other options than the all-to-all default):
    every rank keeps only its shard of each experts module and runs it with
    `moe_ops.distributed.expert_parallel_dispatch` (see `moe_ops.distributed.shard_experts_module`).
    A collective: every rank of the group calls it."""
    if model is None and expert_parallel_group is not None:
        raise ValueError("apply_moe_ops: expert_parallel_group needs a model instance")
    if model is None:
        loaded = _loaded_families()
        if not loaded:
            try:
                import transformers
            except ImportError:
                raise ImportError("apply_moe_ops() patches transformers' MoE classes, and "
                                  "transformers is not installed: pip install 'moe_ops[hf]' "
                                  "(transformers >= 5.0)") from None

            raise UnsupportedModelError(
                f"apply_moe_ops: transformers {transformers.__version__} has none of the supported "
                f"MoE blocks ({_supported_blocks_text()}).")
        for fam, (_, router_cls, experts_cls) in loaded:
            _patch_class(router_cls, fam.router_forward)
            _patch_class(experts_cls, moe_ops_experts_forward)
        return None
    _check_module("apply_moe_ops", model)
    plan = _plan(model)
    for router, router_attr, experts, experts_attr, fam in plan:
        _patch_instance(router, fam.router_forward, router_attr)
        _patch_instance(experts, _patched_experts_forward, experts_attr)
    if expert_parallel_group is not None:
        from moe_ops.distributed import shard_experts_module

        for _, _, experts, experts_attr, _ in plan:
            shard_experts_module(experts, expert_parallel_group, forward_attr=experts_attr)
    return model


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
        return bool(_CLASS_SAVED)
    _check_module("is_patched", model)
    return any(_SAVED in m.__dict__ for m in model.modules())


def _check_module(fn: str, model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn} expects a torch.nn.Module or None, got {type(model).__name__}")

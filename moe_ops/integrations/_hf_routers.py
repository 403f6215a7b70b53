"""The routers `apply_moe_ops` replaces with `moe.route`: each function returns exactly what the
transformers router it replaces returns, `(router_logits, top-k weights, top-k ids)` with the same
dtypes (ids int64, as torch.topk gives them), so the block's forward, the auxiliary loss and the
router-logits recording hooks see no difference.

A router is listed here only when its arithmetic is one `moe.route` call (the class names below
were checked line by line against transformers 5.17 and 5.25). Every other router (PhiMoE's
sparsemixer, ERNIE 4.5's statics-biased softmax, DeepSeek-V2's group-max selection, hash routers,
routers with a softcap or a per-expert scale...) stays as transformers computes it, in torch; only
its experts run on moe.dispatch. Where a listed router's configuration falls outside what moe.route
computes (DeepSeek-V3 with top_k above what its group limit allows), the patched forward calls
transformers' own forward for that module, so the result is transformers' in every case."""
from __future__ import annotations

import inspect
import re

import torch
import torch.nn.functional as F

from ._hf_layouts import UnsupportedModelError  # noqa: F401  (re-exported for the table users)

_route = torch.ops.moe.route


def _ids(ids):
    # moe.route gives int32 ids; transformers' routers give int64 (torch.topk), and an experts
    # implementation left to transformers (one_hot) needs int64.
    return ids.to(torch.int64)


_ORDER: dict = {}


def _ret(self, logits, weights, ids):
    """(logits, weights, ids) in the order this router class returns them: transformers 5.17's
    GraniteMoE router returns (top_k_index, top_k_weights, router_logits), later ones
    (router_logits, top_k_weights, top_k_index). `prepare(cls)` reads it from the class's own
    forward when the patch is installed (not here: torch.compile cannot trace `inspect`)."""
    order = _ORDER.get(type(self), (0, 1, 2))
    if order == (0, 1, 2):
        return logits, weights, ids
    out = (logits, weights, ids)
    return tuple(out[i] for i in order)


def _return_order(fn):
    try:
        src = inspect.getsource(fn)
        names = [n.strip() for n in re.findall(r"return\s+([^\n]+)", src)[-1].split(",")]
    except (OSError, TypeError, IndexError):
        return (0, 1, 2)
    if len(names) != 3:
        return (0, 1, 2)

    def kind(n):
        if "logit" in n:
            return 0
        if "ind" in n or "idx" in n or "expert" in n:
            return 2
        return 1
    found = tuple(kind(n) for n in names)
    return found if sorted(found) == [0, 1, 2] else (0, 1, 2)


def prepare(cls, original) -> None:
    """Reads what the patched forwards need from a router class's own source, once, eagerly:
    the order of its return values and whether it masks discarded groups with 0.0."""
    if cls not in _ORDER:
        _ORDER[cls] = _return_order(original)
    _masks_with_zero(cls)


def softmax_renorm_forward(self, hidden_states):
    """Mixtral, MiniMax: softmax (float32) -> top-k -> renormalise; the weights stay float32."""
    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    router_logits = F.linear(hidden_states, self.weight)
    weights, ids = _route(router_logits, int(self.top_k), "softmax", True, None, 1, 1, 1.0)
    return _ret(self, router_logits, weights, _ids(ids))


def qwen_forward(self, hidden_states):
    """Qwen2/3-MoE, Qwen3-Next, OLMoE, FlexOlmo...: softmax (float32) -> top-k -> renormalise
    only if `norm_topk_prob`; the weights are cast to the logits' dtype."""
    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    router_logits = F.linear(hidden_states, self.weight)
    weights, ids = _route(router_logits, int(self.top_k), "softmax", bool(self.norm_topk_prob),
                          None, 1, 1, 1.0)
    return _ret(self, router_logits, weights.to(router_logits.dtype), _ids(ids))


def qwen_always_renorm_forward(self, hidden_states):
    """Qwen3.5-MoE, Qwen3-VL-MoE, Qwen3-Omni text: as `qwen_forward`, always renormalised."""
    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    router_logits = F.linear(hidden_states, self.weight)
    weights, ids = _route(router_logits, int(self.top_k), "softmax", True, None, 1, 1, 1.0)
    return _ret(self, router_logits, weights.to(router_logits.dtype), _ids(ids))


def jamba_forward(self, hidden_states):
    """Jamba: softmax (float32) -> top-k, not renormalised; weights in the input's dtype."""
    router_logits = F.linear(hidden_states, self.weight)
    weights, ids = _route(router_logits.reshape(-1, router_logits.shape[-1]), int(self.top_k),
                          "softmax", False, None, 1, 1, 1.0)
    return _ret(self, router_logits, weights.to(hidden_states.dtype), _ids(ids))


def granite_forward(self, hidden_states):
    """GraniteMoE (and -Shared, -Hybrid, -SWA): float32 logits -> top-k -> softmax over the k
    selected logits, which is the renormalised softmax over all of them; weights in the input's
    dtype."""
    router_logits = F.linear(hidden_states, self.weight).float()
    weights, ids = _route(router_logits.reshape(-1, router_logits.shape[-1]), int(self.top_k),
                          "softmax", True, None, 1, 1, 1.0)
    return _ret(self, router_logits, weights.type_as(hidden_states), _ids(ids))


def topk_softmax_forward(self, hidden_states):
    """gpt-oss (router bias) and Aria: top-k of the logits -> softmax over them (= renormalised
    softmax); weights in the logits' dtype."""
    bias = getattr(self, "bias", None)
    router_logits = F.linear(hidden_states, self.weight, bias if isinstance(bias, torch.Tensor) else None)
    weights, ids = _route(router_logits.reshape(-1, router_logits.shape[-1]), int(self.top_k),
                          "softmax", True, None, 1, 1, 1.0)
    return _ret(self, router_logits, weights.to(router_logits.dtype), _ids(ids))


def deepseek_v2_forward(self, hidden_states):
    """DeepSeek-V2 "greedy": float32 softmax -> top-k, not renormalised, times
    routed_scaling_factor. "group_limited_greedy" ranks a group by its best expert and zeroes the
    others (moe.route ranks by the two best and never picks a masked expert): transformers'
    own forward computes it."""
    if getattr(self, "topk_method", "greedy") != "greedy":
        return original_forward(self)(self, hidden_states)
    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    weights, ids = _route(router_logits, int(self.top_k), "softmax", False, None, 1, 1,
                          float(self.routed_scaling_factor))
    return _ret(self, router_logits, weights, _ids(ids))


def deepseek_v3_forward(self, hidden_states):
    """DeepSeek-V3, GLM-4-MoE and their copies: float32 logits; sigmoid scores; selection on
    scores + e_score_correction_bias, limited to the topk_group best of n_group groups (a group
    scores the sum of its two best); weights are the unbiased scores, renormalised if
    norm_topk_prob, times routed_scaling_factor.

    transformers masks the other groups' selection scores (to -inf, or to 0.0 in older
    releases) and takes the top-k over all experts, so with top_k > topk_group * (E / n_group) it
    picks masked experts too, and with 0.0 masking it prefers them to allowed experts whose
    biased score is negative. moe.route never picks an expert of a discarded group; those cases
    run transformers' own forward (same arithmetic, same tie-breaking)."""
    E = self.weight.shape[0]
    num_groups = int(getattr(self, "num_group", None) or getattr(self, "n_group", None) or 1)
    topk_groups = int(getattr(self, "topk_group", None) or num_groups)
    top_k = int(self.top_k)
    if num_groups > 1 and (E % num_groups or top_k > topk_groups * (E // num_groups)
                           or _ZERO_MASK.get(type(self), False)):
        return original_forward(self)(self, hidden_states)
    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    weights, ids = _route(router_logits, top_k, "sigmoid", bool(self.norm_topk_prob),
                          self.e_score_correction_bias, num_groups, topk_groups,
                          float(self.routed_scaling_factor))
    return _ret(self, router_logits, weights, _ids(ids))


_ZERO_MASK = {}


def _masks_with_zero(cls) -> bool:
    """Whether this router class masks the discarded groups with 0.0 (transformers before the
    -inf fix): read once from its source."""
    if cls not in _ZERO_MASK:
        try:
            src = inspect.getsource(cls)
        except (OSError, TypeError):
            src = ""
        _ZERO_MASK[cls] = re.search(r"score_mask\.bool\(\),\s*0\.0\)", src) is not None
    return _ZERO_MASK[cls]


# The router classes of each kind (class names: transformers keeps them stable across 5.x).
ROUTER_KINDS = {
    softmax_renorm_forward: ("MixtralTopKRouter", "MiniMaxTopKRouter"),
    qwen_forward: ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "Qwen3NextTopKRouter",
                   "OlmoeTopKRouter", "FlexOlmoTopKRouter", "MellumTopKRouter",
                   "Qwen3OmniMoeThinkerTextTopKRouter", "Qwen3OmniMoeTalkerTextTopKRouter",
                   "Qwen4ExpTextTopKRouter"),
    qwen_always_renorm_forward: ("Qwen3_5MoeTopKRouter", "Qwen3VLMoeTextTopKRouter",
                                 "Qwen3OmniMoeTextTopKRouter"),
    jamba_forward: ("JambaTopKRouter",),
    granite_forward: ("GraniteMoeTopKRouter", "GraniteMoeSharedTopKRouter",
                      "GraniteMoeHybridTopKRouter", "GraniteMoeSWATopKRouter"),
    topk_softmax_forward: ("GptOssTopKRouter", "AriaTextTopKRouter"),
    deepseek_v2_forward: ("DeepseekV2TopkRouter",),
    deepseek_v3_forward: ("DeepseekV3TopkRouter", "DeepseekV32TopkRouter", "Glm4MoeTopkRouter",
                          "Glm4MoeLiteTopkRouter", "Glm4vMoeTextTopkRouter", "GlmMoeDsaTopkRouter",
                          "Dots1TopkRouter", "ExaoneMoeTopkRouter", "SolarOpenTopkRouter",
                          "MiMoV2FlashTopkRouter", "KimiLinearTopkRouter", "AXK1TopkRouter"),
}
# transformers.models.<module> of each router class (for the class-level patch, which imports them).
ROUTER_MODULES = {
    "MixtralTopKRouter": "mixtral", "MiniMaxTopKRouter": "minimax", "Qwen2MoeTopKRouter": "qwen2_moe",
    "Qwen3MoeTopKRouter": "qwen3_moe", "Qwen3NextTopKRouter": "qwen3_next", "OlmoeTopKRouter": "olmoe",
    "FlexOlmoTopKRouter": "flex_olmo", "MellumTopKRouter": "mellum",
    "Qwen3OmniMoeThinkerTextTopKRouter": "qwen3_omni_moe",
    "Qwen3OmniMoeTalkerTextTopKRouter": "qwen3_omni_moe", "Qwen4ExpTextTopKRouter": "qwen4_exp",
    "Qwen3_5MoeTopKRouter": "qwen3_5_moe", "Qwen3VLMoeTextTopKRouter": "qwen3_vl_moe",
    "Qwen3OmniMoeTextTopKRouter": "qwen3_omni_moe", "JambaTopKRouter": "jamba",
    "GraniteMoeTopKRouter": "granitemoe", "GraniteMoeSharedTopKRouter": "granitemoeshared",
    "GraniteMoeHybridTopKRouter": "granitemoehybrid", "GraniteMoeSWATopKRouter": "granitemoe_swa",
    "GptOssTopKRouter": "gpt_oss", "AriaTextTopKRouter": "aria", "DeepseekV2TopkRouter": "deepseek_v2",
    "DeepseekV3TopkRouter": "deepseek_v3", "DeepseekV32TopkRouter": "deepseek_v32",
    "Glm4MoeTopkRouter": "glm4_moe", "Glm4MoeLiteTopkRouter": "glm4_moe_lite",
    "Glm4vMoeTextTopkRouter": "glm4v_moe", "GlmMoeDsaTopkRouter": "glm_moe_dsa",
    "Dots1TopkRouter": "dots1", "ExaoneMoeTopkRouter": "exaone_moe", "SolarOpenTopkRouter": "solar_open",
    "MiMoV2FlashTopkRouter": "mimo_v2_flash", "KimiLinearTopkRouter": "kimi_linear",
    "AXK1TopkRouter": "axk1",
}
ROUTER_BY_NAME = {name: fn for fn, names in ROUTER_KINDS.items() for name in names}
ROUTER_FUNCTIONS = frozenset(ROUTER_KINDS)

# The attributes each kind reads (a router class of that name without them is not the one
# checked here: it is left to transformers).
_NEEDS = {
    softmax_renorm_forward: ("weight", "top_k"),
    qwen_forward: ("weight", "top_k", "norm_topk_prob"),
    qwen_always_renorm_forward: ("weight", "top_k"),
    jamba_forward: ("weight", "top_k"),
    granite_forward: ("weight", "top_k"),
    topk_softmax_forward: ("weight", "top_k"),
    deepseek_v2_forward: ("weight", "top_k", "routed_scaling_factor"),
    deepseek_v3_forward: ("weight", "top_k", "norm_topk_prob", "e_score_correction_bias",
                          "topk_group", "routed_scaling_factor"),
}


def router_forward_for(router) -> "callable | None":
    """The moe.route forward for this router module, or None (left to transformers)."""
    cls = type(router)
    if not cls.__module__.startswith("transformers."):
        return None
    fn = ROUTER_BY_NAME.get(cls.__name__)
    if fn is None:
        return None
    if any(not hasattr(router, a) for a in _NEEDS[fn]):
        return None
    if fn is deepseek_v3_forward and not (hasattr(router, "num_group") or hasattr(router, "n_group")):
        return None
    if fn is deepseek_v2_forward and not hasattr(router, "topk_method"):
        return None
    return fn


# Filled by huggingface.py: the class-level forwards apply_moe_ops() replaced, by class.
CLASS_SAVED: dict = {}
ABSENT = object()


def original_forward(module):
    """transformers' own forward of this module's class (the one before apply_moe_ops() patched
    the class, if it did)."""
    for klass in type(module).__mro__:
        prev = CLASS_SAVED.get(klass)
        if prev is not None and prev is not ABSENT:
            return prev
        if "forward" in klass.__dict__ and klass.__dict__["forward"] not in ROUTER_FUNCTIONS:
            return klass.__dict__["forward"]
    return type(module).forward

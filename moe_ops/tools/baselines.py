"""Baseline MoE expert computations for moe-ops-bench (and benchmarks/bench_train.py).

Every baseline has the signature of `torch.ops.moe.dispatch` without the activation:
`fn(hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K], topk_ids [T, K]) -> [T, H]`,
SwiGLU experts with the gate rows of `w13` first. All ids must lie in `[0, E)`: the benchmark's
routing never produces the `< 0` sentinel, and the baselines do not handle it. transformers is
imported only inside the functions that need it: it is an optional dependency.

`baselines()` lists them, each with whether it can run here and whether it can be captured in a
`torch.cuda.CUDAGraph` (no host synchronisation, no data-dependent allocation sizes).

`gpt_oss_baselines()` lists the same five computations for gpt-oss's experts (issue 36): biases,
`swiglu_oai` (alpha 1.702, limit 7.0) on interleaved gate/up columns, weights in the checkpoint's
layouts. Their signature is `fn(hidden [T, H], gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I],
down_proj [E, I, H], down_proj_bias [E, H], topk_weights [T, K], topk_ids [T, K]) -> [T, H]`
(transformers' GptOssExperts parameters, in its order)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F


# --------------------------------------------------------------------------------------------
# torch._grouped_mm pipeline: argsort, gather, grouped_mm, silu*mul, grouped_mm, weighted
# index_add. No .item(), no nonzero, no bincount: every size comes from shapes, so it captures.
# --------------------------------------------------------------------------------------------

def _grouped_mm_op():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def sort_by_expert(topk_ids, E):
    """(sorted ids, perm, token of each sorted slot, offsets) of [T, K] ids: slots sorted by
    expert (stable not needed: sums commute); offsets[e] = number of slots with id <= e
    (cumulative ends, int32), found by binary search in the sorted ids: one kernel, sized by E
    alone, no host sync."""
    K = topk_ids.shape[1]
    sorted_ids, perm = torch.sort(topk_ids.reshape(-1))
    bounds = torch.arange(E, device=sorted_ids.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds, right=True, out_int32=True)
    return sorted_ids, perm, perm // K, offsets


def torch_grouped_mm(hidden, w13, w2, topk_weights, topk_ids):
    gmm = _grouped_mm_op()
    T = topk_ids.shape[0]
    E, I = w2.shape[0], w2.shape[2]
    sorted_ids, perm, token_idx, offsets = sort_by_expert(topk_ids, E)
    x = hidden.index_select(0, token_idx)                          # [S, H]
    h = gmm(x, w13.transpose(1, 2), offs=offsets)                  # [S, 2I]
    a = F.silu(h[:, :I]) * h[:, I:]                                # [S, I]
    y = gmm(a, w2.transpose(1, 2), offs=offsets)                   # [S, H]
    w = topk_weights.reshape(-1).index_select(0, perm).to(torch.float32)
    out = torch.zeros(T, hidden.shape[1], device=hidden.device, dtype=torch.float32)
    out.index_add_(0, token_idx, y * w[:, None])                   # float32 accumulation
    return out.to(hidden.dtype)


_GMM_PROBE: dict = {}


def grouped_mm_status(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """(usable, reason) for torch's grouped_mm on this device and dtype, found by running it once
    on a tiny problem (CUDA needs bf16 and sm80+; recent CPU builds have a kernel too)."""
    key = (str(device), dtype)
    if key not in _GMM_PROBE:
        gmm = _grouped_mm_op()
        if gmm is None:
            _GMM_PROBE[key] = (False, "torch has no grouped_mm")
        else:
            try:
                x = torch.randn(12, 16, device=device, dtype=dtype)
                w = torch.randn(3, 32, 16, device=device, dtype=dtype)
                offs = torch.tensor([4, 4, 12], device=device, dtype=torch.int32)
                y = gmm(x, w.transpose(1, 2), offs=offs).float()
                ref = torch.cat([x[:4].float() @ w[0].float().t(), x[4:].float() @ w[2].float().t()])
                err = ((y - ref).norm() / ref.norm()).item()
                _GMM_PROBE[key] = (err < 2e-2, "" if err < 2e-2 else f"probe error {err:.2e}")
            except Exception as exc:  # noqa: BLE001 - any failure means "not available here"
                _GMM_PROBE[key] = (False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
    return _GMM_PROBE[key]


# --------------------------------------------------------------------------------------------
# Per-expert loop: plain torch, one host sync (the per-expert counts), eager only.
# --------------------------------------------------------------------------------------------

def loop_experts(hidden, topk_weights, topk_ids, E, expert):
    """sum over slots of weight * expert(e, rows of hidden routed to e), one hit expert at a
    time, accumulated in float32."""
    T, K = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids)
    counts = torch.bincount(flat_ids, minlength=E).tolist()       # the one host sync
    weights = topk_weights.reshape(-1).to(torch.float32)
    out = torch.zeros(T, hidden.shape[1], device=hidden.device, dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        tok = slots // K
        out.index_add_(0, tok, expert(e, hidden[tok]) * weights[slots, None])
    return out.to(hidden.dtype)


def expert_loop(hidden, w13, w2, topk_weights, topk_ids):
    I = w2.shape[2]

    def expert(e, x):
        h = x @ w13[e].t()
        return (F.silu(h[:, :I]) * h[:, I:]) @ w2[e].t()
    return loop_experts(hidden, topk_weights, topk_ids, w2.shape[0], expert)


# --------------------------------------------------------------------------------------------
# transformers' experts implementations, called through transformers' own code: a MixtralExperts
# (decorated with @use_experts_implementation) whose parameters are the benchmark's tensors.
# --------------------------------------------------------------------------------------------

def transformers_version() -> Optional[str]:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def hf_experts_implementations() -> list[str]:
    """The experts implementations this transformers offers that the benchmark runs."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return []
    # "eager" is the class's own forward: the interface returns it for "eager" by design.
    return ["eager"] + [n for n in ("grouped_mm", "batched_mm") if n in ALL_EXPERTS_FUNCTIONS]


def build_hf_experts(w13: torch.Tensor, w2: torch.Tensor, top_k: int, implementation: str):
    """A transformers MixtralExperts whose gate_up_proj / down_proj ARE `w13` / `w2` (same storage,
    no copy), dispatching through `config._experts_implementation = implementation`."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    E, two_i, H = w13.shape
    config = MixtralConfig(hidden_size=H, intermediate_size=two_i // 2, num_local_experts=E,
                           num_experts_per_tok=top_k, hidden_act="silu")
    config._experts_implementation = implementation
    with torch.device("meta"):                       # no allocation of the (huge) default params
        experts = MixtralExperts(config)
    experts.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    assert experts.gate_up_proj.data_ptr() == w13.data_ptr()
    assert experts.down_proj.data_ptr() == w2.data_ptr()
    return experts.eval()


_HF_CACHE: dict = {}


def _tensor_key(t: torch.Tensor):
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))


def make_hf_baseline(implementation: str) -> Callable:
    def fn(hidden, w13, w2, topk_weights, topk_ids):
        key = (_tensor_key(w13), _tensor_key(w2), topk_ids.shape[1])
        cached = _HF_CACHE.get(implementation)
        if cached is None or cached[0] != key:
            _HF_CACHE[implementation] = cached = (key, build_hf_experts(w13, w2, topk_ids.shape[1],
                                                                        implementation))
        # transformers' routers hand the experts int64 ids and float32 weights; the benchmark
        # prepares those outside the timed region (Baseline.int64_ids), this is only a fallback.
        if topk_ids.dtype != torch.int64:
            topk_ids = topk_ids.long()
        with torch.no_grad():
            return cached[1](hidden, topk_ids, topk_weights)

    fn.__name__ = f"hf_{implementation}"
    return fn


def clear_caches() -> None:
    """Drops the cached transformers modules (they hold references to the weights)."""
    _HF_CACHE.clear()


# --------------------------------------------------------------------------------------------
# gpt-oss's experts (issue 36): the same computations with biases, swiglu_oai and interleaved
# gate/up columns, on the checkpoint's [E, H, 2I] / [E, I, H] weights (x @ W, no transpose).
# --------------------------------------------------------------------------------------------

GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0    # GptOssConfig's swiglu_alpha / swiglu_limit


def swiglu_oai(gate_up: torch.Tensor, alpha: float = GPT_OSS_ALPHA,
               limit: float = GPT_OSS_LIMIT) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU on interleaved [.., 2I] gate/up columns (GptOssExperts._apply_gate)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gpt_oss_torch_grouped_mm(hidden, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias,
                             topk_weights, topk_ids):
    """torch_grouped_mm for gpt-oss's experts: the checkpoint's weights are grouped_mm's
    [E, K, N] operands as stored; bias (gathered per sorted slot) and swiglu_oai in torch."""
    gmm = _grouped_mm_op()
    T = topk_ids.shape[0]
    sorted_ids, perm, token_idx, offsets = sort_by_expert(topk_ids, gate_up_proj.shape[0])
    x = hidden.index_select(0, token_idx)                          # [S, H]
    h = gmm(x, gate_up_proj, offs=offsets)                         # [S, 2I]
    h = h + gate_up_proj_bias.index_select(0, sorted_ids)
    a = swiglu_oai(h)                                              # [S, I]
    y = gmm(a, down_proj, offs=offsets)                            # [S, H]
    y = y + down_proj_bias.index_select(0, sorted_ids)
    w = topk_weights.reshape(-1).index_select(0, perm).to(torch.float32)
    out = torch.zeros(T, hidden.shape[1], device=hidden.device, dtype=torch.float32)
    out.index_add_(0, token_idx, y * w[:, None])                   # float32 accumulation
    return out.to(hidden.dtype)


def gpt_oss_expert_loop(hidden, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias,
                        topk_weights, topk_ids):
    """expert_loop for gpt-oss's experts: one x @ W + b, swiglu_oai, a @ W + b per hit expert."""
    def expert(e, x):
        a = swiglu_oai(x @ gate_up_proj[e] + gate_up_proj_bias[e])
        return a @ down_proj[e] + down_proj_bias[e]
    return loop_experts(hidden, topk_weights, topk_ids, gate_up_proj.shape[0], expert)


def build_hf_gpt_oss_experts(gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias,
                             top_k: int, implementation: str):
    """A transformers GptOssExperts whose four parameters ARE the given tensors (same storage),
    dispatching through `config._experts_implementation = implementation`."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    E, H, two_i = gate_up_proj.shape
    config = GptOssConfig(hidden_size=H, intermediate_size=two_i // 2, num_local_experts=E,
                          num_experts_per_tok=top_k, swiglu_alpha=GPT_OSS_ALPHA,
                          swiglu_limit=GPT_OSS_LIMIT, num_hidden_layers=1)
    config._experts_implementation = implementation
    with torch.device("meta"):
        experts = GptOssExperts(config)
    for name, t in (("gate_up_proj", gate_up_proj), ("gate_up_proj_bias", gate_up_proj_bias),
                    ("down_proj", down_proj), ("down_proj_bias", down_proj_bias)):
        setattr(experts, name, torch.nn.Parameter(t, requires_grad=False))
        assert getattr(experts, name).data_ptr() == t.data_ptr()
    return experts.eval()


def make_hf_gpt_oss_baseline(implementation: str) -> Callable:
    def fn(hidden, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias, topk_weights,
           topk_ids):
        params = (gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias)
        key = (*map(_tensor_key, params), topk_ids.shape[1])
        cached = _HF_CACHE.get(("gpt_oss", implementation))
        if cached is None or cached[0] != key:
            cached = (key, build_hf_gpt_oss_experts(*params, topk_ids.shape[1], implementation))
            _HF_CACHE[("gpt_oss", implementation)] = cached
        if topk_ids.dtype != torch.int64:
            topk_ids = topk_ids.long()
        with torch.no_grad():   # GptOssMLP's call: experts(hidden, router_indices, router_scores)
            return cached[1](hidden, topk_ids, topk_weights)

    fn.__name__ = f"hf_gpt_oss_{implementation}"
    return fn


def has_hf_gpt_oss() -> bool:
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Baseline:
    name: str
    fn: Callable
    capturable: bool           # may be captured in a CUDA graph
    int64_ids: bool = False    # call with int64 ids (what its real caller passes)
    needs_grouped_mm: bool = False
    needs_transformers: bool = False
    # gathers a [T*K, 3*H*I] weight copy (transformers batched_mm): skip above a memory budget
    gathers_weights: bool = False
    # "mixtral": moe.dispatch's plain signature; "gpt_oss": gpt-oss's experts, the checkpoint's
    # parameters (see gpt_oss_baselines)
    experts: str = "mixtral"


def baselines() -> list[Baseline]:
    out = [
        Baseline("torch_grouped_mm", torch_grouped_mm, capturable=True, needs_grouped_mm=True),
        Baseline("expert_loop", expert_loop, capturable=False),
    ]
    impls = hf_experts_implementations()
    for impl in ("eager", "grouped_mm", "batched_mm"):
        out.append(Baseline(f"hf_{impl}", make_hf_baseline(impl), capturable=impl != "eager",
                            int64_ids=True, needs_transformers=True,
                            gathers_weights=impl == "batched_mm"))
        if impl not in impls:
            out[-1].fn = None
    return out


def gpt_oss_baselines() -> list[Baseline]:
    """The peers of moe_ops on gpt-oss's experts, under the names of their Mixtral-style twins."""
    out = [
        Baseline("torch_grouped_mm", gpt_oss_torch_grouped_mm, capturable=True,
                 needs_grouped_mm=True, experts="gpt_oss"),
        Baseline("expert_loop", gpt_oss_expert_loop, capturable=False, experts="gpt_oss"),
    ]
    impls = hf_experts_implementations() if has_hf_gpt_oss() else []
    for impl in ("eager", "grouped_mm", "batched_mm"):
        out.append(Baseline(f"hf_{impl}", make_hf_gpt_oss_baseline(impl),
                            capturable=impl != "eager", int64_ids=True, needs_transformers=True,
                            gathers_weights=impl == "batched_mm", experts="gpt_oss"))
        if impl not in impls:
            out[-1].fn = None
    return out


def availability(b: Baseline, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """(available, reason) of baseline `b` for tensors of `dtype` on `device`."""
    if b.needs_transformers:
        if transformers_version() is None:
            return False, "transformers not installed"
        if b.fn is None:
            return False, f"not in transformers {transformers_version()}"
    if b.needs_grouped_mm:
        return grouped_mm_status(device, dtype)
    return True, ""

"""Expert parallelism for transformers MoE models on moe_ops: `shard_experts(model, group)` keeps
this rank's shard of every supported block's experts (`gate_up_proj`, `down_proj`: an even split,
the first E % world_size ranks holding one expert more) and runs the experts through
`moe_ops.distributed.expert_parallel_dispatch`. The router stays whole on every rank and routes
globally. `apply_moe_ops(model, expert_parallel_group=group)` is the same after the usual patch."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from moe_ops.distributed import (
    ExpertParallelGroup,
    _require_initialized,
    even_shard,
    expert_parallel_dispatch,
)

# Instance attribute of a sharded experts module: its ExpertParallelGroup and call options.
_EP = "_moe_ops_expert_parallel"


def _ep_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    from moe_ops.integrations.huggingface import _per_token

    epg, opts = self.__dict__[_EP]
    w13, w2 = self.gate_up_proj, self.down_proj
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    if x.dtype != w13.dtype:  # e.g. under autocast
        x = x.to(w13.dtype)
    T = x.shape[0]
    ids = _per_token(top_k_index, T)
    weights = _per_token(top_k_weights, T)
    if weights.dtype != torch.float32 and weights.dtype != x.dtype:
        weights = weights.float()
    out = expert_parallel_dispatch(x, w13, w2, weights, ids, first_expert=epg.first_expert,
                                   num_experts=epg.num_experts, group=epg, **opts)
    return out.to(hidden_states.dtype).reshape(shape)


def shard_experts(model: torch.nn.Module, group=None, *, mode: str = "all_to_all",
                  sync_free: bool = False, capacity: int | None = None):
    """Turns a single-device transformers MoE model (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3:
    the families `apply_moe_ops` supports) into an expert-parallel one over `group` (None: the
    default process group). Every rank calls it on the same full model; each keeps its shard of
    every experts module (the other experts' weights are freed) and runs the experts with
    `expert_parallel_dispatch(mode=..., sync_free=..., capacity=...)`. With mode="all_to_all"
    each rank then runs its own batch; with mode="replicated" every rank must run the same
    batch. A collective: the shards are checked once per experts module (ExpertParallelGroup).
    Returns the model. One-way: `revert_moe_ops` leaves the experts expert-parallel (their
    weights are sharded) and restores the routers only."""
    from moe_ops.integrations.huggingface import _plan

    _require_initialized("shard_experts")
    if is_expert_parallel(model):
        return model   # sharded already
    pg = dist.group.WORLD if group is None else group
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    plan = _plan(model)   # validates every block before anything changes
    for _router, _router_attr, experts, experts_attr, _fam in plan:
        E = experts.gate_up_proj.shape[0]
        first, count = even_shard(E, world, rank)
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            local = full.detach()[first:first + count].clone()
            if isinstance(full, torch.nn.Parameter):
                local = torch.nn.Parameter(local, requires_grad=full.requires_grad)
            setattr(experts, name, local)
        epg = ExpertParallelGroup.setup(experts.gate_up_proj, experts.down_proj,
                                        first_expert=first, num_experts=E, group=pg)
        experts.__dict__[_EP] = (epg, dict(mode=mode, sync_free=sync_free, capacity=capacity))
        # functools.partial of a module-level function (picklable, as apply_moe_ops' patches)
        experts.__dict__[experts_attr] = functools.partial(_ep_experts_forward, experts)
    return model


def is_expert_parallel(model: torch.nn.Module) -> bool:
    return any(_EP in m.__dict__ for m in model.modules())

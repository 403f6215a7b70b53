"""Expert parallelism for transformers MoE models on moe_ops.

`shard_experts(model, group)` patches every supported MoE block (Mixtral, Qwen2/3-MoE, OLMoE,
DeepSeek-V3) as `apply_moe_ops` does, keeps this rank's shard of each block's experts
(`gate_up_proj`, `down_proj`: an even split, the first E % world_size ranks holding one expert
more) and runs the experts through `moe_ops.distributed.expert_parallel_dispatch`. The router
stays whole on every rank and routes globally."""
from __future__ import annotations

import torch

from moe_ops.distributed import ExpertParallelConfig, is_expert_parallel
from moe_ops.integrations.huggingface import apply_moe_ops

__all__ = ["is_expert_parallel", "shard_experts"]


def shard_experts(model: torch.nn.Module, group=None, *, mode: str = "all_to_all",
                  sync_free: bool = False, capacity: int | None = None,
                  pipeline_chunks: int = 1):
    """Turns a single-device transformers MoE model into an expert-parallel one over `group`
    (None: the default process group): `apply_moe_ops(model, expert_parallel_group=
    ExpertParallelConfig(group=group, mode=mode, sync_free=sync_free, capacity=capacity,
    pipeline_chunks=pipeline_chunks))`.
    Every rank calls it on the same full model (a collective). With mode="all_to_all" each rank
    then runs its own batch; with mode="replicated" every rank must run the same batch.
    Returns the model; a model sharded already is returned as it is. One-way:
    `revert_moe_ops` restores the routers and leaves the experts expert-parallel (their weights
    are sharded)."""
    if is_expert_parallel(model):
        return model
    config = ExpertParallelConfig(group=group, mode=mode, sync_free=sync_free, capacity=capacity,
                                  pipeline_chunks=pipeline_chunks)
    return apply_moe_ops(model, expert_parallel_group=config)

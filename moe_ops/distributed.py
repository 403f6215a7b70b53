"""Expert parallelism on torch.distributed: MoE layers whose experts are sharded across the ranks
of a process group, every expert computed by `moe.dispatch` on the rank that holds it.

Each rank holds a contiguous shard of the experts (`w13_local` [E_local, 2I, H], `w2_local`
[E_local, H, I], global ids [first_expert, first_expert + E_local)) and its own tokens with their
global routing (`topk_weights`, `topk_ids` [T_rank, K]). `expert_parallel_dispatch` returns each
rank's [T_rank, H], equal to `moe.dispatch` with all experts on one device.

Two forms:
- mode="all_to_all" (token shuffle): each token goes once to every rank that holds at least one of
  its experts (one row per (token, destination rank), with its K weights and the K ids made local
  to the destination, -1 for the other ranks' experts); the destination runs `moe.dispatch` on its
  experts, which applies the routing weights and sums the token's local experts; the results come
  back with a second all-to-all and the source rank sums the per-rank partial outputs (float32,
  rank order: deterministic). A token with K experts on R distinct ranks costs R rows each way,
  not K.
- mode="replicated": every rank holds the same tokens; it runs its own experts with the other
  ranks' ids masked to -1 and an all-reduce sums the partial outputs (transformers' "all_reduce"
  expert-parallel implementation).

The collectives are torch.distributed's functional collectives (`_c10d_functional`), inside
autograd.Functions, so both forms are differentiable and traceable by torch.compile. Nothing here
moves data by itself: NCCL, gloo or any other backend of the group does.
"""
from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_ops._compat import c10d_functional
from moe_ops._runtime import checks_enabled

__all__ = ["ExpertParallelConfig", "ExpertParallelGroup", "even_shard", "expert_parallel_dispatch",
           "is_expert_parallel", "shard_experts_module"]

_MODES = ("all_to_all", "replicated")


def _c10d():
    return c10d_functional()


def even_shard(num_experts: int, world_size: int, rank: int) -> tuple[int, int]:
    """(first_expert, num_local_experts) of `rank` when `num_experts` are split as evenly as
    possible: the first `num_experts % world_size` ranks hold one expert more."""
    base, extra = divmod(num_experts, world_size)
    count = base + (1 if rank < extra else 0)
    first = rank * base + min(rank, extra)
    return first, count


def _dtype_code(dtype: torch.dtype) -> int:
    # crc32, not hash(): Python's str hash differs from process to process.
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF


def _require_initialized(where: str, group=None):
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"{where}: group: the torch.distributed process group is not initialised; call "
            "torch.distributed.init_process_group(backend=...) on every rank first")
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"{where}: group: this process (global rank {dist.get_rank()}) is not "
                         "a member of the given process group")


@dataclass(frozen=True, eq=False)
class ExpertParallelGroup:
    """The expert shards of a process group, checked once at set-up (`ExpertParallelGroup.setup`).

    `starts[r]`, `counts[r]`: the global id of rank r's first expert and its number of experts;
    the shards tile [0, num_experts) without overlap (uneven shards and a rank with no expert
    are allowed)."""

    group: object
    group_name: str
    rank: int
    world_size: int
    num_experts: int
    starts: tuple
    counts: tuple
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype

    @property
    def first_expert(self) -> int:
        return self.starts[self.rank]

    @property
    def num_local_experts(self) -> int:
        return self.counts[self.rank]

    @classmethod
    def setup(cls, w13_local: torch.Tensor, w2_local: torch.Tensor, *, first_expert: int,
              num_experts: int, group=None) -> ExpertParallelGroup:
        """A collective (every rank of `group` calls it, with its own shard): all-gathers each
        rank's shard metadata and checks that the shards tile [0, num_experts), that H, I and the
        weight dtypes agree. Raises the same error on every rank, naming the ranks that disagree."""
        where = "ExpertParallelGroup.setup"
        _require_initialized(where, group)
        group = dist.group.WORLD if group is None else group
        for name, w, what in (("w13_local", w13_local, "[E_local, 2I, H]"),
                              ("w2_local", w2_local, "[E_local, H, I]")):
            if not isinstance(w, torch.Tensor):
                raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(w).__name__}")
            if w.dim() != 3:
                raise ValueError(f"{where}: {name} must be 3-D {what}, got shape {tuple(w.shape)}")
        for name, v in (("first_expert", first_expert), ("num_experts", num_experts)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{where}: {name} must be an int, got {type(v).__name__}")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        E_local = w13_local.shape[0]
        meta = torch.tensor(
            [first_expert, E_local, num_experts, w13_local.shape[2], w2_local.shape[2],
             w13_local.shape[1], w2_local.shape[0], w2_local.shape[1],
             _dtype_code(w13_local.dtype), _dtype_code(w2_local.dtype)],
            dtype=torch.int64, device=w13_local.device)
        gathered = [torch.empty_like(meta) for _ in range(world)]
        dist.all_gather(gathered, meta, group=group)
        rows = [g.tolist() for g in gathered]
        cls._check(rows, w13_local, w2_local, where)
        epg = cls(group=group, group_name=group.group_name, rank=rank, world_size=world,
                  num_experts=num_experts, starts=tuple(r[0] for r in rows),
                  counts=tuple(r[1] for r in rows), hidden_size=w13_local.shape[2],
                  intermediate_size=w2_local.shape[2], dtype=w13_local.dtype)
        epg.owner_table(w13_local.device)   # built now, not while torch.compile traces a call
        return epg

    @staticmethod
    def _check(rows, w13_local, w2_local, where):
        def disagree(col, what):
            vals = [r[col] for r in rows]
            if len(set(vals)) != 1:
                per_rank = ", ".join(f"rank {i}: {v}" for i, v in enumerate(vals))
                raise ValueError(f"{where}: {what} differs across ranks ({per_rank})")

        # local consistency first: the same message on every rank would hide which rank is wrong
        for i, r in enumerate(rows):
            first, E_local, E, H, I, two_i, E2, H2 = r[:8]
            if E2 != E_local or two_i != 2 * I or H2 != H:
                raise ValueError(
                    f"{where}: rank {i}'s w13_local [E_local, 2I, H] = [{E_local}, {two_i}, {H}] "
                    f"and w2_local [E_local, H, I] = [{E2}, {H2}, {I}] do not agree")
        disagree(2, "num_experts")
        disagree(3, "the hidden size H (w13_local.shape[2])")
        disagree(4, "the intermediate size I (w2_local.shape[2])")
        for col, name in ((8, "w13_local"), (9, "w2_local")):
            codes = [r[col] for r in rows]
            if len(set(codes)) != 1:
                names = {_dtype_code(d): str(d) for d in vars(torch).values()
                         if isinstance(d, torch.dtype)}
                per_rank = ", ".join(f"rank {i}: {names.get(c, f'dtype #{c}')}"
                                     for i, c in enumerate(codes))
                raise TypeError(f"{where}: {name}'s dtype differs across ranks ({per_rank}); "
                                "every rank must hold its shard in one dtype")
        E = rows[0][2]
        if E < 1:
            raise ValueError(f"{where}: num_experts must be >= 1, got {E}")
        shards = sorted((r[0], r[1], i) for i, r in enumerate(rows))
        nxt = 0
        for first, count, i in shards:
            if count < 0 or first < 0:
                raise ValueError(f"{where}: rank {i} has first_expert {first}, {count} experts")
            if count == 0:
                continue
            if first != nxt:
                what = (f"experts [{nxt}, {first}) are on no rank" if first > nxt else
                        f"rank {i}'s experts [{first}, {first + count}) overlap another rank's")
                raise ValueError(
                    f"{where}: the expert shards do not tile [0, num_experts={E}): {what}; "
                    f"shards (first_expert, count) per rank: {[(r[0], r[1]) for r in rows]}")
            nxt = first + count
        if nxt != E:
            raise ValueError(
                f"{where}: the expert shards cover [0, {nxt}), not [0, num_experts={E}); "
                f"shards (first_expert, count) per rank: {[(r[0], r[1]) for r in rows]}")

    def owner_table(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """([E] int64: the rank that holds each expert, [W] int64: each rank's first expert),
        cached per device."""
        key = str(device)
        cache = self.__dict__.setdefault("_owner", {})
        if key not in cache:
            owner = torch.empty(self.num_experts, dtype=torch.int64)
            for r, (s, c) in enumerate(zip(self.starts, self.counts)):
                owner[s:s + c] = r
            cache[key] = owner.to(device)
            cache[key + ":start"] = torch.tensor(self.starts, dtype=torch.int64, device=device)
        return cache[key], cache[key + ":start"]


_GROUPS: dict = {}


def _resolve_group(group, w13_local, w2_local, first_expert, num_experts) -> ExpertParallelGroup:
    if isinstance(group, ExpertParallelGroup):
        if (first_expert != group.first_expert or w13_local.shape[0] != group.num_local_experts
                or num_experts != group.num_experts):
            raise ValueError(
                f"expert_parallel_dispatch: first_expert={first_expert}, num_experts={num_experts} "
                f"and w13_local's {w13_local.shape[0]} experts do not match the ExpertParallelGroup "
                f"(first_expert={group.first_expert}, num_experts={group.num_experts}, "
                f"{group.num_local_experts} local experts)")
        return group
    _require_initialized("expert_parallel_dispatch", group)
    pg = dist.group.WORLD if group is None else group
    key = (id(pg), first_expert, tuple(w13_local.shape), tuple(w2_local.shape), num_experts,
           w13_local.dtype, w2_local.dtype, str(w13_local.device))
    hit = _GROUPS.get(key)
    if hit is None or hit[0] is not pg:
        # the first call with these shards is the set-up check (a collective every rank makes)
        hit = (pg, ExpertParallelGroup.setup(w13_local, w2_local, first_expert=first_expert,
                                             num_experts=num_experts, group=pg))
        _GROUPS[key] = hit
    return hit[1]


# ------------------------------------------------------------------------------------------------
# Differentiable collectives (functional collectives inside autograd.Functions: one node per
# exchange, so every rank runs the backward's collectives in the same order)


def _a2a(t, out_splits, in_splits, group_name):
    c = _c10d()
    return c.wait_tensor(c.all_to_all_single(t.contiguous(), out_splits, in_splits, group_name))


def _a2a_issue(t, out_splits, in_splits, group_name):
    return _c10d().all_to_all_single(t.contiguous(), out_splits, in_splits, group_name)


def _wait(t):
    # differentiable (identity backward, registered by torch.distributed)
    return _c10d().wait_tensor(t)


def _all_reduce(t, group_name):
    c = _c10d()
    return c.wait_tensor(c.all_reduce(t.contiguous(), "sum", group_name))


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of a float tensor `x` (and optionally a second one, `y`, with the same
    row splits); the backward sends the gradients back along the reversed splits (zeros where
    a gradient is absent, so that every rank makes the same collectives). Fixed arity, tensors
    first: torch.compile traces it without a graph break."""

    @staticmethod
    def forward(ctx, x, y, group_name, out_splits, in_splits, wait=True):
        # wait=False: the outputs are still being received; the caller waits on them
        # (_wait) right before their first use, so that compute enqueued in between overlaps
        # the exchange (NCCL runs it on its own stream)
        ctx.group_name, ctx.out_splits, ctx.in_splits = group_name, out_splits, in_splits
        ctx.has_y = y is not None
        send = _a2a if wait else _a2a_issue
        ox = send(x, out_splits, in_splits, group_name)
        if y is None:
            return ox
        return ox, send(y, out_splits, in_splits, group_name)

    @staticmethod
    def backward(ctx, gx, gy=None):
        gx = _a2a(gx, ctx.in_splits, ctx.out_splits, ctx.group_name)
        if ctx.has_y:
            gy = _a2a(gy, ctx.in_splits, ctx.out_splits, ctx.group_name)
        return gx, gy, None, None, None, None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward: sum over the group. Backward: identity (the loss is replicated on every rank,
    as in tensor parallelism: each rank's output gradient is already the full one)."""

    @staticmethod
    def forward(ctx, t, group_name):
        return _all_reduce(t, group_name)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _CopyToGroup(torch.autograd.Function):
    """Forward: identity. Backward: sum over the group (each rank's experts give a part of the
    gradient of the shared input)."""

    @staticmethod
    def forward(ctx, x, w, group_name):
        ctx.group_name = group_name
        return x.view_as(x), w.view_as(w)

    @staticmethod
    def backward(ctx, gx, gw):
        return _all_reduce(gx, ctx.group_name), _all_reduce(gw, ctx.group_name), None


# ------------------------------------------------------------------------------------------------


def _dispatch_local(hidden, w13_local, w2_local, weights, ids, kwargs):
    """moe.dispatch on the local experts; `ids` are local (-1: not here). With K > E_local, the
    valid ids of each row are moved first and the row is cut to E_local columns (a token has at
    most E_local distinct experts here; more, i.e. repeated ids, is an error raised on the device
    without a host sync: torch._assert_async)."""
    from moe_ops.ops.dispatch import dispatch

    E_local, K = w13_local.shape[0], ids.shape[1]
    if E_local == 0:
        # no experts here: a zero output still connected to the received rows and weights, so
        # that the backward's collectives run on this rank as on the others
        # (and to the empty shard, whose gradient is then an empty tensor, not None)
        zero = (weights.sum(1, keepdim=True) * 0).to(hidden.dtype)
        return hidden * 0 + zero + (w13_local.sum() + w2_local.sum()).to(hidden.dtype) * 0
    if K > E_local:
        valid = ids >= 0
        torch._assert_async(
            (valid.sum(1) <= E_local).all(),
            f"expert_parallel_dispatch: a token routes more than E_local = {E_local} slots to one "
            f"rank's experts (K = {K}): repeated expert ids in a row of topk_ids are not supported "
            "when K exceeds the experts per rank")
        order = torch.sort(valid.to(torch.int8), dim=1, descending=True, stable=True).indices
        order = order[:, :E_local]
        ids = ids.gather(1, order)
        weights = weights.gather(1, order)
    return dispatch(hidden, w13_local, w2_local, weights, ids, **kwargs)


def _check_args(hidden, w13_local, w2_local, topk_weights, topk_ids, first_expert, num_experts,
                mode, sync_free, capacity):
    where = "expert_parallel_dispatch"
    for name, t in (("hidden", hidden), ("w13_local", w13_local), ("w2_local", w2_local),
                    ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"{where}: hidden must be 2-D [T, H], got shape {tuple(hidden.shape)}")
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.dim() != 2 or t.shape[0] != hidden.shape[0]:
            raise ValueError(f"{where}: {name} must be [T, K] with T = hidden.shape[0] = "
                             f"{hidden.shape[0]}, got shape {tuple(t.shape)}")
    if tuple(topk_ids.shape) != tuple(topk_weights.shape):
        raise ValueError(f"{where}: topk_ids must have topk_weights' shape "
                         f"{tuple(topk_weights.shape)}, got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{where}: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"{where}: topk_weights must be a float tensor, got {topk_weights.dtype}")
    for name, v in (("first_expert", first_expert), ("num_experts", num_experts)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{where}: {name} must be an int, got {type(v).__name__}")
    if mode not in _MODES:
        raise ValueError(f"{where}: mode must be one of {_MODES}, got {mode!r}")
    if not isinstance(sync_free, bool):
        raise TypeError(f"{where}: sync_free must be a bool, got {type(sync_free).__name__}")
    if capacity is not None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"{where}: capacity must be None or an int >= 0, got {capacity!r}")
        if not sync_free or mode != "all_to_all":
            raise ValueError(f"{where}: capacity applies to mode='all_to_all' with sync_free=True")
    if checks_enabled() and not torch.compiler.is_compiling() and topk_ids.numel():
        hi = int(topk_ids.max())
        if hi >= num_experts:
            raise ValueError(f"{where}: topk_ids holds expert id {hi}, must be < num_experts = "
                             f"{num_experts} (ids < 0 are dropped)")


def expert_parallel_dispatch(hidden: torch.Tensor, w13_local: torch.Tensor, w2_local: torch.Tensor,
                             topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                             first_expert: int, num_experts: int, group=None,
                             mode: str = "all_to_all", sync_free: bool = False,
                             capacity: int | None = None, pipeline_chunks: int = 1,
                             **dispatch_kwargs) -> torch.Tensor:
    """Expert-parallel `moe.dispatch`: every rank of `group` calls it with its tokens `hidden`
    [T_rank, H], their global routing `topk_weights`/`topk_ids` [T_rank, K], and its expert shard
    `w13_local` [E_local, 2I, H], `w2_local` [E_local, H, I] holding the global experts
    [first_expert, first_expert + E_local) of `num_experts`. Returns [T_rank, H] in hidden's
    dtype, equal to `moe.dispatch` on the full weights. Differentiable (hidden, topk_weights,
    w13_local, w2_local and any local-shard biases passed through `dispatch_kwargs`).

    `group`: a ProcessGroup (None: the default group) or an `ExpertParallelGroup`. Without an
    ExpertParallelGroup the first call for a given shard runs its set-up check (a collective,
    cached); under torch.compile pass an ExpertParallelGroup made beforehand. Every rank must
    agree on which inputs require gradients (the backward's collectives follow the graph).

    `mode="all_to_all"`: each rank brings its own tokens. The default reads the split sizes on
    the host (one device-to-host sync per call). `sync_free=True` sizes every buffer from shapes:
    each rank sends `capacity` rows (default T_rank, the worst case: a token goes at most once to
    each rank) to every rank, so every rank must pass the same capacity (by default: the same
    T_rank, as a CUDA-graph decode step padded to a fixed batch does; MOE_OPS_CHECK=1 verifies
    it). A rank that would send more than `capacity` rows to one rank fails loudly: on the CPU a
    RuntimeError at the call; on CUDA a device-side assert (torch._assert_async) that surfaces
    at the next host synchronisation (the CUDA context is then unusable, as after any device
    assert), and the overflowing tokens' outputs are NaN; never a silent drop. With K > E_local
    and a token routed to the same expert twice, the same assert fires (a token has at most
    E_local distinct experts on one rank; repeated ids are unsupported there).

    `pipeline_chunks` (default mode only; the same on every rank): splits the tokens into that
    many ranges whose exchanges overlap the other ranges' expert compute (chunk i+1's rows travel
    while chunk i's experts run; chunk i's results travel back while chunk i+1's run), still one
    host read per call. Worth it at large T (prefill, training), where the exchange costs a
    fraction of the compute; 1 (no pipelining) for decode.

    `mode="replicated"`: every rank passes the same tokens and routing; each computes its own
    experts and an all-reduce sums the outputs. The backward assumes the loss is replicated (the
    same on every rank): the reduction's backward is the identity and the gradients of hidden
    and topk_weights are summed over the group. The output is the full [T, H] on every rank (an
    all-reduce, not a reduce-scatter: the result keeps the contract's [T_rank, H]; sequence-
    parallel callers that want a slice use the all-to-all form on their own slice instead).

    Ids < 0 contribute nothing; ids >= num_experts raise ValueError with MOE_OPS_CHECK=1 (a host
    sync) and contribute nothing otherwise.
    """
    _check_args(hidden, w13_local, w2_local, topk_weights, topk_ids, first_expert, num_experts,
                mode, sync_free, capacity)
    if not isinstance(pipeline_chunks, int) or isinstance(pipeline_chunks, bool) \
            or pipeline_chunks < 1:
        raise ValueError(f"expert_parallel_dispatch: pipeline_chunks must be an int >= 1, got "
                         f"{pipeline_chunks!r}")
    if pipeline_chunks > 1 and (sync_free or mode != "all_to_all"):
        raise ValueError("expert_parallel_dispatch: pipeline_chunks > 1 applies to "
                         "mode='all_to_all' without sync_free")
    epg = _resolve_group(group, w13_local, w2_local, first_expert, num_experts)
    if (checks_enabled() and not torch.compiler.is_compiling()
            and (sync_free or mode == "replicated")):
        _check_same_tokens(epg, hidden, mode, capacity)
    group_name = epg.group_name
    owner_of, starts = epg.owner_table(hidden.device)
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < num_experts)
    owner = torch.where(valid, owner_of[ids.clamp(0, max(num_experts - 1, 0))], -1)   # [T, K]
    if mode == "replicated":
        return _replicated(hidden, w13_local, w2_local, topk_weights, ids, owner, epg,
                           group_name, dispatch_kwargs)
    return _all_to_all(hidden, w13_local, w2_local, topk_weights, ids, owner, starts, epg,
                       group_name, sync_free, capacity, dispatch_kwargs, pipeline_chunks)


def _check_same_tokens(epg, hidden, mode, capacity):
    """MOE_OPS_CHECK=1 (a collective and a host read): the forms whose buffers are sized from
    shapes need the same T (sync-free: the same capacity) on every rank; a mismatch would make
    the collectives fail (gloo) or hang / read garbage (NCCL)."""
    T = hidden.shape[0]
    mine = torch.tensor([T, -1 if capacity is None else capacity], dtype=torch.int64,
                        device=hidden.device)
    rows = [torch.empty_like(mine) for _ in range(epg.world_size)]
    dist.all_gather(rows, mine, group=epg.group)
    vals = [tuple(r.tolist()) for r in rows]
    if len(set(vals)) != 1:
        what = ("the same tokens (T)" if mode == "replicated" else
                "the same T_rank, or the same capacity")
        per_rank = ", ".join(f"rank {i}: T={t}" + ("" if c < 0 else f", capacity={c}")
                             for i, (t, c) in enumerate(vals))
        if mode != "replicated" and len({c for _, c in vals}) == 1 and vals[0][1] >= 0:
            return   # one capacity everywhere: T may differ
        raise ValueError(f"expert_parallel_dispatch(mode={mode!r}, sync_free=...) needs {what} "
                         f"on every rank ({per_rank})")


def _replicated(hidden, w13_local, w2_local, topk_weights, ids, owner, epg, group_name, kwargs):
    hidden, topk_weights = _CopyToGroup.apply(hidden, topk_weights, group_name)
    local = torch.where(owner == epg.rank, ids - epg.first_expert, -1)
    out = _dispatch_local(hidden, w13_local, w2_local, topk_weights, local, kwargs)
    return _ReduceFromGroup.apply(out, group_name)


def _all_to_all(hidden, w13_local, w2_local, topk_weights, ids, owner, starts, epg, group_name,
                sync_free, capacity, kwargs, chunks=1):
    if chunks > 1:
        return _all_to_all_pipelined(hidden, w13_local, w2_local, topk_weights, ids, owner,
                                     starts, epg, group_name, kwargs, chunks)
    plan = _exchange_plan(owner, epg, group_name, sync_free, capacity)
    recv_hidden, recv_w, recv_ids = _shuffle(hidden, topk_weights, ids, owner, starts, plan,
                                             group_name)
    out_local = _dispatch_local(recv_hidden, w13_local, w2_local, recv_w, recv_ids, kwargs)
    return _combine(out_local, plan, group_name, hidden.dtype)


@dataclass
class _Plan:
    """Where every (token, destination rank) pair travels: `row[t, d]` its send row (n_send:
    none), `src[i]` the token of send row i (T: an unused row of a sync-free buffer), `dst[i]`
    its destination; the split sizes; `overflow[t, d]` (sync-free with a capacity below T)."""
    T: int
    W: int
    R: int
    row: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    n_send: int
    send_splits: list
    recv_splits: list
    overflow: torch.Tensor | None


def _goes(owner, W):
    # goes[t, d]: token t has at least one expert on rank d
    return (owner.unsqueeze(2) == torch.arange(W, device=owner.device)).any(1)


def _plan_from_counts(goes, send_counts, send_splits, recv_splits, R) -> _Plan:
    """The default-mode plan of a token range, its split sizes known on the host."""
    T, W = goes.shape
    ranks = torch.arange(W, device=goes.device)
    pos = goes.long().cumsum(0) - 1
    n_send = sum(send_splits)
    offsets = send_counts.cumsum(0) - send_counts
    row = torch.where(goes, offsets + pos, n_send)
    dst = torch.repeat_interleave(ranks, send_counts, output_size=n_send)
    tok = torch.arange(T, device=goes.device).unsqueeze(1).expand(T, W)
    src = torch.full((n_send + 1,), T, dtype=torch.long, device=goes.device)
    src = src.scatter(0, row.reshape(-1), tok.reshape(-1))[:n_send]
    return _Plan(T, W, R, row, src, dst, n_send, send_splits, recv_splits, None)


def _all_to_all_pipelined(hidden, w13_local, w2_local, topk_weights, ids, owner, starts, epg,
                          group_name, kwargs, chunks):
    """The default all-to-all form in `chunks` token ranges, pipelined: chunk i+1's rows are
    on their way while chunk i's experts run, and chunk i's results travel back while chunk
    i+1's run. One exchange of the per-chunk counts and one host read for all chunks."""
    T, W = hidden.shape[0], epg.world_size
    cs = -(-T // chunks)
    bounds = [(min(c * cs, T), min((c + 1) * cs, T)) for c in range(chunks)]
    goes = _goes(owner, W)
    send_counts = torch.stack([goes[a:b].sum(0) for a, b in bounds])               # [n, W]
    recv_counts = _a2a(send_counts.t().contiguous(), [1] * W, [1] * W, group_name)  # [W, n]
    counts = torch.cat([send_counts.reshape(-1), recv_counts.t().reshape(-1)]).tolist()
    n = chunks * W
    R = min(owner.shape[1], W)
    plans = [_plan_from_counts(goes[a:b], send_counts[c], counts[c * W:(c + 1) * W],
                               counts[n + c * W:n + (c + 1) * W], R)
             for c, (a, b) in enumerate(bounds)]

    def issue(c):
        a, b = bounds[c]
        return _shuffle(hidden[a:b], topk_weights[a:b], ids[a:b], owner[a:b], starts, plans[c],
                        group_name, wait=False)

    outs, back = [], None
    pending = issue(0)
    for c in range(chunks):
        nxt = issue(c + 1) if c + 1 < chunks else None
        recv_hidden, recv_w, recv_ids = _received(pending, ids.shape[1], topk_weights.dtype)
        out_local = _dispatch_local(recv_hidden, w13_local, w2_local, recv_w, recv_ids, kwargs)
        back_c = _AllToAll.apply(out_local, None, group_name, plans[c].send_splits,
                                 plans[c].recv_splits, False)
        if back is not None:
            outs.append(_sum_partials(_wait(back[0]), back[1], hidden.dtype))
        back, pending = (back_c, plans[c]), nxt
    outs.append(_sum_partials(_wait(back[0]), back[1], hidden.dtype))
    return torch.cat(outs)


def _exchange_plan(owner, epg, group_name, sync_free, capacity) -> _Plan:
    T = owner.shape[0]
    W = epg.world_size
    dev = owner.device
    ranks = torch.arange(W, device=dev)
    # goes[t, d]: token t has at least one expert on rank d; pos[t, d]: its row among rank d's
    goes = (owner.unsqueeze(2) == ranks).any(1)                                    # [T, W]
    pos = goes.long().cumsum(0) - 1
    overflow = None
    if sync_free:
        C = T if capacity is None else capacity
        send_splits = recv_splits = [C] * W
        keep = goes & (pos < C)
        if C < T and checks_enabled() and not torch.compiler.is_compiling():
            needed = int(goes.sum(0).max())   # MOE_OPS_CHECK=1: count first (a host read)
            if needed > C:
                raise ValueError(
                    f"expert_parallel_dispatch: capacity = {C} is below the {needed} rows this "
                    f"rank sends to one rank (sync_free=True); raise capacity (at most T_rank = "
                    f"{T} is ever needed)")
        if C < T:
            overflow = goes & ~keep
            torch._assert_async(
                ~overflow.any(),
                f"expert_parallel_dispatch: a rank sends more than capacity = {C} rows to one rank "
                f"(sync_free=True); raise capacity (at most T_rank = {T} is ever needed)")
        n_send = W * C
        row = torch.where(keep, ranks * C + pos, n_send)                           # [T, W]
        dst = ranks.repeat_interleave(C)
    else:
        send_counts = goes.sum(0)                                                  # [W]
        recv_counts = _a2a(send_counts, [1] * W, [1] * W, group_name)
        counts = torch.cat([send_counts, recv_counts]).tolist()   # the one host read of the call
        send_splits, recv_splits = counts[:W], counts[W:]
        n_send = sum(send_splits)
        offsets = send_counts.cumsum(0) - send_counts
        row = torch.where(goes, offsets + pos, n_send)
        dst = torch.repeat_interleave(ranks, send_counts, output_size=n_send)
    tok = torch.arange(T, device=dev).unsqueeze(1).expand(T, W)
    src = torch.full((n_send + 1,), T, dtype=torch.long, device=dev)
    src = src.scatter(0, row.reshape(-1), tok.reshape(-1))[:n_send]
    R = min(owner.shape[1], W)   # the most rows a token sends
    return _Plan(T, W, R, row, src, dst, n_send, send_splits, recv_splits, overflow)


def _shuffle(hidden, topk_weights, ids, owner, starts, plan: _Plan, group_name, wait=True):
    """Sends every (token, destination) row with its K weights and K ids local to the
    destination (-1: another rank's expert or padding). Returns the received rows, weights and
    local ids."""
    T, H = hidden.shape
    K = ids.shape[1]
    n_send, src, dst = plan.n_send, plan.src, plan.dst
    if T == 0:
        # zeros still connected to hidden and topk_weights: the backward of the exchange is a
        # collective this rank must make too
        send_hidden = (hidden.sum(0, keepdim=True) * 0).expand(n_send, H)
        send_w = (topk_weights.sum(0, keepdim=True) * 0).expand(n_send, K)
        send_ids = ids.new_full((n_send, K), -1)
    else:
        used = src < T
        src_c = src.clamp(max=T - 1)
        send_hidden = hidden[src_c]
        send_w = topk_weights[src_c]
        send_ids = torch.where((owner[src_c] == dst.unsqueeze(1)) & used.unsqueeze(1),
                               ids[src_c] - starts[dst].unsqueeze(1), -1)
    meta_dtype = torch.float64 if topk_weights.dtype == torch.float64 else torch.float32
    # weights and ids travel together (ids < 2^24 are exact in float32)
    meta = torch.cat([send_w.to(meta_dtype), send_ids.to(meta_dtype)], 1)
    sent = _AllToAll.apply(send_hidden, meta, group_name, plan.recv_splits, plan.send_splits,
                           wait)
    return _received(sent, K, topk_weights.dtype) if wait else sent


def _received(sent, K, weights_dtype):
    recv_hidden, recv_meta = (_wait(t) for t in sent)
    recv_w = recv_meta[:, :K].to(weights_dtype)
    recv_ids = recv_meta[:, K:].detach().round().long()
    return recv_hidden, recv_w, recv_ids


# tokens per gather in the combine: bounds its [tokens, R, H] temporary
_COMBINE_CHUNK = 2048


def _combine(out_local, plan: _Plan, group_name, dtype):
    """Sends the partial outputs back and sums each token's (at most min(K, W)) partials in
    float32, in rank order: deterministic (no atomics), one read of every partial row."""
    back = _AllToAll.apply(out_local, None, group_name, plan.send_splits, plan.recv_splits)
    return _sum_partials(back, plan, dtype)


def _sum_partials(back, plan: _Plan, dtype):
    T, H = plan.T, back.shape[1]
    back = torch.cat([back, back.new_zeros(1, H)])   # row n_send: zeros
    # each token's rows first (sorted: rank order, the zero row last), cut to the most any
    # token has: R = min(K, W)
    row = torch.sort(plan.row, dim=1).values[:, :plan.R]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    parts = []
    for t0 in range(0, T, _COMBINE_CHUNK):
        r = row[t0:t0 + _COMBINE_CHUNK]
        parts.append(back[r].sum(1, dtype=acc))
    # (no tokens: an empty slice of `back`, still connected for the backward's collective)
    out = torch.cat(parts) if parts else back[:0].to(acc)
    out = out.to(dtype)
    if plan.overflow is not None:
        out = torch.where(plan.overflow.any(1, keepdim=True), float("nan"), out)
    return out


# ------------------------------------------------------------------------------------------------
# Sharding an experts module (transformers' layout: gate_up_proj [E, 2I, H], down_proj [E, H, I])


@dataclass(frozen=True, kw_only=True)
class ExpertParallelConfig:
    """How `shard_experts_module` (and `apply_moe_ops(model, expert_parallel_group=...)`) runs
    the sharded experts: the process group (None: the default group) and
    `expert_parallel_dispatch`'s mode, sync_free, capacity and pipeline_chunks."""

    group: object = None
    mode: str = "all_to_all"
    sync_free: bool = False
    capacity: int | None = None
    pipeline_chunks: int = 1

    def __post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"ExpertParallelConfig: mode must be one of {_MODES}, got {self.mode!r}")


# Instance attribute of a sharded experts module: (ExpertParallelGroup, call options).
_SHARDED = "_moe_ops_expert_parallel"


def _per_token(t, T):
    # [..., K] -> [T, K] (not reshape(T, -1): that raises for T = 0)
    return t.reshape(T, t.shape[-1]) if t.dim() >= 2 else t.reshape(T, -1)


def _ep_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    epg, opts = self.__dict__[_SHARDED]
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


def shard_experts_module(experts: torch.nn.Module, config=None, *, forward_attr: str = "forward"):
    """Keeps this rank's shard of an experts module's `gate_up_proj` [E, 2I, H] and `down_proj`
    [E, H, I] (an even split: the first E % world_size ranks hold one expert more; the other
    experts' weights are freed) and installs `forward_attr` (an instance attribute) computing
    `forward(hidden_states [T, H], top_k_index [T, K] global ids, top_k_weights [T, K])` with
    `expert_parallel_dispatch`. `config`: a ProcessGroup, None (the default group) or an
    ExpertParallelConfig. A collective (the shard check): every rank calls it, in the same
    order for every module. A module sharded already is left as it is. Returns the module."""
    if _SHARDED in experts.__dict__:
        return experts
    if not isinstance(config, ExpertParallelConfig):
        config = ExpertParallelConfig(group=config)
    _require_initialized("shard_experts_module")
    pg = dist.group.WORLD if config.group is None else config.group
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(experts, name, None)
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            raise ValueError(f"shard_experts_module: {type(experts).__name__}.{name} must be a 3-D "
                             f"tensor ([E, 2I, H] / [E, H, I]), got {type(w).__name__}")
    E = experts.gate_up_proj.shape[0]
    first, count = even_shard(E, world, rank)
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, name)
        local = full.detach()[first:first + count].clone()
        if isinstance(full, torch.nn.Parameter):
            local = torch.nn.Parameter(local, requires_grad=full.requires_grad)
        setattr(experts, name, local)
    epg = ExpertParallelGroup.setup(experts.gate_up_proj, experts.down_proj, first_expert=first,
                                    num_experts=E, group=pg)
    opts = {"mode": config.mode, "sync_free": config.sync_free, "capacity": config.capacity,
            "pipeline_chunks": config.pipeline_chunks}
    experts.__dict__[_SHARDED] = (epg, opts)
    # functools.partial of a module-level function: picklable, unlike a bound method
    experts.__dict__[forward_attr] = functools.partial(_ep_experts_forward, experts)
    return experts


def is_expert_parallel(model: torch.nn.Module) -> bool:
    """Whether any module of `model` was sharded by `shard_experts_module`."""
    return any(_SHARDED in m.__dict__ for m in model.modules())

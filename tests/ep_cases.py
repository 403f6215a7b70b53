"""Cases of the expert-parallel tests, run inside every rank of a spawned process group
(tests/test_distributed.py: gloo on the CPU; benchmarks/ep_gpu_check.py: NCCL on GPUs).

Each case builds the same global problem on every rank from a shared seed (full weights, every
rank's tokens and routing), runs `expert_parallel_dispatch` on this rank's share, and compares
forward and backward with single-process `moe_ops.dispatch` on the full weights (float64 on the
CPU: the reference path; on CUDA the same dtype's kernels, compared against float64). A case
returns None or raises; `run_cases` records the outcome per case without stopping, so that one
failing comparison does not desynchronise the ranks' collectives."""
from __future__ import annotations

import datetime
import inspect
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

import moe_ops
from moe_ops.distributed import (
    ExpertParallelGroup,
    even_shard,
    expert_parallel_dispatch,
)

# relative error bounds against the float64 reference (the distributed sum adds one rounding
# of each rank's partial output in the input dtype)
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _rel(a, b):
    a, b = a.double(), b.double()
    assert a.shape == b.shape, (a.shape, b.shape)
    assert not torch.isnan(a).any(), "NaN in the result"
    return ((a - b).norm() / max(b.norm().item(), 1e-30)).item()


def _problem(W, *, E, H, I, K, tokens, seed, route="random", pad_frac=0.0, dtype, device):
    """Global weights, per-rank tokens/routing (lists), all identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g, dtype=torch.float64) / I ** 0.5
    per = []
    for r in range(W):
        T = tokens[r]
        x = torch.randn(T, H, generator=g, dtype=torch.float64)
        if route == "random":
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
                torch.zeros(0, K, dtype=torch.long)
        elif isinstance(route, tuple) and route[0] == "experts":   # only these experts
            pool = torch.tensor(route[1])
            ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:K]]
                               for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.long)
        elif route == "round_robin":   # K = 1, token t to rank t % W: T / W rows per rank
            E_local = E // W
            ids = ((torch.arange(T) % W) * E_local).unsqueeze(1)
        else:
            raise ValueError(route)
        if pad_frac and T:
            drop = torch.rand(T, K, generator=g) < pad_frac
            ids = torch.where(drop, -1, ids)
        w = torch.rand(T, K, generator=g, dtype=torch.float64) + 0.1
        gout = torch.randn(T, H, generator=g, dtype=torch.float64)
        per.append(dict(x=x, ids=ids.to(torch.int32), w=w, gout=gout))
    def cast(t):
        return t.to(device=device, dtype=dtype)
    w13, w2 = cast(w13), cast(w2)
    for p in per:
        p["x"], p["gout"] = cast(p["x"]), cast(p["gout"])
        p["w"] = p["w"].to(device=device, dtype=torch.float32 if dtype != torch.float64 else dtype)
        p["ids"] = p["ids"].to(device)
    return w13, w2, per


class CaseSkipped(Exception):
    """A case that cannot run here (recorded as "skip: <reason>", reported as a skipped test)."""


def _reference(w13, w2, per, replicated, biases=None, kwargs=None):
    """Single-process moe.dispatch on the full weights (and biases), forward and backward, in
    float64 on the CPU (the reference path): the oracle."""
    if replicated:
        per = per[:1]
    x = torch.cat([p["x"] for p in per]).double().cpu().requires_grad_()
    w = torch.cat([p["w"] for p in per]).double().cpu().requires_grad_()
    ids = torch.cat([p["ids"] for p in per]).cpu()
    a = w13.double().cpu().requires_grad_()
    b = w2.double().cpu().requires_grad_()
    kw = dict(kwargs or {})
    bias = [t.double().cpu().requires_grad_() for t in biases] if biases else []
    if bias:
        kw.update(w13_bias=bias[0], w2_bias=bias[1])
    out = moe_ops.dispatch(x, a, b, w, ids, **kw)
    gout = torch.cat([p["gout"] for p in per]).double().cpu()
    (out * gout).sum().backward()
    return out.detach(), x.grad, w.grad, a.grad, b.grad, [t.grad for t in bias]


def check_parity(rank, W, group, *, E, H=8, I=6, K=2, tokens=None, mode="all_to_all",
                 sync_free=False, capacity=None, shards=None, route="random", pad_frac=0.0,
                 dtype=torch.float64, device="cpu", seed=0, backward=True, use_epg=False,
                 biases=False, **kwargs):
    params = inspect.signature(moe_ops.dispatch).parameters
    ep_only = ("pipeline_chunks",)
    missing = [k for k in ([*kwargs, "w13_bias"] if biases else kwargs)
               if k not in params and k not in ep_only]
    if missing:
        raise CaseSkipped(f"this moe_ops.dispatch has no {missing} argument")
    tokens = tokens or [5] * W
    replicated = mode == "replicated"
    if replicated:
        tokens = [tokens[0]] * W
    w13, w2, per = _problem(W, E=E, H=H, I=I, K=K, tokens=tokens, seed=seed, route=route,
                            pad_frac=pad_frac, dtype=dtype, device=device)
    first, count = shards[rank] if shards else even_shard(E, W, rank)
    mine = per[0] if replicated else per[rank]
    x = mine["x"].clone().requires_grad_(backward)
    w = mine["w"].clone().requires_grad_(backward)
    a = w13[first:first + count].clone().requires_grad_(backward)
    b = w2[first:first + count].clone().requires_grad_(backward)
    full_bias = local_bias = None
    if biases:
        g = torch.Generator().manual_seed(seed + 100)
        full_bias = [torch.randn(E, 2 * I, generator=g, dtype=torch.float64).to(device, dtype),
                     torch.randn(E, H, generator=g, dtype=torch.float64).to(device, dtype)]
        local_bias = [t[first:first + count].clone().requires_grad_(backward) for t in full_bias]
        kwargs = dict(kwargs, w13_bias=local_bias[0], w2_bias=local_bias[1])
    grp = group
    if use_epg:
        grp = ExpertParallelGroup.setup(a, b, first_expert=first, num_experts=E, group=group)
    out = expert_parallel_dispatch(x, a, b, w, mine["ids"], first_expert=first, num_experts=E,
                                   group=grp, mode=mode, sync_free=sync_free, capacity=capacity,
                                   **kwargs)
    plain_kwargs = {k: v for k, v in kwargs.items()
                    if k not in ("w13_bias", "w2_bias", *ep_only)}
    ref_out, gx, gw, ga, gb, gbias = _reference(w13, w2, per, replicated, full_bias, plain_kwargs)
    rows = slice(0, tokens[0]) if replicated else slice(sum(tokens[:rank]), sum(tokens[:rank + 1]))
    tol = TOL[dtype]
    assert out.shape == x.shape and out.dtype == x.dtype, (out.shape, out.dtype)
    errs = {"out": _rel(out.cpu(), ref_out[rows])}
    if backward:
        (out * mine["gout"]).sum().backward()
        gw_err = _rel(w.grad.cpu(), gw[rows])
        if (dtype != torch.float64 and not biases and not kwargs.get("weights_on_input")
                and kwargs.get("activation", "silu") == "silu"):
            # bf16/fp16 (GPU runs): d topk_weights is one dot product per slot that can cancel;
            # its error is taken relative to the size of its terms (conftest.ds_scale)
            from conftest import ds_scale
            scale = ds_scale(mine["gout"].cpu(), mine["x"].cpu(), w13.cpu(), w2.cpu(),
                             mine["w"].cpu(), mine["ids"].cpu())
            gw_err = ((w.grad.cpu().double() - gw[rows].double()).norm()
                      / max(scale.norm().item(), 1e-30)).item()
        errs.update(hidden=_rel(x.grad.cpu(), gx[rows]), topk_weights=gw_err,
                    w13=_rel(a.grad.cpu(), ga[first:first + count]),
                    w2=_rel(b.grad.cpu(), gb[first:first + count]))
        for name, t, gref in zip(("w13_bias", "w2_bias"), local_bias or [], gbias):
            errs[name] = _rel(t.grad.cpu(), gref[first:first + count])
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"rank {rank}: relative errors above {tol}: {bad} (all: {errs})"


def _expect(exc_type, text, fn):
    try:
        fn()
    except exc_type as e:
        assert text in str(e), f"expected {text!r} in: {e}"
        return
    raise AssertionError(f"no {exc_type.__name__} raised (expected {text!r})")


# ------------------------------------------------------------------------------------------------
# Cases: name -> fn(rank, W, group, device, dtype)


def _cases():
    c = {}
    for mode in ("all_to_all", "replicated"):
        m = "a2a" if mode == "all_to_all" else "rep"
        c[f"{m}_random"] = lambda r, W, g, d, t, mode=mode: check_parity(
            r, W, g, E=8, K=3, mode=mode, device=d, dtype=t, seed=1)
        c[f"{m}_one_rank_gets_all"] = lambda r, W, g, d, t, mode=mode: check_parity(
            r, W, g, E=8, K=2, mode=mode, route=("experts", [6, 7]), device=d, dtype=t, seed=2)
        c[f"{m}_k_above_local_experts"] = lambda r, W, g, d, t, mode=mode: check_parity(
            r, W, g, E=W * 2, K=3, mode=mode, device=d, dtype=t, seed=3)
        c[f"{m}_padding_ids"] = lambda r, W, g, d, t, mode=mode: check_parity(
            r, W, g, E=8, K=3, mode=mode, pad_frac=0.4, device=d, dtype=t, seed=4)
        c[f"{m}_uneven_shards"] = lambda r, W, g, d, t, mode=mode: check_parity(
            r, W, g, E=2 * W - 1, K=2, mode=mode, device=d, dtype=t, seed=5)
        c[f"{m}_rank_without_experts"] = lambda r, W, g, d, t, mode=mode: check_parity(
            r, W, g, E=W - 1, K=1, mode=mode, device=d, dtype=t, seed=6)
        c[f"{m}_epg_shuffled_shards"] = lambda r, W, g, d, t, mode=mode: check_parity(
            r, W, g, E=3 * W, K=2, mode=mode, use_epg=True, device=d, dtype=t, seed=7,
            shards=[(3 * (W - 1 - q), 3) for q in range(W)])
    # token counts that differ per rank, one rank without tokens
    c["a2a_rank_with_no_tokens"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=8, K=2, tokens=[0] + [3 + q for q in range(1, W)], device=d, dtype=t, seed=8)
    c["a2a_all_ranks_one_token"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=8, K=2, tokens=[1] * W, device=d, dtype=t, seed=9)
    c["rep_no_tokens"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=8, K=2, tokens=[0] * W, mode="replicated", device=d, dtype=t, seed=10)
    # pipelined default form: chunks overlapping; fewer tokens than chunks on some ranks
    c["a2a_pipelined"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=2 * W - 1, K=3, tokens=[7, 0, 2, 11][:W], pipeline_chunks=3, pad_frac=0.2,
        device=d, dtype=t, seed=27)
    # sync-free: worst-case buffers, and a capacity below T that suffices
    c["sf_random"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=8, K=3, sync_free=True, device=d, dtype=t, seed=11)
    c["sf_padding_uneven_k_above"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=2 * W - 1, K=3, sync_free=True, pad_frac=0.3, device=d, dtype=t, seed=12)
    c["sf_one_rank_gets_all"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=8, K=2, sync_free=True, route=("experts", [0, 1]), device=d, dtype=t, seed=13)
    c["sf_capacity_enough"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=4 * W, K=1, sync_free=True, capacity=2, tokens=[2 * W] * W,
        route="round_robin", device=d, dtype=t, seed=14)
    c["sf_no_tokens"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=8, K=2, sync_free=True, tokens=[0] * W, capacity=2, device=d, dtype=t,
        seed=15)
    c["sf_capacity_overflow_raises"] = _case_overflow
    c["a2a_float32"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=8, K=2, device=d, dtype=torch.float32 if t == torch.float64 else t,
        seed=16, H=12, I=10)
    c["a2a_activation_kwarg"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=8, K=2, device=d, dtype=t, seed=17, activation="silu")
    # biases of the local shard pass through to moe.dispatch (the extended schema)
    c["a2a_biases"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=2 * W - 1, K=3, biases=True, pad_frac=0.2, device=d, dtype=t, seed=18)
    c["rep_biases"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=2 * W - 1, K=3, mode="replicated", biases=True, device=d, dtype=t, seed=19)
    c["sf_biases"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=8, K=2, sync_free=True, biases=True, device=d, dtype=t, seed=24)
    # other dispatch arguments pass through unchanged (activation, weights_on_input)
    c["a2a_gelu_weights_on_input"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=8, K=3, activation="gelu", weights_on_input=True, device=d, dtype=t, seed=25)
    c["rep_swiglu_oai_biases"] = lambda r, W, g, d, t: check_parity(
        r, W, g, E=8, K=2, mode="replicated", activation="swiglu_oai", biases=True, device=d,
        dtype=t, seed=26)
    c["a2a_fp8_experts"] = _case_fp8
    c["rep_fp8_experts"] = lambda r, W, g, d, t: _case_fp8(r, W, g, d, t, mode="replicated")
    c["sf_fp8_experts"] = lambda r, W, g, d, t: _case_fp8(r, W, g, d, t, sync_free=True)
    c["setup_errors"] = _case_setup_errors
    c["ids_beyond_e_checked"] = _case_ids_check
    c["unequal_tokens_checked"] = _case_unequal_tokens_checked
    c["repeated_ids_k_above_local_raise"] = _case_repeated_ids_k_above_local
    c["dynamo_explain"] = _case_explain
    c["compiled"] = _case_compiled
    c["hf_apply_moe_ops_expert_parallel"] = _case_hf_apply
    c["hf_shard_experts_replicated"] = _case_hf_replicated
    c["hf_transformers_ep_plan"] = _case_hf_plan
    return c


def _case_overflow(rank, W, group, device, dtype):
    # every rank sends all its 4 tokens to rank 0 (experts [0, 1]) with capacity 2: every rank
    # raises before its first collective (on CUDA it is a device-side assert instead)
    w13, w2, per = _problem(W, E=2 * W, H=8, I=6, K=1, tokens=[4] * W, seed=20,
                            route=("experts", [0, 1]), dtype=dtype, device=device)
    first, count = even_shard(2 * W, W, rank)
    p = per[rank]

    def call():
        out = expert_parallel_dispatch(
            p["x"], w13[first:first + count], w2[first:first + count], p["w"], p["ids"],
            first_expert=first, num_experts=2 * W, group=group, sync_free=True, capacity=2)
        if out.is_cuda:
            torch.cuda.synchronize()   # where a device-side assert surfaces
        return out
    # MOE_OPS_CHECK=1: counted first, ValueError (every rank overflows here: no peer waits)
    old = os.environ.get("MOE_OPS_CHECK")
    os.environ["MOE_OPS_CHECK"] = "1"
    try:
        _expect(ValueError, "capacity = 2 is below the 4 rows", call)
    finally:
        if old is None:
            del os.environ["MOE_OPS_CHECK"]
        else:
            os.environ["MOE_OPS_CHECK"] = old
    # CPU: torch._assert_async raises at the call with the message; CUDA: a device-side assert
    # (the message goes to stderr; the CUDA context is lost: run this case last)
    _expect(RuntimeError, "capacity = 2" if str(device) == "cpu" else "device-side assert", call)


def _case_fp8(rank, W, group, device, dtype, mode="all_to_all", sync_free=False):
    """FP8 block-quantized experts (frozen; the scales are the local shard's, like biases):
    forward and the hidden / topk_weights / bias gradients equal single-process moe.dispatch on
    the full quantized weights (float32 activations)."""
    if "w13_scale" not in inspect.signature(moe_ops.dispatch).parameters:
        raise CaseSkipped("this moe_ops.dispatch has no quantized weights")
    from moe_ops.reference.quant import quantize_fp8_block

    E, H, I, K, bs = 2 * W + 1, 64, 32, 3, [16, 32]
    tokens = [5, 3, 0, 6][:W] if mode == "all_to_all" and not sync_free else [5] * W
    if mode == "replicated":
        tokens = [tokens[0]] * W
    w13, w2, per = _problem(W, E=E, H=H, I=I, K=K, tokens=tokens, seed=40, dtype=torch.float32,
                            device=device)
    q13, s13 = quantize_fp8_block(w13.cpu(), bs)
    q2, s2 = quantize_fp8_block(w2.cpu(), bs)
    g = torch.Generator().manual_seed(41)
    b13, b2 = torch.randn(E, 2 * I, generator=g) * 0.1, torch.randn(E, H, generator=g) * 0.1
    full = [t.to(device) for t in (q13, s13, q2, s2, b13, b2)]
    src = per[0] if mode == "replicated" else per[rank]
    first, count = even_shard(E, W, rank)
    loc = [t[first:first + count] for t in full]
    x = src["x"].clone().requires_grad_()
    w = src["w"].clone().requires_grad_()
    lb13, lb2 = (t.clone().requires_grad_() for t in loc[4:])
    out = expert_parallel_dispatch(x, loc[0], loc[2], w, src["ids"], first_expert=first,
                                   num_experts=E, group=group, mode=mode, sync_free=sync_free,
                                   w13_scale=loc[1], w2_scale=loc[3], block_shape=bs,
                                   w13_bias=lb13, w2_bias=lb2)
    (out * src["gout"]).sum().backward()
    ref_per = per[:1] if mode == "replicated" else per
    rx = torch.cat([p["x"] for p in ref_per]).cpu().requires_grad_()
    rw = torch.cat([p["w"] for p in ref_per]).cpu().requires_grad_()
    rb13, rb2 = b13.clone().requires_grad_(), b2.clone().requires_grad_()
    ref = moe_ops.dispatch(rx, q13, q2, rw, torch.cat([p["ids"] for p in ref_per]).cpu(),
                           w13_scale=s13, w2_scale=s2, block_shape=bs, w13_bias=rb13, w2_bias=rb2)
    (ref * torch.cat([p["gout"] for p in ref_per]).cpu()).sum().backward()
    rows = slice(0, tokens[0]) if mode == "replicated" else \
        slice(sum(tokens[:rank]), sum(tokens[:rank + 1]))
    errs = {"out": _rel(out.detach().cpu(), ref.detach()[rows]),
            "hidden": _rel(x.grad.cpu(), rx.grad[rows]),
            "topk_weights": _rel(w.grad.cpu(), rw.grad[rows]),
            "w13_bias": _rel(lb13.grad.cpu(), rb13.grad[first:first + count]),
            "w2_bias": _rel(lb2.grad.cpu(), rb2.grad[first:first + count])}
    # CPU: the same reference arithmetic on both sides; CUDA: the FP8 kernels (W8A8) against
    # the CPU reference
    tol = 1e-5 if str(device) == "cpu" else 2e-2
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"rank {rank}: {bad} (all: {errs})"


def _case_setup_errors(rank, W, group, device, dtype):
    H, I = 8, 6

    def shard(n, dt=dtype, h=H):
        return (torch.zeros(n, 2 * I, h, dtype=dt, device=device),
                torch.zeros(n, h, I, dtype=dt, device=device))
    # overlapping shards: every rank claims experts [0, 2)
    a, b = shard(2)
    _expect(ValueError, "do not tile", lambda: ExpertParallelGroup.setup(
        a, b, first_expert=0, num_experts=2 * W, group=group))
    # a gap: shards too small for num_experts
    _expect(ValueError, "cover [0,", lambda: ExpertParallelGroup.setup(
        a, b, first_expert=2 * rank, num_experts=2 * W + 1, group=group))
    # num_experts disagrees
    _expect(ValueError, "num_experts differs", lambda: ExpertParallelGroup.setup(
        a, b, first_expert=2 * rank, num_experts=2 * W + rank, group=group))
    # H disagrees
    a2, b2 = shard(2, h=H + rank)
    _expect(ValueError, "hidden size H", lambda: ExpertParallelGroup.setup(
        a2, b2, first_expert=2 * rank, num_experts=2 * W, group=group))
    # dtypes differ across ranks
    other = torch.float32 if dtype != torch.float32 else torch.float64
    a3, b3 = shard(2, dt=dtype if rank == 0 else other)
    _expect(TypeError, f"rank 0: {dtype}, rank 1: {other}", lambda: ExpertParallelGroup.setup(
        a3, b3, first_expert=2 * rank, num_experts=2 * W, group=group))
    # the good one, and a call whose arguments contradict it
    epg = ExpertParallelGroup.setup(a, b, first_expert=2 * rank, num_experts=2 * W, group=group)
    assert epg.starts == tuple(2 * q for q in range(W)) and epg.counts == (2,) * W
    x = torch.zeros(3, H, dtype=dtype, device=device)
    ids = torch.zeros(3, 1, dtype=torch.int32, device=device)
    w = torch.ones(3, 1, dtype=dtype, device=device)
    _expect(ValueError, "do not match the ExpertParallelGroup", lambda: expert_parallel_dispatch(
        x, a, b, w, ids, first_expert=2 * rank + 1, num_experts=2 * W, group=epg))
    _expect(ValueError, "mode must be one of", lambda: expert_parallel_dispatch(
        x, a, b, w, ids, first_expert=2 * rank, num_experts=2 * W, group=epg, mode="bogus"))
    _expect(ValueError, "capacity applies", lambda: expert_parallel_dispatch(
        x, a, b, w, ids, first_expert=2 * rank, num_experts=2 * W, group=epg, capacity=3))


def _case_ids_check(rank, W, group, device, dtype):
    w13, w2, per = _problem(W, E=2 * W, H=8, I=6, K=2, tokens=[3] * W, seed=21, dtype=dtype,
                            device=device)
    first, count = even_shard(2 * W, W, rank)
    p = per[rank]
    bad = p["ids"].clone()
    bad[1, 0] = 2 * W + 5
    old = os.environ.get("MOE_OPS_CHECK")
    os.environ["MOE_OPS_CHECK"] = "1"
    try:
        _expect(ValueError, f"expert id {2 * W + 5}", lambda: expert_parallel_dispatch(
            p["x"], w13[first:first + count], w2[first:first + count], p["w"], bad,
            first_expert=first, num_experts=2 * W, group=group))
    finally:
        if old is None:
            del os.environ["MOE_OPS_CHECK"]
        else:
            os.environ["MOE_OPS_CHECK"] = old


def _case_unequal_tokens_checked(rank, W, group, device, dtype):
    """MOE_OPS_CHECK=1: sync-free with different T per rank (and no common capacity), or the
    replicated form with different T, raise ValueError on every rank; one capacity for all
    allows different T."""
    E = 2 * W
    first, count = even_shard(E, W, rank)
    a = torch.randn(count, 12, 8, dtype=dtype, device=device)
    b = torch.randn(count, 8, 6, dtype=dtype, device=device)
    T = 3 + rank
    g = torch.Generator().manual_seed(30 + rank)
    x = torch.randn(T, 8, generator=g, dtype=torch.float64).to(device, dtype)
    w = torch.rand(T, 2, generator=g, dtype=torch.float64).to(device, dtype)
    ids = torch.randint(0, E, (T, 2), generator=g).to(device)
    old = os.environ.get("MOE_OPS_CHECK")
    os.environ["MOE_OPS_CHECK"] = "1"
    try:
        for kw in ({"sync_free": True}, {"mode": "replicated"}):
            _expect(ValueError, "on every rank", lambda kw=kw: expert_parallel_dispatch(
                x, a, b, w, ids, first_expert=first, num_experts=E, group=group, **kw))
        out = expert_parallel_dispatch(x, a, b, w, ids, first_expert=first, num_experts=E,
                                       group=group, sync_free=True, capacity=3 + W)
        assert out.shape == x.shape and not torch.isnan(out).any()
    finally:
        if old is None:
            del os.environ["MOE_OPS_CHECK"]
        else:
            os.environ["MOE_OPS_CHECK"] = old


def _case_repeated_ids_k_above_local(rank, W, group, device, dtype):
    """K > E_local with an expert repeated in a row: a loud error (CPU: at the call), not a
    silently dropped slot. On a group of one rank (every rank makes its own), so that no peer
    waits in a collective for the rank that raises."""
    solo = None
    for r in range(W):   # new_group is a collective: every rank creates every group
        g = dist.new_group([r])
        if r == rank:
            solo = g
    a = torch.randn(2, 12, 8, dtype=dtype, device=device)
    b = torch.randn(2, 8, 6, dtype=dtype, device=device)
    x = torch.randn(2, 8, dtype=dtype, device=device)
    w = torch.rand(2, 3, dtype=dtype, device=device)
    for mode in ("all_to_all", "replicated"):
        ids = torch.tensor([[0, 1, -1], [1, 0, 1]], dtype=torch.int32, device=device)

        def call(mode=mode, ids=ids):
            out = expert_parallel_dispatch(x, a, b, w, ids, first_expert=0, num_experts=2,
                                           group=solo, mode=mode)
            if out.is_cuda:
                torch.cuda.synchronize()
        _expect(RuntimeError, "repeated expert ids" if str(device) == "cpu"
                else "device-side assert", call)


def _case_explain(rank, W, group, device, dtype):
    """torch._dynamo.explain: zero graph breaks for sync_free and replicated; the default
    all-to-all breaks at its one host read of the split sizes."""
    E, H, I, K = 2 * W, 8, 6, 2
    w13, w2, per = _problem(W, E=E, H=H, I=I, K=K, tokens=[4] * W, seed=22, dtype=dtype,
                            device=device)
    first, count = even_shard(E, W, rank)
    a, b = w13[first:first + count], w2[first:first + count]
    epg = ExpertParallelGroup.setup(a, b, first_expert=first, num_experts=E, group=group)
    p = per[rank]
    breaks = {}
    for name, kw in (("sync_free", dict(sync_free=True)), ("replicated", dict(mode="replicated")),
                     ("default", {})):
        def f(x, w, ids, kw=kw):
            return expert_parallel_dispatch(x, a, b, w, ids, first_expert=first, num_experts=E,
                                            group=epg, **kw)
        torch._dynamo.reset()
        ex = torch._dynamo.explain(f)(p["x"], p["w"], p["ids"])
        breaks[name] = (ex.graph_break_count, [str(r.reason)[:120] for r in ex.break_reasons])
    assert breaks["sync_free"][0] == 0, breaks
    assert breaks["replicated"][0] == 0, breaks
    assert breaks["default"][0] >= 1, breaks


def _case_compiled(rank, W, group, device, dtype):
    """torch.compile (inductor): sync_free and replicated with fullgraph=True, the default
    all-to-all with its graph break; forward and backward equal eager's."""
    import shutil
    import tempfile

    # one fresh inductor cache per rank and per run, removed afterwards: the ranks compile the
    # same graphs at the same time, and a cache left by an earlier run (possibly from another
    # checkout, with another op schema) must not be reused
    cache = tempfile.mkdtemp(prefix=f"moe_ops_ep_inductor_rank{rank}_")
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        _compiled_parity(rank, W, group, device, dtype)
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
        shutil.rmtree(cache, ignore_errors=True)


def _compiled_parity(rank, W, group, device, dtype):
    E, H, I, K = 2 * W, 8, 6, 2
    w13, w2, per = _problem(W, E=E, H=H, I=I, K=K, tokens=[4] * W, seed=23, dtype=dtype,
                            device=device)
    first, count = even_shard(E, W, rank)
    epg = ExpertParallelGroup.setup(w13[first:first + count], w2[first:first + count],
                                    first_expert=first, num_experts=E, group=group)
    p = per[rank]
    for name, kw, full in (("sync_free", dict(sync_free=True), True),
                           ("replicated", dict(mode="replicated"), True),
                           ("default", {}, False)):
        def f(x, w, a, b, ids, kw=kw):
            return expert_parallel_dispatch(x, a, b, w, ids, first_expert=first, num_experts=E,
                                            group=epg, **kw)
        torch._dynamo.reset()
        runs = []
        for fn in (f, torch.compile(f, fullgraph=full)):
            x = (per[0] if name == "replicated" else p)["x"].clone().requires_grad_()
            w = (per[0] if name == "replicated" else p)["w"].clone().requires_grad_()
            a = w13[first:first + count].clone().requires_grad_()
            b = w2[first:first + count].clone().requires_grad_()
            ids = (per[0] if name == "replicated" else p)["ids"]
            out = fn(x, w, a, b, ids)
            out.square().sum().backward()
            runs.append((out.detach(), x.grad, w.grad, a.grad, b.grad))
        for e, c_ in zip(*runs):
            err = _rel(c_, e)
            assert err < TOL[dtype], (name, err)


# ------------------------------------------------------------------------------------------------
# transformers


def _hf_dtype_tol(device):
    # float64 on the CPU (the reference path); float32 on CUDA (the kernels; the reference is the
    # same model on one device, so only the distributed sum's rounding differs)
    return (torch.float64, 1e-10) if str(device) == "cpu" else (torch.float32, 1e-4)


def _tiny_qwen3_moe(num_experts=5, device="cpu"):
    """A tiny random Qwen3-MoE (the same on every rank: seeded). 5 experts: uneven shards."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         intermediate_size=48, moe_intermediate_size=24, num_experts=num_experts,
                         num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Qwen3MoeForCausalLM(cfg).to(device=device, dtype=_hf_dtype_tol(device)[0]).eval()
    model.set_experts_implementation("eager")   # (grouped_mm has no float64)
    return model


def _batches(W, seq=6, device="cpu"):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 128, (1 + r % 2, seq), generator=g).to(device) for r in range(W)]


def _case_hf_apply(rank, W, group, device, dtype):
    """apply_moe_ops(model, expert_parallel_group=...): each rank runs its own batch; logits and
    the local experts' gradients equal the single-device model's."""
    from moe_ops.tools.debug import OpCounter
    from moe_ops.integrations.hf_expert_parallel import is_expert_parallel
    from moe_ops.integrations.huggingface import apply_moe_ops

    batches = _batches(W, device=device)
    tol = _hf_dtype_tol(device)[1]
    # the reference runs moe_ops on one process (moe.route's float32 weights, as the EP model):
    # the comparison isolates expert parallelism
    ref = apply_moe_ops(_tiny_qwen3_moe(device=device))
    ref_logits = [ref(b).logits for b in batches]
    sum(lg.square().mean() for lg in ref_logits).backward()
    ref_grads = [blk.mlp.experts.gate_up_proj.grad for blk in ref.model.layers]
    model = apply_moe_ops(_tiny_qwen3_moe(device=device), expert_parallel_group=group)
    assert is_expert_parallel(model)
    first, count = even_shard(5, W, rank)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == count
    with OpCounter() as calls:
        logits = model(batches[rank]).logits
    # (with gradients moe.dispatch runs as moe.dispatch_train)
    n = calls.counts.get("dispatch", 0) + calls.counts.get("dispatch_train", 0)
    assert n == 2 and calls.counts.get("route", 0) == 2, calls.counts
    err = _rel(logits.detach(), ref_logits[rank].detach())
    assert err < tol, err
    logits.square().mean().backward()
    for blk, g in zip(model.model.layers, ref_grads):
        e = _rel(blk.mlp.experts.gate_up_proj.grad, g[first:first + count])
        assert e < tol, e


def _case_hf_replicated(rank, W, group, device, dtype):
    from moe_ops.integrations.hf_expert_parallel import shard_experts

    batch = _batches(W, device=device)[1]
    ref = _tiny_qwen3_moe(device=device)
    with torch.no_grad():
        ref_logits = ref(batch).logits
        model = shard_experts(_tiny_qwen3_moe(device=device), group, mode="replicated")
        err = _rel(model(batch).logits, ref_logits)
    assert err < _hf_dtype_tol(device)[1], err


def _case_hf_plan(rank, W, group, device, dtype):
    """A model loaded with transformers' own expert-parallel plan (DistributedConfig(ep_size=W),
    both of its implementations), with and without the "moe_ops" experts implementation, gives
    the single-device logits; apply_moe_ops refuses it with a clear error."""
    import tempfile

    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from moe_ops.tools.debug import OpCounter
    from moe_ops.integrations.huggingface import UnsupportedModelError, apply_moe_ops

    # under a process group transformers saves on rank 0 only: one directory for all ranks
    box = [tempfile.mkdtemp(prefix="ep_hf_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    path = box[0]
    if rank == 0:
        _tiny_qwen3_moe(num_experts=4).save_pretrained(path)   # transformers' plan: E % W == 0
    dist.barrier(group=group)
    dt, tol = _hf_dtype_tol(device)
    batch = _batches(W, device=device)[1]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dt,
                                               experts_implementation="eager").to(device)
    with torch.no_grad():
        ref_logits = ref(batch).logits
    for impl in ("all_to_all", "all_reduce"):
        cfg = DistributedConfig(tp_size=W, tp_plan={}, ep_size=W, ep_implementation=impl)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt,
                                                     experts_implementation="eager",
                                                     distributed_config=cfg)
        with torch.no_grad():
            plain = model(batch).logits
            model.set_experts_implementation("moe_ops")
            with OpCounter() as calls:
                patched = model(batch).logits
        assert calls.counts.get("dispatch", 0) == 2, (impl, calls.counts)
        for name, lg in (("unpatched", plain), ("moe_ops", patched)):
            err = _rel(lg, ref_logits)
            assert err < tol, (impl, name, err)
        # apply_moe_ops(model) on transformers' plan: either a clear refusal (the experts carry
        # transformers' instance-level expert-parallel forward) or, where huggingface.py routes
        # such experts through the "moe_ops" implementation, the same logits through moe_ops
        model.set_experts_implementation("eager")
        try:
            apply_moe_ops(model)
        except UnsupportedModelError as e:
            assert "instance-level forward" in str(e) or "expert parallel" in str(e), e
        else:
            with torch.no_grad(), OpCounter() as calls:
                applied = model(batch).logits
            assert calls.counts.get("dispatch", 0) == 2, (impl, calls.counts)
            err = _rel(applied, ref_logits)
            assert err < tol, (impl, "apply_moe_ops", err)


CASES = _cases()


def run_cases(rank, W, init, names, out_dir, device="cpu", dtype=torch.float64,
              timeout_s=60.0, hard_exit=False):
    """Worker of one rank: init the group (`init`: a FileStore path for gloo, or "env" for
    torchrun), run the named cases, write {name: "ok" | traceback} to out_dir/rank<r>.json.
    `hard_exit`: leave with os._exit(0) once the results are written (a spawned rank that ran
    torch.compile sometimes aborted in interpreter teardown, "terminate called without an
    active exception", after its results were complete)."""
    backend = "gloo" if device == "cpu" else "nccl"
    if device != "cpu":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    if init == "env":
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    else:
        dist.init_process_group(backend, store=dist.FileStore(init, W), rank=rank, world_size=W,
                                timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)
    results = {}
    try:
        for name in names:
            try:
                CASES[name](rank, W, dist.group.WORLD, device, dtype)
                results[name] = "ok"
            except CaseSkipped as e:
                results[name] = f"skip: {e}"
            except Exception:  # noqa: BLE001  recorded, reported by the parent
                results[name] = traceback.format_exc()
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
    if hard_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

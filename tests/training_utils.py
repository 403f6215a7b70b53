"""Shared inputs, oracles and fixtures of the training tests (tests/test_dispatch_autograd.py,
tests/test_launch_dispatch.py, tests/test_launch_dispatch_backward.py).

Random inputs come from a fresh seed per test, printed in every failure message; set
MOE_OPS_TEST_SEED=<seed> to replay one."""
import os
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import moe_ops
from conftest import (RTOL, OpCounter, assert_equal_across_tile_heights, ds_scale,
                      expert_counts_skewed, grad_errors, needs_interpreter, rel_err,
                      spy_kernel_launches)
from moe_ops.ops.samples import dispatch_samples, make_dispatch_inputs
from moe_ops.reference.dispatch import dispatch_backward_reference, dispatch_z_reference

MODES = ["saved", "recompute"]
PATHS = ["reference_path", "interpreter"]
# "mixed": empty experts and ids < 0 in one routing (see _inputs).
ROUTINGS = ["uniform", "negative", "empty_experts", "one_expert", "skewed", "mixed"]
OPS = {"saved": {"dispatch_train": 1, "dispatch_backward_saved": 1},
       "recompute": {"dispatch": 1, "dispatch_backward": 1}}
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
NAMES = ("hidden", "w13", "w2", "topk_weights")


def fresh_seed() -> int:
    env = os.environ.get("MOE_OPS_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


@pytest.fixture(autouse=True)
def _default_mode(monkeypatch):
    """Every test starts from the default (saved) mode and leaves it restored."""
    monkeypatch.delenv("MOE_OPS_RECOMPUTE", raising=False)
    moe_ops.set_recompute(None)
    yield
    moe_ops.set_recompute(None)


@pytest.fixture(params=MODES)
def mode(request):
    moe_ops.set_recompute(request.param == "recompute")
    yield request.param


def _inputs(T, H, I, E, K, *, routing, seed, dtype=torch.float32, requires_grad=False,
            ids_dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    base = "empty_experts" if routing == "mixed" else routing
    h, w13, w2, w, ids = make_dispatch_inputs(T, H, I, E, K, dtype=dtype, routing=base,
                                              generator=g, ids_dtype=ids_dtype)
    if routing == "mixed":
        ids = ids.masked_fill(torch.rand(ids.shape, generator=g) < 0.3, -1)
        ids[0, 0] = -1  # at least one dropped slot
    if dtype == torch.float64:
        w = w.double()  # float64 end to end (make_dispatch_inputs gives float32 topk_weights)
    if requires_grad:
        for t in (h, w13, w2, w):
            t.requires_grad_(True)
    return (h, w13, w2, w, ids), g


def _poison_empty(monkeypatch):
    """Every floating-point buffer made by torch.empty (in moe_ops' launchers too) starts as NaN,
    so that an element read before it is written shows up."""
    real = torch.empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)


def _z_err(z, args):
    """Relative error of a saved pre-activation z against float64, over the slots of valid ids
    (rows of dropped ids are never written)."""
    valid = _valid_slots(args[4])
    z_ref = dispatch_z_reference(*_double(args[:2]), args[4])
    return rel_err(z[valid], z_ref[valid])


def _valid_slots(ids):
    return (ids >= 0).reshape(-1)


def _double(args):
    return [a.detach().double() if a.is_floating_point() else a for a in args]


def _dense_float64(hidden, w13, w2, w, ids):
    """Differentiable float64 MoE written with masks, independently of moe_ops.reference."""
    E, I = w13.shape[0], w2.shape[2]
    out = torch.zeros_like(hidden)
    for e in range(E):
        sel = (ids.long() == e).to(hidden.dtype)          # [T, K]
        coef = (w * sel).sum(1, keepdim=True)             # [T, 1] (repeated ids add up)
        z = hidden @ w13[e].t()
        a = F.silu(z[:, :I]) * z[:, I:]
        out = out + coef * (a @ w2[e].t())
    return out


def _oracle_grads(args, go):
    ref = [a.detach().double().requires_grad_(True) for a in args[:4]] + [args[4]]
    _dense_float64(*ref).backward(go.double())
    return [r.grad for r in ref[:4]]


def _train_step(args, go):
    """moe.dispatch forward + backward; returns (out, grads, op counts)."""
    for a in args[:4]:
        a.grad = None
    with OpCounter() as c:
        out = torch.ops.moe.dispatch(*args)
        out.backward(go)
    return out, [a.grad for a in args[:4]], c.counts


def _assert_exact_zeros(args, grads, msg):
    """Experts with no valid slot get exactly zero weight gradients; dropped slots (ids < 0) get
    exactly zero routing-weight gradients."""
    ids, E = args[4].long(), args[1].shape[0]
    used = set(ids[ids >= 0].tolist())
    for e in range(E):
        if e not in used:
            assert torch.equal(grads[1][e], torch.zeros_like(grads[1][e])), (msg, "w13", e)
            assert torch.equal(grads[2][e], torch.zeros_like(grads[2][e])), (msg, "w2", e)
    dropped = ids < 0
    assert torch.equal(grads[3][dropped], torch.zeros_like(grads[3][dropped])), (msg, "dropped")


def _check_grads(mode, routing, dtype, seed, T=13, H=17, I=11, E=6, K=2, ids_dtype=torch.int32,
                 strided_hidden=False):
    args, g = _inputs(T, H, I, E, K, routing=routing, seed=seed, dtype=dtype, requires_grad=True,
                      ids_dtype=ids_dtype)
    if strided_hidden:   # same values, hidden.stride() == (1, T)
        h = args[0].detach().t().contiguous().t().requires_grad_(True)
        assert not h.is_contiguous()
        args = (h,) + args[1:]
    go = torch.randn(T, H, generator=g).to(dtype)
    out, grads, counts = _train_step(args, go)
    msg = f"seed={seed} mode={mode} routing={routing} dtype={dtype}"
    assert counts == OPS[mode], (msg, counts)
    assert rel_err(out, _dense_float64(*_double(args))) <= RTOL[dtype], msg
    ref = _oracle_grads(args, go)
    for name, a, gr in zip(NAMES, args[:4], grads):
        assert gr is not None and gr.shape == a.shape and gr.dtype == a.dtype, (msg, name)
    for name, err in zip(NAMES, grad_errors(grads, ref, go, args)):
        assert err <= GRAD_TOL[dtype], (msg, name, err)
    _assert_exact_zeros(args, grads, msg)
    return grads




def with_weight_grad(bc, **fields):
    """`bc` (a BackwardConfig) with its weight-gradient config's `fields` replaced."""
    import dataclasses

    return dataclasses.replace(bc, weight_grad=dataclasses.replace(bc.weight_grad, **fields))


def with_row_gemms(bc, **fields):
    """`bc` with both backward row GEMMs' (dA and dx) `fields` replaced."""
    import dataclasses

    return dataclasses.replace(
        bc, activation_grad_gemm=dataclasses.replace(bc.activation_grad_gemm, **fields),
        input_grad_gemm=dataclasses.replace(bc.input_grad_gemm, **fields))


def _interpreted_int(v) -> int:
    """A scalar seen inside an interpreted kernel (a tensor wrapper around a numpy handle, or a
    plain int) as a Python int."""
    return int(v.handle.data.item()) if hasattr(v, "handle") else int(v)

"""Training modes of moe.dispatch: saved z (the default: moe.dispatch_train in the forward,
moe.dispatch_backward_saved in the backward) and recompute (moe_ops.set_recompute(True) or
MOE_OPS_RECOMPUTE=1: moe.dispatch, then moe.dispatch_backward).

opcheck of the internal ops and of moe.dispatch in both modes; gradients against float64 oracles
(torch reference and interpreted Triton kernels); which ops run; the saved z itself; T = 0.

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


# ---------------------------------------------------------------------------------------------
# 1. opcheck


@pytest.mark.parametrize("sample", [0, 2, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_dispatch_train(reference_path, dtype, sample):
    args, kw = dispatch_samples(dtype=dtype)[sample]
    torch.library.opcheck(torch.ops.moe.dispatch_train.default, args, kw)


@pytest.mark.parametrize("sample", [0, 2, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_dispatch_backward_saved(reference_path, dtype, sample):
    args, kw = dispatch_samples(dtype=dtype)[sample]
    _, z = torch.ops.moe.dispatch_train(*args, **kw)
    go = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(sample)).to(dtype)
    torch.library.opcheck(torch.ops.moe.dispatch_backward_saved.default, (go, z, *args), kw)


@pytest.mark.parametrize("sample", [0, 2, 4, 5])
def test_internal_ops_not_differentiable(reference_path, sample):
    """moe.dispatch_train / dispatch_backward / dispatch_backward_saved have no derivative: an
    Autograd kernel runs them below Autograd (opcheck with inputs that require grad: autograd
    registration included), their outputs never require grad, and a double backward through
    moe.dispatch fails with an error instead of PyTorch's autograd fallback."""
    args, kw = dispatch_samples(requires_grad=True)[sample]
    torch.library.opcheck(torch.ops.moe.dispatch_train.default, args, kw)
    out, z = torch.ops.moe.dispatch_train(*args, **kw)
    assert not out.requires_grad and not z.requires_grad
    go = torch.randn(out.shape, dtype=out.dtype).requires_grad_(True)
    torch.library.opcheck(torch.ops.moe.dispatch_backward_saved.default, (go, z, *args), kw)
    torch.library.opcheck(torch.ops.moe.dispatch_backward.default, (go, *args), kw)
    assert not any(g.requires_grad for g in torch.ops.moe.dispatch_backward(go, *args, **kw))
    y = torch.ops.moe.dispatch(*args, **kw)
    g, = torch.autograd.grad(y.sum(), args[0], create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(g.sum(), args[0])


@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_second_derivatives_raise_instead_of_reading_zero(path, mode, request):
    """A double backward through moe.dispatch raises: before, its gradients came back as
    constants, so a gradient penalty beside another term silently lost the penalty's part and
    autograd.functional.jvp (double-backward trick) returned zeros. Forward-mode AD raises too
    (dual inputs used to come out without a tangent: a zero derivative). A backward with
    create_graph=True whose graph is not differentiated again still works, and moe.route (torch
    ops in its backward) keeps its double backward."""
    request.getfixturevalue(path)
    import torch.autograd.forward_ad as fwAD
    from torch.autograd.functional import jvp

    args, kw = dispatch_samples(requires_grad=True)[0]
    h = args[0]
    f = lambda x: torch.ops.moe.dispatch(x, *args[1:], **kw)  # noqa: E731
    g, = torch.autograd.grad(f(h).sum(), h, create_graph=True)   # first order: fine
    ref, = torch.autograd.grad(f(h).sum(), h)
    torch.testing.assert_close(g, ref, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(g.pow(2).sum() + h.sum(), h)   # the penalty pattern
    with pytest.raises(RuntimeError, match="no second derivative"):
        jvp(f, h.detach(), torch.ones_like(h))
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="moe.dispatch: forward-mode AD"):
            f(fwAD.make_dual(h.detach(), torch.ones_like(h)))
        with pytest.raises(NotImplementedError, match="moe.route: forward-mode AD"):
            torch.ops.moe.route(fwAD.make_dual(torch.randn(3, 8), torch.ones(3, 8)), 2)
        f(h.detach())   # no dual input: runs
    # (route's weights are float32 whatever the logits' dtype: finite differences at eps 1e-3;
    # logits >= 0.25 apart, so no perturbation flips the top-k selection)
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    logits = torch.stack([torch.randperm(8, generator=gen) * 0.5 for _ in range(4)]).double()
    logits = (logits + torch.rand(4, 8, generator=gen, dtype=torch.float64) * 0.25 - 2.0)
    logits.requires_grad_(True)
    torch.autograd.gradgradcheck(lambda x: torch.ops.moe.route(x, 3, "sigmoid", True)[0],
                                 (logits,), eps=1e-3, atol=2e-3, rtol=1e-2)


def test_torch_func_gradients_raise_naming_the_op(reference_path):
    """torch.func.grad / vjp through the ops raised torch's "In order to use an
    autograd.Function with functorch transforms ... it must override the setup_context
    staticmethod", which names neither the op nor what to use instead; vmap alone still runs
    (torch's batching fallback), with inputs that require grad too."""
    args, kw = dispatch_samples()[1]
    h, rest = args[0], args[1:]
    f = lambda x: torch.ops.moe.dispatch(x, *rest, **kw).sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match="moe.dispatch: torch.func transforms"):
        torch.func.grad(f)(h)
    with pytest.raises(NotImplementedError, match="moe.dispatch: torch.func transforms"):
        torch.func.vjp(f, h)
    with pytest.raises(NotImplementedError, match="moe.route: torch.func transforms"):
        torch.func.grad(lambda x: torch.ops.moe.route(x, 2)[0].sum())(torch.randn(3, 8))
    w13 = rest[0].detach().requires_grad_(True)
    out = torch.func.vmap(lambda x: torch.ops.moe.dispatch(x, w13, *rest[1:], **kw))(
        h[None].expand(2, -1, -1))
    torch.testing.assert_close(out[1], torch.ops.moe.dispatch(h, w13, *rest[1:], **kw))


@pytest.mark.parametrize("sample", [0, 2, 4, 5])
def test_opcheck_dispatch_requires_grad(reference_path, mode, sample):
    args, kw = dispatch_samples(requires_grad=True)[sample]
    torch.library.opcheck(torch.ops.moe.dispatch.default, args, kw)
    assert moe_ops.set_recompute(None) == (mode == "recompute")  # opcheck kept the mode


def test_opcheck_dispatch_requires_grad_interpreter(interpreter, mode):
    args, kw = dispatch_samples(requires_grad=True)[4]   # ids < 0
    torch.library.opcheck(torch.ops.moe.dispatch.default, args, kw)


# ---------------------------------------------------------------------------------------------
# 2. gradients against float64 oracles


@pytest.mark.parametrize("routing", ROUTINGS)
def test_gradients_reference_path(reference_path, mode, routing):
    _check_grads(mode, routing, torch.float32, fresh_seed())


@pytest.mark.parametrize("routing", ["negative", "mixed"])
def test_gradients_reference_path_float64(reference_path, mode, routing):
    seed = fresh_seed()
    args, g = _inputs(7, 9, 5, 4, 2, routing=routing, seed=seed, dtype=torch.float64,
                      requires_grad=True)
    go = torch.randn(7, 9, generator=g, dtype=torch.float64)
    _, grads, counts = _train_step(args, go)
    assert counts == OPS[mode], (seed, counts)
    ref = dispatch_backward_reference(go, *_double(args))
    for name, err in zip(NAMES, grad_errors(grads, ref, go, args)):
        assert err <= 1e-12, (seed, name, err)


@pytest.mark.parametrize("routing", ["negative", "mixed"])
def test_gradcheck_float64(reference_path, mode, routing):
    seed = fresh_seed()
    args, _ = _inputs(5, 6, 4, 3, 2, routing=routing, seed=seed, dtype=torch.float64,
                      requires_grad=True)
    diff = args[:4]
    with OpCounter() as c:
        out = torch.ops.moe.dispatch(*diff, args[4])
        out.sum().backward()
    assert c.counts == OPS[mode], (seed, c.counts)
    assert torch.autograd.gradcheck(lambda *a: torch.ops.moe.dispatch(*a, args[4]), diff), seed


@needs_interpreter
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gradients_interpreter(interpreter, mode, routing, dtype):
    _check_grads(mode, routing, dtype, fresh_seed())


@needs_interpreter
def test_gradients_interpreter_several_tiles(interpreter, mode):
    # rows per expert above one row block, H and I above one tile: multi-tile loops, one expert
    # empty, some slots dropped.
    _check_grads(mode, "mixed", torch.float32, fresh_seed(), T=20, H=40, I=37, E=3, K=2)


@needs_interpreter
def test_gradients_interpreter_int64_ids_strided_hidden(interpreter, mode):
    _check_grads(mode, "mixed", torch.float32, fresh_seed(), ids_dtype=torch.int64,
                 strided_hidden=True)


@needs_interpreter
def test_gradients_interpreter_bfloat16(interpreter, mode):
    # interpreted bf16 runs on float32 copies; the saved z is kept in bf16
    _check_grads(mode, "mixed", torch.bfloat16, fresh_seed())


# ---------------------------------------------------------------------------------------------
# 3. which forward and backward ops run


@pytest.mark.parametrize("path", PATHS)
def test_default_mode_saves_z(path, request):
    request.getfixturevalue(path)
    args, g = _inputs(6, 8, 6, 4, 2, routing="negative", seed=fresh_seed(), requires_grad=True)
    _, _, counts = _train_step(args, torch.randn(6, 8, generator=g))
    assert counts == OPS["saved"], counts


@pytest.mark.parametrize("path", PATHS)
def test_recompute_mode_recomputes(path, request):
    request.getfixturevalue(path)
    assert moe_ops.set_recompute(True) is False
    args, g = _inputs(6, 8, 6, 4, 2, routing="negative", seed=fresh_seed(), requires_grad=True)
    _, _, counts = _train_step(args, torch.randn(6, 8, generator=g))
    assert counts == OPS["recompute"], counts


@pytest.mark.parametrize("env,expected", [("1", "recompute"), ("0", "saved"), ("", "saved")])
def test_env_selects_mode(reference_path, monkeypatch, env, expected):
    monkeypatch.setenv("MOE_OPS_RECOMPUTE", env)
    moe_ops.set_recompute(None)
    args, g = _inputs(5, 8, 6, 4, 2, routing="uniform", seed=fresh_seed(), requires_grad=True)
    _, _, counts = _train_step(args, torch.randn(5, 8, generator=g))
    assert counts == OPS[expected], (env, counts)


def test_set_recompute_overrides_env(reference_path, monkeypatch):
    monkeypatch.setenv("MOE_OPS_RECOMPUTE", "1")
    moe_ops.set_recompute(False)
    args, g = _inputs(5, 8, 6, 4, 2, routing="uniform", seed=fresh_seed(), requires_grad=True)
    _, _, counts = _train_step(args, torch.randn(5, 8, generator=g))
    assert counts == OPS["saved"], counts
    moe_ops.set_recompute(None)    # back to the environment
    _, _, counts = _train_step(args, torch.randn(5, 8, generator=g))
    assert counts == OPS["recompute"], counts


def test_set_recompute_returns_previous(monkeypatch):
    assert moe_ops.set_recompute(True) is False    # default: save
    assert moe_ops.set_recompute(True) is True
    assert moe_ops.set_recompute(False) is True
    assert moe_ops.set_recompute(None) is False
    monkeypatch.setenv("MOE_OPS_RECOMPUTE", "1")
    assert moe_ops.set_recompute(False) is True    # None in effect: the environment's setting
    assert moe_ops.set_recompute(None) is False
    assert moe_ops.set_recompute(None) is True
    monkeypatch.setenv("MOE_OPS_RECOMPUTE", "0")
    assert moe_ops.set_recompute(None) is False


def test_mode_is_read_when_forward_runs(reference_path):
    seed = fresh_seed()
    args, g = _inputs(6, 8, 6, 4, 2, routing="negative", seed=seed, requires_grad=True)
    go = torch.randn(6, 8, generator=g)
    for fwd_mode, bwd_mode in (("saved", "recompute"), ("recompute", "saved")):
        moe_ops.set_recompute(fwd_mode == "recompute")
        with OpCounter() as c:
            out = torch.ops.moe.dispatch(*args)
            moe_ops.set_recompute(bwd_mode == "recompute")
            out.backward(go)
        assert c.counts == OPS[fwd_mode], (seed, fwd_mode, c.counts)


@pytest.mark.parametrize("path", PATHS)
def test_no_grad_runs_plain_dispatch(path, request, mode):
    request.getfixturevalue(path)
    seed = fresh_seed()
    args, _ = _inputs(6, 8, 6, 4, 2, routing="negative", seed=seed, requires_grad=True)
    with torch.no_grad(), OpCounter() as c:
        out = torch.ops.moe.dispatch(*args)
    assert c.counts == {"dispatch": 1}, (seed, c.counts)
    assert not out.requires_grad
    plain = [a.detach() for a in args[:4]] + [args[4]]
    with OpCounter() as c:
        out = torch.ops.moe.dispatch(*plain)
    assert c.counts == {"dispatch": 1}, (seed, c.counts)
    assert not out.requires_grad


@pytest.mark.parametrize("which", [0, 1, 2, 3])
def test_one_input_requiring_grad(reference_path, mode, which):
    """Any one differentiable input switches the training forward on; only it gets a gradient."""
    seed = fresh_seed()
    args, g = _inputs(7, 9, 5, 4, 2, routing="negative", seed=seed)
    args = list(args)
    args[which] = args[which].clone().requires_grad_(True)
    go = torch.randn(7, 9, generator=g)
    with OpCounter() as c:
        torch.ops.moe.dispatch(*args).backward(go)
    assert c.counts == OPS[mode], (seed, c.counts)
    for i, a in enumerate(args[:4]):
        assert (a.grad is not None) == (i == which), (seed, NAMES[i])
    ref = _oracle_grads(args, go)
    got = [a.grad if i == which else r for i, (a, r) in enumerate(zip(args, ref))]
    assert grad_errors(got, ref, go, args)[which] <= 1e-5, (seed, NAMES[which])


# ---------------------------------------------------------------------------------------------
# 4. the saved z


def _valid_slots(ids):
    return (ids >= 0).reshape(-1)


@pytest.mark.parametrize("routing", ["uniform", "negative", "empty_experts", "one_expert", "mixed"])
@pytest.mark.parametrize("path,dtype", [("reference_path", torch.float32),
                                        ("reference_path", torch.float64),
                                        ("interpreter", torch.float32),
                                        ("interpreter", torch.float16)])
def test_z_matches_oracle(path, dtype, routing, request, monkeypatch):
    request.getfixturevalue(path)
    seed = fresh_seed()
    T, H, I, E, K = 11, 14, 9, 5, 2
    args, _ = _inputs(T, H, I, E, K, routing=routing, seed=seed, dtype=dtype)
    _poison_empty(monkeypatch)
    out, z = torch.ops.moe.dispatch_train(*args)
    msg = f"seed={seed} path={path} dtype={dtype} routing={routing}"
    assert z.shape == (T * K, 2 * I) and z.dtype == dtype, (msg, z.shape, z.dtype)
    err = _z_err(z, args)
    assert err <= RTOL[dtype], (msg, err)
    if path == "reference_path":
        valid = _valid_slots(args[4])
        assert torch.equal(z[~valid], torch.zeros_like(z[~valid])), msg
    assert torch.equal(out, torch.ops.moe.dispatch(*args)), msg


@needs_interpreter
def test_z_interpreter_several_tiles(interpreter):
    seed = fresh_seed()
    args, _ = _inputs(20, 40, 37, 3, 2, routing="mixed", seed=seed)
    out, z = torch.ops.moe.dispatch_train(*args)
    assert _z_err(z, args) <= RTOL[torch.float32], seed
    assert torch.equal(out, torch.ops.moe.dispatch(*args)), seed


def test_z_is_what_the_backward_gets(reference_path):
    """The autograd forward hands dispatch_train's z to dispatch_backward_saved unchanged."""
    seed = fresh_seed()
    args, g = _inputs(6, 8, 6, 4, 2, routing="negative", seed=seed, requires_grad=True)
    seen = {}

    class Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            res = func(*args, **(kwargs or {}))
            if func is torch.ops.moe.dispatch_train.default:
                seen["z"] = res[1]
            elif func is torch.ops.moe.dispatch_backward_saved.default:
                seen["z_bwd"] = args[1]
            return res

    with Capture():
        torch.ops.moe.dispatch(*args).backward(torch.randn(6, 8, generator=g))
    assert torch.equal(seen["z_bwd"], seen["z"]), seed
    z_ref = dispatch_z_reference(*_double(args[:2]), args[4])
    assert rel_err(seen["z"], z_ref) <= RTOL[torch.float32], seed


# ---------------------------------------------------------------------------------------------
# 5. saved and recompute gradients agree (interpreted Triton kernels); poisoned buffers


def _grads_in_mode(mode, args, go):
    moe_ops.set_recompute(mode == "recompute")
    _, grads, counts = _train_step(args, go)
    assert counts == OPS[mode], counts
    return [gr.clone() for gr in grads]


@needs_interpreter
@pytest.mark.parametrize("routing", ["uniform", "negative", "empty_experts", "one_expert", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_saved_and_recompute_agree(interpreter, routing, dtype):
    seed = fresh_seed()
    args, g = _inputs(15, 19, 13, 6, 2, routing=routing, seed=seed, dtype=dtype,
                      requires_grad=True)
    go = torch.randn(15, 19, generator=g).to(dtype)
    saved = _grads_in_mode("saved", args, go)
    recomputed = _grads_in_mode("recompute", args, go)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    scales = [None, None, None, ds_scale(go, *args)]   # d topk_weights can cancel: grad_errors
    for name, a, b, scale in zip(NAMES, saved, recomputed, scales):
        assert a.shape == b.shape and a.dtype == b.dtype, (seed, name)
        if b.norm() == 0:
            assert torch.equal(a, b), (seed, name)
        else:
            err = rel_err(a, b, scale=scale)
            assert err <= tol, (seed, routing, name, err)


@needs_interpreter
@pytest.mark.parametrize("routing", ["negative", "mixed"])
def test_saved_backward_never_reads_dropped_rows_of_z(interpreter, monkeypatch, routing):
    """Rows of z for ids < 0 are unspecified: NaN there, and NaN in every torch.empty scratch
    buffer of the backward, changes nothing."""
    seed = fresh_seed()
    args, g = _inputs(13, 17, 11, 5, 2, routing=routing, seed=seed)
    go = torch.randn(13, 17, generator=g)
    _, z = torch.ops.moe.dispatch_train(*args)
    clean = torch.ops.moe.dispatch_backward_saved(go, z, *args)
    dropped = ~_valid_slots(args[4])
    assert dropped.any(), seed
    z_nan = z.clone()
    z_nan[dropped] = float("nan")
    _poison_empty(monkeypatch)
    poisoned = torch.ops.moe.dispatch_backward_saved(go, z_nan, *args)
    ref = dispatch_backward_reference(go.double(), *_double(args))
    for name, a, b in zip(NAMES, poisoned, clean):
        assert torch.equal(a, b), (seed, name)
    for name, err in zip(NAMES, grad_errors(poisoned, ref, go, args)):
        assert err <= 1e-5, (seed, name, err)


@needs_interpreter
def test_training_step_with_poisoned_scratch(interpreter, monkeypatch, mode):
    """A whole forward + backward with NaN in every torch.empty float buffer: nothing unwritten
    is read (z rows of dropped slots included) and the gradients are right."""
    seed = fresh_seed()
    args, g = _inputs(13, 17, 11, 6, 2, routing="mixed", seed=seed, requires_grad=True)
    go = torch.randn(13, 17, generator=g)
    _poison_empty(monkeypatch)
    out, grads, counts = _train_step(args, go)
    assert counts == OPS[mode], (seed, counts)
    assert rel_err(out, _dense_float64(*_double(args))) <= RTOL[torch.float32], seed
    for name, err in zip(NAMES, grad_errors(grads, _oracle_grads(args, go), go, args)):
        assert err <= 1e-5, (seed, name, err)
    _assert_exact_zeros(args, grads, f"seed={seed}")


# ---------------------------------------------------------------------------------------------
# 6. T = 0


@pytest.mark.parametrize("path", PATHS)
def test_T0_backward(path, request, monkeypatch, mode):
    request.getfixturevalue(path)
    args, _ = _inputs(0, 8, 6, 4, 2, routing="uniform", seed=0, requires_grad=True)
    _poison_empty(monkeypatch)
    out, grads, counts = _train_step(args, torch.zeros(0, 8))
    assert counts == OPS[mode], counts
    assert out.shape == (0, 8)
    for name, a, gr in zip(NAMES, args[:4], grads):
        assert gr is not None and gr.shape == a.shape and gr.dtype == a.dtype, name
        assert torch.equal(gr, torch.zeros_like(a)), name   # w13 / w2: zeros, not garbage
    if mode == "saved":
        _, z = torch.ops.moe.dispatch_train(*[a.detach() for a in args[:4]], args[4])
        assert z.shape == (0, 12), z.shape


# ---------------------------------------------------------------------------------------------
# 7. the Triton backward's launcher directly


@needs_interpreter
@pytest.mark.parametrize("saved", [True, False])
def test_backward_launcher_several_tiles(interpreter, monkeypatch, saved):
    """dispatch_backward_triton (dA GEMM + elementwise SwiGLU-gradient pass, weight gradients,
    dx) matches float64 over several row blocks and I chunks, with NaN-poisoned scratch."""
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 21, 40, 37, 3, 2
    args, g = _inputs(T, H, I, E, K, routing="mixed", seed=seed)
    go = torch.randn(T, H, generator=g)
    cfg = dispatch_config(T, E, K, H, I, "cpu", torch.float32)
    bc = backward_config(cfg, "cpu", torch.float32)
    _, z = dispatch_triton(*args, save_z=True)
    _poison_empty(monkeypatch)
    got = dispatch_backward_triton(go, *args, z=z if saved else None, config=cfg, bwd_config=bc)
    ref = dispatch_backward_reference(go.double(), *_double(args))
    for name, a, err in zip(NAMES, got, grad_errors(got, ref, go, args)):
        assert not a.isnan().any(), (seed, name)
        assert err <= 1e-5, (seed, name, err)


@needs_interpreter
@pytest.mark.parametrize("routing", ["mixed", "skewed"])
def test_backward_da_in_input_dtype(interpreter, monkeypatch, routing):
    """BackwardConfig.da_half: the dA GEMM writes dO W2_e in the input dtype (float16 here)
    instead of float32, and the elementwise pass reads it back as float32: the gradients stay
    within the float16 bound of float64, with NaN-poisoned scratch."""
    import dataclasses

    import moe_ops.launch.dispatch_backward as db
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 21, 40, 37, 3, 2
    args, g = _inputs(T, H, I, E, K, routing=routing, seed=seed, dtype=torch.float16)
    go = torch.randn(T, H, generator=g).to(torch.float16)
    cfg = dispatch_config(T, E, K, H, I, "cpu", torch.float16)
    bc = dataclasses.replace(backward_config(cfg, "cpu", torch.float16), da_half=True)
    _, z = dispatch_triton(*args, save_z=True)
    _poison_empty(monkeypatch)
    outs = []   # the row GEMMs' outputs: dA, then the per-slot dx
    run = db.rows_gemm_triton
    monkeypatch.setattr(db, "rows_gemm_triton", lambda *a, **k: (outs.append(a[3].dtype), run(*a, **k))[1])
    got = db.dispatch_backward_triton(go, *args, z=z, config=cfg, bwd_config=bc)
    assert outs[0] == torch.float16, (seed, outs)
    ref = dispatch_backward_reference(go.double(), *_double(args))
    for name, a, err in zip(NAMES, got, grad_errors(got, ref, go, args)):
        assert not a.isnan().any(), (seed, name)
        assert err <= GRAD_TOL[torch.float16], (seed, name, err)


@needs_interpreter
@pytest.mark.parametrize("T", [1, 13])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_dispatch_train_z_zero_for_slots_without_an_expert(interpreter, monkeypatch, T, ids_dtype):
    """moe.dispatch_train's z on the Triton path: rows of ids < 0 and >= E are zero (as the
    reference's), not what the allocator left there (gate_up never writes them), so the op is
    bitwise reproducible and passes opcheck with dropped slots; other rows match the float64
    reference. NaN-filled allocations make an unwritten row show; ids in a strided view."""
    seed = fresh_seed()
    H, I, E, K = 24, 13, 5, 3
    args, g = _inputs(T, H, I, E, K, routing="uniform", seed=seed, ids_dtype=ids_dtype)
    h, w13, w2, w, ids = args
    wide = torch.full((T, 2 * K), 7, dtype=ids_dtype)
    wide[:, ::2] = ids
    ids = wide[:, ::2]                       # non-contiguous ids
    ids[0, 1] = -1
    ids[-1, 0] = E if T > 1 else -(2 ** 31 if ids_dtype == torch.int32 else 2 ** 40)
    if T > 1:
        ids[T // 2, 2] = -7
    args = (h, w13, w2, w, ids)
    _poison_empty(monkeypatch)
    z1 = torch.ops.moe.dispatch_train(*args)[1]
    z2 = torch.ops.moe.dispatch_train(*args)[1]
    assert torch.equal(z1, z2), seed
    flat = ids.reshape(-1)
    dropped = (flat < 0) | (flat >= E)
    assert dropped.sum() >= 2
    assert torch.equal(z1[dropped], torch.zeros_like(z1[dropped])), seed
    ref = dispatch_z_reference(*_double(args[:2]), ids)
    assert rel_err(z1[~dropped], ref[~dropped]) <= 1e-5, seed
    torch.library.opcheck(torch.ops.moe.dispatch_train.default, args)


@needs_interpreter
@pytest.mark.parametrize("pair,a_tma", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("H,I", [(32, 48), (64, 32), (17, 11), (64, 11)])
def test_tma_weight_tiles(interpreter, monkeypatch, H, I, pair, a_tma):
    """DispatchConfig.tma / BackwardConfig.tma (weight tiles through tensor descriptors, zero-
    filled past the edges; gate tiles past I read up rows that are never stored),
    DispatchConfig.tma_pair (gate and up tiles in one copy of a [E, 2, I, H] view, each
    zero-filled past I) and tma_a (the row GEMMs' A tiles, unmasked: NaN-poisoned padding rows
    must not reach a stored row) match float64 in the forward (output and saved z) and the
    backward; H=17 and I=11 have rows TMA cannot address and fall back."""
    import dataclasses

    from moe_ops.launch.dispatch import dispatch_triton, weight_desc
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    T, E, K = 21, 3, 2
    args, g = _inputs(T, H, I, E, K, routing="mixed", seed=seed)
    assert (weight_desc(args[1], [1, 16, 16]) is None) == (H % 4 != 0)
    go = torch.randn(T, H, generator=g)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float32), tma=True,
                              tma_pair=pair, tma_a=a_tma)
    bc = dataclasses.replace(backward_config(cfg, "cpu", torch.float32), tma=True, tma_a=a_tma)
    _poison_empty(monkeypatch)
    out, z = dispatch_triton(*args, config=cfg, save_z=True)
    assert rel_err(out, _dense_float64(*_double(args))) <= 1e-5, seed
    assert _z_err(z, args) <= 1e-5, seed
    got = dispatch_backward_triton(go, *args, z=z, config=cfg, bwd_config=bc)
    ref = dispatch_backward_reference(go.double(), *_double(args))
    for name, err in zip(NAMES, grad_errors(got, ref, go, args)):
        assert err <= 1e-5, (seed, name, err)


@needs_interpreter
@pytest.mark.parametrize("routing", ["uniform", "negative"])
@pytest.mark.parametrize("K", [1, 2, 4])
def test_direct_rows_one_token(interpreter, monkeypatch, routing, K):
    """DispatchConfig.direct (slot s is row block s, no alignment launch): output and saved z
    match float64 with NaN-poisoned scratch, ids < 0 included; at T = 1 (K distinct experts)
    and at T = 3 (slots sharing experts: 3*K slots over 5 experts)."""
    import dataclasses

    import moe_ops.launch.dispatch as launch
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    for T in (1, 3):
        args, g = _inputs(T, 24, 40, 5, K, routing=routing, seed=seed)
        cfg = dataclasses.replace(dispatch_config(T, 5, K, 24, 40, "cpu", torch.float32),
                                  direct=True)
        _poison_empty(monkeypatch)
        monkeypatch.setattr(launch, "align_triton", None)   # the direct path never aligns
        out, z = dispatch_triton(*args, config=cfg, save_z=True)
        assert rel_err(out, _dense_float64(*_double(args))) <= 1e-5, (seed, T)
        assert _z_err(z, args) <= 1e-5, (seed, T)
        monkeypatch.undo()
    # non-contiguous ids at T > 1 take the aligned path (same result)
    args, g = _inputs(3, 24, 40, 5, K, routing=routing, seed=seed)
    ids_t = args[4].t().contiguous().t()
    assert not ids_t.is_contiguous() or K == 1
    args = (*args[:4], ids_t)
    cfg = dataclasses.replace(dispatch_config(3, 5, K, 24, 40, "cpu", torch.float32), direct=True)
    out = dispatch_triton(*args, config=cfg)
    assert rel_err(out, _dense_float64(*_double(args))) <= 1e-5, seed


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_half_tail_tiles(interpreter, monkeypatch, dtype):
    """DispatchConfig.half_tail: a row block whose valid rows all fit its first half runs a
    half-height tile. Counts per expert chosen so that both kinds of block occur: 40 rows (a full
    block of 32, then a tail of 8: half), 20 (one block, more than half: full), 16 (exactly half:
    half), 0, and ids < 0. Output, saved z and the backward (recompute mode: gate_up again, and
    the dA and dx GEMMs with BackwardConfig.half_tail) match float64 and the full-tile path
    (bitwise where numpy's products allow it: conftest.numpy_matmul_rows_stable), with
    NaN-poisoned scratch; also with the row GEMMs' A tiles through descriptors
    (tma_a: half-height tiles take a half-height descriptor; padding rows read unmasked)."""
    import dataclasses

    from moe_ops.launch.alignment import align_triton
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    T, H, I, E, K = 40, 24, 40, 5, 2
    args, _ = _inputs(T, H, I, E, K, routing="uniform", seed=seed, dtype=dtype)
    counts = {0: 40, 1: 20, 2: 16, 4: 3}   # expert 3 empty, 1 slot dropped
    flat = torch.cat([torch.full((n,), e) for e, n in counts.items()] + [torch.tensor([-1])])
    ids = flat[torch.randperm(T * K, generator=g)].view(T, K).to(torch.int32)
    args = (*args[:4], ids)
    base = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", dtype), block_m=32)
    al = align_triton(ids, E, 32)
    sorted_slots = al.sorted_slots[: int(al.num_rows)].view(-1, 32)
    half = (sorted_slots[:, 16] >= T * K).tolist()
    assert True in half and False in half, half
    go = torch.randn(T, H, generator=g).to(dtype)
    outs = {}
    for ht in (False, True, "tma_a"):
        cfg = dataclasses.replace(base, half_tail=bool(ht), tma_a=ht == "tma_a")
        _poison_empty(monkeypatch)
        out, z = dispatch_triton(*args, config=cfg, save_z=True)
        bc = dataclasses.replace(backward_config(cfg, "cpu", dtype), half_tail=bool(ht),
                                 tma_a=cfg.tma_a)
        grads = dispatch_backward_triton(go, *args, z=None, config=cfg, bwd_config=bc)
        monkeypatch.undo()
        outs[ht] = (out, z, grads)
        tol = RTOL[dtype]
        assert rel_err(out, _dense_float64(*_double(args))) <= tol, (seed, ht)
        assert _z_err(z, args) <= tol, (seed, ht)
        ref = dispatch_backward_reference(go.double(), *_double(args))
        for name, err in zip(NAMES, grad_errors(grads, ref, go, args)):
            assert err <= GRAD_TOL[dtype], (seed, ht, name, err)
    for ht in (True, "tma_a"):
        assert_equal_across_tile_heights(outs[ht][0], outs[False][0], (seed, ht), dtype)
        for a, b in zip(outs[ht][2], outs[False][2]):
            assert_equal_across_tile_heights(a, b, (seed, ht), dtype)


def _interpreted_int(v) -> int:
    """A scalar seen inside an interpreted kernel (a tensor wrapper around a numpy handle, or a
    plain int) as a Python int."""
    return int(v.handle.data.item()) if hasattr(v, "handle") else int(v)


@needs_interpreter
def test_half_tail_decides_on_the_middle_row(interpreter, monkeypatch):
    """half_tail's test reads row block_m/2 of a block: the half-height tile runs exactly where
    a block's valid rows fit its first half. Tail blocks of 17 valid rows of 32 (experts 0 and
    1; the latter after a full block) run the full tile (a test on a later row would run the
    half tile and drop row 16: its slot's output, z and dA/dx rows); 16 (expert 3) runs the
    half tile. The tile heights are recorded per row block in every gate+up and down-kernel
    launch (interpreter: the kernels' block functions are looked up at call time), forward and
    backward (recompute, half tiles in dA and dx); NaN-poisoned scratch."""
    import dataclasses

    import moe_ops.kernels.expert_gemm as kg
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    T, H, I, E, K = 42, 16, 16, 4, 2
    args, _ = _inputs(T, H, I, E, K, routing="uniform", seed=seed)
    counts = {0: 17, 1: 49, 3: 16, -1: 2}   # expert 2 empty, 2 slots dropped
    flat = torch.cat([torch.full((n,), e) for e, n in counts.items()])
    ids = flat[torch.randperm(T * K, generator=g)].view(T, K).to(torch.int32)
    args = (*args[:4], ids)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float32), block_m=32,
                              half_tail=True, direct=False)
    bc = dataclasses.replace(backward_config(cfg, "cpu", torch.float32), half_tail=True)
    heights = {"gate_up_block": set(), "down_block": set()}
    # (TILE_M's position: before the variant arguments, 12 in gate_up_block, 4 in down_block)
    for name, pid_arg, tile_arg in (("gate_up_block", 5, -13), ("down_block", 6, -7)):
        def block(*a, _run=getattr(kg, name), _seen=heights[name], _pid=pid_arg, _tile=tile_arg):
            pid_m = a[_pid]
            _seen.add((_interpreted_int(pid_m), int(a[_tile])))
            return _run(*a)
        monkeypatch.setattr(kg, name, block)
    go = torch.randn(T, H, generator=g)
    _poison_empty(monkeypatch)
    out, z = dispatch_triton(*args, config=cfg, save_z=True)
    grads = dispatch_backward_triton(go, *args, z=None, config=cfg, bwd_config=bc)
    monkeypatch.undo()
    expected = {(0, 32), (1, 32), (2, 32), (3, 16)}   # blocks: e0 17, e1 32 and 17, e3 16
    assert heights == {"gate_up_block": expected, "down_block": expected}, (seed, heights)
    assert rel_err(out, _dense_float64(*_double(args))) <= RTOL[torch.float32], seed
    assert _z_err(z, args) <= RTOL[torch.float32], seed
    ref = dispatch_backward_reference(go.double(), *_double(args))
    for name, err in zip(NAMES, grad_errors(grads, ref, go, args)):
        assert err <= GRAD_TOL[torch.float32], (seed, name, err)


@needs_interpreter
@pytest.mark.parametrize("routing", ["uniform", "negative", "mixed"])
@pytest.mark.parametrize("K,H,block_n", [(1, 24, 16), (2, 70, 32), (8, 33, 16), (5, 16, 16)])
def test_combine_last_one_token(interpreter, monkeypatch, routing, K, H, block_n):
    """DispatchConfig.combine_last at T == 1: the last down program of each H tile sums the K
    rows (counters zeroed by gate_up). Bitwise equal to the separate combine kernel and within
    float32 rounding of float64, with NaN-poisoned scratch and outputs, ids < 0 included, H
    tiles 1 to 5; the counters never depend on an earlier call (two calls in a row)."""
    import dataclasses

    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    E, I = 9, 37
    args, _ = _inputs(1, H, I, E, K, routing=routing, seed=seed)
    base = dataclasses.replace(dispatch_config(1, E, K, H, I, "cpu", torch.float32), direct=True,
                               block_n2=block_n)
    ref = _dense_float64(*_double(args))
    got = {}
    for cl in (False, True, True):
        _poison_empty(monkeypatch)
        out = torch.full((1, H), float("nan"))
        dispatch_triton(*args, config=dataclasses.replace(base, combine_last=cl), out=out)
        monkeypatch.undo()
        assert rel_err(out, ref) <= 1e-5, (seed, cl)
        if cl in got:
            assert torch.equal(out, got[cl]), seed
        got[cl] = out
    assert torch.equal(got[True], got[False]), seed


@needs_interpreter
@pytest.mark.parametrize("routing", ["uniform", "negative"])
@pytest.mark.parametrize("K,H,I,block_n,block_k,dtype", [   # (dtypes alternate: CI time)
    (1, 24, 40, 16, 32, torch.float32), (2, 17, 11, 16, 16, torch.float16),
    (4, 33, 70, 32, 32, torch.float32), (16, 40, 72, 16, 64, torch.float16),
    (16, 40, 72, 16, 64, torch.float32), (40, 9, 5, 16, 16, torch.float16)])
def test_fused_combine_one_token(interpreter, monkeypatch, routing, K, H, I, block_n, block_k,
                                 dtype):
    """DispatchConfig.fuse_combine at T == 1 (the down GEMM and the combine in one launch, one
    pipelined loop over (slot, I step)): output and saved z match float64 with NaN-poisoned
    scratch, ids < 0 included, odd H and I, several H tiles and I steps, K = block_m = 16 (every
    accumulator row in use) and K = 40 > block_m (falls back to the separate combine); the
    backward consumes the z it saves. At T > 1 the setting is ignored."""
    import dataclasses

    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    import moe_ops.launch.dispatch as launch

    seed = fresh_seed()
    E = max(5, K)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for T, tma in ((1, False), (1, True), (3, False)):
        args, g = _inputs(T, H, I, E, K, routing=routing, seed=seed, dtype=dtype)
        cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", dtype), direct=True,
                                  fuse_combine=True, block_n2=block_n, block_k2=block_k, tma=tma)
        assert cfg.block_m == 16
        _poison_empty(monkeypatch)
        combines = []
        real_combine = launch.combine_triton
        monkeypatch.setattr(launch, "combine_triton",
                            lambda *a, **kw: combines.append(1) or real_combine(*a, **kw))
        out, z = dispatch_triton(*args, config=cfg, save_z=True)
        assert len(combines) == (0 if T == 1 and K <= 16 else 1), (T, K)   # the path taken
        assert not out.isnan().any(), (seed, T)
        assert rel_err(out, _dense_float64(*_double(args))) <= tol, (seed, T)
        assert _z_err(z, args) <= tol, (seed, T)
        if dtype == torch.float32 and K <= 4:
            go = torch.randn(T, H, generator=g)
            got = dispatch_backward_triton(go, *args, z=z, config=cfg,
                                           bwd_config=backward_config(cfg, "cpu", dtype))
            ref = dispatch_backward_reference(go.double(), *_double(args))
            for name, err in zip(NAMES, grad_errors(got, ref, go, args)):
                assert err <= 1e-5, (seed, T, name, err)
        monkeypatch.undo()


@needs_interpreter
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("path", ["fused", "fused tma", "combine last", "combine kernel"])
def test_one_token_unused_expert_weights_never_reach_the_output(interpreter, path, bad):
    """T == 1 on each of its paths, with a dropped id (< 0 and >= E) and non-finite weights
    (w13 and w2) in an expert no slot uses (expert 0, which a dropped id was mapped to for an
    in-bounds read): an id that is dropped contributes nothing, so the output is finite and
    matches float64, and with every id dropped the output row is zeros (the fused kernel once
    multiplied expert 0's tile by zero rows: 0 * NaN = NaN in every accumulator row)."""
    import dataclasses

    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.reference.dispatch import dispatch_reference
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    H, I, E, K = 24, 40, 6, 4
    args, _ = _inputs(1, H, I, E, K, routing="uniform", seed=seed)
    h, w13, w2, w, _ = args
    w13, w2 = w13.clone(), w2.clone()
    w13[0].fill_(bad)
    w2[0].fill_(bad)
    cfg = dataclasses.replace(dispatch_config(1, E, K, H, I, "cpu", torch.float32), direct=True,
                              fuse_combine=path.startswith("fused"), tma="tma" in path,
                              combine_last=path == "combine last")
    for ids in ([[3, -1, 5, E]], [[-1, E, -7, E + 3]]):
        ids = torch.tensor(ids, dtype=torch.int32)
        out = dispatch_triton(h, w13, w2, w, ids, config=cfg)
        ref = dispatch_reference(h.double(), w13.double(), w2.double(), w.double(), ids)
        assert ref.isfinite().all()
        assert out.isfinite().all(), (seed, ids)
        assert rel_err(out, ref) <= 1e-5 or torch.equal(out, torch.zeros_like(out)), (seed, ids)
        if (ids < 0).logical_or(ids >= E).all():
            assert torch.equal(out, torch.zeros_like(out)), seed


# int64 ids out of range that wrap to a valid expert when narrowed to int32
WRAPPING_IDS = (-(2**32), -(2**32) + 2, 2**32 + 1, -(2**40) + 1)


@needs_interpreter
def test_int64_ids_wrapping_in_int32_dropped(interpreter, mode):
    """int64 ids < 0 or >= E whose low 32 bits name a valid expert (-2^32 -> 0, 2^32 + 1 -> 1)
    are dropped like -1: the forward and every gradient in both backward modes are bitwise
    those of the same call with -1 there (the alignment kernels once narrowed the ids before
    testing them, so the recompute backward routed such slots to an expert)."""
    seed = fresh_seed()
    T, H, I, E, K = 6, 16, 8, 4, 2
    args, g = _inputs(T, H, I, E, K, routing="uniform", seed=seed, requires_grad=True,
                      ids_dtype=torch.int64)
    ids = args[4].clone()
    for n, v in enumerate(WRAPPING_IDS):
        ids[n, n % K] = v
    dropped = ids.masked_fill((ids < 0) | (ids >= E), -1)
    go = torch.randn(T, H, generator=g)
    out, grads, _ = _train_step(args[:4] + (ids,), go)
    out_ref, grads_ref, _ = _train_step(args[:4] + (dropped,), go)
    assert torch.equal(out, out_ref), seed
    for name, a, b in zip(NAMES, grads, grads_ref):
        assert torch.equal(a, b), (seed, mode, name)


@needs_interpreter
@pytest.mark.parametrize("fused", [False, True])
def test_one_token_int64_wrapping_ids_dropped(interpreter, fused):
    """At T == 1 (direct rows; with and without the folded combine) an int64 id whose low 32
    bits name a valid expert is dropped (the folded down+combine kernel once narrowed first and
    read a never-written activation row)."""
    import dataclasses

    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 1, 32, 24, 5, 4
    (h, w13, w2, w, ids), _ = _inputs(T, H, I, E, K, routing="uniform", seed=seed,
                                      ids_dtype=torch.int64)
    bad = ids.clone()
    bad[0, 0] = -(2**32) + 1
    bad[0, 2] = 2**32 + 3
    dropped = bad.masked_fill((bad < 0) | (bad >= E), -1)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float32), direct=True,
                              fuse_combine=fused)
    out = dispatch_triton(h, w13, w2, w, bad, config=cfg)
    assert rel_err(out, _dense_float64(*_double((h, w13, w2, w, dropped)))) <= 1e-5, seed


@needs_interpreter
@pytest.mark.parametrize("fused,tma", [(False, False), (True, False), (True, True)])
def test_one_token_out_of_range_ids_dropped(interpreter, monkeypatch, fused, tma):
    """At T == 1 (direct rows, and the folded combine) an id >= E is dropped like an id < 0:
    no out-of-bounds weight read, the other slots unchanged."""
    import dataclasses

    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 1, 32, 24, 5, 4
    (h, w13, w2, w, ids), _ = _inputs(T, H, I, E, K, routing="uniform", seed=seed)
    bad = ids.clone()
    bad[0, 1] = E
    bad[0, 3] = 1000
    dropped = bad.masked_fill(bad >= E, -1)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float32), direct=True,
                              fuse_combine=fused, tma=tma)
    _poison_empty(monkeypatch)
    out = dispatch_triton(h, w13, w2, w, bad, config=cfg)
    assert rel_err(out, _dense_float64(*_double((h, w13, w2, w, dropped)))) <= 1e-5, seed


# ---------------------------------------------------------------------------------------------
# 6. the persistent weight-gradient kernels (interpreted) against the per-tile kernel


# The per-tile kernel's configuration and the persistent kernel's, per persistent kernel: the
# plain one (the heuristic's 32-row tiles), the warp-specialised one (16-row tiles, so that the
# output rows H = 48 and 2I = 80 are multiples of them).
PERSISTENT_WG = {
    "persistent": ("_weight_grad_persistent", dict(wg_persistent=False), dict(wg_persistent=True)),
    # several bookkeeping chunks per program; the tile stored in 2 and 4 column slices
    "small chunks": ("_weight_grad_persistent", dict(wg_persistent=False),
                     dict(wg_persistent=True, wg_chunk=4)),
    "split": ("_weight_grad_persistent", dict(wg_persistent=False),
              dict(wg_persistent=True, wg_chunk=2, wg_split=2)),
    "split4": ("_weight_grad_persistent", dict(wg_persistent=False, wg_n=64),
               dict(wg_persistent=True, wg_n=64, wg_chunk=8, wg_split=4)),
    "ws": ("_weight_grad_ws", dict(wg_m=16), dict(wg_m=16, wg_ws=True)),
    # largest experts first, snaking rounds; with 2-tile chunks, several chunks per program
    "lpt": ("_weight_grad_persistent", dict(wg_persistent=False),
            dict(wg_persistent=True, wg_lpt=True, wg_chunk=2)),
}


@needs_interpreter
@pytest.mark.parametrize("kernel", list(PERSISTENT_WG))
@pytest.mark.parametrize("routing", ["uniform", "mixed", "one_expert", "skewed"])
def test_persistent_weight_grads_match_per_tile(interpreter, routing, kernel):
    """Three programs of a persistent weight-gradient kernel (plain, or warp-specialised: the
    same arithmetic in the interpreter, no warp groups) walk all output tiles of both weight
    gradients (several tiles per expert, several experts per program, an empty expert where the
    routing leaves one): bitwise the per-tile kernel's sums (same rows, same order, same tile),
    and near float64. (The warp-specialised launcher's fallbacks: the next test.)"""
    import dataclasses

    import moe_ops.launch.dispatch_backward as db
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    launcher, per_tile_fields, fields = PERSISTENT_WG[kernel]
    seed = fresh_seed()
    T, H, I, E, K = 24, 48, 40, 5, 2
    args, g = _inputs(T, H, I, E, K, routing=routing, seed=seed, dtype=torch.float16)
    go = torch.randn(T, H, generator=g).to(torch.float16)
    cfg = dispatch_config(T, E, K, H, I, "cpu", torch.float16)
    bc = backward_config(cfg, "cpu", torch.float16)
    calls = []
    run = getattr(db, launcher)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(db, launcher, lambda *a: (calls.append(a[2].shape), run(*a))[1])
        per_tile = db.dispatch_backward_triton(
            go, *args, config=cfg, bwd_config=dataclasses.replace(bc, **per_tile_fields))
        assert calls == []
        persistent = db.dispatch_backward_triton(
            go, *args, config=cfg, bwd_config=dataclasses.replace(bc, **fields))
    assert calls == [(E, H, I), (E, 2 * I, H)], (seed, calls)   # dW2, then dW13
    ref = dispatch_backward_reference(go.double(), *_double(args))
    errs = grad_errors(persistent, ref, go, args)
    for name, a, b, r, err in zip(NAMES, persistent, per_tile, ref, errs):
        assert torch.equal(a, b), (seed, name)
        if r.norm() == 0:
            assert torch.equal(a, torch.zeros_like(a)), (seed, name)
        else:
            assert err <= GRAD_TOL[torch.float16], (seed, name, err)


@needs_interpreter
@pytest.mark.parametrize("routing", ["skewed", "one_expert", "empty_experts", "negative",
                                     "balanced"])
def test_persistent_weight_grads_lpt_order(interpreter, routing, monkeypatch):
    """The LPT schedule's expert order, as each program computes it: where the largest expert
    has more than twice the mean rows, experts by valid rows, largest first, ties by expert
    index (empty experts last); else the experts' own order; in every program's row of the
    scratch. The gradients are bitwise those of the fixed schedule (each tile is still summed
    whole, in row order, by one program)."""
    import dataclasses

    import moe_ops.launch.dispatch_backward as db
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 40, 32, 24, 12, 3
    args, g = _inputs(T, H, I, E, K, routing="uniform" if routing == "balanced" else routing,
                      seed=seed, dtype=torch.float16)
    if routing == "balanced":   # every expert 10 rows: the experts' own order
        args = (*args[:4], (torch.arange(T * K) % E).reshape(T, K).to(args[4].dtype))
    go = torch.randn(T, H, generator=g).to(torch.float16)
    cfg = dispatch_config(T, E, K, H, I, "cpu", torch.float16)
    bc = dataclasses.replace(backward_config(cfg, "cpu", torch.float16), wg_persistent=True,
                             wg_chunk=2)
    orders = []

    def record(kernel, grid, args, kwargs):
        if kwargs.get("LPT"):
            orders.append(kwargs["order_ptr"].clone())

    spy_kernel_launches(monkeypatch, db, record)
    fixed = db.dispatch_backward_triton(go, *args, config=cfg, bwd_config=bc)
    assert orders == []
    lpt = db.dispatch_backward_triton(go, *args, config=cfg,
                                      bwd_config=dataclasses.replace(bc, wg_lpt=True))
    assert len(orders) == 2, (seed, len(orders))   # dW2, dW13
    counts, skewed = expert_counts_skewed(args[4], E, db.LPT_MIN_SKEW)
    if routing in ("skewed", "one_expert"):
        assert skewed, (seed, counts)   # both branches of the kernel's test are covered
    if routing == "balanced":
        assert not skewed, (seed, counts)
    expected = sorted(range(E), key=lambda e: (-counts[e], e)) if skewed else list(range(E))
    for order in orders:
        assert order.shape == (3, 16), order.shape   # 3 interpreted programs, BLOCK_E = 16
        for row in order:
            assert row[:E].tolist() == expected, (seed, routing, row.tolist(), counts)
    for name, a, b in zip(NAMES, lpt, fixed):
        assert torch.equal(a, b), (seed, name)


@needs_interpreter
def test_persistent_weight_grads_many_experts(interpreter, monkeypatch):
    """More experts (1100) than the persistent kernel once allowed (one vector lane per expert,
    at most 1024): the chunked kernel has no expert limit, runs, and is bitwise the per-tile
    kernel's on NaN-poisoned scratch, most experts empty. (The per-tile kernel runs on the
    experts hit alone, renumbered in order: each expert's rows, their order and their place in
    a tile are the same, so are its sums; interpreting 1100 per-tile programs took ~45 s.)"""
    import dataclasses

    import moe_ops.launch.dispatch_backward as db
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 6, 16, 16, 1100, 2
    args, g = _inputs(T, H, I, E, K, routing="uniform", seed=seed, dtype=torch.float16)
    h, w13, w2, w, ids = args
    go = torch.randn(T, H, generator=g).to(torch.float16)
    cfg = dispatch_config(T, E, K, H, I, "cpu", torch.float16)
    bc = backward_config(cfg, "cpu", torch.float16)
    hit = torch.unique(ids[ids >= 0])
    assert 1 <= len(hit) < E // 2, (seed, hit)
    renumber = torch.full((E,), -1, dtype=ids.dtype)
    renumber[hit] = torch.arange(len(hit), dtype=ids.dtype)
    ids_hit = torch.where(ids >= 0, renumber[ids.clamp_min(0).long()], ids)
    calls = []
    run = db._weight_grad_persistent
    monkeypatch.setattr(db, "_weight_grad_persistent",
                        lambda *a: (calls.append(a[2].shape), run(*a))[1])
    _poison_empty(monkeypatch)
    per_tile = db.dispatch_backward_triton(go, h, w13[hit], w2[hit], w, ids_hit, config=cfg,
                                           bwd_config=bc)
    persistent = db.dispatch_backward_triton(
        go, *args, config=cfg, bwd_config=dataclasses.replace(bc, wg_persistent=True))
    assert calls == [(E, H, I), (E, 2 * I, H)], (seed, calls)
    missed = torch.ones(E, dtype=torch.bool)
    missed[hit] = False
    for name, a, b in zip(NAMES, persistent, per_tile):
        if name in ("w13", "w2"):
            assert torch.equal(a[missed], torch.zeros_like(a[missed])), (seed, name)
            a = a[hit]
        assert torch.equal(a, b), (seed, name)
    assert persistent[1][hit].abs().sum() > 0, seed   # the experts hit


@needs_interpreter
@pytest.mark.parametrize("field,value", [("wg_chunk", 3), ("wg_chunk", 64), ("wg_chunk", 0),
                                         ("wg_split", 3), ("wg_per_sm", 0)])
def test_persistent_weight_grads_bad_config(interpreter, field, value):
    """A persistent weight-gradient config the kernel cannot run is a ValueError naming the
    field, not a compile error or a silently wrong store."""
    import dataclasses

    import moe_ops.launch.dispatch_backward as db
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    T, H, I, E, K = 4, 16, 16, 3, 2
    args, g = _inputs(T, H, I, E, K, routing="uniform", seed=0, dtype=torch.float16)
    go = torch.randn(T, H, generator=g).to(torch.float16)
    cfg = dispatch_config(T, E, K, H, I, "cpu", torch.float16)
    bc = dataclasses.replace(backward_config(cfg, "cpu", torch.float16), wg_persistent=True,
                             **{field: value})
    with pytest.raises(ValueError, match=field):
        db.dispatch_backward_triton(go, *args, config=cfg, bwd_config=bc)


# ---------------------------------------------------------------------------------------------
# 7. the warp-specialised kernels' launchers (interpreted)


@needs_interpreter
def test_weight_grad_ws_falls_back(interpreter, monkeypatch):
    """The warp-specialised weight-gradient launcher declines what its kernel cannot do, and the
    gradients are still right: output rows not a multiple of the tile's (odd H), float32, or
    more than 4 stages (a Triton 3.6 miscompile on the H200); its kernel never runs then."""
    import dataclasses

    import moe_ops.launch.dispatch_backward as db
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    ran = []
    monkeypatch.setattr(db, "weight_grad_ws_kernel", _Spy(db.weight_grad_ws_kernel, ran))
    for (H, I, dtype, stages) in ((37, 24, torch.float16, 3), (48, 40, torch.float32, 3),
                                  (48, 40, torch.float16, 5)):
        T, E, K = 9, 4, 2
        args, g = _inputs(T, H, I, E, K, routing="skewed", seed=seed, dtype=dtype)
        go = torch.randn(T, H, generator=g).to(dtype)
        cfg = dispatch_config(T, E, K, H, I, "cpu", dtype)
        bc = dataclasses.replace(backward_config(cfg, "cpu", dtype), wg_m=16, wg_ws=True,
                                 wg_stages=stages)
        got = db.dispatch_backward_triton(go, *args, config=cfg, bwd_config=bc)
        ref = dispatch_backward_reference(go.double(), *_double(args))
        for name, err in zip(NAMES, grad_errors(got, ref, go, args)):
            assert err <= GRAD_TOL[dtype], (seed, H, dtype, stages, name, err)
    assert ran == [], ran


class _Spy:
    """Stands in for a kernel in a launcher's module: records launches, then launches it."""

    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log
        self.fn = getattr(kernel, "fn", kernel)

    def __getitem__(self, grid):
        def launch(*a, **kw):
            self.log.append(grid)
            from moe_ops._runtime import kernel_for
            return kernel_for(self.kernel, torch.device("cpu"))[grid](*a, **kw)
        return launch


@needs_interpreter
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("routing", ["uniform", "mixed", "one_expert", "skewed"])
def test_rows_gemm_ws_matches_down_kernel(interpreter, monkeypatch, routing, block_m):
    """The warp-specialised persistent row GEMM (128-row blocks; three programs walking the row
    blocks below the device-side row count) computes the forward's down GEMM and the backward's
    dA and dx GEMMs with down_kernel's tiles and order: outputs and gradients bitwise equal to
    the per-tile kernel's, near float64, ids < 0 and empty experts included; poisoned buffers
    show any row it reads unwritten or leaves unwritten."""
    import dataclasses

    import moe_ops.launch.dispatch as launch
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 40, 64, 48, 5, 2
    args, g = _inputs(T, H, I, E, K, routing=routing, seed=seed, dtype=torch.float16)
    go = torch.randn(T, H, generator=g).to(torch.float16)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float16),
                              block_m=block_m, block_n1=32, block_k1=16, block_n2=32, block_k2=16)
    bc = backward_config(cfg, "cpu", torch.float16)
    _poison_empty(monkeypatch)
    calls = []
    real = launch._rows_gemm_ws
    monkeypatch.setattr(launch, "_rows_gemm_ws", lambda *a: (calls.append(a[5]), real(*a))[1])
    base, z = launch.dispatch_triton(*args, config=cfg, save_z=True)
    base_g = dispatch_backward_triton(go, *args, z=z, config=cfg, bwd_config=bc)
    assert calls == []
    out, z2 = launch.dispatch_triton(*args, config=dataclasses.replace(cfg, down_ws=True),
                                     save_z=True)
    assert calls == [H]
    got_g = dispatch_backward_triton(go, *args, z=z2, config=cfg,
                                     bwd_config=dataclasses.replace(bc, rows_ws=True))
    assert calls == [H, I, H], calls   # forward down, then dA (N = I) and dx (N = H)
    assert torch.equal(out, base), seed
    assert not out.isnan().any(), seed
    assert rel_err(out, _dense_float64(*_double(args))) <= 2e-3, seed
    ref = dispatch_backward_reference(go.double(), *_double(args))
    for name, a, b, r, err in zip(NAMES, got_g, base_g, ref, grad_errors(got_g, ref, go, args)):
        assert torch.equal(a, b), (seed, name)
        if r.norm() > 0:
            assert err <= GRAD_TOL[torch.float16], (seed, name, err)


@needs_interpreter
def test_rows_gemm_ws_declines(interpreter):
    """The warp-specialised row GEMM's launcher declines what its kernel does not cover (and
    the per-tile kernel runs): blocks of fewer than 64 rows, float32, a reduction that is not a
    multiple of the step, more than 4 stages, direct rows (T == 1)."""
    import dataclasses

    import moe_ops.launch.dispatch as launch
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    calls = []
    real = launch._rows_gemm_ws
    for (T, H, I, dtype, change) in ((9, 64, 48, torch.float16, dict(block_m=32)),
                                     (9, 64, 48, torch.float32, {}),
                                     (9, 64, 40, torch.float16, {}),        # I % 16 = 8
                                     (9, 64, 48, torch.float16, dict(num_stages=5)),
                                     (1, 64, 48, torch.float16, dict(direct=True))):
        E, K = 4, 2
        args, _ = _inputs(T, H, I, E, K, routing="uniform", seed=seed, dtype=dtype)
        cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", dtype), block_m=128,
                                  block_n2=32, block_k2=16, down_ws=True)
        cfg = dataclasses.replace(cfg, **change)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(launch, "_rows_gemm_ws", lambda *a: calls.append(real(*a)) or calls[-1])
            out = launch.dispatch_triton(*args, config=cfg)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert rel_err(out, _dense_float64(*_double(args))) <= tol, (seed, T, change)
    assert calls == [False] * 5, calls   # asked and declined every time


@needs_interpreter
def test_rows_gemm_ws_declines_over_shared_memory(interpreter):
    """The backward's dA GEMM (float32 output) on 256-wide warp-specialised tiles would need
    ~279 KB of shared memory on sm_90 (its epilogue stages a whole float32 tile): the launcher
    declines it from its estimate, and the dx GEMM (16-bit output) still runs warp-specialised;
    the gradients match the per-tile kernels' bitwise."""
    import dataclasses

    import moe_ops.launch.dispatch as launch
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 24, 64, 64, 4, 2
    args, g = _inputs(T, H, I, E, K, routing="skewed", seed=seed, dtype=torch.float16)
    go = torch.randn(T, H, generator=g).to(torch.float16)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float16), block_m=128,
                              block_n1=32, block_k1=16)
    bc = dataclasses.replace(backward_config(cfg, "cpu", torch.float16), da_n=256, da_k=64,
                             dx_n=32, dx_k=16, num_stages=3)
    calls = []
    real = launch._rows_gemm_ws
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "_rows_gemm_ws", lambda *a: calls.append(real(*a)) or calls[-1])
        got = dispatch_backward_triton(go, *args, config=cfg,
                                       bwd_config=dataclasses.replace(bc, rows_ws=True))
    assert calls == [False, True], calls   # dA declined, dx warp-specialised
    base = dispatch_backward_triton(go, *args, config=cfg, bwd_config=bc)
    for name, a, b in zip(NAMES, got, base):
        assert torch.equal(a, b), (seed, name)


@needs_interpreter
def test_ws_kernels_fall_back_when_they_do_not_compile(interpreter, monkeypatch):
    """A warp-specialised kernel that this Triton fails to compile (its warp-specialisation
    pass raising, as Triton 3.6's does on some loops) makes its launcher warn once, remember
    the config and run the per-tile kernels: right outputs and gradients. Any other error
    propagates."""
    import dataclasses

    import moe_ops.launch.dispatch as launch
    import moe_ops.launch.dispatch_backward as db
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 24, 64, 48, 4, 2
    args, g = _inputs(T, H, I, E, K, routing="skewed", seed=seed, dtype=torch.float16)
    go = torch.randn(T, H, generator=g).to(torch.float16)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float16), block_m=128,
                              block_n1=32, block_k1=16, block_n2=32, block_k2=16)
    bc = dataclasses.replace(backward_config(cfg, "cpu", torch.float16), wg_m=16)
    ref_out = launch.dispatch_triton(*args, config=cfg)
    ref_g = db.dispatch_backward_triton(go, *args, config=cfg, bwd_config=bc)
    real_kernel_for = launch.kernel_for
    tried = []
    error = [RuntimeError("PassManager::run failed")]

    def kernel_for(kernel, device, key=None):
        if getattr(kernel, "fn", kernel).__name__ in ("rows_gemm_ws_kernel",
                                                      "weight_grad_ws_kernel"):
            class _Failing:
                def __getitem__(self, grid):
                    def launch_(*a, **kw):
                        tried.append(kernel)
                        raise error[0]
                    return launch_
            return _Failing()
        return real_kernel_for(kernel, device, key)

    monkeypatch.setattr(launch, "kernel_for", kernel_for)
    monkeypatch.setattr(db, "kernel_for", kernel_for)
    monkeypatch.setattr(launch, "_WS_REJECTED", set())
    ws_cfg = dataclasses.replace(cfg, down_ws=True)
    ws_bc = dataclasses.replace(bc, wg_ws=True, rows_ws=True)
    with pytest.warns(RuntimeWarning, match="did not compile"):
        out = launch.dispatch_triton(*args, config=ws_cfg)
        got = db.dispatch_backward_triton(go, *args, config=cfg, bwd_config=ws_bc)
    assert torch.equal(out, ref_out), seed
    for name, a, b in zip(NAMES, got, ref_g):
        assert torch.equal(a, b), (seed, name)
    n = len(tried)
    assert n >= 3, n   # forward down, dA and dx (other keys), the weight gradients
    launch.dispatch_triton(*args, config=ws_cfg)   # remembered: not tried again
    db.dispatch_backward_triton(go, *args, config=cfg, bwd_config=ws_bc)
    assert len(tried) == n
    error[0] = ValueError("not a compile failure")
    monkeypatch.setattr(launch, "_WS_REJECTED", set())
    with pytest.raises(ValueError, match="not a compile failure"):
        launch.dispatch_triton(*args, config=ws_cfg)


@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_backward_without_experts_is_zero(path, request):
    """E = 0 (so K = 0): the forward is zeros and every gradient is zero on both paths (the
    Triton backward once divided by E)."""
    request.getfixturevalue(path)
    h = torch.randn(5, 8, requires_grad=True)
    w13 = torch.zeros(0, 8, 8, requires_grad=True)
    w2 = torch.zeros(0, 8, 4, requires_grad=True)
    tw = torch.rand(5, 0, requires_grad=True)
    out = torch.ops.moe.dispatch(h, w13, w2, tw, torch.zeros(5, 0, dtype=torch.int32))
    assert torch.equal(out, torch.zeros(5, 8))
    (out * torch.randn(5, 8)).sum().backward()
    assert torch.equal(h.grad, torch.zeros(5, 8))
    assert w13.grad.shape == w13.shape and w2.grad.shape == w2.shape and tw.grad.shape == (5, 0)


@needs_interpreter
@pytest.mark.parametrize("persistent,dtype", [(False, torch.float32), (True, torch.float16)])
def test_weight_grads_stop_after_the_valid_rows(interpreter, persistent, dtype):
    """BackwardConfig.wg_trim: an expert's weight-gradient sum stops at the first BLOCK_K step
    past its valid rows; the padding rows after that step are never read. Here they are NaN
    (the rows before, up to the step's end, are zero as in the backward), so a sum over every
    padded row shows. Expert counts 5 (one 16-row step of its 32), 21 (two), 40 and 0."""
    import dataclasses

    from moe_ops.launch.alignment import align_triton
    from moe_ops.launch.dispatch import _dot_precision
    from moe_ops.launch.dispatch_backward import weight_grad_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    E, M, N = 4, 24, 40
    counts = {0: 5, 1: 21, 3: 40}
    ids = torch.cat([torch.full((n,), e) for e, n in counts.items()])
    ids = ids[torch.randperm(ids.numel(), generator=g)].view(-1, 1).to(torch.int32)
    al = align_triton(ids, E, 32)
    cfg = dispatch_config(ids.shape[0], E, 1, M, N, "cpu", dtype)
    bc = dataclasses.replace(backward_config(cfg, "cpu", dtype), wg_persistent=persistent)
    bk = min(bc.wg_k, al.block_m)
    assert bk == 16
    left = torch.full((al.max_rows, M), float("nan"), dtype=dtype)
    right = torch.full((al.max_rows, N), float("nan"), dtype=dtype)
    ref = torch.zeros(E, M, N, dtype=torch.float64)
    ends, valid_ends = al.expert_ends.tolist(), al.valid_ends.tolist()
    poisoned = 0
    for e in range(E):
        start, valid_end = (ends[e - 1] if e else 0), valid_ends[e]
        step_end = start + -(-(valid_end - start) // bk) * bk
        left[start:step_end] = 0
        right[start:step_end] = 0
        left[start:valid_end] = torch.randn(valid_end - start, M, generator=g).to(dtype)
        right[start:valid_end] = torch.randn(valid_end - start, N, generator=g).to(dtype)
        poisoned += ends[e] - step_end
        ref[e] = left[start:valid_end].double().t() @ right[start:valid_end].double()
    assert poisoned == 16 + 16, poisoned   # experts 0 and 3: a whole step past the valid rows
    out = torch.full((E, M, N), float("nan"), dtype=dtype)
    weight_grad_triton(left, right, out, al, bc, _dot_precision(dtype))
    assert rel_err(out, ref) <= RTOL[dtype], seed
    assert torch.equal(out[2], torch.zeros_like(out[2])), seed


@needs_interpreter
@pytest.mark.parametrize("routing", ["skewed", "balanced"])
def test_persistent_weight_grads_lpt_deal(interpreter, routing, monkeypatch):
    """The LPT deal itself, as each program walks it: tiles in the experts' LPT order (expert,
    output row block, column block), in rounds of NUM_PROGRAMS; where skewed, program p takes
    position p of even rounds and NUM_PROGRAMS-1-p of odd ones (the snake), else tile
    p + r*NUM_PROGRAMS. Recorded from every tile store of both weight-gradient launches
    (interpreter: the kernel's store helper is looked up at call time); each tile is stored
    once, by the program the deal gives it."""
    import dataclasses

    import moe_ops.kernels.expert_gemm_backward as kb
    import moe_ops.launch.dispatch_backward as db
    import triton.language as tl
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 40, 32, 24, 12, 3
    args, g = _inputs(T, H, I, E, K, routing="uniform" if routing == "balanced" else routing,
                      seed=seed, dtype=torch.float16)
    if routing == "balanced":   # every expert 10 rows: the fixed deal
        args = (*args[:4], (torch.arange(T * K) % E).reshape(T, K).to(args[4].dtype))
    go = torch.randn(T, H, generator=g).to(torch.float16)
    cfg = dispatch_config(T, E, K, H, I, "cpu", torch.float16)
    bc = dataclasses.replace(backward_config(cfg, "cpu", torch.float16), wg_persistent=True,
                             wg_chunk=2, wg_lpt=True)
    stores, launches = [], []

    def store_slice(o_desc, x, e, m0, n0, ROWS, COLS, _run=kb._store_slice):
        stores.append(tuple(map(_interpreted_int, (tl.program_id(0), e, m0, n0))))
        return _run(o_desc, x, e, m0, n0, ROWS, COLS)

    def record(kernel, grid, a, kw):
        if kw.get("LPT"):
            launches.append((a[4], a[5], kw["BLOCK_M"], kw["BLOCK_N"], kw["NUM_PROGRAMS"],
                             list(stores)))
            stores.clear()

    monkeypatch.setattr(kb, "_store_slice", store_slice)
    spy_kernel_launches(monkeypatch, db, record)
    db.dispatch_backward_triton(go, *args, config=cfg, bwd_config=bc)
    monkeypatch.undo()
    assert len(launches) == 2, (seed, len(launches))   # dW2, dW13
    counts, skewed = expert_counts_skewed(args[4], E, db.LPT_MIN_SKEW)
    assert skewed == (routing == "skewed"), (seed, counts)
    order = sorted(range(E), key=lambda e: (-counts[e], e)) if skewed else list(range(E))
    for M, N, block_m, block_n, programs, got in launches:
        n_m, n_n = -(-M // block_m), -(-N // block_n)
        per_e = n_m * n_n
        assert programs > 1 and E * per_e > 2 * programs, (programs, E * per_e)
        expected = []
        for t in range(E * per_e):
            rnd, q = divmod(t, programs)
            p = programs - 1 - q if skewed and rnd % 2 else q
            rem = t % per_e
            expected.append((p, order[t // per_e], rem // n_n * block_m, rem % n_n * block_n))
        assert sorted(got) == sorted(expected), (seed, routing, M, N)


@needs_interpreter
@pytest.mark.parametrize("T,K,direct", [(64, 4, True), (257, 1, False)])
def test_direct_rows_up_to_max_slots(interpreter, monkeypatch, T, K, direct):
    """DispatchConfig.direct at T > 1: direct rows (no alignment launch) for up to
    DIRECT_MAX_SLOTS (256) slots with contiguous ids; one slot more takes the alignment. Both
    match float64."""
    import dataclasses

    import moe_ops.launch.dispatch as ld
    from moe_ops.tuning.heuristics import dispatch_config

    assert ld.DIRECT_MAX_SLOTS == 256
    seed = fresh_seed()
    H, I, E = 16, 16, 8
    args, _ = _inputs(T, H, I, E, K, routing="mixed", seed=seed)
    aligned = []
    real = ld.align_triton
    monkeypatch.setattr(ld, "align_triton", lambda *a, **kw: aligned.append(a) or real(*a, **kw))
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float32), direct=True)
    out = ld.dispatch_triton(*args, config=cfg)
    assert len(aligned) == (0 if direct else 1), (seed, T, K, len(aligned))
    assert rel_err(out, _dense_float64(*_double(args))) <= RTOL[torch.float32], seed

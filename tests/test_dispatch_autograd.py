"""Autograd of moe.dispatch: the training modes (saved z, the default: moe.dispatch_train then
moe.dispatch_backward_saved; recompute: moe_ops.set_recompute(True) or MOE_OPS_RECOMPUTE=1),
opcheck of the internal ops, gradients against float64 oracles on the reference path and the
interpreted kernels, the saved z itself, T = 0."""
import os  # noqa: F401

import pytest
import torch
import torch.nn.functional as F  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

import moe_ops  # noqa: F401
from conftest import (RTOL, OpCounter, assert_equal_across_tile_heights, ds_scale,  # noqa: F401
                      expert_counts_skewed, grad_errors, needs_interpreter, rel_err,
                      spy_kernel_launches)
from training_utils import *  # noqa: F401,F403
from training_utils import _default_mode, _inputs, _poison_empty, _z_err, _double  # noqa: F401
from training_utils import _dense_float64, _oracle_grads, _train_step, _assert_exact_zeros  # noqa: F401
from training_utils import _check_grads, _valid_slots  # noqa: F401
from moe_ops.ops.samples import dispatch_samples, make_dispatch_inputs  # noqa: F401
from moe_ops.reference.dispatch import dispatch_backward_reference, dispatch_z_reference  # noqa: F401,E501


# ---------------------------------------------------------------------------------------------
# opcheck


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
# gradients against float64 oracles


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
# which forward and backward ops run


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
# the saved z


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
# saved and recompute gradients agree (interpreted Triton kernels); poisoned buffers


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
# T = 0


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

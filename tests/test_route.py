"""moe.route: parity with the float64 reference, interpreter kernels, gradients, errors, opcheck."""
import random

import pytest
import torch

from conftest import needs_interpreter
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_ops.launch.routing import route_triton
from moe_ops.ops.samples import route_samples
from moe_ops.reference import route_reference

CASES = [
    # (T, E, K, kwargs)
    (1, 8, 2, {}),
    (33, 8, 2, {}),
    (17, 64, 8, {"renormalize": False}),
    (5, 7, 7, {}),
    (20, 16, 4, {"scoring": "sigmoid", "num_groups": 4, "topk_groups": 2, "scale": 2.5}),
    (9, 32, 6, {"scoring": "sigmoid", "num_groups": 8, "topk_groups": 3, "renormalize": True}),
    (12, 12, 3, {"scoring": "softmax", "num_groups": 12, "topk_groups": 5}),
]


def _check(T, E, K, kw, gen, with_bias=False, dtype=torch.float32, neg_inf=0.0, nan=0.0):
    logits = torch.randn(T, E, generator=gen).to(dtype)
    if neg_inf:   # that fraction of the logits -inf (rows may keep fewer than K finite ones)
        logits = logits.masked_fill(torch.rand(T, E, generator=gen) < neg_inf, float("-inf"))
    if nan:   # that fraction NaN (ranked first, as torch.topk ranks NaN)
        logits = logits.masked_fill(torch.rand(T, E, generator=gen) < nan, float("nan"))
    if with_bias:
        kw = dict(kw, bias=torch.randn(E, generator=gen) * 0.05)
    w, ids = torch.ops.moe.route(logits, K, **kw)
    w_ref, ids_ref = route_reference(logits.double(), K, **kw)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert w.shape == (T, K) and ids.shape == (T, K)
    assert torch.equal(ids, ids_ref)
    # (NaN where both take 0/0: an all -inf row under softmax, or renormalised zeros)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-6,
                               equal_nan=bool(neg_inf or nan))


@pytest.mark.parametrize("T,E,K,kw", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_path(reference_path, T, E, K, kw, with_bias):
    _check(T, E, K, kw, torch.Generator().manual_seed(T * 31 + E), with_bias)


@pytest.mark.parametrize("T,E,K,kw", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_interpreter(interpreter, T, E, K, kw, with_bias):
    _check(T, E, K, kw, torch.Generator().manual_seed(T * 31 + E + 1), with_bias)


@needs_interpreter
@settings(max_examples=15, deadline=None)
@given(T=st.integers(0, 40), E=st.integers(1, 64), data=st.data())
def test_interpreter_hypothesis(T, E, data):
    import os
    K = data.draw(st.integers(1, E))
    scoring = data.draw(st.sampled_from(["softmax", "sigmoid"]))
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        _check(T, E, K, {"scoring": scoring, "renormalize": data.draw(st.booleans())},
               torch.Generator().manual_seed(data.draw(st.integers(0, 2**31))),
               neg_inf=data.draw(st.sampled_from([0.0, 0.0, 0.5, 0.9])),
               nan=data.draw(st.sampled_from([0.0, 0.0, 0.0, 0.1, 0.5])))
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_minus_inf_logits_give_distinct_ids(path, scoring, renormalize, request):
    """Rows with fewer finite logits than top_k: the ids of a row stay distinct (the -inf
    experts in index order after the finite ones; the kernel once picked an already chosen
    expert again), and the weights are their scores (0 for a -inf logit), renormalised."""
    request.getfixturevalue(path)
    inf = float("inf")
    logits = torch.tensor([[0.5, -inf, -inf, -inf, 0.1, -inf],
                           [-inf, -inf, 2.0, -inf, -inf, -inf],
                           [-inf, -inf, -inf, -inf, -inf, -inf],
                           [0.3, -0.2, 1.0, 0.0, -inf, 0.7]])
    w, ids = torch.ops.moe.route(logits, 3, scoring, renormalize, scale=2.0)
    expect_ids = torch.tensor([[0, 4, 1], [2, 0, 1], [0, 1, 2], [2, 5, 0]], dtype=torch.int32)
    assert torch.equal(ids, expect_ids), ids
    x = logits.double()
    s = x.softmax(-1) if scoring == "softmax" else x.sigmoid()
    expect_w = s.gather(1, expect_ids.long())
    if renormalize:   # (0 / 0 for an all -inf row under sigmoid, as the contract's formula)
        expect_w = expect_w / expect_w.sum(-1, keepdim=True)
    expect_w = expect_w * 2.0
    finite = torch.isfinite(s).all(-1)   # softmax of an all -inf row is NaN: ids only there
    torch.testing.assert_close(w.double()[finite], expect_w[finite], rtol=1e-6, atol=1e-7,
                               equal_nan=True)


@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_nan_logits_rank_first_and_reach_the_weights(path, request):
    """A NaN logit ranks first, as torch.topk ranks NaN (ties with +inf and other NaNs by
    index), so the NaN reaches the weights (and the output) instead of being routed around;
    the kernel once ranked NaN last, disagreeing with the reference. Random NaN / -inf
    patterns: both paths give the float64 reference's ids exactly, every scoring, bias and
    grouping."""
    request.getfixturevalue(path)
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[0.5, nan, 0.1, 0.3], [nan, 2.0, nan, -1.0]])
    w, ids = torch.ops.moe.route(logits, 2, "sigmoid", False)
    assert ids.tolist() == [[1, 0], [0, 2]], ids
    assert torch.isnan(w[0, 0]) and w[0, 1].item() == pytest.approx(torch.tensor(0.5).sigmoid().item())
    assert torch.isnan(w[1]).all()
    # a bias of +inf ties with NaN: the lower index first
    w, ids = torch.ops.moe.route(torch.tensor([[0.0, 0.0, nan, 1.0]]), 3, "sigmoid", True,
                                 torch.tensor([0.0, inf, 0.0, 0.0]))
    assert ids.tolist() == [[1, 2, 3]], ids
    # a group whose two best are NaN (+inf) and -inf: the group scores NaN, ranked first
    w, ids = torch.ops.moe.route(torch.tensor([[nan, 0.0, 3.0, 2.0]]), 1, "sigmoid", True,
                                 torch.tensor([0.0, -inf, 0.0, 0.0]), 2, 1)
    assert ids.tolist() == [[0]], ids
    # ... and ties with a group of +inf score (the reference ranks its group scores with NaN
    # as +inf, as the kernel): the lower index first, here the +inf group
    w, ids = torch.ops.moe.route(torch.tensor([[0.0, 0.0, nan, 0.0]]), 1, "sigmoid", True,
                                 torch.tensor([inf, 0.0, 0.0, -inf]), 2, 1)
    assert ids.tolist() == [[0]], ids
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    for T, E, K, kw in CASES:
        for with_bias in (False, True):
            _check(T, E, K, kw, gen, with_bias, neg_inf=0.2, nan=0.15)


@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_grouped_selection_with_minus_inf_bias(path, request):
    """Fewer groups with a finite score than topk_groups (-inf bias entries): every allowed
    group stays allowed (the kernel once picked a chosen group again, dropped the best expert
    and picked a masked one), and both paths agree with the float64 reference."""
    request.getfixturevalue(path)
    inf = float("inf")
    w, ids = torch.ops.moe.route(torch.tensor([[0.0, 0.0, 2.0, 0.0]]), 2, "sigmoid", True,
                                 torch.tensor([0.0, -inf, 0.0, -inf]), 2, 2, 1.0)
    assert ids.tolist() == [[2, 0]], ids
    s = torch.tensor([0.0, 2.0]).double().sigmoid()
    torch.testing.assert_close(w.double(), (s[[1, 0]] / s.sum())[None], rtol=1e-6, atol=1e-7)
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    E = 8
    for num_groups, topk_groups, k in ((2, 2, 3), (4, 3, 2), (4, 4, 4), (8, 5, 3), (4, 2, 2)):
        logits = torch.randn(6, E, generator=g)
        bias = torch.zeros(E)
        bias[torch.randperm(E, generator=g)[:5]] = -inf
        w, ids = torch.ops.moe.route(logits, k, "sigmoid", True, bias, num_groups, topk_groups)
        w_ref, ids_ref = route_reference(logits.double(), k, "sigmoid", True, bias.double(),
                                         num_groups, topk_groups)
        assert torch.equal(ids, ids_ref), (seed, num_groups, topk_groups, k, ids, ids_ref)
        torch.testing.assert_close(w.double(), w_ref, rtol=1e-6, atol=1e-7)


def test_transposed_logits_give_contiguous_outputs():
    """A transposed view of the logits: contiguous [T, K] outputs on the reference path, as on
    the kernel path and in the fake implementation (torch.compile asserts the strides)."""
    logits = torch.randn(16, 6).t()
    w, ids = torch.ops.moe.route(logits, 3)
    assert w.is_contiguous() and ids.is_contiguous() and ids.stride() == (3, 1)
    fn = torch.compile(lambda x: torch.ops.moe.route(x.t(), 3)[1] + 0, fullgraph=True,
                       backend="aot_eager")
    x = torch.randn(16, 6)
    assert torch.equal(fn(x), torch.ops.moe.route(x.t(), 3)[1])


def test_bf16_logits_and_strided(interpreter):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 24, generator=g).t()[:10]  # non-contiguous [10, 16]
    w, ids = torch.ops.moe.route(logits, 4)
    w_ref, ids_ref = route_reference(logits.double(), 4)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-6)
    lb = logits.to(torch.bfloat16)
    w, ids = torch.ops.moe.route(lb, 4)
    assert torch.equal(ids, route_reference(lb.double(), 4)[1])


@pytest.mark.parametrize("kw", [{}, {"scoring": "sigmoid", "num_groups": 4, "topk_groups": 2}])
def test_strided_bias(interpreter, kw):
    """A bias that is a slice of a larger tensor or an expanded scalar (stride 0) is read with
    its stride: the same ids and weights as the reference and as a contiguous copy."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(9, 16, generator=g)
    full = torch.randn(32, generator=g)
    for bias in (full[1::2], full[3:19], torch.tensor(0.3).expand(16), full[:16].flip(0)):
        w, ids = torch.ops.moe.route(logits, 4, bias=bias, **kw)
        w_ref, ids_ref = route_reference(logits.double(), 4, bias=bias.double(), **kw)
        assert torch.equal(ids, ids_ref), bias.stride()
        torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-6)
        w_c, ids_c = torch.ops.moe.route(logits, 4, bias=bias.contiguous(), **kw)
        assert torch.equal(ids, ids_c) and torch.equal(w, w_c)


def _assert_routes_as_float32(logits, bias):
    """moe.route of `logits` (and `bias`, grouped sigmoid) gives exactly what their float32
    values give, weights in float32 and ids in int32."""
    for kw in ({}, {"scoring": "sigmoid", "bias": bias, "num_groups": 4, "topk_groups": 2}):
        w, ids = torch.ops.moe.route(logits, 4, **kw)
        kw32 = {k: (v.float() if torch.is_tensor(v) else v) for k, v in kw.items()}
        w32, ids32 = torch.ops.moe.route(logits.float(), 4, **kw32)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32
        assert torch.equal(ids, ids32) and torch.equal(w, w32)


@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_float64_logits_scored_in_float32(path, request):
    """Scores are computed in float32 whatever the logits' dtype (CONTRACT.md): float64 logits
    (and bias) give exactly what their float32 rounding gives, weights in float32."""
    request.getfixturevalue(path)
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(20, 16, dtype=torch.float64, generator=g)
    bias = torch.randn(16, dtype=torch.float64, generator=g) * 0.1
    _assert_routes_as_float32(logits, bias)


@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                  "float8_e5m2fnuz", "float8_e8m0fnu"])
def test_any_float_logits_dtype(path, name, request):
    """"router_logits: any float dtype" (CONTRACT.md): the kernel is fed float32 for dtypes it
    does not load itself (Triton's interpreter has no float8_e8m0fnu; Triton's CUDA backend has
    no fnuz float8 and no float8 before sm_89); logits and bias give what their float32 values
    give."""
    request.getfixturevalue(path)
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    g = torch.Generator().manual_seed(12)
    logits = torch.rand(9, 16, generator=g).mul(8).to(dtype)
    bias = torch.rand(16, generator=g).to(dtype)
    _assert_routes_as_float32(logits, bias)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_near_ties_same_experts_on_reference_and_kernel(scoring, interpreter):
    """Logits that differ by less than float32 score rounding (softmax of 0 and 1e-12; sigmoid
    saturating at 1.0) pick the same experts on the CPU reference and in the Triton kernel
    (interpreted): both rank the logits, the larger first, ties to the lower index."""
    logits = torch.tensor([[0.0, 1e-12, -5.0, -5.0], [20.0, 30.0, 25.0, 1.0],
                           [1.0, 1.0, 0.5, 1.0]])
    ref_w, ref_ids = route_reference(logits, 2, scoring)
    assert ref_ids[0, 0] == 1 and ref_ids[1].tolist() == [1, 2] and ref_ids[2].tolist() == [0, 1]
    w = torch.full((3, 2), float("nan"))
    ids = torch.full((3, 2), -7, dtype=torch.int32)
    route_triton(logits, 2, scoring, True, None, 1, 1, 1.0, out=(w, ids))
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=0)


def test_poisoned_outputs_fully_written(interpreter):
    logits = torch.randn(13, 16)
    w = torch.full((13, 3), float("nan"))
    ids = torch.full((13, 3), -7, dtype=torch.int32)
    route_triton(logits, 3, "softmax", True, None, 1, 1, 1.0, out=(w, ids))
    w_ref, ids_ref = route_reference(logits.double(), 3)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-6)


def test_grouped_selection_respects_groups(reference_path):
    # 4 groups of 4; the two best groups must hold every chosen expert.
    logits = torch.randn(50, 16)
    _, ids = torch.ops.moe.route(logits, 4, "sigmoid", True, None, 4, 2, 1.0)
    assert all(len(set(row.tolist())) <= 2 for row in ids // 4)


@pytest.mark.parametrize("kw", [{}, {"renormalize": False, "scale": 1.7},
                                {"scoring": "sigmoid", "num_groups": 2, "topk_groups": 1}])
@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_gradient_matches_float64_autograd(kw, path, request):
    request.getfixturevalue(path)
    logits = torch.randn(11, 8, dtype=torch.float32, requires_grad=True)
    w, ids = torch.ops.moe.route(logits, 3, **kw)
    gw = torch.randn_like(w)
    (w * gw).sum().backward()
    # float64 autograd through plain torch with the same (fixed) selection
    x = logits.detach().double().requires_grad_(True)
    s = torch.softmax(x, -1) if kw.get("scoring", "softmax") == "softmax" else torch.sigmoid(x)
    p = s.gather(1, ids.long())
    if kw.get("renormalize", True):
        p = p / p.sum(-1, keepdim=True)
    p = p * kw.get("scale", 1.0)
    (p * gw.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shift", [-30.0, -60.0, -80.0])
def test_sigmoid_renormalized_gradient_far_negative_logits(reference_path, shift):
    """Sigmoid scores of logits far below 0 (~1e-26 at -60) renormalise to ordinary weights; the
    gradient must stay finite and right there (the backward squared the row sum, which
    underflows in float32 below ~-46: -inf gradients from ~-55)."""
    logits = (torch.randn(9, 8) + shift).requires_grad_(True)
    w, ids = torch.ops.moe.route(logits, 3, "sigmoid", True)
    gw = torch.randn_like(w)
    (w * gw).sum().backward()
    x = logits.detach().double().requires_grad_(True)
    p = torch.sigmoid(x).gather(1, ids.long())
    ((p / p.sum(-1, keepdim=True)) * gw.double()).sum().backward()
    assert torch.isfinite(logits.grad).all()
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=1e-5, atol=1e-6)


def test_gradcheck_float64(reference_path):
    logits = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    # route returns float32 weights; check the backward formula in float64 directly
    from moe_ops.reference.routing import route_backward_reference

    _, ids = route_reference(logits.detach(), 3)

    def f(x):
        s = torch.softmax(x, -1)
        p = s.gather(1, ids.long())
        return p / p.sum(-1, keepdim=True)

    gw = torch.randn(6, 3, dtype=torch.float64)
    torch.autograd.gradcheck(f, (logits,))
    x = logits.detach().requires_grad_(True)
    (f(x) * gw).sum().backward()
    got = route_backward_reference(gw, logits.detach(), ids, "softmax", True, None, 1, 1, 1.0)
    torch.testing.assert_close(got, x.grad)


@pytest.mark.parametrize("args,kw", route_samples(requires_grad=True))
def test_opcheck(reference_path, args, kw):
    torch.library.opcheck(torch.ops.moe.route.default, args, kw)


def test_opcheck_interpreter(interpreter):
    args, kw = route_samples(requires_grad=True)[3]
    torch.library.opcheck(torch.ops.moe.route.default, args, kw)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: torch.ops.moe.route(torch.randn(4), 2), ValueError, "router_logits must be 2-D"),
    (lambda: torch.ops.moe.route(torch.randn(4, 8).long(), 2), TypeError, "router_logits must be a float"),
    (lambda: torch.ops.moe.route(torch.randn(4, 8), 9), ValueError, "top_k must be in"),
    (lambda: torch.ops.moe.route(torch.randn(4, 8), 0), ValueError, "top_k must be in"),
    (lambda: torch.ops.moe.route(torch.randn(4, 8), 2, "relu"), ValueError, "scoring must be"),
    (lambda: torch.ops.moe.route(torch.randn(4, 8), 2, bias=torch.randn(7)), ValueError, "bias must have shape"),
    (lambda: torch.ops.moe.route(torch.randn(4, 8), 2, bias=torch.arange(8)), TypeError,
     "bias must be a float tensor"),
    (lambda: torch.ops.moe.route(torch.randn(4, 8), 2, num_groups=3), ValueError, "num_groups must"),
    (lambda: torch.ops.moe.route(torch.randn(4, 8), 2, num_groups=4, topk_groups=5), ValueError, "topk_groups must"),
    (lambda: torch.ops.moe.route(torch.randn(4, 8), 3, num_groups=4, topk_groups=1), ValueError,
     r"top_k=3 exceeds the experts in the topk_groups=1 allowed groups \(2\)"),
    (lambda: torch.ops.moe.route(torch.randn(4, 8), 5, num_groups=4, topk_groups=2), ValueError, "exceeds"),
    (lambda: torch.ops.moe.route(torch.randn(4, 8), 2, scale=float("nan")), ValueError, "scale must be finite"),
    (lambda: torch.ops.moe.route(torch.randn(4, 8), 2, scale=float("inf")), ValueError, "scale must be finite"),
    (lambda: torch.ops.moe.route(torch.randn(4, 8, device="meta"), 2, scale=float("-inf")), ValueError,
     "scale must be finite"),
])
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("kw,match", [
    ({"top_k": 2.0}, "top_k must be an int"), ({"top_k": True}, "top_k must be an int"),
    ({"top_k": 2, "num_groups": 2.0}, "num_groups must be an int"),
    ({"top_k": 2, "topk_groups": None}, "topk_groups must be an int"),
    ({"top_k": 2, "scale": "1"}, "scale must be a float"),
    ({"top_k": 2, "scoring": None}, "scoring must be a str"),
    ({"top_k": 2, "renormalize": "no"}, "renormalize must be a bool"),
])
def test_python_api_scalar_types(kw, match):
    """moe_ops.route names a scalar argument of the wrong type (TypeError) before the
    dispatcher sees it (which would raise RuntimeError, or take a bool as an int)."""
    import moe_ops

    with pytest.raises(TypeError, match=match):
        moe_ops.route(torch.randn(4, 8), **kw)


def test_python_api_numpy_scalars():
    """numpy integers and floats pass as Python ones (the same result)."""
    import moe_ops

    np = pytest.importorskip("numpy")

    logits = torch.randn(5, 8)
    got = moe_ops.route(logits, np.int64(3), scale=np.float32(1.5), num_groups=np.int32(2),
                        topk_groups=np.int16(2))
    want = moe_ops.route(logits, 3, scale=1.5, num_groups=2, topk_groups=2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # numpy booleans too (numpy 2 names its type "bool": the error once read "got bool")
    got = moe_ops.route(logits, 3, renormalize=np.bool_(False))
    want = moe_ops.route(logits, 3, renormalize=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rows_per_program_do_not_change_the_result(interpreter):
    """route_triton's block_t (rows per program; the measured variants): the same
    ids and, to float32 rounding, the same weights as the launcher's rule, grouped or not."""
    g = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    for E, K, scoring, has_bias, groups, topk_groups in ((128, 8, "softmax", False, 1, 1),
                                                         (64, 6, "sigmoid", True, 8, 3)):
        bias = torch.randn(E, generator=g) * 0.1 if has_bias else None
        x = torch.randn(37, E, generator=g)   # 37 rows: 3 programs at 16 rows, the last partial
        ref_w, ref_i = route_triton(x, K, scoring, True, bias, groups, topk_groups, 1.0)
        for bt in (1, 4, 16):
            w, i = route_triton(x, K, scoring, True, bias, groups, topk_groups, 1.0, block_t=bt)
            assert torch.equal(i, ref_i), bt
            torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)

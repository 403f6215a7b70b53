"""moe.dispatch: float64-reference parity (torch reference and interpreted Triton kernels),
edge cases, gradients, errors, opcheck."""
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ds_scale, needs_interpreter, RTOL, rel_err, subnormal_floor
from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.ops.samples import dispatch_samples, make_dispatch_inputs
from moe_ops.reference import dispatch_reference

ROUTINGS = ["uniform", "one_expert", "empty_experts", "negative", "skewed"]


def _oracle(hidden, w13, w2, w, ids):
    return dispatch_reference(hidden.double(), w13.double(), w2.double(), w.double(), ids)


def _magnitude(hidden, w13, w2, w, ids):
    """sum_k |w[t,k]| * |w2[e]| @ |act| per token, act = SwiGLU(w13[e] @ hidden[t]) in float64:
    the size of the sums behind each output element. A dot product's rounding error is bounded
    by eps * sum |a_i b_i|, not eps * |sum a_i b_i|: where the down GEMM's terms cancel (tiny H,
    low-precision intermediates), the output's error is relative to this, not to the output."""
    T, K = ids.shape
    E, I = w2.shape[0], w2.shape[2]
    ids = ids.long()
    ok = (ids >= 0) & (ids < E)
    e = ids.clamp(0, E - 1).reshape(-1)
    x = hidden.double().repeat_interleave(K, dim=0)                      # [T*K, H]
    gu = torch.einsum("sih,sh->si", w13.double()[e], x)                 # [T*K, 2I]
    act = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    y = torch.einsum("shi,si->sh", w2.double()[e].abs(), act.abs())    # [T*K, H]
    y = y * (w.double().abs() * ok).reshape(-1, 1)
    return y.view(T, K, -1).sum(1)


def _check(T, H, I, E, K, dtype, routing, seed, ids_dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    args = make_dispatch_inputs(T, H, I, E, K, dtype=dtype, routing=routing, generator=g,
                                ids_dtype=ids_dtype)
    out = torch.ops.moe.dispatch(*args)
    assert out.shape == (T, H) and out.dtype == dtype
    ref = _oracle(*args)
    if T:
        err = (out.double() - ref.double()).norm().item()
        # the relative tolerance, plus ~4 roundings of the intermediates (act, per-slot rows:
        # stored in `dtype`) on the scale of the sums behind each output
        bound = (RTOL[dtype] * ref.norm().item() + subnormal_floor(dtype, out.numel())
                 + 2 * torch.finfo(dtype).eps * _magnitude(*args).norm().item())
        assert err <= bound, (rel_err(out, ref), RTOL[dtype], err, bound)
    return out


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_path(reference_path, routing, dtype):
    _check(23, 19, 13, 8, 3, dtype, routing, seed=1)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreter(interpreter, routing, dtype):
    _check(21, 19, 13, 8, 3, dtype, routing, seed=2)


@pytest.mark.parametrize("T", [0, 1, 2])
def test_tiny_T(interpreter, T):
    _check(T, 16, 8, 4, 2, torch.float32, "uniform", seed=3)


def test_int64_ids_and_K_equals_E(interpreter):
    _check(9, 8, 6, 4, 4, torch.float32, "uniform", seed=4, ids_dtype=torch.int64)


def test_many_experts_sparse_tokens(interpreter):
    # T*K << E: most experts empty, small padded bound.
    _check(3, 16, 8, 64, 4, torch.float32, "uniform", seed=5)


def test_blocks_span_several_tiles(interpreter):
    # rows per expert > BLOCK_M and H, I > one tile: exercises the K loops and multiple N tiles.
    _check(40, 70, 45, 2, 1, torch.float32, "uniform", seed=6)


def _with_env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    return old


def _restore_env(name, old):
    if old is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = old


@settings(max_examples=30, deadline=None)
@given(T=st.integers(0, 70), H=st.integers(1, 40), I=st.integers(1, 40), E=st.integers(1, 64),
       routing=st.sampled_from(ROUTINGS), data=st.data())
def test_reference_hypothesis(T, H, I, E, routing, data):
    K = data.draw(st.integers(1, min(E, 8)))
    old = _with_env("TRITON_INTERPRET", "0")
    try:
        _check(T, H, I, E, K, torch.float32, routing, data.draw(st.integers(0, 2**31)))
    finally:
        _restore_env("TRITON_INTERPRET", old)


@needs_interpreter
@settings(max_examples=12, deadline=None)
@given(T=st.integers(0, 70), H=st.integers(1, 40), I=st.integers(1, 40), E=st.integers(1, 64),
       routing=st.sampled_from(ROUTINGS), dtype=st.sampled_from([torch.float32, torch.float16]),
       data=st.data())
def test_interpreter_hypothesis(T, H, I, E, routing, dtype, data):
    K = data.draw(st.integers(1, E))
    old = _with_env("TRITON_INTERPRET", "1")
    try:
        _check(T, H, I, E, K, dtype, routing, data.draw(st.integers(0, 2**31)))
    finally:
        _restore_env("TRITON_INTERPRET", old)


@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_non_contiguous_inputs(path, request):
    request.getfixturevalue(path)
    g = torch.Generator().manual_seed(7)
    h, w13, w2, w, ids = make_dispatch_inputs(11, 14, 9, 6, 2, generator=g)
    h_nc = torch.randn(14, 22, generator=g).t()[::2]             # [11, 14], strides (2, 22)
    w13_nc = w13.transpose(1, 2).contiguous().transpose(1, 2)     # same values, other strides
    w_nc = torch.rand(2, 11, generator=g).t()
    out = torch.ops.moe.dispatch(h_nc, w13_nc, w2, w_nc, ids)
    assert rel_err(out, _oracle(h_nc, w13_nc, w2, w_nc, ids)) <= RTOL[torch.float32]


def test_output_is_new_tensor(interpreter):
    args = make_dispatch_inputs(4, 8, 6, 4, 2)
    out = torch.ops.moe.dispatch(*args)
    for a in args:
        assert out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


def test_poisoned_output_fully_written(interpreter):
    args = make_dispatch_inputs(17, 21, 10, 6, 2, routing="negative")
    out = torch.full((17, 21), float("nan"))
    dispatch_triton(*args, out=out)
    assert rel_err(out, _oracle(*args)) <= RTOL[torch.float32]


def test_all_ids_dropped_gives_zeros(interpreter):
    h, w13, w2, w, ids = make_dispatch_inputs(5, 8, 6, 4, 2)
    ids = torch.full_like(ids, -1)
    out = torch.full((5, 8), float("nan"))
    dispatch_triton(h, w13, w2, w, ids, out=out)
    assert torch.equal(out, torch.zeros(5, 8))


def test_out_of_range_ids_never_read(interpreter):
    # Without MOE_OPS_CHECK an id >= E is dropped like an id < 0 (no out-of-bounds read).
    h, w13, w2, w, ids = make_dispatch_inputs(6, 8, 6, 4, 2)
    bad = ids.clone()
    bad[0, 0] = 4
    bad[3, 1] = 1000
    dropped = bad.masked_fill(bad >= 4, -1)
    out = torch.ops.moe.dispatch(h, w13, w2, w, bad)
    assert rel_err(out, _oracle(h, w13, w2, w, dropped)) <= RTOL[torch.float32]


@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_moe_ops_check_raises_on_id_out_of_range(path, request, monkeypatch):
    request.getfixturevalue(path)
    monkeypatch.setenv("MOE_OPS_CHECK", "1")
    h, w13, w2, w, ids = make_dispatch_inputs(6, 8, 6, 4, 2)
    ids[2, 1] = 4
    with pytest.raises(ValueError, match="topk_ids"):
        torch.ops.moe.dispatch(h, w13, w2, w, ids)
    ids[2, 1] = -1  # negative ids stay legal
    torch.ops.moe.dispatch(h, w13, w2, w, ids)


@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_deterministic(path, request):
    request.getfixturevalue(path)
    args = make_dispatch_inputs(30, 16, 12, 4, 2, routing="skewed")
    a = torch.ops.moe.dispatch(*args)
    b = torch.ops.moe.dispatch(*args)
    assert torch.equal(a, b)


def _dense_float64(hidden, w13, w2, w, ids):
    """Differentiable float64 oracle written independently of moe_ops.reference."""
    I = w2.shape[2]
    valid = (ids >= 0) & (ids < w13.shape[0])
    safe = ids.long().clamp(0, w13.shape[0] - 1)
    z = torch.einsum("th,tkih->tki", hidden, w13[safe])
    a = torch.nn.functional.silu(z[..., :I]) * z[..., I:]
    y = torch.einsum("tki,tkhi->tkh", a, w2[safe])
    return (y * (w * valid)[..., None]).sum(1)


@pytest.mark.parametrize("routing", ["uniform", "negative", "one_expert", "empty_experts"])
@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_gradients_match_float64_autograd(routing, path, request):
    request.getfixturevalue(path)
    g = torch.Generator().manual_seed(8)
    args = make_dispatch_inputs(9, 10, 7, 5, 2, routing=routing, generator=g, requires_grad=True)
    out = torch.ops.moe.dispatch(*args)
    go = torch.randn(out.shape, generator=g)
    out.backward(go)
    ref_args = [a.detach().double().requires_grad_(a.requires_grad) for a in args[:4]] + [args[4]]
    _dense_float64(*ref_args).backward(go.double())
    for a, r in zip(args[:4], ref_args[:4]):
        assert rel_err(a.grad, r.grad) <= 1e-5


def test_gradcheck_float64(reference_path):
    g = torch.Generator().manual_seed(9)
    args = make_dispatch_inputs(5, 6, 4, 3, 2, dtype=torch.float64, generator=g, routing="negative",
                                requires_grad=True)
    args[3].data = args[3].data.double()
    torch.autograd.gradcheck(lambda *a: torch.ops.moe.dispatch(*a, args[4]), args[:4])


@pytest.mark.parametrize("sample", range(6))
def test_opcheck(reference_path, sample):
    args, kw = dispatch_samples(requires_grad=True)[sample]
    torch.library.opcheck(torch.ops.moe.dispatch.default, args, kw)


def test_opcheck_interpreter(interpreter):
    args, kw = dispatch_samples(requires_grad=True)[2]
    torch.library.opcheck(torch.ops.moe.dispatch.default, args, kw)


def _good():
    return make_dispatch_inputs(4, 8, 6, 3, 2)


def _bad(i, value):
    a = list(_good())
    a[i] = value
    return a


@pytest.mark.parametrize("args,exc,match", [
    (_bad(0, torch.randn(8)), ValueError, "hidden must be 2-D"),
    (_bad(1, torch.randn(3, 12)), ValueError, "w13 must be 3-D"),
    (_bad(2, torch.randn(3, 8)), ValueError, "w2 must be 3-D"),
    (_bad(1, torch.randn(3, 10, 8)), ValueError, r"w13 must have shape \[E, 2I, H\] with 2I"),
    (_bad(1, torch.randn(3, 12, 9)), ValueError, r"w13 must have shape \[E, 2I, H\] with H"),
    (_bad(2, torch.randn(3, 9, 6)), ValueError, r"w2 must have shape \[E, H, I\] with H"),
    (_bad(2, torch.randn(4, 8, 6)), ValueError, "w2 must have E"),
    (_bad(4, torch.zeros(4, 3, dtype=torch.int32)), ValueError, "topk_ids must have topk_weights' shape"),
    (_bad(3, torch.rand(5, 2)), ValueError, r"topk_weights must have shape \[T, K\] with T = hidden"),
    (_bad(3, torch.rand(4, 3)), ValueError, "topk_ids must have topk_weights' shape"),
    (_bad(4, torch.zeros(5, 2, dtype=torch.int32)), ValueError,
     r"topk_ids must have shape \[T, K\] with T = hidden"),
    (_bad(0, torch.randn(5, 8)), ValueError, r"topk_weights must have shape \[T, K\] with T = hidden"),
    (_bad(4, torch.zeros(4, 2)), TypeError, "topk_ids must be int32 or int64"),
    (_bad(0, torch.randn(4, 8).long()), TypeError, "hidden must be bfloat16, float16 or float32"),
    (_bad(1, torch.randn(3, 12, 8).half()), TypeError, "w13 must have hidden's dtype"),
    (_bad(2, torch.randn(3, 8, 6).half()), TypeError, "w2 must have hidden's dtype"),
    (_bad(3, torch.rand(4, 2).double()), TypeError, "topk_weights must be float32"),
])
def test_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        torch.ops.moe.dispatch(*args)


def test_error_float64_off_the_cpu_names_the_device():
    """float64 runs the reference on the CPU only; elsewhere the error says so (meta here: the
    fake implementation runs the same checks as CUDA)."""
    a = [t.to("meta") for t in _good()]
    a[0], a[1], a[2] = (t.double() for t in a[:3])
    with pytest.raises(TypeError, match=r"float32 on meta \(float64 runs on the CPU only\)"):
        torch.ops.moe.dispatch(*a)


def test_error_non_tensor_through_python_api():
    import moe_ops

    with pytest.raises(TypeError, match="hidden must be a torch.Tensor"):
        moe_ops.dispatch("x", *_good()[1:])
    with pytest.raises(TypeError, match="router_logits must be a torch.Tensor"):
        moe_ops.route([[1.0]], 1)


def test_error_activation():
    with pytest.raises(ValueError, match="activation must be one of 'silu', 'gelu', 'gelu_tanh', "
                                         "'relu', 'swiglu_oai', 'silu_clamp', "
                                         "'silu_clamp_out', 'swiglu_softcap', got 'swish'"):
        torch.ops.moe.dispatch(*_good(), activation="swish")
    import moe_ops

    with pytest.raises(TypeError, match="activation must be a str"):
        moe_ops.dispatch(*_good(), activation=None)


def test_set_recompute_rejects_non_bool():
    """A string would silently turn the recompute on (bool("no") is True)."""
    import moe_ops
    from moe_ops._runtime import recompute_enabled

    before = recompute_enabled()
    with pytest.raises(TypeError, match="set_recompute"):
        moe_ops.set_recompute("no")
    assert recompute_enabled() == before   # left as it was


def test_error_K_greater_than_E():
    h, w13, w2, _, _ = make_dispatch_inputs(4, 8, 6, 3, 2)
    with pytest.raises(ValueError, match="must be at most E"):
        torch.ops.moe.dispatch(h, w13, w2, torch.rand(4, 4), torch.zeros(4, 4, dtype=torch.int32))


def test_error_meta_device_mix():
    h, w13, w2, w, ids = _good()
    with pytest.raises(ValueError, match="one device"):
        torch.ops.moe.dispatch(h, w13.to("meta"), w2, w, ids)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_backward_matches_float64(interpreter, routing, dtype):
    """The Triton backward kernels (interpreted) against the float64 reference backward."""
    from moe_ops.reference import dispatch_backward_reference

    g = torch.Generator().manual_seed(10)
    args = make_dispatch_inputs(19, 21, 13, 6, 2, dtype=dtype, routing=routing, generator=g)
    go = torch.randn(19, 21, generator=g).to(dtype)
    got = torch.ops.moe.dispatch_backward(go, *args)
    ref = dispatch_backward_reference(go.double(), *[a.double() if a.is_floating_point() else a
                                                    for a in args])
    for name, a, r in zip(("hidden", "w13", "w2", "topk_weights"), got, ref):
        assert a.dtype == (torch.float32 if name == "topk_weights" else dtype)
        if r.norm() == 0:
            assert torch.equal(a, torch.zeros_like(a)), name
        else:
            assert rel_err(a, r) <= RTOL[dtype], (name, rel_err(a, r))


@needs_interpreter
@settings(max_examples=12, deadline=None)
@given(T=st.integers(0, 40), H=st.integers(1, 24), I=st.integers(1, 24), E=st.integers(1, 12),
       routing=st.sampled_from(ROUTINGS), data=st.data())
def test_triton_backward_hypothesis(T, H, I, E, routing, data):
    from moe_ops.reference import dispatch_backward_reference

    K = data.draw(st.integers(1, E))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    args = make_dispatch_inputs(T, H, I, E, K, routing=routing, generator=g)
    go = torch.randn(T, H, generator=g)
    old = _with_env("TRITON_INTERPRET", "1")
    try:
        got = torch.ops.moe.dispatch_backward(go, *args)
    finally:
        _restore_env("TRITON_INTERPRET", old)
    ref = dispatch_backward_reference(go.double(), *[a.double() if a.is_floating_point() else a
                                                    for a in args])
    scales = [r.double() for r in ref[:3]] + [ds_scale(go, *args)]   # see grad_errors
    for a, r, scale in zip(got, ref, scales):
        assert not torch.isnan(a).any()
        assert (a.double() - r).norm() <= 1e-5 * max(scale.norm().item(), 1e-6)


def test_triton_backward_deterministic(interpreter):
    args = make_dispatch_inputs(25, 16, 12, 4, 2, routing="skewed", requires_grad=True)
    go = torch.randn(25, 16)
    grads = []
    for _ in range(2):
        for a in args[:4]:
            a.grad = None
        torch.ops.moe.dispatch(*args).backward(go)
        grads.append([a.grad.clone() for a in args[:4]])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_interpreter_bfloat16_is_correct(interpreter):
    """Triton's interpreter gets bfloat16 tl.dot wrong silently; moe_ops runs interpreted bf16 on
    float32 copies, so the answer is right (and returned in bf16)."""
    g = torch.Generator().manual_seed(16)
    args = make_dispatch_inputs(9, 32, 16, 4, 2, dtype=torch.bfloat16, generator=g,
                                requires_grad=True)
    out = torch.ops.moe.dispatch(*args)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, _oracle(*args)) <= RTOL[torch.bfloat16]
    go = torch.randn(out.shape, generator=g).bfloat16()
    out.backward(go)
    ref_args = [a.detach().double().requires_grad_(True) for a in args[:4]] + [args[4]]
    _dense_float64(*ref_args).backward(go.double())
    for a, r in zip(args[:4], ref_args[:4]):
        assert a.grad.dtype == a.dtype
        assert rel_err(a.grad, r.grad) <= RTOL[torch.bfloat16]


def test_many_slots_per_token(interpreter):
    # K = E = 40 (contract: any K <= E), including dropped ids.
    _check(5, 8, 6, 40, 40, torch.float32, "negative", seed=8)


@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_errors_internal_backward_ops(path, request):
    """moe.dispatch_backward / moe.dispatch_backward_saved called directly (autograd always
    passes consistent tensors): a grad_out or z of the wrong shape or dtype, or bad forward
    arguments, raise naming the argument (a grad_out with fewer rows was read out of bounds
    by the kernels), in the real and the fake implementations."""
    request.getfixturevalue(path)
    h, w13, w2, w, ids = make_dispatch_inputs(5, 8, 6, 4, 2)
    g = torch.randn(5, 8)
    z = torch.zeros(10, 12)
    bw, bws = torch.ops.moe.dispatch_backward, torch.ops.moe.dispatch_backward_saved
    cases = [
        (lambda: bw(g[:3].clone(), h, w13, w2, w, ids), ValueError, "grad_out must have shape"),
        (lambda: bw(g.half(), h, w13, w2, w, ids), TypeError, "grad_out must have hidden's dtype"),
        (lambda: bw(g, h, w13, w2, w, ids.float()), TypeError, "topk_ids"),
        (lambda: bw(g, h, w13[:, :10], w2, w, ids), ValueError, "w13"),
        (lambda: bw(g, h, w13, w2, w, ids, "swish"), ValueError, "activation"),
        (lambda: bws(g, z[:3], h, w13, w2, w, ids), ValueError, "z must have shape"),
        (lambda: bws(g, z.half(), h, w13, w2, w, ids), TypeError, "z must have hidden's dtype"),
    ]
    from torch._subclasses.fake_tensor import FakeTensorMode

    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(exc, match=match):
            call()
    assert bw(g, h, w13, w2, w, ids)[0].shape == (5, 8)
    assert bws(g, z, h, w13, w2, w, ids)[1].shape == w13.shape


def test_no_tensor_descriptor_for_a_zero_stride():
    """An expanded weight (stride 0 along E) gets no tensor descriptor (the pointer path reads
    it); its contiguous copy does (the interpreter takes descriptors)."""
    from moe_ops.launch._common import tma_layout_ok, weight_desc

    w = torch.randn(1, 32, 16, dtype=torch.float16)
    assert tma_layout_ok(w.expand(4, -1, -1).contiguous())
    assert not tma_layout_ok(w.expand(4, -1, -1))
    assert weight_desc(w.expand(4, -1, -1), [1, 16, 16]) is None
    assert weight_desc(w.expand(4, -1, -1).contiguous(), [1, 16, 16]) is not None

"""moe.dispatch with the up projection apart from the gate (`w3`, DBRX's layout): w13 is the gate
[E, I, H], w3 the up projection [E, I, H]. Oracle: the float64 reference on the joined
[E, 2I, H] weight (the one-tensor path, itself checked against a dense oracle in
tests/test_dispatch_variants.py). The reference (CPU kernel) and the interpreted Triton kernels,
forward and backward, opcheck, errors, no copy of a strided w3, one compiled frame for every T.
GPU tests: tests/test_dispatch_variants_gpu.py -k w3."""
import pytest
import torch
import torch._dynamo.testing

import moe_ops
from conftest import RTOL, rel_err
from moe_ops.ops.samples import make_dispatch_inputs
from moe_ops.reference.dispatch import (dispatch_backward_reference, dispatch_reference,
                                        dispatch_z_reference)


def _make(T=7, H=9, I=5, E=4, K=2, dtype=torch.float32, routing="negative", seed=0,
          biases=False, strided=False, dbrx=False, device="cpu"):
    """(hidden, w13 = gate [E, I, H], w2 [E, H, I], topk_weights, topk_ids), kw with w3 and the
    biases. strided: w3 and w2 as transposed views of [E, H, I] storage (w13 too); dbrx: the
    three weights as DBRX's views of [E*I, H] parameters."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, w13, w2, tw, ids = make_dispatch_inputs(T, H, I, E, K, dtype=dtype, routing=routing,
                                               generator=g, device=device)
    gate, up = w13[:, :I].clone(), w13[:, I:].clone()
    if strided:
        gate = gate.transpose(1, 2).contiguous().transpose(1, 2)
        up = up.transpose(1, 2).contiguous().transpose(1, 2)
        w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    if dbrx:
        gate = gate.reshape(E * I, H).view(E, I, H)
        up = up.reshape(E * I, H).view(E, I, H)
        w2 = w2.transpose(1, 2).reshape(E * I, H).view(E, I, H).transpose(1, 2)
    kw = dict(w3=up)
    if biases:
        kw.update(w13_bias=(torch.randn(E, 2 * I, generator=g, device=device) * 0.5).to(dtype),
                  w2_bias=(torch.randn(E, H, generator=g, device=device) * 0.5).to(dtype))
    return (h, gate, w2, tw, ids), kw


def _d(t):
    return None if t is None else t.detach().double()


def _joined64(args, kw):
    """The float64 one-tensor arguments: w13 = [gate; up] rows, no w3."""
    h, gate, w2, tw, ids = args
    kw64 = {k: _d(v) for k, v in kw.items() if k != "w3" and isinstance(v, torch.Tensor)}
    kw64.update({k: v for k, v in kw.items() if not isinstance(v, torch.Tensor) and v is not None})
    w13 = torch.cat([_d(gate), _d(kw["w3"])], dim=1)
    return (_d(h), w13, _d(w2), _d(tw), ids), kw64


def _oracle(args, kw):
    a, k = _joined64(args, kw)
    return dispatch_reference(*a, **k)


def _grad_oracle(args, kw, go):
    """float64 (hidden, w13 gate, w2, topk_weights, w13_bias, w2_bias, w3) gradients."""
    a, k = _joined64(args, kw)
    g = dispatch_backward_reference(go.double(), *a, **k)
    g = list(g) + [None] * (6 - len(g))
    I = args[2].shape[2]
    return [g[0], g[1][:, :I], g[2], g[3], g[4], g[5], g[1][:, I:]]


ACTS = [dict(), dict(activation="gelu"), dict(activation="swiglu_oai", alpha=1.3, limit=0.4),
        dict(activation="relu", weights_on_input=True)]
ACT_IDS = ["silu", "gelu", "swiglu_oai", "relu_woi"]


# ---------------------------------------------------------------------------------------------
# forward

@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("act", range(len(ACTS)), ids=ACT_IDS)
@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_forward_matches_reference(path, request, act, biases):
    request.getfixturevalue(path)
    args, kw = _make(biases=biases, strided=act % 2 == 1, seed=act)
    kw.update(ACTS[act])
    out = moe_ops.dispatch(*args, **kw)
    assert out.dtype == torch.float32 and out.shape == args[0].shape
    assert rel_err(out, _oracle(args, kw)) <= RTOL[torch.float32]


@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_forward_bfloat16(path, request):
    request.getfixturevalue(path)
    args, kw = _make(T=5, dtype=torch.bfloat16, biases=True, dbrx=True, seed=1)
    out = moe_ops.dispatch(*args, **kw)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, _oracle(args, kw)) <= RTOL[torch.bfloat16]


def _configs():
    from dataclasses import replace

    from moe_ops.tuning.configs import DispatchConfig

    base = DispatchConfig(block_m=16, gate_up_block_n=16, gate_up_block_k=16, down_block_n=16,
                          down_block_k=16, num_warps=4, num_stages=1)
    return {
        "pointer": base,
        # descriptor configs: calls with w3 take the pointer path all the same
        "tma_pair": replace(base, block_m=32, tma_weights=True, tma_gate_up_pair=True,
                            half_height_tails=True, tma_down_activations=True),
        "tma": replace(base, tma_weights=True),
        "direct": replace(base, direct_rows=True),
        "direct_fused": replace(base, direct_rows=True, down_combine_fused=True),
        "direct_combine_last": replace(base, direct_rows=True, combine_in_down=True),
    }


def _compute_kw(kw):
    return {k: v for k, v in kw.items() if k in ("activation", "w13_bias", "w2_bias", "alpha",
                                                  "limit", "weights_on_input", "w3")}


@pytest.mark.parametrize("path", list(_configs()))
def test_triton_forward_paths(interpreter, path):
    """Every path of dispatch_triton with w3 (the descriptor configs with 16-byte aligned rows,
    where they would take TMA without w3), the saved z = [W13_e x | W3_e x] per slot."""
    from moe_ops.launch.dispatch import dispatch_triton

    cfg = _configs()[path]
    T = 1 if path in ("direct_fused", "direct_combine_last") else 5
    H, I = (16, 8) if path.startswith("tma") else (9, 5)
    args, kw = _make(T=T, H=H, I=I, E=5, K=3, biases=path != "tma", seed=3)
    out = torch.full(args[0].shape, float("nan"))
    got, z = dispatch_triton(*args, config=cfg, out=out, save_z=True, **_compute_kw(kw))
    assert got.data_ptr() == out.data_ptr()
    assert rel_err(got, _oracle(args, kw)) <= 1e-5
    a, _ = _joined64(args, kw)
    assert rel_err(z, dispatch_z_reference(a[0], a[1], args[4])) <= 1e-5


@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_forward_edges(path, request):
    """T = 0, T = 1, odd H and I, experts without tokens, every slot on one expert, ids < 0,
    a token with no valid id."""
    request.getfixturevalue(path)
    args, kw = _make(T=0)
    out = moe_ops.dispatch(*args, **kw)
    assert out.shape == (0, 9)
    for T, H, I, E, K, routing in ((1, 7, 3, 4, 2, "negative"), (6, 11, 7, 6, 1, "one_expert"),
                                   (5, 5, 1, 3, 3, "uniform")):
        args, kw = _make(T=T, H=H, I=I, E=E, K=K, routing=routing, seed=T)
        if T == 5:
            args[4][2] = -1    # a token without an expert
        out = moe_ops.dispatch(*args, **kw)
        assert rel_err(out, _oracle(args, kw)) <= RTOL[torch.float32], (T, H, I)
        if T == 5:
            assert torch.equal(out[2], torch.zeros_like(out[2]))


# ---------------------------------------------------------------------------------------------
# backward

def _check_grads(got, ref, leaves, tol):
    names = ["hidden", "w13", "w2", "topk_weights", "w13_bias", "w2_bias", "w3"]
    for name, t, a, r in zip(names, leaves, got, ref):
        if t is None:
            continue
        assert a is not None and a.shape == t.shape and a.dtype == t.dtype, name
        if name in ("w13", "w2", "w3"):
            assert a.stride() == t.stride(), (name, a.stride(), t.stride())
        assert rel_err(a, r) <= tol, (name, rel_err(a, r))


@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("act", range(len(ACTS)), ids=ACT_IDS)
@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_autograd_matches_reference(path, request, act, biases):
    """moe_ops.dispatch under autograd (saved z; recompute for the interpreted SiLU case):
    .grad of hidden, w13 (gate), w2, topk_weights, the biases and w3, with the weights' strides."""
    request.getfixturevalue(path)
    args, kw = _make(biases=biases, strided=act % 2 == 0, seed=10 + act)
    kw.update(ACTS[act])
    leaves = [*args[:4], kw.get("w13_bias"), kw.get("w2_bias"), kw["w3"]]
    for t in leaves:
        if t is not None:
            t.requires_grad_(True)
    go = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(act))
    old = moe_ops.set_recompute(act == 0 and path == "interpreter")
    try:
        moe_ops.dispatch(*args, **kw).backward(go)
    finally:
        moe_ops.set_recompute(old)
    _check_grads([None if t is None else t.grad for t in leaves], _grad_oracle(args, kw, go),
                 leaves, 2e-5)


@pytest.mark.parametrize("saved_z", [False, True])
def test_triton_backward_float16_aligned(interpreter, saved_z):
    """float16, 16-byte aligned rows (the descriptor paths of the backward's row GEMMs and the
    persistent weight-gradient kernel, on dz's gate and up column halves), biases."""
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton

    args, kw = _make(T=12, H=16, I=8, E=3, K=2, dtype=torch.float16, biases=True, seed=20)
    go = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(21)).half()
    z = dispatch_triton(*args, save_z=True, **_compute_kw(kw))[1] if saved_z else None
    got = dispatch_backward_triton(go, *args, z=z, **_compute_kw(kw))
    assert len(got) == 7
    leaves = [*args[:4], kw["w13_bias"], kw["w2_bias"], kw["w3"]]
    _check_grads(got, _grad_oracle(args, kw, go), leaves, 6e-3)


def test_backward_t0_and_dropped(interpreter):
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton

    args, kw = _make(T=0)
    got = dispatch_backward_triton(torch.zeros(0, 9), *args, **_compute_kw(kw))
    assert len(got) == 7 and torch.equal(got[6], torch.zeros_like(kw["w3"]))
    args, kw = _make(T=4, routing="negative", seed=22)
    args[4].fill_(-1)
    got = dispatch_backward_triton(torch.ones(4, 9), *args, **_compute_kw(kw))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in got if g is not None)


# ---------------------------------------------------------------------------------------------
# opcheck, compile, copies, errors

def _samples(requires_grad=True):
    out = []
    for T, opts in ((5, dict(biases=True, strided=True)), (1, dict(dbrx=True)),
                    (0, dict())):
        args, kw = _make(T=T, seed=30 + T, **opts)
        if requires_grad:
            for t in (*args[:4], *[v for v in kw.values() if isinstance(v, torch.Tensor)]):
                t.requires_grad_(True)
        out.append((args, kw))
    out[0][1].update(activation="swiglu_oai", alpha=1.2, limit=0.5, weights_on_input=True)
    return out


@pytest.mark.parametrize("sample", range(3))
def test_opcheck(reference_path, sample):
    args, kw = _samples()[sample]
    torch.library.opcheck(torch.ops.moe.dispatch.default, args, kw)
    torch.library.opcheck(torch.ops.moe.dispatch_train.default, args, kw)
    out, z = torch.ops.moe.dispatch_train(*args, **kw)
    assert z.shape == (args[0].shape[0] * args[4].shape[1], 2 * args[2].shape[2])
    go = torch.randn(out.shape, dtype=out.dtype)
    torch.library.opcheck(torch.ops.moe.dispatch_backward_saved.default, (go, z, *args), kw)
    grads = torch.ops.moe.dispatch_backward(go, *args, **kw)
    assert len(grads) == 7 and grads[6].shape == kw["w3"].shape


def test_gradcheck(reference_path):
    args, kw = _make(T=3, H=4, I=3, E=3, K=2, biases=True, seed=40)
    args = [a.double() if a.is_floating_point() else a for a in args]
    b13, b2, w3 = kw["w13_bias"].double(), kw["w2_bias"].double(), kw["w3"].double()
    ids = args[4]

    def f(h, w13, w2, w, b13, b2, w3):
        return moe_ops.dispatch(h, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, w3=w3,
                                activation="gelu")

    inputs = [t.requires_grad_(True) for t in (*args[:4], b13, b2, w3)]
    assert torch.autograd.gradcheck(f, inputs)


def test_fullgraph_one_frame_for_every_T(reference_path):
    """moe_ops.route then moe_ops.dispatch with w3 inside one compiled function: one frame
    (fullgraph, T unbacked) for T = 1, 0, 3, 11, forward and w3's gradient."""
    from torch._dynamo.decorators import mark_unbacked

    torch._dynamo.reset()
    (_, w13, w2, _, _), kw = _make(T=2, dbrx=True)
    w3 = kw["w3"].requires_grad_(True)
    router = torch.randn(9, 4, generator=torch.Generator().manual_seed(0))

    def f(h, w13, w2, w3):
        w, ids = moe_ops.route(h @ router, 2)
        return moe_ops.dispatch(h, w13, w2, w, ids, w3=w3), w, ids

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for i, T in enumerate([1, 0, 3, 11]):
        h = torch.randn(T, 9, generator=torch.Generator().manual_seed(T))
        if i == 0:
            mark_unbacked(h, 0)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out, w, ids = compiled(h, w13, w2, w3)
        if T:
            assert rel_err(out, _oracle((h, w13, w2, w, ids), dict(w3=w3))) <= 1e-5
        w3.grad = None
        go = torch.randn(T, 9, generator=torch.Generator().manual_seed(100 + T))
        out.backward(go)
        ref = _grad_oracle((h, w13, w2, w, ids), dict(w3=w3), go)[6]
        assert torch.allclose(w3.grad, ref.float(), atol=1e-5)
    assert counter.frame_count == 1


@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_strided_w3_is_not_copied(path, request, monkeypatch):
    """DBRX's views (w1 / v1 [E*I, H] viewed as [E, I, H], w2 seen transposed) and transposed
    views are read as they are: no .contiguous() of a weight, the result right."""
    request.getfixturevalue(path)
    args, kw = _make(dbrx=True, seed=50)
    assert not args[2].is_contiguous()
    args_t, kw_t = _make(strided=True, seed=51)
    assert not kw_t["w3"].is_contiguous()
    ptrs = {t.data_ptr() for t in (args[1], args[2], kw["w3"], args_t[1], args_t[2], kw_t["w3"])}
    calls = []
    real = torch.Tensor.contiguous

    def spy(self, *a, **k):
        if self.data_ptr() in ptrs:
            calls.append(tuple(self.shape))
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    for a, k in ((args, kw), (args_t, kw_t)):
        out = moe_ops.dispatch(*a, **k)
        assert rel_err(out, _oracle(a, k)) <= RTOL[torch.float32]
    assert calls == []


def test_errors_name_w3(reference_path):
    args, kw = _make(T=3, H=8, I=4, E=4, K=2)
    h, w13, w2, tw, ids = args
    w3 = kw["w3"]
    cases = [
        (dict(w3=w3[:, :3]), ValueError, "w3"),
        (dict(w3=w3[:3]), ValueError, "w3"),
        (dict(w3=w3.double()), TypeError, "w3"),
        (dict(w3=w3.to("meta")), ValueError, "w3"),
        (dict(w3=w3, gate_up_interleaved=True), ValueError, "w3"),
        (dict(w3="up"), TypeError, "w3"),
    ]
    for extra, exc, word in cases:
        with pytest.raises(exc, match=word):
            moe_ops.dispatch(h, w13, w2, tw, ids, **extra)
    # a [E, 2I, H] w13 with w3: w13 must be the gate alone
    with pytest.raises(ValueError, match=r"w13 must have shape \[E, I, H\]"):
        moe_ops.dispatch(h, torch.cat([w13, w3], 1), w2, tw, ids, w3=w3)
    # the op itself raises too (not only the Python entry point)
    with pytest.raises(ValueError, match="w3"):
        torch.ops.moe.dispatch(h, w13, w2, tw, ids, w3=w3[:, :3])
    # a w3 stride the kernels cannot address (meta tensors: the check runs first), a sparse w3
    from moe_ops.ops.checks import check_dispatch

    meta = [t.detach().to("meta") for t in args]
    huge = torch.empty_strided((4, 4, 8), (2**31, 8, 1), device="meta")
    with pytest.raises(ValueError, match="w3 has strides .* non-view copy would be needed"):
        check_dispatch(*meta, w3=huge)
    with pytest.raises(TypeError, match="w3 must be a strided"):
        moe_ops.dispatch(h, w13, w2, tw, ids, w3=w3.to_sparse())


def test_w3_with_quantized_weights_is_refused(reference_path):
    from moe_ops.reference.quant import quantize_fp8_block

    h, w13, w2, tw, ids = make_dispatch_inputs(3, 32, 16, 4, 2)
    q13, s13 = quantize_fp8_block(w13[:, :16].contiguous(), (16, 16))
    q2, s2 = quantize_fp8_block(w2, (16, 16))
    q3, _ = quantize_fp8_block(w13[:, 16:].contiguous(), (16, 16))
    for w3 in (q3, w13[:, 16:]):
        with pytest.raises(ValueError, match="w3.*not supported with quantized"):
            moe_ops.dispatch(h, q13, q2, tw, ids, w13_scale=s13, w2_scale=s2,
                             block_shape=[16, 16], w3=w3)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_w3_same_as_w13_relu_squared(path, request, recompute):
    """Ungated ReLU-squared experts (NemotronH) as moe.dispatch(w13=up, w3=up, "relu"): the
    output is sum_k w * W2_e relu(up_e x)^2 (float64 oracle), the gate+up kernel takes its
    one-product path (SAME_W3), and the two uses of `up` add up in its gradient."""
    from moe_ops.launch.dispatch import Variant, same_view

    request.getfixturevalue(path)
    args, _ = _make(T=6, H=9, I=5, E=4, K=2, strided=True, seed=21)
    h, up, w2, tw, ids = args
    assert same_view(up, up) and not same_view(up, up.clone()) and not same_view(up, None)
    kw = Variant(activation="relu", w3=up, same_w3=same_view(up, up)).gate_up_args(tw)
    assert kw["SAME_W3"] is True and kw["HAS_W3"] is True
    leaves = [t.detach().clone().requires_grad_(True) for t in (h, up, w2, tw)]
    h_, up_, w2_, tw_ = leaves
    old = moe_ops.set_recompute(recompute)
    try:
        out = moe_ops.dispatch(h_, up_, w2_, tw_, ids, activation="relu", w3=up_)
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
        out.backward(go)
    finally:
        moe_ops.set_recompute(old)
    h64, up64, w264, tw64 = (t.detach().double().requires_grad_(True) for t in (h, up, w2, tw))
    ref = torch.zeros(h.shape, dtype=torch.float64)
    for t in range(h.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if 0 <= e < up.shape[0]:
                ref[t] += tw64[t, k] * (w264[e] @ torch.relu(up64[e] @ h64[t]) ** 2)
    ref.backward(go.double())
    assert rel_err(out, ref) <= 1e-5
    for got, want in zip(leaves, (h64, up64, w264, tw64)):
        assert rel_err(got.grad, want.grad) <= 2e-5

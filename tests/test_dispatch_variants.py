"""moe.dispatch's expert variants (biases, activations, interleaved gate/up rows, strided
weights, the routing weight on the input): the reference against a dense float64 oracle,
gradients (gradcheck, bias gradients, gradient strides), opcheck, errors, and the interpreted
Triton kernels."""
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch._dynamo.testing
import torch.nn.functional as F

import moe_ops
from conftest import RTOL, needs_interpreter, rel_err
from moe_ops.ops.checks import check_dispatch
from moe_ops.ops.samples import VARIANTS, dispatch_variant_samples, make_variant_inputs

VARIANT_IDS = [name for name, _, _ in VARIANTS]


def dense_oracle(hidden, w13, w2, tw, ids, activation="silu", w13_bias=None, w2_bias=None,
                 alpha=1.702, limit=7.0, gate_up_interleaved=False, weights_on_input=False,
                 **_):
    """Every slot at once (einsum over gathered expert weights), differentiable: an oracle
    written apart from moe_ops.reference, in the arithmetic of docs/contract.md."""
    T, K = ids.shape
    E = w13.shape[0]
    ids = ids.long()
    ok = ((ids >= 0) & (ids < E)).to(hidden.dtype)[..., None]
    e = ids.clamp(0, E - 1)
    x = hidden[:, None, :].expand(T, K, hidden.shape[1])
    s = tw.to(hidden.dtype)[..., None]
    if weights_on_input:
        x = x * s
    h = torch.einsum("tkih,tkh->tki", w13[e], x)
    if w13_bias is not None:
        h = h + w13_bias.to(h.dtype)[e]
    if gate_up_interleaved:
        g, u = h[..., 0::2], h[..., 1::2]
    else:
        g, u = h.chunk(2, dim=-1)
    if activation == "silu":
        a = F.silu(g) * u
    elif activation == "gelu":
        a = 0.5 * g * (1 + torch.erf(g / 2 ** 0.5)) * u
    elif activation == "gelu_tanh":
        a = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3))) * u
    elif activation == "relu":
        a = torch.relu(g) * u
    elif activation == "silu_clamp":   # transformers' DeepseekV4Experts._apply_gate
        a = F.silu(g.clamp(min=None, max=limit)) * u.clamp(min=-limit, max=limit)
    elif activation == "silu_clamp_out":   # transformers' Step3p7Experts._apply_gate
        a = F.silu(g).clamp(max=limit) * u.clamp(min=-limit, max=limit)
    elif activation == "swiglu_softcap":   # transformers' Inkling2SoftcappedSwiGLU
        a = torch.tanh(g / alpha) * alpha * torch.sigmoid(g) * (torch.tanh(u / limit) * limit)
    else:   # transformers' GptOssExperts._apply_gate
        g = g.clamp(min=None, max=limit)
        u = u.clamp(min=-limit, max=limit)
        a = (u + 1) * (g * torch.sigmoid(g * alpha))
    y = torch.einsum("tkhi,tki->tkh", w2[e], a)
    if w2_bias is not None:
        y = y + w2_bias.to(y.dtype)[e]
    if not weights_on_input:
        y = y * s
    return (y * ok).sum(1)


def _double(t):
    return None if t is None else t.detach().double()


def _inputs(name, T=7, H=9, I=5, E=4, K=2, dtype=torch.float32, routing="negative", seed=0,
            requires_grad=False, **opts_extra):
    _, opts, kw = dict((n, (n, o, k)) for n, o, k in VARIANTS)[name]
    g = torch.Generator().manual_seed(seed)
    args, b13, b2 = make_variant_inputs(T, H, I, E, K, dtype=dtype, routing=routing,
                                        generator=g, **dict(opts, **opts_extra))
    if dtype == torch.float64:
        args = (*args[:3], args[3].double(), args[4])
    if requires_grad:
        for t in (*args[:4], b13, b2):
            if t is not None:
                t.requires_grad_(True)
    return args, dict(kw, w13_bias=b13, w2_bias=b2)


def _oracle64(args, kw):
    kw64 = dict(kw, w13_bias=_double(kw["w13_bias"]), w2_bias=_double(kw["w2_bias"]))
    return dense_oracle(*[_double(a) if a.is_floating_point() else a for a in args], **kw64)


# ---------------------------------------------------------------------------------------------
# reference (the CPU kernel)

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", VARIANT_IDS)
def test_reference_matches_dense_oracle(reference_path, name, dtype):
    args, kw = _inputs(name, dtype=dtype)
    out = moe_ops.dispatch(*args, **kw)
    assert out.dtype == dtype and out.shape == args[0].shape
    assert rel_err(out, _oracle64(args, kw)) <= RTOL[dtype]


@pytest.mark.parametrize("name", VARIANT_IDS)
def test_reference_gradients_match_dense_autograd(reference_path, name):
    """Autograd through moe.dispatch (the reference backward, float64) against autograd through
    the dense oracle: all six gradients; weight gradients keep the weights' strides."""
    args, kw = _inputs(name, dtype=torch.float64, requires_grad=True)
    g = torch.Generator().manual_seed(1)
    go = torch.randn(args[0].shape, generator=g, dtype=torch.float64)
    leaves = [t for t in (*args[:4], kw["w13_bias"], kw["w2_bias"]) if t is not None]
    got = torch.autograd.grad(moe_ops.dispatch(*args, **kw), leaves, go)
    ref = torch.autograd.grad(dense_oracle(*args, **kw), leaves, go)
    for t, a, r in zip(leaves, got, ref):
        assert a.shape == t.shape and a.stride() == t.stride(), (a.stride(), t.stride())
        assert rel_err(a, r) <= 1e-10


@pytest.mark.parametrize("name", VARIANT_IDS)
def test_gradcheck(reference_path, name):
    args, kw = _inputs(name, T=3, H=4, I=3, E=3, K=2, dtype=torch.float64, requires_grad=True,
                       seed=2)
    b13, b2 = kw.pop("w13_bias"), kw.pop("w2_bias")
    ids = args[4]

    def f(h, w13, w2, w, b13, b2):
        return moe_ops.dispatch(h, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, **kw)

    assert torch.autograd.gradcheck(f, (*args[:4], b13, b2))


@pytest.mark.parametrize("sample", range(len(VARIANTS) + 1))
def test_opcheck_variants(reference_path, sample):
    args, kw = dispatch_variant_samples(requires_grad=True)[sample]
    torch.library.opcheck(torch.ops.moe.dispatch.default, args, kw)
    out, z = torch.ops.moe.dispatch_train(*args, **kw)
    go = torch.randn(out.shape, dtype=out.dtype)
    torch.library.opcheck(torch.ops.moe.dispatch_backward_saved.default, (go, z, *args), kw)


def test_z_is_the_raw_product(reference_path):
    """dispatch_train's z is W13_e x per slot in w13's row order, before the bias and the
    input's weight (what the backward recomputes from)."""
    from moe_ops.reference.dispatch import dispatch_z_reference

    args, kw = _inputs("gpt_oss", dtype=torch.float64)
    kw["weights_on_input"] = True
    _, z = torch.ops.moe.dispatch_train(*args, **kw)
    assert torch.equal(z, dispatch_z_reference(args[0], args[1], args[4]))


def test_transposed_weights_are_not_copied(reference_path, monkeypatch):
    """The op reads transposed views as they are: no .contiguous() of a weight."""
    args, kw = _inputs("gpt_oss", dtype=torch.float32)
    assert not args[1].is_contiguous() and not args[2].is_contiguous()
    calls = []
    real = torch.Tensor.contiguous

    def spy(self, *a, **k):
        if self.data_ptr() in (args[1].data_ptr(), args[2].data_ptr()):
            calls.append(tuple(self.shape))
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    moe_ops.dispatch(*args, **kw)
    assert calls == []


# ---------------------------------------------------------------------------------------------
# errors

def _good():
    args, kw = _inputs("gpt_oss", T=3, H=8, I=4, E=4, K=2)
    return args, kw


@pytest.mark.parametrize("path", ["reference_path", "interpreter"])
def test_errors(path, request):
    request.getfixturevalue(path)
    args, kw = _good()
    h, w13, w2, w, ids = args
    b13, b2 = kw["w13_bias"], kw["w2_bias"]
    cases = [
        (dict(w13_bias=b13[:, :4]), ValueError, r"w13_bias must have shape \[E, 2I\] = \[4, 8\]"),
        (dict(w2_bias=b2[:3]), ValueError, r"w2_bias must have shape \[E, H\] = \[4, 8\]"),
        (dict(w13_bias=b13.half()), TypeError, "w13_bias must be float32 or hidden's dtype"),
        (dict(w2_bias=b2.to(torch.int32)), TypeError, "w2_bias must be float32"),
        (dict(w2_bias=b2.to("meta")), ValueError, "w2_bias is on meta"),
        (dict(activation="geglu"), ValueError,
         "activation must be one of 'silu', 'gelu', 'gelu_tanh', 'relu', 'swiglu_oai', "
         "'silu_clamp', 'silu_clamp_out', 'swiglu_softcap'"),
        (dict(limit=-1.0), ValueError, "limit must be > 0"),
        (dict(activation="swiglu_softcap", alpha=0.0), ValueError,
         "alpha must be > 0 with activation='swiglu_softcap'"),
        (dict(alpha=float("nan")), ValueError, "alpha must be finite"),
        (dict(w13_scale=torch.ones(4, 1, 1)), TypeError,
         "w13_scale given with float32 weights"),
        (dict(w2_scale=torch.ones(4, 1, 1)), TypeError, "w2_scale given with float32 weights"),
        (dict(block_shape=[128, 128]), TypeError, "block_shape given with float32 weights"),
    ]
    for extra, exc, match in cases:
        with pytest.raises(exc, match=match):
            torch.ops.moe.dispatch(*args, **dict(kw, **extra))
        with pytest.raises(exc, match=match):
            moe_ops.dispatch(*args, **dict(kw, **extra))
    for extra, exc, match in [
            (dict(alpha="1.7"), TypeError, "alpha must be a float, got str"),
            (dict(limit=None), TypeError, "limit must be a float, got NoneType"),
            (dict(gate_up_interleaved=1), TypeError, "gate_up_interleaved must be a bool"),
            (dict(weights_on_input="yes"), TypeError, "weights_on_input must be a bool"),
            (dict(w13_bias=[0.0]), TypeError, "w13_bias must be a torch.Tensor")]:
        with pytest.raises(exc, match=match):
            moe_ops.dispatch(*args, **dict(kw, **extra))
    # an odd 2I with interleaved rows (w2 then disagrees with w13 as well: the flag is named)
    with pytest.raises(ValueError, match="gate_up_interleaved=True needs an even w13.shape"):
        moe_ops.dispatch(h, w13[:, :7], w2, w, ids, gate_up_interleaved=True)
    # a weight with a stride the kernels cannot address: raises, never copies
    meta = [t.detach().to("meta") for t in (h, w13, w2, w, ids)]
    meta[2] = torch.empty_strided((4, 8, 4), (1, 2**31, 1), device="meta")
    with pytest.raises(ValueError, match="w2 has strides .* non-view copy would be needed"):
        check_dispatch(*meta)   # (the op runs this check first; no Meta kernel to reach)
    with pytest.raises(TypeError, match="w2 must be a strided"):
        moe_ops.dispatch(h, w13, w2.detach().contiguous().to_sparse(), w, ids)


# ---------------------------------------------------------------------------------------------
# Triton forward (interpreted): every path of dispatch_triton with every variant

def _configs():
    from dataclasses import replace

    from moe_ops.tuning.configs import DispatchConfig

    base = DispatchConfig(block_m=16, gate_up_block_n=16, gate_up_block_k=16, down_block_n=16,
                          down_block_k=16, num_warps=4, num_stages=1)
    return {
        "pointer": base,
        "tma_pair": replace(base, block_m=32, tma_weights=True, tma_gate_up_pair=True,
                            half_height_tails=True, tma_down_activations=True),
        "tma": replace(base, tma_weights=True),
        "direct": replace(base, direct_rows=True),
        "direct_fused": replace(base, direct_rows=True, down_combine_fused=True),
        "direct_combine_last": replace(base, direct_rows=True, combine_in_down=True),
    }


def _compute_kw(kw):
    return {k: kw[k] for k in ("activation", "w13_bias", "w2_bias", "alpha", "limit",
                               "gate_up_interleaved", "weights_on_input") if k in kw}


def _triton_forward_check(args, kw, cfg, dtype, save_z=False):
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.reference.dispatch import dispatch_z_reference

    T, H = args[0].shape
    out = torch.full((T, H), float("nan"), dtype=dtype)
    res = dispatch_triton(*args, config=cfg, out=out, save_z=save_z, **_compute_kw(kw))
    got = res[0] if save_z else res
    assert got.data_ptr() == out.data_ptr()
    ref = _oracle64(args, kw)
    if T:
        tol = 1e-5 if dtype == torch.float32 else 4e-3
        assert rel_err(got, ref) <= tol, rel_err(got, ref)
    if save_z:
        z_ref = dispatch_z_reference(*[_double(a) if a.is_floating_point() else a
                                       for a in (args[0], args[1])], args[4])
        assert rel_err(res[1], z_ref) <= (1e-5 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("path", ["pointer", "tma_pair", "direct", "direct_fused",
                                  "direct_combine_last"])
@pytest.mark.parametrize("name", VARIANT_IDS)
def test_triton_forward_variants(interpreter, name, path):
    """Each variant on each path: T = 1 for the one-token paths (dropped ids included), an odd
    shape elsewhere; 16-byte aligned rows for the descriptor path (else it falls back)."""
    cfg = _configs()[path]
    if path.startswith("direct"):
        T, K, routing = (1 if path != "direct" else 5), 3, "negative"
    else:
        T, K, routing = 7, 2, "negative"
    H, I = (16, 8) if path == "tma_pair" else (9, 5)
    args, kw = _inputs(name, T=T, H=H, I=I, E=5, K=K, routing=routing, seed=3)
    _triton_forward_check(args, kw, cfg, torch.float32, save_z=path in ("pointer", "direct"))


@pytest.mark.parametrize("name", ["gpt_oss", "weights_on_input", "gelu_tanh"])
def test_triton_forward_float16_and_edges(interpreter, name):
    """float16 with float32 biases, the two-copy descriptor path, T = 0, every slot on one
    expert, K = E."""
    cfg = _configs()
    args, kw = _inputs(name, T=6, H=16, I=8, E=3, K=2, dtype=torch.float16, seed=4,
                       bias_dtype=torch.float32)
    _triton_forward_check(args, kw, cfg["tma"], torch.float16)
    args, kw = _inputs(name, T=0, H=9, I=5, E=3, K=2, seed=5)
    _triton_forward_check(args, kw, cfg["pointer"], torch.float32, save_z=True)
    args, kw = _inputs(name, T=9, H=9, I=5, E=3, K=1, routing="one_expert", seed=6)
    _triton_forward_check(args, kw, cfg["pointer"], torch.float32)
    args, kw = _inputs(name, T=4, H=9, I=5, E=3, K=3, routing="uniform", seed=7)
    _triton_forward_check(args, kw, cfg["tma_pair"], torch.float32)


@pytest.mark.parametrize("name", ["gpt_oss", "relu"])
def test_op_interpreted_bfloat16(interpreter, name):
    """bf16 through the op under the interpreter (run on float32 copies: see
    ops.dispatch._interpreted_bf16), forward and backward."""
    args, kw = _inputs(name, T=5, H=9, I=5, E=4, K=2, dtype=torch.bfloat16, seed=8,
                       requires_grad=True)
    out = moe_ops.dispatch(*args, **kw)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, _oracle64(args, kw)) <= RTOL[torch.bfloat16]


# ---------------------------------------------------------------------------------------------
# Triton backward (interpreted)

def _grads_oracle(args, kw, go):
    a64 = [_double(a).requires_grad_(True) if a.is_floating_point() else a for a in args]
    kw64 = dict(kw, w13_bias=_double(kw["w13_bias"]), w2_bias=_double(kw["w2_bias"]))
    for k in ("w13_bias", "w2_bias"):
        if kw64[k] is not None:
            kw64[k].requires_grad_(True)
    leaves = [*a64[:4], kw64["w13_bias"], kw64["w2_bias"]]
    out = dense_oracle(*a64, **kw64)
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(out, present, go.double()))
    return [None if t is None else next(grads) for t in leaves]


def _check_backward(args, kw, dtype, z=None, seed=0):
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton

    go = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    got = dispatch_backward_triton(go, *args, z=z, **_compute_kw(kw))
    has_bias = kw["w13_bias"] is not None or kw["w2_bias"] is not None
    assert len(got) == (6 if has_bias else 4)
    got = list(got) + [None] * (6 - len(got))
    ref = _grads_oracle(args, kw, go)
    tol = 2e-5 if dtype == torch.float32 else 6e-3
    names = ["hidden", "w13", "w2", "topk_weights", "w13_bias", "w2_bias"]
    leaves = [*args[:4], kw["w13_bias"], kw["w2_bias"]]
    for name, t, a, r in zip(names, leaves, got, ref):
        if t is None:
            assert a is None, name
            continue
        assert a.shape == t.shape and a.dtype == t.dtype, name
        if name in ("w13", "w2"):
            assert a.stride() == t.stride(), (name, a.stride(), t.stride())
        if r.norm() == 0:
            assert torch.equal(a, torch.zeros_like(a)), name
        else:
            assert rel_err(a, r) <= tol, (name, rel_err(a, r))


@pytest.mark.parametrize("saved_z", [False, True])
@pytest.mark.parametrize("name", VARIANT_IDS)
def test_triton_backward_variants(interpreter, name, saved_z):
    """All six gradients of every variant against float64 autograd through the dense oracle;
    z recomputed, or saved by the Triton training forward."""
    from moe_ops.launch.dispatch import dispatch_triton

    args, kw = _inputs(name, T=7, H=9, I=5, E=4, K=2, routing="negative", seed=9)
    z = dispatch_triton(*args, save_z=True, **_compute_kw(kw))[1] if saved_z else None
    _check_backward(args, kw, torch.float32, z=z, seed=10)


@pytest.mark.parametrize("name", ["gpt_oss", "weights_on_input", "gelu"])
def test_triton_backward_float16_aligned(interpreter, name):
    """float16 with 16-byte aligned rows (the descriptor paths of the row GEMMs and the
    persistent weight-gradient kernel), every slot on one expert, and T = 0."""
    args, kw = _inputs(name, T=12, H=16, I=8, E=3, K=2, dtype=torch.float16, seed=11)
    _check_backward(args, kw, torch.float16, seed=12)
    args, kw = _inputs(name, T=6, H=9, I=5, E=3, K=1, routing="one_expert", seed=13)
    _check_backward(args, kw, torch.float32, seed=14)
    args, kw = _inputs(name, T=0, H=9, I=5, E=3, K=2, seed=15)
    _check_backward(args, kw, torch.float32, seed=16)


@pytest.mark.parametrize("name", ["gpt_oss", "weights_on_input"])
def test_op_autograd_interpreted(interpreter, name):
    """moe_ops.dispatch under autograd on the interpreted kernels (saved z): .grad of every
    input, weight gradients with the transposed weights' strides."""
    args, kw = _inputs(name, T=5, H=9, I=5, E=4, K=2, seed=17, requires_grad=True)
    go = torch.randn(5, 9, generator=torch.Generator().manual_seed(18))
    moe_ops.dispatch(*args, **kw).backward(go)
    ref = _grads_oracle(args, kw, go)
    for t, r in zip([*args[:4], kw["w13_bias"], kw["w2_bias"]], ref):
        assert t.grad is not None and t.grad.stride() == t.stride()
        assert rel_err(t.grad, r) <= 2e-5


# ---------------------------------------------------------------------------------------------
# torch.compile: one frame for every T with the variant arguments (CPU, reference kernels)

def test_fullgraph_one_frame_for_every_T(reference_path):
    """moe_ops.dispatch with biases, swiglu_oai, interleaved rows and transposed weights, routed
    by moe_ops.route inside the compiled function: one frame (fullgraph) for T = 1, 0, 3, 11,
    forward and the bias gradient."""
    from torch._dynamo.decorators import mark_unbacked

    torch._dynamo.reset()
    (_, w13, w2, _, _), kw = _inputs("gpt_oss", T=2)
    b13, b2 = kw.pop("w13_bias"), kw.pop("w2_bias")
    b13.requires_grad_(True)
    router = torch.randn(9, 4, generator=torch.Generator().manual_seed(0))

    def f(h, w13, w2, b13, b2):
        w, ids = moe_ops.route(h @ router, 2)
        return moe_ops.dispatch(h, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, **kw), w, ids

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for i, T in enumerate([1, 0, 3, 11]):
        h = torch.randn(T, 9, generator=torch.Generator().manual_seed(T))
        if i == 0:
            mark_unbacked(h, 0)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out, w, ids = compiled(h, w13, w2, b13, b2)
        full = dict(kw, w13_bias=b13, w2_bias=b2)
        if T:
            assert rel_err(out, _oracle64((h, w13, w2, w, ids), full)) <= 1e-5
        b13.grad = None
        out.sum().backward()
        g_ref, = torch.autograd.grad(dense_oracle(h, w13, w2, w, ids, **full).sum(), b13)
        assert torch.allclose(b13.grad, g_ref, atol=1e-5)
    assert counter.frame_count == 1


@pytest.mark.parametrize("name", ["gpt_oss", "swiglu_oai"])
def test_transposed_w13_takes_the_storage_descriptor(interpreter, monkeypatch, name):
    """A transposed w13 (gpt-oss's [E, H, 2I] storage) with 16-byte aligned rows is read
    through a descriptor over its storage (TMA_TRANS; interleaved or gate-first columns), not
    by pointer loads, and gives the reference's answer."""
    import moe_ops.launch.dispatch as ld
    from conftest import spy_kernel_launches

    seen = []
    spy_kernel_launches(monkeypatch, ld, lambda k, g, a, kw: seen.append(
        (k.fn.__name__, kw.get("TMA_TRANS", False), kw.get("INTERLEAVED", False))))
    args, kw = _inputs(name, T=7, H=16, I=8, E=5, K=2, seed=19)
    _triton_forward_check(args, kw, _configs()["tma"], torch.float32)
    interleaved = kw.get("gate_up_interleaved", False)
    assert ("gate_up_kernel", True, interleaved) in seen, seen


@pytest.mark.slow
@needs_interpreter
@settings(max_examples=15, deadline=None)
@given(T=st.integers(0, 40), H=st.integers(1, 24), I=st.integers(1, 16), E=st.integers(1, 8),
       activation=st.sampled_from(["silu", "gelu", "gelu_tanh", "relu", "swiglu_oai", "silu_clamp",
                                   "silu_clamp_out", "swiglu_softcap"]),
       flags=st.lists(st.booleans(), min_size=6, max_size=6),
       routing=st.sampled_from(["uniform", "negative", "one_expert", "skewed"]),
       scale=st.sampled_from([1e-3, 1.0]), data=st.data())
def test_triton_variants_hypothesis(T, H, I, E, activation, flags, routing, scale, data):
    """Random shapes and combinations of the variants: the interpreted forward (heuristic
    config) and backward against float64 autograd, with hidden of scale 1 or 1e-3 (small
    gate/up values are where an activation's float32 formula can lose relative precision)."""
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton

    K = data.draw(st.integers(1, E))
    if routing == "one_expert":
        K = 1
    b13, b2, t13, t2, inter, woi = flags
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    args, bias13, bias2 = make_variant_inputs(T, H, I, E, K, routing=routing, generator=g,
                                              w13_bias=b13, w2_bias=b2, transpose_w13=t13,
                                              transpose_w2=t2)
    args = (args[0] * scale, *args[1:])
    kw = dict(activation=activation, w13_bias=bias13, w2_bias=bias2, alpha=1.3, limit=0.5,
              gate_up_interleaved=inter, weights_on_input=woi)
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        out = torch.full((T, H), float("nan"))
        dispatch_triton(*args, out=out, **kw)
        go = torch.randn(T, H, generator=g)
        got = dispatch_backward_triton(go, *args, **kw)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old
    if T:
        assert rel_err(out, _oracle64(args, kw)) <= 1e-5
    ref = _grads_oracle(args, kw, go)
    got = list(got) + [None] * (6 - len(got))
    for a, r in zip(got, ref):
        if r is None:
            assert a is None
        elif r.norm() == 0:
            assert torch.equal(a, torch.zeros_like(a))
        else:
            assert rel_err(a, r) <= 5e-5


def test_plain_call_launches_no_variant_arguments(interpreter, monkeypatch):
    """Without variant arguments the kernels get none of theirs (the compiled Mixtral kernels
    are the ones from before the variants: same constexprs, same code), forward and backward."""
    import moe_ops.launch.dispatch as ld
    import moe_ops.launch.dispatch_backward as ldb
    from conftest import spy_kernel_launches

    launches = []
    for mod in (ld, ldb):
        spy_kernel_launches(monkeypatch, mod, lambda k, g, a, kw: launches.append(
            (k.fn.__name__, set(kw))))
    args, _ = _inputs("relu", T=7, H=16, I=8, E=4, K=2, requires_grad=True)
    one, _ = _inputs("relu", T=1, H=16, I=8, E=4, K=2)
    for cfg, a in ((_configs()["pointer"], args), (_configs()["tma_pair"], args),
                   (_configs()["direct_fused"], one)):
        ld.dispatch_triton(*[t.detach() for t in a], config=cfg, save_z=True)
    moe_ops.dispatch(*args).sum().backward()
    variant_names = {"ACT", "alpha", "limit", "INTERLEAVED", "HAS_BIAS", "b_ptr",
                     "WEIGHTS_ON_INPUT", "tw_ptr", "TMA_TRANS", "SCALED", "weights_ptr"}
    names = {n for n, _ in launches}
    assert {"gate_up_kernel", "down_kernel", "down_combine_one_token_kernel",
            "swiglu_grad_kernel", "gather_rows_kernel"} <= names, names
    assert "act_grad_kernel" not in names and "expert_colsum_kernel" not in names
    for name, kws in launches:
        assert not kws & variant_names, (name, kws & variant_names)


@needs_interpreter
@pytest.mark.parametrize("scale", [1e-3, 1.0])
def test_softcap_small_arguments_float32(interpreter, scale):
    """swiglu_softcap's tanh(g / alpha) and tanh(u / limit) near 0: written as 2 sigmoid(2x) - 1
    they lose relative precision as x -> 0 (~1e-7 / |x|), so a small hidden (or routing
    weights on the input) gave float32 outputs up to 9e-4 off float64 (hidden of scale 1e-3;
    this test's case before tanh_f32). Forward and backward of the
    interpreted kernels within float32's tolerances at hidden of scale 1e-3 and 1."""
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton

    g = torch.Generator().manual_seed(23)
    args, b13, b2 = make_variant_inputs(9, 16, 12, 4, 2, generator=g, w13_bias=False,
                                        w2_bias=False)
    args = (args[0] * scale, *args[1:])
    kw = dict(activation="swiglu_softcap", alpha=3.0, limit=5.0, w13_bias=None, w2_bias=None)
    out = torch.full(args[0].shape, float("nan"))
    dispatch_triton(*args, out=out, **kw)
    assert rel_err(out, _oracle64(args, kw)) <= 1e-5
    go = torch.randn(args[0].shape, generator=g)
    got = dispatch_backward_triton(go, *args, **kw)
    for name, a, r in zip(["hidden", "w13", "w2", "topk_weights"], got,
                          _grads_oracle(args, kw, go)):
        assert rel_err(a, r) <= 2e-5, name

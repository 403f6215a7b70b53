"""moe.dispatch's expert variants (biases, activations, interleaved gate/up rows, strided
weights, the routing weight on the input): the reference against a dense float64 oracle,
gradients (gradcheck, bias gradients, gradient strides), opcheck, errors, and the interpreted
Triton kernels."""
import pytest
import torch
import torch.nn.functional as F

import moe_ops
from conftest import RTOL, rel_err
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
         "activation must be one of 'silu', 'gelu', 'gelu_tanh', 'relu', 'swiglu_oai'"),
        (dict(limit=-1.0), ValueError, "limit must be > 0"),
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

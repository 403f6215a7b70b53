"""Quantized expert weights (issue 42) on CPU: the dequantization against transformers', the
W8A8 reference, the interpreted kernels (FP8 W8A8 / W8A16, MXFP4 W4A16 with gpt-oss's
variants) against float64 references on fresh random inputs, scales' edge values, and bad
input."""
import pytest
import torch
import triton
import triton.language as tl
from conftest import RTOL, needs_interpreter, rel_err

import moe_ops
from moe_ops.launch._common import kernel_for
from moe_ops.kernels.quant_gemm import (
    e2m1_decode,
    e4m3_decode,
    e4m3_round,
    e8m0_decode,
    scales_at_most_128,
)
from moe_ops.launch.quant import dispatch_quantized
from moe_ops.ops.quant_checks import check_quantized_dispatch
from moe_ops.ops.samples import make_dispatch_inputs, quant_dispatch_samples
from moe_ops.reference.quant import (
    FP4_VALUES,
    dequantize_fp8_block,
    dequantize_mxfp4,
    quantize_activation_groups,
    quantize_fp8_block,
    quantized_dispatch_reference,
)


def _seed():
    """Fresh inputs every run (the seed is printed by a failing assert through the inputs)."""
    return int(torch.randint(0, 2**31 - 1, ()).item())


def fp8_inputs(T, H, I, E, K, block_shape=(16, 32), dtype=torch.float32, routing="uniform",
               seed=None, weight_std=0.1):
    g = torch.Generator().manual_seed(_seed() if seed is None else seed)
    h, w13, w2, tw, ids = make_dispatch_inputs(T, H, I, E, K, routing=routing, generator=g,
                                               weight_std=weight_std)
    q13, s13 = quantize_fp8_block(w13, block_shape)
    q2, s2 = quantize_fp8_block(w2, block_shape)
    return (h.to(dtype), q13, q2, tw, ids), dict(w13_scale=s13, w2_scale=s2,
                                                 block_shape=list(block_shape))


def mxfp4_inputs(T, H, I, E, K, dtype=torch.float32, routing="uniform", seed=None):
    """Random e2m1 bytes with e8m0 scales around 2^-6 (weights up to ~0.1, as trained gpt-oss
    experts), biases, float32 routing weights."""
    g = torch.Generator().manual_seed(_seed() if seed is None else seed)
    h, _, _, tw, ids = make_dispatch_inputs(T, H, 2, E, K, routing=routing, generator=g)
    b13 = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8)
    b2 = torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8)
    s13 = torch.randint(119, 124, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8)
    s2 = torch.randint(119, 124, (E, H, I // 32), generator=g, dtype=torch.uint8)
    biases = dict(w13_bias=torch.randn(E, 2 * I, generator=g) * 0.1,
                  w2_bias=torch.randn(E, H, generator=g) * 0.1)
    return (h.to(dtype), b13, b2, tw, ids), dict(w13_scale=s13, w2_scale=s2), biases


def _poisoned(hidden):
    return torch.full(hidden.shape, float("nan"), dtype=hidden.dtype)


# ---------------------------------------------------------------- dequantization, references

def test_mxfp4_dequantize_matches_transformers():
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    E, N, G = 3, 5, 4
    blocks = torch.randint(0, 256, (E, N, G, 16), dtype=torch.uint8)
    scales = torch.randint(100, 150, (E, N, G), dtype=torch.uint8)
    scales[0, 0, 0] = 0      # the subnormal 2^-127
    for dtype in (torch.float32, torch.bfloat16):
        theirs = mx.convert_moe_packed_tensors(blocks, scales, dtype=dtype)    # [E, K, N]
        ours = dequantize_mxfp4(blocks.reshape(E, N, G * 16), scales, dtype)  # [E, N, K]
        assert torch.equal(ours.transpose(1, 2), theirs)
    assert tuple(mx.FP4_VALUES) == FP4_VALUES


def test_fp8_dequantize_matches_transformers():
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    theirs_fn = getattr(fp8, "_dequantize_fp8_weight", None)
    if theirs_fn is None:
        pytest.skip("this transformers has no _dequantize_fp8_weight (not run)")
    w = torch.randn(2, 40, 72)
    q, s = quantize_fp8_block(w, (16, 32))     # partial blocks on both dims
    assert s.shape == (2, 3, 3)
    ours = dequantize_fp8_block(q, s, (16, 32))
    assert torch.equal(ours, theirs_fn(q, s, [16, 32], torch.float32))
    assert rel_err(ours, w) < 0.04       # e4m3 has 3 mantissa bits: ~2.5% rms


def test_activation_groups():
    x = torch.randn(3, 40)
    x[1, :16] = 0.0                      # an all-zero group quantizes to zeros, not NaN
    x[2, 16:32] *= 1e-20                 # a tiny group keeps its relative precision
    q = quantize_activation_groups(x, 16)
    assert torch.equal(q[1, :16], torch.zeros(16, dtype=torch.float64))
    for r, c in ((0, slice(0, 16)), (2, slice(16, 32)), (0, slice(32, 40))):
        assert rel_err(q[r, c], x[r, c].double()) < 0.06
    amax = x[0, :16].abs().max()
    assert q[0, :16].abs().max().item() == pytest.approx(amax.item(), rel=1e-6)


# ---------------------------------------------------------------- interpreter conversions

@triton.jit
def _convert_kernel(x_ptr, r_ptr, bits_ptr, d_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(r_ptr + offs, e4m3_round(x), mask=m)
    b = tl.load(bits_ptr + offs, mask=m, other=0)
    tl.store(d_ptr + offs, e4m3_decode(b), mask=m)


@needs_interpreter
def test_e4m3_round_and_decode_match_torch():
    """The interpreter's own fp8 cast is wrong (see quant_gemm's docstring); the kernels'
    integer-arithmetic rounding must equal torch's .to(float8_e4m3fn) bit for bit (saturating
    like the GPU's cvt.rn.satfinite) and the decoding must give every code's value."""
    g = torch.Generator().manual_seed(_seed())
    x = torch.cat([torch.randn(20000, generator=g) * 10.0 ** torch.randint(-4, 3, (20000,), generator=g),
                   torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float(),
                   torch.tensor([448.0, 464.0, 479.9, 1e9, -1e9, 2.0 ** -10, 3 * 2.0 ** -11,
                                 2.0 ** -6 - 2.0 ** -12, 0.0, -0.0])])
    x = x[torch.isfinite(x)]
    bits = torch.randint(0, 256, (x.numel(),), generator=g, dtype=torch.uint8)
    bits[:256] = torch.arange(256, dtype=torch.uint8)
    r = torch.empty_like(x)
    d = torch.empty_like(x)
    kernel_for(_convert_kernel, x.device)[(triton.cdiv(x.numel(), 1024),)](
        x, r, bits, d, x.numel(), BLOCK=1024)
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(r.view(torch.int32), want.view(torch.int32)), \
        (x[r != want][:8], r[r != want][:8], want[r != want][:8])
    dw = bits.view(torch.float8_e4m3fn).float()
    assert torch.equal(d.nan_to_num(7.0), dw.nan_to_num(7.0))
    assert d.isnan().sum() == dw.isnan().sum()


@triton.jit
def _mx_kernel(p_ptr, s_ptr, v_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    p = tl.load(p_ptr + offs).to(tl.int32)
    s = tl.load(s_ptr + offs // 16)
    v = tl.reshape(tl.join(e2m1_decode(p & 15), e2m1_decode(p >> 4)), (2 * BLOCK,))
    sc = tl.reshape(tl.join(e8m0_decode(s), e8m0_decode(s)), (2 * BLOCK,))
    tl.store(v_ptr + tl.arange(0, 2 * BLOCK), v * sc)


@needs_interpreter
def test_e2m1_e8m0_decode():
    p = torch.arange(256, dtype=torch.uint8)
    s = torch.tensor([0, 1, 100, 127, 127, 150, 200, 254, 127, 127, 1, 2, 126, 128, 129, 130],
                     dtype=torch.uint8)
    v = torch.empty(512)
    kernel_for(_mx_kernel, p.device)[(1,)](p, s, v, BLOCK=256)
    # per value: byte j holds values 2j (low) and 2j+1 (high); scale s[j // 16]
    lut = torch.tensor(FP4_VALUES)
    ref = torch.stack([lut[(p & 15).long()], lut[(p >> 4).long()]], -1).flatten()
    ref = torch.ldexp(ref, (s.long() - 127).repeat_interleave(32).float())
    assert torch.equal(v, ref)



@triton.jit
def _at_most_128_kernel(s_ptr, out_ptr, n_rows, K, stride_r, ROWS: tl.constexpr):
    rows = tl.arange(0, ROWS)
    one = scales_at_most_128(s_ptr + rows * stride_r, rows < n_rows, K, 1, 32)
    tl.store(out_ptr, one.to(tl.int32))


@needs_interpreter
@pytest.mark.parametrize("K", [32, 1024, 2880, 3104])
def test_scales_at_most_128(K):
    """The one-factor decode's per-program check (QuantDispatchConfig.mxfp4_one_factor): 1 only
    where every scale byte of the rows inside the mask, over all K // 32 groups (more than one
    32-group load, a partial last one), is <= 128; bytes past the mask or past K never count."""
    g = torch.Generator().manual_seed(_seed())
    n_rows, groups = 12, K // 32
    s = torch.randint(0, 129, (16, groups + 3), generator=g, dtype=torch.uint8)
    s[n_rows:] = 255                      # rows outside the mask
    s[:, groups:] = 255                   # bytes past K
    out = torch.empty(1, dtype=torch.int32)

    def check():
        kernel_for(_at_most_128_kernel, s.device)[(1,)](s, out, n_rows, K, s.stride(0), ROWS=16)
        return int(out.item())

    s[:n_rows, :groups].clamp_(max=128)
    assert check() == 1
    for r, c in ((0, 0), (n_rows - 1, groups - 1), (5, groups // 2)):
        for v in (129, 200, 255):
            s[r, c] = v
            assert check() == 0, (r, c, v)
            s[r, c] = 128
    assert check() == 1

# ---------------------------------------------------------------- FP8 through the interpreter

# W8A8 against unquantized activations at these tiny shapes (16-32 column groups, a few
# tokens): over 150 seeds per case the reference itself is at a median of 3.6-4.1% (issue 42's
# 4%) with a tail to 10% (T = 1, K = 3); issue 42's 6e-2 holds at real shapes, where the error
# averages over many more elements: tests/test_quant_gpu.py checks it there. The kernels' own
# correctness is the comparison with the same quantization (1e-4).
TINY_W8A8_VS_UNQUANTIZED = 0.15


def _errors(out, args, kw, **more):
    """(error against the W8A8 reference with the same activation quantization, against
    float64 on the dequantized weights with unquantized activations)."""
    w8a8 = quantized_dispatch_reference(*args, **kw, **more)
    exact = quantized_dispatch_reference(*args, **kw, **more, emulate_kernel=False)
    return rel_err(out, w8a8), rel_err(out, exact)


# (T, H, I, E, K, block_shape, routing): odd H and I (partial scale blocks on both dims),
# bn not a divisor of the tiles, T = 1, empty experts, ids < 0, all slots on one expert
FP8_CASES = [
    (13, 40, 24, 4, 2, (16, 16), "uniform"),
    (1, 48, 40, 6, 3, (32, 32), "uniform"),
    (9, 64, 32, 8, 2, (24, 32), "negative"),
    (6, 32, 16, 4, 1, (16, 16), "one_expert"),
    (11, 40, 24, 8, 2, (16, 16), "empty_experts"),
]


@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_w8a8(interpreter, case):
    T, H, I, E, K, bs, routing = case
    args, kw = fp8_inputs(T, H, I, E, K, bs, routing=routing)
    out = dispatch_quantized(*args, **kw, out=_poisoned(args[0]))
    same_q, unquantized = _errors(out, args, kw)
    # float32 activations: only the float32 accumulation order differs from the reference
    assert same_q < 1e-4, same_q
    assert unquantized < TINY_W8A8_VS_UNQUANTIZED, unquantized


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_w8a8_half(interpreter, dtype):
    args, kw = fp8_inputs(10, 64, 32, 4, 2, (16, 32), dtype=dtype)
    out = dispatch_quantized(*args, **kw, out=_poisoned(args[0]))
    assert out.dtype == dtype
    same_q, unquantized = _errors(out, args, kw)
    assert same_q < 1e-2, same_q
    assert unquantized < TINY_W8A8_VS_UNQUANTIZED, unquantized


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_w8a16(interpreter, dtype):
    args, kw = fp8_inputs(12, 40, 24, 4, 2, (16, 16), dtype=dtype, routing="negative")
    kw["quantize_activations"] = False
    out = dispatch_quantized(*args, **kw, out=_poisoned(args[0]))
    _, exact = _errors(out, args, kw)
    assert exact < (1e-5 if dtype == torch.float32 else 2e-2), exact


def test_fp8_transposed_storage(interpreter):
    """Checkpoints that store [E, H, 2I] / [E, I, H] pass transposed views (any strides)."""
    args, kw = fp8_inputs(7, 32, 16, 4, 2, (16, 16))
    h, q13, q2, tw, ids = args
    q13_t = q13.transpose(1, 2).contiguous().transpose(1, 2)
    q2_t = q2.transpose(1, 2).contiguous().transpose(1, 2)
    s13_t = kw["w13_scale"].transpose(1, 2).contiguous().transpose(1, 2)
    out = dispatch_quantized(h, q13_t, q2_t, tw, ids, **{**kw, "w13_scale": s13_t})
    assert torch.equal(out, dispatch_quantized(*args, **kw))


def test_fp8_variants(interpreter):
    """Biases, interleaved gate/up, weights on the input, the other activations."""
    args, kw = fp8_inputs(9, 32, 16, 4, 2, (16, 16))
    E, H, I = 4, 32, 16
    for more in (dict(activation="swiglu_oai", gate_up_interleaved=True,
                      w13_bias=torch.randn(E, 2 * I) * 0.1, w2_bias=torch.randn(E, H) * 0.1),
                 dict(activation="gelu", weights_on_input=True),
                 dict(activation="gelu_tanh"), dict(activation="relu"),
                 # limits that bind on these inputs (|h| reaches ~1)
                 dict(activation="silu_clamp", limit=0.2),
                 dict(activation="silu_clamp_out", limit=0.1, gate_up_interleaved=True),
                 dict(activation="swiglu_softcap", alpha=0.3, limit=0.2)):
        out = dispatch_quantized(*args, **kw, **more, out=_poisoned(args[0]))
        same_q, unquantized = _errors(out, args, kw, **more)
        assert same_q < 1e-4, (more, same_q)
        assert unquantized < TINY_W8A8_VS_UNQUANTIZED, (more, unquantized)


def test_fp8_scale_edge_values(interpreter):
    """Zero, tiny (1e-30 x) and huge (1e20 x) block scales: each token uses one expert whose
    scales are all of one kind; every token's output matches the reference relative to its
    own size (zeros for the zero-scale expert)."""
    E, H, I, T = 4, 32, 16, 8
    args, kw = fp8_inputs(T, H, I, E, 1, (16, 16), seed=_seed())
    h, q13, q2, tw, _ = args
    ids = (torch.arange(T) % E).view(T, 1).int()
    factor = torch.tensor([1.0, 0.0, 1e-30, 1e20]).view(E, 1, 1)
    kw = {**kw, "w2_scale": kw["w2_scale"] * factor, "quantize_activations": True}
    out = dispatch_quantized(h, q13, q2, tw, ids, **kw, out=_poisoned(h))
    ref = quantized_dispatch_reference(h, q13, q2, tw, ids, **kw)
    assert torch.isfinite(out).all()
    for t in range(T):
        if ids[t, 0] == 1:
            assert torch.equal(out[t], torch.zeros(H))
        else:
            assert rel_err(out[t], ref[t]) < 1e-4, (t, ids[t, 0])


@pytest.mark.parametrize("which", ["w13_scale", "w2_scale"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fp8_nonfinite_scale_is_local(interpreter, which, bad):
    """A NaN/inf in one block's scale reaches only the outputs that read that block: through
    w13 every output of the tokens routed to that expert, through w2 the bn output columns of
    that block of those tokens; nothing else."""
    E, H, I, T, bs = 4, 32, 16, 12, (16, 16)
    args, kw = fp8_inputs(T, H, I, E, 2, bs)
    h, q13, q2, tw, ids = args
    e = int(ids[0, 0])
    s = kw[which].clone()
    s[e, 1, 0] = bad
    out = dispatch_quantized(h, q13, q2, tw, ids, **{**kw, which: s}, out=_poisoned(h))
    clean = dispatch_quantized(*args, **kw)
    uses = (ids == e).any(1)
    cols = torch.zeros(H, dtype=torch.bool)
    if which == "w2_scale":
        cols[bs[0]:2 * bs[0]] = True
    else:
        cols[:] = True
    hit = uses[:, None] & cols[None, :]
    assert torch.equal(out[~hit], clean[~hit])
    assert (~torch.isfinite(out[hit])).any()


def test_fp8_edges(interpreter):
    """T = 0; every id dropped (zeros); int64 ids; deterministic and batch-invariant rows."""
    args, kw = fp8_inputs(0, 32, 16, 4, 2, (16, 16))
    assert dispatch_quantized(*args, **kw).shape == (0, 32)
    args, kw = fp8_inputs(5, 32, 16, 4, 2, (16, 16))
    h, q13, q2, tw, ids = args
    out = dispatch_quantized(h, q13, q2, tw, torch.full_like(ids, -1), **kw, out=_poisoned(h))
    assert torch.equal(out, torch.zeros_like(out))
    a = dispatch_quantized(h, q13, q2, tw, ids.long(), **kw)
    assert torch.equal(a, dispatch_quantized(*args, **kw))
    # batch invariance: a token's output does not depend on the other tokens
    one = dispatch_quantized(h[2:3], q13, q2, tw[2:3], ids[2:3], **kw)
    assert torch.allclose(one[0], a[2], rtol=1e-6, atol=1e-7)
    # non-contiguous hidden and topk_weights (strides are passed, nothing is copied)
    h_t = h.t().contiguous().t()
    tw_t = tw.t().contiguous().t()
    assert not h_t.is_contiguous() and not tw_t.is_contiguous()
    assert torch.equal(dispatch_quantized(h_t, q13, q2, tw_t, ids, **kw), a)


def test_zero_width_experts():
    """I = 0 (and H = 0): no reduction to run. The kernels' K loops assume a positive length, so
    the launcher answers from the reference: zeros, or with gpt-oss's biases the weighted sum of
    the down biases of each token's experts (the SwiGLU of an empty gate/up row is empty)."""
    T, E, H = 3, 4, 64
    ids = torch.tensor([[0, 1], [2, 3], [1, -1]], dtype=torch.int32)
    tw = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 3.0]])
    h = torch.randn(T, H).bfloat16()
    fp8 = torch.float8_e4m3fn
    out = dispatch_quantized(h, torch.zeros(E, 0, H).to(fp8), torch.zeros(E, H, 0).to(fp8), tw, ids,
                             w13_scale=torch.ones(E, 0, 1), w2_scale=torch.ones(E, 1, 0),
                             block_shape=[128, 128], out=_poisoned(h))
    assert torch.equal(out, torch.zeros_like(out))
    b2 = torch.randn(E, H).bfloat16()
    out = dispatch_quantized(h, torch.zeros(E, 0, H // 2, dtype=torch.uint8),
                             torch.zeros(E, H, 0, dtype=torch.uint8), tw, ids,
                             w13_scale=torch.zeros(E, 0, H // 32, dtype=torch.uint8),
                             w2_scale=torch.zeros(E, H, 0, dtype=torch.uint8),
                             activation="swiglu_oai", gate_up_interleaved=True,
                             w13_bias=torch.zeros(E, 0).bfloat16(), w2_bias=b2, out=_poisoned(h))
    want = torch.stack([0.25 * b2[0].double() + 0.75 * b2[1].double(),
                        0.5 * b2[2].double() + 0.5 * b2[3].double(), b2[1].double()])
    assert torch.allclose(out.double(), want, rtol=1e-2, atol=1e-2), (out, want)
    out = dispatch_quantized(h[:, :0], torch.zeros(E, 32, 0).to(fp8), torch.zeros(E, 0, 16).to(fp8),
                             tw, ids, w13_scale=torch.ones(E, 1, 0), w2_scale=torch.ones(E, 0, 1),
                             block_shape=[128, 128])
    assert out.shape == (T, 0)


# ---------------------------------------------------------------- MXFP4 through the interpreter

@pytest.mark.parametrize("variant", ["plain", "gpt_oss", "weights_on_input", "silu_clamp"])
def test_mxfp4_w4a16(interpreter, variant):
    args, kw, biases = mxfp4_inputs(11, 64, 64, 4, 2, routing="negative")
    more = {"plain": {},
            "gpt_oss": dict(activation="swiglu_oai", gate_up_interleaved=True, alpha=1.702,
                            limit=7.0, **biases),
            "weights_on_input": dict(weights_on_input=True, activation="gelu"),
            "silu_clamp": dict(activation="silu_clamp", limit=0.3, **biases)}[variant]
    out = dispatch_quantized(*args, **kw, **more, out=_poisoned(args[0]))
    ref = quantized_dispatch_reference(*args, **kw, **more)
    assert rel_err(out, ref) < 1e-5


def test_mxfp4_bf16_and_transposed(interpreter):
    """bf16 activations (<= 1e-2, issue 42), and the blocks as a transposed view of [E, H/2,
    2I] storage."""
    args, kw, biases = mxfp4_inputs(9, 96, 32, 4, 2, dtype=torch.bfloat16)
    h, b13, b2, tw, ids = args
    more = dict(activation="swiglu_oai", gate_up_interleaved=True, **biases)
    out = dispatch_quantized(*args, **kw, **more, out=_poisoned(h))
    ref = quantized_dispatch_reference(*args, **kw, **more)
    assert rel_err(out, ref) < 1e-2
    b13_t = b13.transpose(1, 2).contiguous().transpose(1, 2)
    s13_t = kw["w13_scale"].transpose(1, 2).contiguous().transpose(1, 2)
    out_t = dispatch_quantized(h, b13_t, b2, tw, ids, **{**kw, "w13_scale": s13_t}, **more)
    assert torch.equal(out_t, out)


# ---------------------------------------------------------------- bad input

def _bad(fn, exc, *words):
    with pytest.raises(exc) as info:
        fn()
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_bad_input():
    args, kw = fp8_inputs(3, 32, 16, 4, 2, (16, 16))
    h, q13, q2, tw, ids = args
    c = check_quantized_dispatch
    _bad(lambda: c(*args, w13_scale=kw["w13_scale"][:, :1], w2_scale=kw["w2_scale"],
                   block_shape=[16, 16]), ValueError, "w13_scale", "shape")
    _bad(lambda: c(*args, w13_scale=kw["w13_scale"].double(), w2_scale=kw["w2_scale"],
                   block_shape=[16, 16]), TypeError, "w13_scale", "float32")
    _bad(lambda: c(*args, w13_scale=kw["w13_scale"], w2_scale=kw["w2_scale"],
                   block_shape=[16, 24]), ValueError, "block_shape", "bk")
    _bad(lambda: c(*args, w13_scale=kw["w13_scale"], w2_scale=kw["w2_scale"],
                   block_shape=[32, 16]), ValueError, "w13_scale", "block_shape")
    _bad(lambda: c(*args, block_shape=[16, 16]), ValueError, "w13_scale", "required")
    _bad(lambda: c(h.to(torch.float8_e4m3fn), q13, q2, tw, ids, **kw), TypeError, "hidden")
    _bad(lambda: c(h, q13.float(), q2, tw, ids, **kw), TypeError, "w13", "w2")
    margs, mkw, _ = mxfp4_inputs(3, 64, 32, 4, 2)
    mh, b13, b2, mtw, mids = margs
    _bad(lambda: c(mh[:, :48], b13, b2, mtw, mids, **mkw), ValueError, "H")
    _bad(lambda: c(mh, b13[:, :, :16], b2, mtw, mids, **mkw), ValueError, "w13")
    _bad(lambda: c(mh, b13, b2, mtw, mids, w13_scale=mkw["w13_scale"][..., :1],
                   w2_scale=mkw["w2_scale"]), ValueError, "w13_scale")
    _bad(lambda: c(*margs, w13_scale=mkw["w13_scale"].float(), w2_scale=mkw["w2_scale"]),
         TypeError, "w13_scale", "uint8")
    _bad(lambda: c(*margs, **mkw, block_shape=[128, 128]), ValueError, "block_shape")
    _bad(lambda: c(*margs, **mkw, activation="tanh"), ValueError, "activation")
    _bad(lambda: c(*margs, **mkw, w13_bias=torch.zeros(4, 3)), ValueError, "w13_bias")


# ---------------------------------------------------------------- moe.dispatch

@pytest.mark.parametrize("path", ["reference", "interpreter"])
def test_op_matches_reference(request, path):
    """torch.ops.moe.dispatch with quantized weights, on the CPU reference and the interpreted
    kernels, against the reference computed directly."""
    request.getfixturevalue("reference_path" if path == "reference" else "interpreter")
    for args, kw in quant_dispatch_samples():
        out = torch.ops.moe.dispatch(*args, **kw)
        assert out.shape == args[0].shape and out.dtype == args[0].dtype
        if args[0].shape[0]:
            assert rel_err(out, quantized_dispatch_reference(*args, **kw)) < 1e-4, kw


def test_opcheck(interpreter):
    """opcheck's test_schema compares the inputs before and after with torch.allclose, which
    torch does not implement for float8 (NotImplementedError "mul_cpu_reduced_float"): FP8
    samples get the other checks and an explicit bitwise no-mutation check instead."""
    for args, kw in quant_dispatch_samples():
        fp8 = args[1].dtype == torch.float8_e4m3fn
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(torch.ops.moe.dispatch.default, args, kw,
                              test_utils=utils if fp8 else utils + ("test_schema",))
        if fp8:
            before = [a.view(torch.uint8).clone() if a.dtype == torch.float8_e4m3fn
                      else a.clone() for a in args]
            torch.ops.moe.dispatch(*args, **kw)
            for a, b in zip(args, before):
                assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn
                                   else a, b)


def test_fake_and_meta():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kw = quant_dispatch_samples()[2]
    with FakeTensorMode() as mode:
        fa = [mode.from_tensor(a) for a in args]
        fk = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        out = torch.ops.moe.dispatch(*fa, **fk)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype


@pytest.mark.parametrize("which", [1, 4])
def test_gradients_through_frozen_experts(reference_path, which):
    """hidden, topk_weights and the biases get gradients through quantized experts: those of
    the float64 computation on the dequantized weights (activation quantization taken as the
    identity); the experts are frozen (a scale that requires grad is refused by name); the
    internal backward op refuses quantized weights."""
    args, kw = quant_dispatch_samples()[which]
    h, q13, q2, tw, ids = args
    E, I2 = q13.shape[:2]
    kw = dict(kw, w13_bias=torch.randn(E, I2) * 0.1, w2_bias=torch.randn(E, h.shape[1]) * 0.1)
    leaves = [h.clone().requires_grad_(True), tw.clone().requires_grad_(True),
              kw["w13_bias"].clone().requires_grad_(True), kw["w2_bias"].clone().requires_grad_(True)]
    kw_g = dict(kw, w13_bias=leaves[2], w2_bias=leaves[3])
    out = moe_ops.dispatch(leaves[0], q13, q2, leaves[1], ids, **kw_g)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, go)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = quantized_dispatch_reference(ref_leaves[0], q13, q2, ref_leaves[1], ids,
                                       **dict(kw, w13_bias=ref_leaves[2], w2_bias=ref_leaves[3]),
                                       emulate_kernel=False)
    want = torch.autograd.grad(ref, ref_leaves, go.double())
    for name, a, b in zip(("hidden", "topk_weights", "w13_bias", "w2_bias"), got, want):
        assert a.shape == b.shape and a.dtype == leaves[0].dtype
        assert rel_err(a, b) < 1e-5, name
    if kw["w13_scale"].is_floating_point():      # (uint8 e8m0 scales cannot require grad)
        s13 = kw["w13_scale"].clone().requires_grad_()
        with pytest.raises(ValueError, match="w13_scale.*frozen"):
            moe_ops.dispatch(*args, **{**kw, "w13_scale": s13})
        with torch.no_grad():     # inference reads a trainable scale as it is
            moe_ops.dispatch(*args, **{**kw, "w13_scale": s13})
    with pytest.raises(NotImplementedError):
        torch.ops.moe.dispatch_backward(torch.zeros_like(h), *args, **kw)


def test_op_bad_input(reference_path):
    """Through the public entry point: scales with float weights, FP8 weights without scales,
    a hidden of FP8 dtype."""
    args, kw = quant_dispatch_samples()[1]
    h, q13, q2, tw, ids = args
    wf = torch.zeros(q13.shape)
    with pytest.raises(TypeError, match="w13_scale"):
        moe_ops.dispatch(h, wf, torch.zeros(q2.shape), tw, ids, w13_scale=kw["w13_scale"])
    with pytest.raises(ValueError, match="w13_scale.*required"):
        moe_ops.dispatch(h, q13, q2, tw, ids)
    with pytest.raises(TypeError, match="hidden"):
        moe_ops.dispatch(h.to(torch.float8_e4m3fn), q13, q2, tw, ids, **kw)


# ---------------------------------------------------------------- transformers

def test_hf_fp8_experts(interpreter):
    """transformers' FineGrainedFP8 experts (FP8Experts) run through moe.dispatch on their own
    parameters: against transformers' dequantization and gating in float64 (<= 6e-2, W8A8) and
    against the W8A8 reference (<= 1e-4, float32 activations); "moe_ops" joins the FP8 experts
    interface."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers import Qwen3MoeConfig

    from moe_ops.integrations.hf_quant import fp8_experts_forward, register_fp8_experts_interface

    E, H, I, T, K = 4, 256, 128, 6, 2
    experts = fp8.FP8Experts(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I,
                                            num_experts=E, num_experts_per_tok=K),
                             block_size=(128, 128))
    g = torch.Generator().manual_seed(_seed())
    q13, s13 = quantize_fp8_block(torch.randn(E, 2 * I, H, generator=g) * 0.05, (128, 128))
    q2, s2 = quantize_fp8_block(torch.randn(E, H, I, generator=g) * 0.05, (128, 128))
    with torch.no_grad():
        for name, t in (("gate_up_proj", q13), ("gate_up_proj_scale_inv", s13),
                        ("down_proj", q2), ("down_proj_scale_inv", s2)):
            getattr(experts, name).data = t
    x = torch.randn(T, H, generator=g)
    w, ids = torch.rand(T, E, generator=g).softmax(-1).topk(K, -1)
    out = fp8_experts_forward(experts, x, ids, w)
    # transformers' own arithmetic on its dequantized weights
    deq = getattr(fp8, "_dequantize_fp8_weight", None)
    if deq is None:
        pytest.skip("this transformers has no _dequantize_fp8_weight (not run)")
    d13 = deq(q13, s13, [128, 128], torch.float64)
    d2 = deq(q2, s2, [128, 128], torch.float64)
    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            a = experts._apply_gate(x[t].double() @ d13[e].t())
            ref[t] += w[t, k].double() * (a @ d2[e].t())
    assert rel_err(out, ref) < 6e-2
    kw = dict(w13_scale=s13, w2_scale=s2, block_shape=[128, 128])
    assert rel_err(out, quantized_dispatch_reference(x, q13, q2, w, ids, **kw)) < 1e-4
    assert register_fp8_experts_interface()
    assert fp8.ALL_FP8_EXPERTS_FUNCTIONS["moe_ops"] is fp8_experts_forward
    # patch_quantized_experts: the module's own forward now runs moe.dispatch
    from moe_ops.integrations.hf_quant import patch_quantized_experts

    holder = torch.nn.Module()
    holder.experts = experts
    assert patch_quantized_experts(holder) == 1
    assert torch.equal(experts(x, ids, w), out)
    experts.activation_scheme = "static"
    with pytest.raises(Exception, match="activation_scheme"):
        patch_quantized_experts(holder)


def test_hf_mxfp4_attach(interpreter):
    """gpt-oss's raw checkpoint tensors ([E, N, K/32, 16] blocks) attached to an experts
    module run with its biases, alpha and limit, as transformers dequantizes and computes them
    (convert_moe_packed_tensors, GptOssExperts' arithmetic) in float64."""
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    from moe_ops.integrations.hf_quant import attach_mxfp4, mxfp4_experts_forward

    E, H, I, T, K = 4, 64, 64, 5, 2
    g = torch.Generator().manual_seed(_seed())
    kw = dict(generator=g, dtype=torch.uint8)
    blocks13 = torch.randint(0, 256, (E, 2 * I, H // 32, 16), **kw)
    scales13 = torch.randint(119, 123, (E, 2 * I, H // 32), **kw)
    blocks2 = torch.randint(0, 256, (E, H, I // 32, 16), **kw)
    scales2 = torch.randint(119, 123, (E, H, I // 32), **kw)
    experts = torch.nn.Module()
    experts.alpha, experts.limit = 1.702, 7.0
    experts.gate_up_proj_bias = torch.nn.Parameter(torch.randn(E, 2 * I, generator=g) * 0.1)
    experts.down_proj_bias = torch.nn.Parameter(torch.randn(E, H, generator=g) * 0.1)
    x = torch.randn(T, H, generator=g)
    w, ids = torch.rand(T, E, generator=g).softmax(-1).topk(K, -1)
    outs = []
    for layout in ("plain", "mma", "auto"):
        attach_mxfp4(experts, blocks13, scales13, blocks2, scales2, layout=layout)
        # ("auto" on CPU tensors keeps the views)
        assert experts.moe_ops_mxfp4_layout == ("plain" if layout == "auto" else layout)
        with torch.no_grad():
            outs.append(mxfp4_experts_forward(experts, x, ids, w))
    out = outs[0]
    # (the interpreter's mma path runs 64-value K steps: float32 sums in another order)
    assert rel_err(outs[1], out.double()) < 1e-6 and torch.equal(outs[2], out)
    with pytest.raises(ValueError, match="layout"):
        attach_mxfp4(experts, blocks13, scales13, blocks2, scales2, layout="swizzled")
    # GptOssExperts: gate_up_proj [E, H, 2I] (dequantized, transposed), gate = [..., ::2]
    gu = mx.convert_moe_packed_tensors(blocks13, scales13, dtype=torch.float32).double()
    dn = mx.convert_moe_packed_tensors(blocks2, scales2, dtype=torch.float32).double()
    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            h = x[t].double() @ gu[e] + experts.gate_up_proj_bias[e].double()
            gate, up = h[::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)
            a = (up + 1) * gate * torch.sigmoid(gate * 1.702)
            ref[t] += w[t, k].double() * (a @ dn[e] + experts.down_proj_bias[e].double())
    assert rel_err(out, ref) < 1e-5


def test_compile_fullgraph_one_frame(reference_path):
    """torch.compile(fullgraph=True) traces a router + moe.dispatch with quantized weights
    through the op's fake (aot_eager: the graph, not Inductor's code), T unbacked: one frame
    for every T, results equal to eager."""
    from torch._dynamo.decorators import mark_unbacked
    from torch._dynamo.testing import CompileCounterWithBackend

    args, kw = quant_dispatch_samples()[2]
    h, q13, q2, tw, ids = args
    router = torch.randn(h.shape[1], q13.shape[0])

    def f(h):
        w, i = (h @ router).softmax(-1).topk(tw.shape[1], dim=-1)
        return moe_ops.dispatch(h, q13, q2, w, i, **kw)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(f, fullgraph=True, backend=counter)
    for T in (9, 5, 1):
        hT = h[:T].clone()
        mark_unbacked(hT, 0)
        assert torch.equal(fn(hT), f(hT))
    assert counter.frame_count == 1


def test_one_token_direct_rows(interpreter):
    """T = 1 runs without an alignment (row block k = slot k): a dropped id (-1) contributes
    nothing, NaN weights in an expert no slot uses are never read; FP8 W8A8 and MXFP4."""
    args, kw = fp8_inputs(1, 32, 16, 6, 3, (16, 16))
    h, q13, q2, tw, _ = args
    ids = torch.tensor([[4, -1, 1]], dtype=torch.int32)
    q13 = q13.clone()
    q13[0] = float("nan")            # expert 0: unused (a dropped id must not read it)
    out = dispatch_quantized(h, q13, q2, tw, ids, **kw, out=_poisoned(h))
    assert rel_err(out, quantized_dispatch_reference(h, q13, q2, tw, ids, **kw)) < 1e-4
    margs, mkw, biases = mxfp4_inputs(1, 64, 32, 4, 2)
    mh, b13, b2, mtw, _ = margs
    mids = torch.tensor([[-1, 2]], dtype=torch.int32)
    more = dict(activation="swiglu_oai", gate_up_interleaved=True, **biases)
    out = dispatch_quantized(mh, b13, b2, mtw, mids, **mkw, **more, out=_poisoned(mh))
    assert rel_err(out, quantized_dispatch_reference(mh, b13, b2, mtw, mids, **mkw, **more)) < 1e-5


@pytest.mark.skipif(not hasattr(tl, "dot_scaled"), reason="this Triton has no tl.dot_scaled")
def test_mxfp4_dot_scaled_path(interpreter):
    """The tl.dot_scaled form of the MXFP4 kernels (QuantDispatchConfig.mxfp4_dot_scaled; the
    interpreter runs it with float16 activations) matches the reference, with gpt-oss's
    variants and a K tail (H = 96: the last 64-wide K step is half empty)."""
    import dataclasses

    from moe_ops.launch.quant import has_dot_scaled, quant_dispatch_config

    assert has_dot_scaled()
    args, kw, biases = mxfp4_inputs(7, 96, 64, 4, 2, dtype=torch.float16, routing="negative")
    more = dict(activation="swiglu_oai", gate_up_interleaved=True, **biases)
    cfg = dataclasses.replace(quant_dispatch_config(7, 4, 2, 96, 64, "mxfp4", 32, "cpu"),
                              mxfp4_dot_scaled=True)
    out = dispatch_quantized(*args, **kw, **more, config=cfg, out=_poisoned(args[0]))
    ref = quantized_dispatch_reference(*args, **kw, **more)
    assert rel_err(out, ref) < 3e-3      # float16 intermediates (act, y, out)
    plain = dispatch_quantized(*args, **kw, **more)
    assert rel_err(out, plain.double()) < 3e-3


def _variant_agrees(args, kw, base, ref_tol, plain_tol, **fields):
    """dispatch_quantized with `base` changed by `fields` (into a NaN-poisoned output) against
    the reference (relative error < ref_tol) and against `base` itself (< plain_tol)."""
    import dataclasses

    out = dispatch_quantized(*args, **kw, out=_poisoned(args[0]),
                             config=dataclasses.replace(base, **fields))
    assert rel_err(out, quantized_dispatch_reference(*args, **kw)) < ref_tol, fields
    plain = dispatch_quantized(*args, **kw, config=base)
    assert rel_err(out, plain.double()) < plain_tol, fields


@pytest.mark.parametrize("T", [1, 7])
def test_mxfp4_swap_ab_path(interpreter, T):
    """The transposed MXFP4 products (QuantDispatchConfig.mxfp4_swap_ab: decoded weights as the
    left operand, accumulators [BLOCK_N, BLOCK_M]) match the reference, with gpt-oss's
    variants, a K tail (H = 96) and a dropped id, and agree with the plain form."""
    from moe_ops.launch.quant import quant_dispatch_config

    args, kw, biases = mxfp4_inputs(T, 96, 64, 4, 2, routing="negative")
    more = dict(activation="swiglu_oai", gate_up_interleaved=True, **biases)
    base = quant_dispatch_config(T, 4, 2, 96, 64, "mxfp4", 32, "cpu")
    _variant_agrees(args, dict(kw, **more), base, 1e-5, 1e-5, mxfp4_swap_ab=True)


@pytest.mark.parametrize("T", [1, 7])
def test_fp8_swap_ab_path(interpreter, T):
    """The transposed FP8 products (QuantDispatchConfig.fp8_swap_ab: weight tile x rows^T,
    accumulators [BLOCK_N, BLOCK_M]) match the kernel-emulating reference (W8A8) or the plain
    reference (W8A16), with the scalar and the per-row weight scale, several K steps and a K
    tail (H = 96, bk = 32), a dropped id, and agree with the plain form."""
    import dataclasses

    from moe_ops.launch.quant import quant_dispatch_config

    args, kw = fp8_inputs(T, 96, 64, 4, 2, (32, 32), routing="negative")
    for quant_a in (True, False):
        base = quant_dispatch_config(T, 4, 2, 96, 64, "fp8", 32, "cpu", quant_a=quant_a)
        for scalar in (True, False):
            _variant_agrees(args, dict(kw, quantize_activations=quant_a),
                            dataclasses.replace(base, scalar_weight_scale=scalar), 1e-5, 1e-6,
                            fp8_swap_ab=True)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("T", [1, 7])
def test_mxfp4_stacked_gate_up(interpreter, T, interleaved):
    """Gate and up rows decoded as one tile (QuantDispatchConfig.mxfp4_stacked_gate_up, with
    the transposed products) match the reference, with gpt-oss's interleaved rows, biases and
    activation or the plain [gate; up] layout, a K tail (H = 96) and a dropped id, and agree with
    the unstacked form (each output the same sum; the interpreter's numpy dot may order it
    differently for another tile shape)."""
    import dataclasses

    from moe_ops.launch.quant import quant_dispatch_config

    args, kw, biases = mxfp4_inputs(T, 96, 64, 4, 2, routing="negative")
    more = (dict(activation="swiglu_oai", gate_up_interleaved=True, **biases) if interleaved
            else dict(activation="silu"))
    base = dataclasses.replace(quant_dispatch_config(T, 4, 2, 96, 64, "mxfp4", 32, "cpu"),
                               mxfp4_swap_ab=True)
    _variant_agrees(args, dict(kw, **more), base, 1e-5, 1e-6, mxfp4_stacked_gate_up=True)


@pytest.mark.parametrize("T", [1, 7])
def test_prefetched_scales_are_bit_equal(interpreter, T):
    """Scales loaded one K step ahead (QuantDispatchConfig.prefetch_scales) give the in-step
    loads' output bit for bit: MXFP4 with gpt-oss's variants, plain, transposed and stacked
    products, K steps 32 and 64 (a K tail at H = 96); FP8 W8A8 and W8A16 with the scalar and the
    per-row weight scale, plain and transposed, several K steps; a dropped id each time."""
    import dataclasses

    from moe_ops.launch.quant import quant_dispatch_config

    args, kw, biases = mxfp4_inputs(T, 96, 64, 4, 2, routing="negative")
    more = dict(activation="swiglu_oai", gate_up_interleaved=True, **biases)
    base = quant_dispatch_config(T, 4, 2, 96, 64, "mxfp4", 32, "cpu")
    cases = [(args, dict(kw, **more), dataclasses.replace(base, block_k=bk, mxfp4_swap_ab=swap))
             for swap, bk in [(False, 32), (True, 32), (True, 64)]]
    cases.append((args, dict(kw, **more), dataclasses.replace(
        base, block_k=32, mxfp4_swap_ab=True, mxfp4_stacked_gate_up=True)))
    f_args, f_kw = fp8_inputs(T, 96, 64, 4, 2, (32, 32), routing="negative")
    for quant_a in (True, False):
        f_base = quant_dispatch_config(T, 4, 2, 96, 64, "fp8", 32, "cpu", quant_a=quant_a)
        for scalar, swap in ((True, False), (False, False), (True, True)):
            cases.append((f_args, dict(f_kw, quantize_activations=quant_a),
                          dataclasses.replace(f_base, scalar_weight_scale=scalar,
                                              fp8_swap_ab=swap)))
    cases.append(cases.pop(-2))   # W8A16 with per-row scales last
    for i, (a, k, cfg) in enumerate(cases):
        outs = []
        for prefetch in (False, True):
            out = _poisoned(a[0])
            dispatch_quantized(*a, **k, out=out,
                               config=dataclasses.replace(cfg, prefetch_scales=prefetch))
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), (i, cfg)
        assert torch.isfinite(outs[1]).all(), i
    # the last case is W8A16 with per-row scales
    assert rel_err(outs[1], quantized_dispatch_reference(*f_args, **f_kw,
                                                          quantize_activations=False)) < 2e-2
    out = dispatch_quantized(*args, **kw, **more, out=_poisoned(args[0]))
    assert rel_err(out, quantized_dispatch_reference(*args, **kw, **more)) < 1e-5


@pytest.mark.parametrize("T", [1, 7])
def test_prefetched_special_scales_and_wide_k_steps(interpreter, T):
    """Scales loaded one K step ahead and in the step give the same output bit for bit where
    scales are zero, negative zero or NaN, and at MXFP4 K steps up to 256 values. FP8: W8A8
    (prequantized hidden: its activation scales too) and W8A16, plain and transposed tiles, 3 K
    steps on gate+up (H = 96) and 2 on down, weight scales with a zero, a negative zero and a
    NaN block (its outputs NaN in both); a dropped id. MXFP4 (gpt-oss's variants): plain,
    transposed and stacked tiles, K steps of 32, 64, 128 and 256 values (1, 2, 4 and 8 scale
    bytes per row and step, at H = 320 and I = 288; H = 96 has a K tail at 64 and 128); the
    256-value steps (the heuristic's at <= 4 slots) match the reference."""
    import dataclasses

    from moe_ops.launch.quant import quant_dispatch_config

    args, kw = fp8_inputs(T, 96, 64, 4, 2, (32, 32), routing="negative")
    s13, s2 = kw["w13_scale"].clone(), kw["w2_scale"].clone()
    s13[0, 0, 1] = 0.0
    s13[1, 1, 2] = -0.0
    s2[2, 0, 1] = float("nan")
    kw = dict(kw, w13_scale=s13, w2_scale=s2)
    for quant_a in (True, False):
        base = quant_dispatch_config(T, 4, 2, 96, 64, "fp8", 32, "cpu", quant_a=quant_a)
        for swap in (False, True):
            cfg = dataclasses.replace(base, fp8_swap_ab=swap)
            outs = []
            for prefetch in (False, True):
                out = _poisoned(args[0])
                dispatch_quantized(*args, **kw, quantize_activations=quant_a, out=out,
                                   config=dataclasses.replace(cfg, prefetch_scales=prefetch))
                outs.append(out)
            assert torch.equal(outs[0].nan_to_num(7.0), outs[1].nan_to_num(7.0)), (quant_a, swap)
            assert torch.equal(outs[0].isnan(), outs[1].isnan()), (quant_a, swap)
    ref = quantized_dispatch_reference(*args, **kw, quantize_activations=False)
    assert torch.equal(outs[1].isnan(), ref.isnan())
    ok = ~ref.isnan()
    assert rel_err(outs[1][ok], ref[ok]) < 2e-2

    m_args, m_kw, biases = mxfp4_inputs(T, 96, 64, 4, 2, routing="negative")
    more = dict(activation="swiglu_oai", gate_up_interleaved=True, **biases)
    m_base = quant_dispatch_config(T, 4, 2, 96, 64, "mxfp4", 32, "cpu")
    # K steps of 256 values: 8 scale bytes per row and step, all used at H = 320, I = 288
    w_args, w_kw, w_biases = mxfp4_inputs(T, 320, 288, 4, 2, routing="negative")
    w_more = dict(activation="swiglu_oai", gate_up_interleaved=True, **w_biases)
    for bk, swap, stack in ((32, False, False), (64, True, False), (128, True, True),
                            (64, True, True), (256, True, True)):
        a, k, extra = (w_args, w_kw, w_more) if bk == 256 else (m_args, m_kw, more)
        cfg = dataclasses.replace(m_base, block_k=bk, mxfp4_swap_ab=swap,
                                  mxfp4_stacked_gate_up=stack)
        outs = []
        for prefetch in (False, True):
            out = _poisoned(a[0])
            dispatch_quantized(*a, **k, **extra, out=out,
                               config=dataclasses.replace(cfg, prefetch_scales=prefetch))
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), (bk, swap, stack)
        assert torch.isfinite(outs[1]).all()
    assert rel_err(outs[1], quantized_dispatch_reference(*w_args, **w_kw, **w_more)) < 1e-5


def test_scales_as_views_of_padded_rows(interpreter):
    """Weight scales passed as views of buffers with padded rows (a row stride past the row's
    length, e.g. gpt-oss's 90-byte e8m0 rows padded to 96 so they are 16-byte aligned) give the
    contiguous scales' output bit for bit, MXFP4 and FP8."""
    def padded(s):
        buf = torch.full((*s.shape[:-1], s.shape[-1] + 5), 7, dtype=s.dtype)
        buf[..., :s.shape[-1]] = s
        return buf[..., :s.shape[-1]]

    m_args, m_kw, biases = mxfp4_inputs(3, 96, 64, 4, 2, routing="negative")
    m_kw = dict(m_kw, activation="swiglu_oai", gate_up_interleaved=True, **biases)
    f_args, f_kw = fp8_inputs(3, 96, 64, 4, 2, (32, 32), routing="negative")
    for args, kw in ((m_args, m_kw), (f_args, f_kw)):
        pk = dict(kw, w13_scale=padded(kw["w13_scale"]), w2_scale=padded(kw["w2_scale"]))
        assert not pk["w13_scale"].is_contiguous()
        a = dispatch_quantized(*args, **kw, out=_poisoned(args[0]))
        b = dispatch_quantized(*args, **pk, out=_poisoned(args[0]))
        assert torch.equal(a, b)
        assert torch.isfinite(b).all()


# ---------------------------------------------------------------- config paths

def test_fp8_prequantized_hidden_is_the_fused_arithmetic(interpreter, monkeypatch):
    """hidden quantized once per token (QuantDispatchConfig.prequantize_hidden) gives what the
    gate+up gather's own quantization gives, bit for bit; with weights_on_input (rows scaled per
    slot before quantizing) the option is not taken and the result stays exact too."""
    import dataclasses

    import moe_ops.launch.quant as lq

    launched = []
    real = lq.kernel_for
    monkeypatch.setattr(lq, "kernel_for", lambda k, d, key=None: launched.append(k) or real(k, d, key))
    args, kw = fp8_inputs(13, 64, 32, 4, 2, (16, 32), routing="negative")
    h = args[0]
    base = lq.quant_dispatch_config(13, 4, 2, 64, 32, "fp8", 32, "cpu", quant_a=True)
    for extra, taken in (({}, True), ({"weights_on_input": True}, False)):
        fused = dispatch_quantized(*args, **kw, **extra, config=base, out=_poisoned(h))
        launched.clear()
        pre = dispatch_quantized(*args, **kw, **extra,
                                 config=dataclasses.replace(base, prequantize_hidden=True),
                                 out=_poisoned(h))
        assert (lq.quantize_groups_kernel in launched) == taken
        assert torch.isfinite(pre).all()
        assert torch.equal(pre, fused)


def test_fp8_act_quant_in_down_is_the_epilogue_arithmetic(interpreter):
    """W8A8 with the activation quantized in the down GEMM's gather
    (QuantDispatchConfig.act_quant_in_down: float32 act between the kernels) gives the
    epilogue's quantization bit for bit at the same tiles; narrower gate+up tiles, which only
    this form allows, agree to float32 rounding and with the W8A8 reference; without the flag
    a gate+up tile that is not one bk group is refused."""
    import dataclasses

    from moe_ops.launch.quant import quant_dispatch_config

    for T in (1, 13):
        args, kw = fp8_inputs(T, 64, 64, 4, 2, (16, 32), routing="negative")
        h = args[0]
        base = quant_dispatch_config(T, 4, 2, 64, 64, "fp8", 32, "cpu", quant_a=True)
        assert base.block_n1 == 32 and not base.act_quant_in_down
        epi = dispatch_quantized(*args, **kw, config=base, out=_poisoned(h))
        down = dispatch_quantized(*args, **kw, out=_poisoned(h),
                                  config=dataclasses.replace(base, act_quant_in_down=True))
        assert torch.isfinite(down).all() and torch.equal(down, epi)
        narrow = dispatch_quantized(*args, **kw, out=_poisoned(h), config=dataclasses.replace(
            base, act_quant_in_down=True, block_n1=16))
        assert rel_err(narrow, epi.double()) < 1e-6
        same_q, _ = _errors(narrow, args, kw)
        assert same_q < 1e-4, same_q
    with pytest.raises(ValueError, match="block_n1"):
        dispatch_quantized(*args, **kw, config=dataclasses.replace(base, block_n1=16))


def test_fp8_scalar_weight_scale(interpreter):
    """Tiles inside one [bn, bk] scale block read one scalar scale per K step (the default
    where the layout allows it); the per-column form agrees to float32 rounding."""
    import dataclasses

    from moe_ops.launch.quant import quant_dispatch_config

    args, kw = fp8_inputs(9, 64, 64, 4, 2, (64, 32))
    h = args[0]
    base = quant_dispatch_config(9, 4, 2, 64, 64, "fp8", 32, "cpu", quant_a=True)
    assert base.scalar_weight_scale and 64 % base.block_n1 == 0 and 64 % base.block_n2 == 0
    scalar = dispatch_quantized(*args, **kw, config=base, out=_poisoned(h))
    cols = dispatch_quantized(*args, **kw, config=dataclasses.replace(
        base, scalar_weight_scale=False), out=_poisoned(h))
    assert rel_err(scalar, cols.double()) < 1e-6
    same_q, _ = _errors(scalar, args, kw)
    assert same_q < 1e-4, same_q


def test_gpu_heuristic_row_blocks():
    """The GPU tiles the heuristic picks (no GPU needed: a pure function of the shape): W8A8
    takes 128-row blocks from 256 rows per expert, 64-row blocks below and transposed 16-row
    blocks up to 8 rows (all wgmma, the same sums), the weight-only FP8 path 64-row blocks;
    MXFP4 128-row transposed tiles from 128 rows per expert, gate and up stacked in one tile up
    to 64 slots."""
    from moe_ops.launch.quant import quant_dispatch_config

    def cfg(T, E, K, fmt, quant_a=True):
        return quant_dispatch_config(T, E, K, 2048, 768, fmt, 128, "cuda", quant_a=quant_a)

    assert [cfg(T, 128, 8, "fp8").block_m for T in (1, 8, 128, 129, 2048, 4095, 4096,
                                                    8192)] == \
        [16, 16, 16, 64, 64, 64, 128, 128]
    assert [cfg(T, 128, 8, "fp8").fp8_swap_ab for T in (1, 128, 129)] == [True, True, False]
    assert not cfg(8, 128, 8, "fp8", quant_a=False).fp8_swap_ab
    assert cfg(8192, 128, 8, "fp8", quant_a=False).block_m == 64
    big = cfg(8192, 128, 8, "fp8")
    assert (big.block_n1, big.num_warps, big.num_stages) == (128, 8, 4)
    assert [cfg(T, 32, 4, "mxfp4").block_m for T in (512, 1024)] == [64, 128]
    assert all(cfg(T, 32, 4, "mxfp4").mxfp4_swap_ab for T in (1, 512, 1024))
    assert [(cfg(T, 32, 4, "mxfp4").mxfp4_stacked_gate_up, cfg(T, 32, 4, "mxfp4").block_n1)
            for T in (1, 16, 17)] == [(True, 32), (True, 32), (False, 64)]


def test_config_errors_name_the_field(interpreter):
    """A QuantDispatchConfig the kernels cannot run is refused before any launch, with the
    field and what it must be: the FP8 K step is the block shape's bk, the W8A8 gate+up tile
    one bk group, the MXFP4 K step a multiple of 32."""
    import dataclasses

    from moe_ops.launch.quant import quant_dispatch_config

    f_args, f_kw = fp8_inputs(3, 64, 32, 4, 2, (32, 32))
    f_base = quant_dispatch_config(3, 4, 2, 64, 32, "fp8", 32, "cpu", quant_a=True)
    m_args, m_kw, _ = mxfp4_inputs(3, 64, 64, 4, 2)
    m_base = quant_dispatch_config(3, 4, 2, 64, 64, "mxfp4", 32, "cpu")
    cases = [
        (f_args, f_kw, dataclasses.replace(f_base, block_k=64), "block_k must equal"),
        (f_args, f_kw, dataclasses.replace(f_base, block_n1=16), "block_n1 must equal bk"),
        (m_args, m_kw, dataclasses.replace(m_base, block_k=48), "multiple of 32"),
    ]
    for args, kw, cfg, msg in cases:
        with pytest.raises(ValueError, match=msg):
            dispatch_quantized(*args, **kw, config=cfg)


# ---------------------------------------------------------------- MXFP4 mma layout

def test_mxfp4_layout_round_trip_and_byte_map():
    """swizzle_mxfp4 is a permutation of each 16-row x 32-byte block plus a per-word re-encoding
    that unswizzle_mxfp4 inverts exactly; the permutation puts logical byte (n, kb) where the
    kernels' unshuffle reads it (moe_ops.mxfp4_layout's byte map); bad shapes name the
    argument."""
    from moe_ops.mxfp4_layout import _permute, swizzle_mxfp4, unswizzle_mxfp4

    g = torch.Generator().manual_seed(_seed())
    w = torch.randint(0, 256, (2, 32, 64), generator=g, dtype=torch.uint8)
    s = swizzle_mxfp4(w)
    assert s.shape == w.shape and s.dtype == torch.uint8 and s.is_contiguous()
    assert not torch.equal(s, w)
    assert torch.equal(unswizzle_mxfp4(s), w)
    flat = _permute(w).reshape(2, -1)
    for n in range(32):
        a, r = divmod(n, 16)
        gg, r = divmod(r, 8)
        b, d = divmod(r, 2)
        for kb in range(64):
            c, r2 = divmod(kb, 32)
            f, e = divmod(r2, 4)
            pos = (4 * a + b) * 4 * 64 + 128 * c + 64 * d + 16 * e + 2 * f + gg
            assert flat[1, pos] == w[1, n, kb]
    # every code of a word survives the re-encoding: all 2^8 values in each byte position
    words = torch.stack([torch.arange(256, dtype=torch.uint8)] * 4, dim=-1)
    words[:, 1] = words[:, 1].flip(0)
    words = words.reshape(1, 16, 64)
    assert torch.equal(unswizzle_mxfp4(swizzle_mxfp4(words)), words)
    with pytest.raises(ValueError, match="N % 16"):
        swizzle_mxfp4(torch.zeros(1, 24, 64, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        swizzle_mxfp4(torch.zeros(1, 32, 64, dtype=torch.int8))


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("T", [1, 7])
def test_mxfp4_mma_layout_path(interpreter, T, interleaved):
    """The kernels' MMA_LAYOUT path on swizzled weights (stacked and two-tile gate+up, a K tail
    of 64 values in a 128-value step, a dropped id, e8m0 edge scales) gives the plain layout's
    values (same config) and matches the reference."""
    import dataclasses

    from moe_ops.launch.quant import quant_dispatch_config
    from moe_ops.mxfp4_layout import swizzle_mxfp4

    H, I, E, K = 192, 64, 4, 2
    args, kw, biases = mxfp4_inputs(T, H, I, E, K, routing="negative")
    for s in (kw["w13_scale"], kw["w2_scale"]):
        s.view(-1)[::7] = 0
        s.view(-1)[3::11] = 129
    more = (dict(activation="swiglu_oai", gate_up_interleaved=True, **biases) if interleaved
            else dict(activation="silu"))
    kw = dict(kw, **more)
    ref = quantized_dispatch_reference(*args, **kw)
    mma_args = (args[0], swizzle_mxfp4(args[1]), swizzle_mxfp4(args[2]), *args[3:])
    base = quant_dispatch_config(T, E, K, H, I, "mxfp4", 32, "cpu")
    for fields in (dict(block_k=64, mxfp4_stacked_gate_up=True),
                   dict(block_k=128, mxfp4_stacked_gate_up=interleaved)):
        cfg = dataclasses.replace(base, mxfp4_swap_ab=True, **fields)
        out = dispatch_quantized(*mma_args, **kw, mxfp4_layout="mma", config=cfg,
                                 out=_poisoned(args[0]))
        plain = dispatch_quantized(*args, **kw, config=cfg)
        assert torch.isfinite(out).all()
        assert rel_err(out, plain.double()) < 1e-6, fields
        assert rel_err(out, ref) < 1e-5, fields


def test_mxfp4_mma_layout_errors(interpreter):
    """The mma layout's requirements raise naming what is wrong: MXFP4 weights only, H and I
    multiples of 64, contiguous rows."""
    from moe_ops.mxfp4_layout import swizzle_mxfp4

    args, kw, _ = mxfp4_inputs(2, 96, 64, 4, 2)
    with pytest.raises(ValueError, match="multiples of 64"):
        dispatch_quantized(*args, **kw, mxfp4_layout="mma")
    args, kw, _ = mxfp4_inputs(2, 128, 64, 4, 2)
    w13 = swizzle_mxfp4(args[1])
    strided = torch.empty(4, 128, 64, dtype=torch.uint8)[:, :, :32]
    strided.copy_(swizzle_mxfp4(args[2]))
    with pytest.raises(ValueError, match="w2: the mma layout"):
        dispatch_quantized(args[0], w13, strided, *args[3:], **kw, mxfp4_layout="mma")
    fa, fkw = fp8_inputs(2, 128, 64, 4, 2)
    with pytest.raises(ValueError, match="MXFP4"):
        dispatch_quantized(*fa, **fkw, mxfp4_layout="mma")


@pytest.mark.parametrize("path", ["reference", "interpreter"])
def test_op_mxfp4_mma_layout(request, path):
    """moe.dispatch(mxfp4_layout="mma") on swizzled blocks: the plain layout's result through the
    op (CPU reference and interpreter), gradients for hidden through the frozen swizzled experts,
    fake tensors, and the argument's errors."""
    request.getfixturevalue("reference_path" if path == "reference" else "interpreter")
    args, kw, biases = mxfp4_inputs(3, 128, 64, 4, 2, routing="negative")
    kw = dict(kw, activation="swiglu_oai", gate_up_interleaved=True, **biases)
    mma = (args[0], moe_ops.swizzle_mxfp4(args[1]), moe_ops.swizzle_mxfp4(args[2]), *args[3:])
    plain = moe_ops.dispatch(*args, **kw)
    out = moe_ops.dispatch(*mma, **kw, mxfp4_layout="mma")
    assert rel_err(out, plain.double()) < 1e-6
    assert rel_err(out, quantized_dispatch_reference(*args, **kw)) < 1e-5
    if path == "reference":
        h = args[0].clone().requires_grad_(True)
        gm, = torch.autograd.grad(moe_ops.dispatch(h, *mma[1:], **kw, mxfp4_layout="mma").sum(),
                                  h)
        gp, = torch.autograd.grad(moe_ops.dispatch(h, *args[1:], **kw).sum(), h)
        assert rel_err(gm, gp.double()) < 1e-6
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            fa = [mode.from_tensor(a) for a in mma]
            fk = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                  for k, v in kw.items()}
            assert torch.ops.moe.dispatch(*fa, **fk, mxfp4_layout="mma").shape == args[0].shape
    with pytest.raises(ValueError, match="mxfp4_layout"):
        moe_ops.dispatch(*mma, **kw, mxfp4_layout="hopper")
    with pytest.raises(TypeError, match="mxfp4_layout"):
        moe_ops.dispatch(*mma, **kw, mxfp4_layout=1)
    with pytest.raises(ValueError, match="mxfp4_layout"):
        hf = args[0].float()
        moe_ops.dispatch(hf, torch.zeros(4, 128, 128), torch.zeros(4, 128, 64), *args[3:],
                         mxfp4_layout="mma")
    fa, fkw = fp8_inputs(2, 128, 64, 4, 2)
    with pytest.raises(ValueError, match="mxfp4_layout='mma' applies to MXFP4"):
        moe_ops.dispatch(*fa, **fkw, mxfp4_layout="mma")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mxfp4_dequantize_triton(interpreter, dtype):
    """launch.quant.dequantize_mxfp4_triton (the decode of QuantDispatchConfig.mxfp4_dequant_rows)
    gives the reference dequantization's values bit for bit, from the plain and the mma layout,
    with e8m0 bytes at the edges (0 and 1: subnormal factors; 128/129: the two-factor boundary;
    255: inf, NaN for code 0) and N, K that are not multiples of the 64-wide tiles."""
    from moe_ops.launch.quant import dequantize_mxfp4_triton
    from moe_ops.mxfp4_layout import swizzle_mxfp4

    g = torch.Generator().manual_seed(_seed())
    for E, N, K, mma in ((3, 80, 96, False), (2, 128, 192, True)):
        b = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
        s = torch.randint(110, 135, (E, N, K // 32), generator=g, dtype=torch.uint8)
        edges = torch.tensor([0, 1, 2, 127, 128, 129, 255], dtype=torch.uint8)
        s.view(-1)[::5] = edges[torch.randint(0, len(edges), (s.numel() // 5 + 1,),
                                              generator=g)][:s.view(-1)[::5].numel()]
        if dtype == torch.float16:
            s.clamp_(112, 135)   # float16's range: 2^-14 .. 2^15 (subnormals to 2^-24)
        ref = torch.stack([dequantize_mxfp4(b[e], s[e], torch.float32) for e in range(E)])
        got = dequantize_mxfp4_triton(swizzle_mxfp4(b) if mma else b, s, dtype, mma=mma)
        assert got.dtype == dtype and got.shape == (E, N, K)
        want = ref.to(dtype)
        same = (got == want) | (got.isnan() & want.isnan())
        assert same.all(), (mma, int((~same).sum()), got[~same][:4], want[~same][:4])


@pytest.mark.parametrize("layout", ["plain", "mma"])
def test_mxfp4_dequant_rows_path(interpreter, layout, monkeypatch):
    """QuantDispatchConfig.mxfp4_dequant_rows: from that many slots per expert the call decodes
    the experts once and runs the 16-bit expert kernels (gpt-oss's variant: biases, swiglu_oai,
    interleaved rows, a dropped id), matching the reference and the fused kernels; below it,
    or with the buffer over MXFP4_DEQUANT_MAX_BYTES, the fused kernels run."""
    import dataclasses

    import moe_ops.launch.dispatch as bf16_dispatch
    from moe_ops.launch import quant
    from moe_ops.mxfp4_layout import swizzle_mxfp4

    calls = []
    real = bf16_dispatch.dispatch_triton
    monkeypatch.setattr(bf16_dispatch, "dispatch_triton",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    T, H, I, E, K = 9, 128, 64, 4, 2
    args, kw, biases = mxfp4_inputs(T, H, I, E, K, dtype=torch.bfloat16, routing="negative")
    kw = dict(kw, activation="swiglu_oai", gate_up_interleaved=True, **biases)
    ref = quantized_dispatch_reference(*args, **kw)
    if layout == "mma":
        args = (args[0], swizzle_mxfp4(args[1]), swizzle_mxfp4(args[2]), *args[3:])
        kw["mxfp4_layout"] = "mma"
    base = quant.quant_dispatch_config(T, E, K, H, I, "mxfp4", 32, "cpu")
    fused = dispatch_quantized(*args, **kw, config=base)
    assert not calls
    cfg = dataclasses.replace(base, mxfp4_dequant_rows=T * K // E)
    out = dispatch_quantized(*args, **kw, config=cfg, out=_poisoned(args[0]))
    assert len(calls) == 1
    assert rel_err(out, ref) < RTOL[torch.bfloat16]
    assert rel_err(out, fused.double()) < 5e-3
    dispatch_quantized(*args, **kw, config=dataclasses.replace(cfg, mxfp4_dequant_rows=T * K))
    monkeypatch.setattr(quant, "MXFP4_DEQUANT_MAX_BYTES", 3 * E * H * I * 2 - 1)
    dispatch_quantized(*args, **kw, config=cfg)
    assert len(calls) == 1


def test_activation_codes_are_the_bf16_kernels():
    """The quantized kernels pass ACTIVATIONS.index(name) to expert_gemm.activate, whose codes
    are ACT_CODES: the two orders must agree."""
    from moe_ops.kernels.expert_gemm import ACT_CODES
    from moe_ops.ops.quant_checks import ACTIVATIONS

    assert {a: ACTIVATIONS.index(a) for a in ACTIVATIONS} == ACT_CODES


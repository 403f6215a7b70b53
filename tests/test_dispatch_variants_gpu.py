"""GPU: moe.dispatch's expert variants (biases, activations, interleaved gate/up rows, transposed
checkpoint-layout weights, the routing weight on the input, a separate up projection w3) in
bf16 against float64, CUDA-graph capture, no host sync, one compiled frame for every T, no
weight-sized allocation for transposed gpt-oss weights, and the gpt-oss-20b and DBRX expert
shapes. The CPU side (reference, interpreted kernels, gradcheck, opcheck, errors) is
tests/test_dispatch_variants.py (tests/test_dispatch_w3.py for w3). Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from torch._dynamo.decorators import mark_unbacked

import moe_ops
from conftest import rel_err
from gpu_utils import peak_beyond_allocated
from moe_ops.ops.samples import VARIANTS, make_variant_inputs
from test_dispatch_variants import _grads_oracle, _oracle64, dense_oracle

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
VARIANT_IDS = [name for name, _, _ in VARIANTS]
# Norm-wise bf16 error bounds against float64 (test_gpu.py's for the plain experts).
BF16_FWD = 1.5e-2
BF16_BWD = 2.5e-2
GPT_OSS = VARIANTS[0]


def _torch_bf16_grads(args, kw, go):
    """The gradients PyTorch's own bf16 autograd gives through the dense oracle (the error
    any bf16 implementation carries: with swiglu_oai's clamps binding, a bf16-rounded
    pre-activation crosses the limit where the exact one does not, and the derivative jumps)."""
    a = [x.detach().clone().requires_grad_(True) if x.is_floating_point() else x for x in args]
    kwb = dict(kw)
    for k in ("w13_bias", "w2_bias"):
        if kw[k] is not None:
            kwb[k] = kw[k].detach().clone().requires_grad_(True)
    leaves = [*a[:4], kwb["w13_bias"], kwb["w2_bias"]]
    out = dense_oracle(*a, **kwb)
    present = [x for x in leaves if x is not None]
    grads = iter(torch.autograd.grad(out, present, go))
    return [None if x is None else next(grads) for x in leaves]


def _grad_bound(name, args, kw, go, ref):
    """BF16_BWD; where clamps bind (swiglu_oai, silu_clamp, silu_clamp_out), at most twice
    PyTorch's own bf16 error per gradient (flash-attention's rule), whichever is larger. (On an
    H100, silu_clamp / silu_clamp_out at T = 5 and 300: moe_ops 3.0-3.9% in dx / dw13; PyTorch's
    own bf16 autograd through the dense oracle is 4-23% off on CPU draws of the same inputs.)"""
    if kw.get("activation") not in ("swiglu_oai", "silu_clamp", "silu_clamp_out"):
        return [BF16_BWD] * len(ref)
    own = _torch_bf16_grads(args, kw, go)
    return [BF16_BWD if o is None or r is None or r.norm() == 0
            else max(BF16_BWD, 2 * rel_err(o, r)) for o, r in zip(own, ref)]


def _inputs(name, T, H=256, I=192, E=8, K=2, routing="negative", seed=0, requires_grad=False,
            dtype=torch.bfloat16, **opts_extra):
    _, opts, kw = {n: (n, o, k) for n, o, k in VARIANTS}[name]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    args, b13, b2 = make_variant_inputs(T, H, I, E, K, dtype=dtype, device=DEVICE,
                                        routing=routing, generator=g,
                                        requires_grad=requires_grad, **dict(opts, **opts_extra))
    return args, dict(kw, w13_bias=b13, w2_bias=b2)


@pytest.mark.parametrize("T", [1, 5, 300])
@pytest.mark.parametrize("name", VARIANT_IDS)
def test_forward_backward_bf16(name, T):
    """bf16 forward and all six gradients against float64 autograd (T = 1: the one-token
    paths; 5: direct rows; 300: aligned rows)."""
    args, kw = _inputs(name, T, seed=T, requires_grad=True)
    out = moe_ops.dispatch(*args, **kw)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, _oracle64(args, kw)) <= BF16_FWD
    go = torch.randn(out.shape, device=DEVICE, dtype=torch.bfloat16)
    out.backward(go)
    ref = _grads_oracle(args, kw, go)
    bounds = _grad_bound(name, args, kw, go, ref)
    for t, r, bound in zip([*args[:4], kw["w13_bias"], kw["w2_bias"]], ref, bounds):
        if t is None:
            continue
        assert t.grad is not None and t.grad.stride() == t.stride()
        if r.norm() > 0:
            assert rel_err(t.grad, r) <= bound


@pytest.mark.parametrize("recompute", [False, True])
def test_recompute_and_saved_z_agree(recompute):
    from moe_ops import set_recompute

    args, kw = _inputs("gpt_oss", 64, seed=3, requires_grad=True)
    old = set_recompute(recompute)
    try:
        out = moe_ops.dispatch(*args, **kw)
        out.backward(torch.ones_like(out))
    finally:
        set_recompute(old)
    ref = _grads_oracle(args, kw, torch.ones_like(out))
    bounds = _grad_bound("gpt_oss", args, kw, torch.ones_like(out), ref)
    for t, r, bound in zip([*args[:4], kw["w13_bias"], kw["w2_bias"]], ref, bounds):
        assert rel_err(t.grad, r) <= bound


@pytest.mark.parametrize("T", [1, 8, 200])
def test_cuda_graph_capture_and_no_host_sync(T):
    """The gpt-oss variant captured in a CUDA graph replays on fresh inputs copied into its
    static buffers; forward and backward run under set_sync_debug_mode("error")."""
    args, kw = _inputs("gpt_oss", T, seed=T)
    static = [a.clone() for a in args]
    moe_ops.dispatch(*static, **kw)   # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_ops.dispatch(*static, **kw)
    fresh, _ = _inputs("gpt_oss", T, seed=T + 100)
    for s, f in zip(static, fresh):
        s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, _oracle64(fresh, kw)) <= BF16_FWD

    grad_args, gkw = _inputs("gpt_oss", T, seed=T + 1, requires_grad=True)
    y = moe_ops.dispatch(*grad_args, **gkw)   # warm-up (kernel compiles may sync)
    y.backward(torch.ones_like(y))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = moe_ops.dispatch(*grad_args, **gkw)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.inductor
def test_fullgraph_one_frame_for_every_T():
    """The gpt-oss variant routed by moe_ops.route inside one fullgraph Inductor frame, for
    T = 1, 0, 3, 17, 256 without recompiling."""
    torch._dynamo.reset()
    (_, w13, w2, _, _), kw = _inputs("gpt_oss", 4, seed=0)
    b13, b2 = kw.pop("w13_bias"), kw.pop("w2_bias")
    router = torch.randn(256, 8, device=DEVICE, dtype=torch.bfloat16)

    def f(h, w13, w2, b13, b2):
        w, ids = moe_ops.route(h @ router, 2)
        return moe_ops.dispatch(h, w13, w2, w, ids, w13_bias=b13, w2_bias=b2, **kw), w, ids

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for i, T in enumerate([1, 0, 3, 17, 256]):
        h = torch.randn(T, 256, device=DEVICE, dtype=torch.bfloat16)
        if i == 0:
            mark_unbacked(h, 0)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out, w, ids = compiled(h, w13, w2, b13, b2)
        if T:
            full = dict(kw, w13_bias=b13, w2_bias=b2)
            assert rel_err(out, _oracle64((h, w13, w2, w, ids), full)) <= BF16_FWD
    assert counter.frame_count == 1


def test_transposed_weights_allocate_no_weight_copy():
    """gpt-oss's [E, H, 2I] / [E, I, H] storage passed as transposed views: the forward's peak
    allocation stays well under one weight's bytes (no copy of either)."""
    args, kw = _inputs("gpt_oss", 16, H=1024, I=1024, E=16, K=4, seed=5)
    w13_bytes = args[1].numel() * args[1].element_size()
    w2_bytes = args[2].numel() * args[2].element_size()
    out, delta = peak_beyond_allocated(lambda: moe_ops.dispatch(*args, **kw))
    assert delta < min(w13_bytes, w2_bytes) / 4, (delta, w13_bytes, w2_bytes)
    del out


@pytest.mark.parametrize("T", [1, 4, 64, 1024])
def test_gpt_oss_20b_shape(T):
    """E = 32, K = 4, H = I = 2880, biases, swiglu_oai (alpha 1.702, limit 7), interleaved
    gate/up, weights as transposed views of the checkpoint layout: bf16 forward against float64
    (the reference expert by expert)."""
    from moe_ops.reference import dispatch_reference

    E, K, H, I = 32, 4, 2880, 2880
    g = torch.Generator(device=DEVICE).manual_seed(T)
    args, b13, b2 = make_variant_inputs(T, H, I, E, K, device=DEVICE, dtype=torch.bfloat16,
                                        generator=g, w13_bias=True, w2_bias=True,
                                        transpose_w13=True, transpose_w2=True, weight_std=0.02)
    kw = dict(activation="swiglu_oai", alpha=1.702, limit=7.0, gate_up_interleaved=True,
              w13_bias=b13, w2_bias=b2)
    out = moe_ops.dispatch(*args, **kw)
    ref = dispatch_reference(args[0].double(), args[1], args[2], args[3].double(), args[4],
                             w13_bias=b13.double(), w2_bias=b2.double(),
                             **{k: v for k, v in kw.items() if "bias" not in k})
    assert rel_err(out, ref) <= BF16_FWD


# ---------------------------------------------------------------------------------------------
# w3: the up projection apart from the gate (DBRX). CPU side: tests/test_dispatch_w3.py.

def _w3_inputs(T, H, I, E, K, seed=0, requires_grad=False, **opts):
    from test_dispatch_w3 import _make

    args, kw = _make(T=T, H=H, I=I, E=E, K=K, dtype=torch.bfloat16, routing="negative",
                     seed=seed, device=DEVICE, **opts)
    if requires_grad:
        for t in (*args[:4], *[v for v in kw.values() if isinstance(v, torch.Tensor)]):
            t.requires_grad_(True)
    return args, kw


def _w3_check_grads(args, kw, go, bound=BF16_BWD):
    from test_dispatch_w3 import _grad_oracle

    ref = _grad_oracle(args, kw, go)
    leaves = [*args[:4], kw.get("w13_bias"), kw.get("w2_bias"), kw["w3"]]
    for name, t, r in zip(["hidden", "w13", "w2", "topk_weights", "w13_bias", "w2_bias", "w3"],
                          leaves, ref):
        if t is None:
            continue
        assert t.grad is not None and t.grad.stride() == t.stride(), name
        if r.norm() > 0:
            assert rel_err(t.grad, r) <= bound, (name, rel_err(t.grad, r))


@pytest.mark.parametrize("T", [1, 128])
def test_w3_dbrx_shape_forward(T):
    """DBRX's expert shape (E = 16, K = 4, H = 6144, I = 10752) with DBRX's views (w1 / v1 /
    w2 [E*I, H] seen as [E, I, H], w2 transposed), bf16 forward against float64."""
    from test_dispatch_w3 import _oracle

    args, kw = _w3_inputs(T, 6144, 10752, 16, 4, seed=T, dbrx=True)
    out = moe_ops.dispatch(*args, **kw)
    assert rel_err(out, _oracle(args, kw)) <= BF16_FWD


@pytest.mark.parametrize("T", [1, 256])
def test_w3_dbrx_views_backward(T):
    """Every gradient (w3's included) with DBRX's views at E = 16, K = 4 and a third of DBRX's
    H and I (the float64 oracle's weight gradients stay a few GB), bf16 against float64."""
    args, kw = _w3_inputs(T, 2048, 3584, 16, 4, seed=T, requires_grad=True, dbrx=True)
    out = moe_ops.dispatch(*args, **kw)
    go = torch.randn(out.shape, device=DEVICE, dtype=torch.bfloat16)
    out.backward(go)
    _w3_check_grads(args, kw, go)


@pytest.mark.parametrize("T", [1, 5, 300])
@pytest.mark.parametrize("biases", [False, True])
def test_w3_tma_capable_shapes_take_the_pointer_path(T, biases, monkeypatch):
    """H and I multiples of 128 (the shapes whose configs take the descriptor paths): calls with
    w3 launch the gate+up kernel on pointer loads (no descriptor, HAS_W3), forward and the
    backward's recompute, with the right result; also under a config that asks for TMA."""
    from dataclasses import replace

    import moe_ops.launch.dispatch as launch
    from conftest import spy_kernel_launches
    from moe_ops.kernels.expert_gemm import gate_up_kernel
    from moe_ops.tuning.heuristics import dispatch_config
    from test_dispatch_w3 import _compute_kw, _oracle

    monkeypatch.setenv("MOE_OPS_FAST_LAUNCH", "0")   # (every launch through the spy)
    seen = []
    spy_kernel_launches(monkeypatch, launch, lambda k, g, a, kw: seen.append(kw)
                        if k is gate_up_kernel else None)
    args, kw = _w3_inputs(T, 256, 384, 8, 2, seed=T, requires_grad=True, biases=biases,
                          strided=T == 5)
    out = moe_ops.dispatch(*args, **kw)
    assert rel_err(out, _oracle(args, kw)) <= BF16_FWD
    go = torch.randn(out.shape, device=DEVICE, dtype=torch.bfloat16)
    moe_ops.set_recompute(True)
    try:
        moe_ops.dispatch(*args, **kw).backward(go)
    finally:
        moe_ops.set_recompute(None)
    _w3_check_grads(args, kw, go)
    cfg = replace(dispatch_config(T, 8, 2, 256, 384, "cuda", torch.bfloat16), tma_weights=True,
                  tma_gate_up_pair=True)
    det = [a.detach() for a in args]
    kw_d = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    got = launch.dispatch_triton(*det, config=cfg, **_compute_kw(kw_d))
    assert rel_err(got, _oracle(det, kw_d)) <= BF16_FWD
    assert len(seen) >= 3
    for launch_kw in seen:
        assert launch_kw.get("HAS_W3") and not launch_kw.get("USE_TMA"), launch_kw


@pytest.mark.parametrize("T", [1, 8, 200])
def test_w3_cuda_graph_capture_and_no_host_sync(T):
    """DBRX-style views captured in a CUDA graph replay on fresh inputs copied into the static
    buffers; forward and backward (w3's gradient included) under set_sync_debug_mode("error")."""
    from test_dispatch_w3 import _oracle

    args, kw = _w3_inputs(T, 256, 384, 8, 4, seed=T, dbrx=True, biases=True)
    static = [a.clone() for a in args]
    moe_ops.dispatch(*static, **kw)   # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_ops.dispatch(*static, **kw)
    fresh, _ = _w3_inputs(T, 256, 384, 8, 4, seed=T + 100, dbrx=True)
    for s, f in zip(static, fresh):
        s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, _oracle(fresh, kw)) <= BF16_FWD

    grad_args, gkw = _w3_inputs(T, 256, 384, 8, 4, seed=T + 1, requires_grad=True, dbrx=True)
    y = moe_ops.dispatch(*grad_args, **gkw)   # warm-up (kernel compiles may sync)
    y.backward(torch.ones_like(y))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = moe_ops.dispatch(*grad_args, **gkw)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert gkw["w3"].grad is not None


@pytest.mark.parametrize("T", [1, 300])
def test_w3_same_as_w13_nemotron_shape(T):
    """Ungated ReLU-squared experts as transformers' integration passes them (w13 = w3 = up, the
    same view, "relu"), Nemotron-3-Nano's expert shape (E = 128, K = 6, H = 2688, I = 1856):
    bf16 forward and every gradient against float64 (up's gradient: both uses added up)."""
    g = torch.Generator(device=DEVICE).manual_seed(T)
    E, K, H, I = 128, 6, 2688, 1856
    up = (torch.randn(E, I, H, device=DEVICE, generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=DEVICE, generator=g) * I ** -0.5).bfloat16()
    h = torch.randn(T, H, device=DEVICE, generator=g).bfloat16()
    w, ids = torch.randn(T, E, device=DEVICE, generator=g).softmax(-1).topk(K, -1)
    leaves = [t.clone().requires_grad_(True) for t in (h, up, w2, w)]
    out = moe_ops.dispatch(*leaves[:3], leaves[3], ids, activation="relu", w3=leaves[1])
    go = torch.randn(out.shape, device=DEVICE, generator=g).bfloat16()
    out.backward(go)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (h, up, w2, w)]
    h64, up64, w264, w64 = ref_leaves
    ref = torch.zeros(T, H, dtype=torch.float64, device=DEVICE)
    for e in ids.unique().tolist():   # (per expert: a gather of [T, I, H] float64 is GBs)
        t, k = (ids == e).nonzero(as_tuple=True)
        a = torch.relu(h64[t] @ up64[e].t()) ** 2
        ref = ref.index_add(0, t, w64[t, k, None] * (a @ w264[e].t()))
    ref.backward(go.double())
    assert rel_err(out, ref) <= BF16_FWD
    for name, t, r in zip(["hidden", "up", "w2", "topk_weights"], leaves, ref_leaves):
        assert rel_err(t.grad, r.grad) <= BF16_BWD, (name, rel_err(t.grad, r.grad))

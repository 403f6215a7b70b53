"""moe.dispatch forward on the GPU (H200): parity on every benchmark shape and path, odd sizes,
expanded weights, offsets past 2^31, determinism, CUDA-graph capture, no host sync."""
import os  # noqa: F401

import pytest
import torch
import triton  # noqa: F401
import triton.language as tl  # noqa: F401

from conftest import assert_same_selection, nan_summary, rel_err  # noqa: F401
from gpu_utils import (BWD_RTOL, GPU_RTOL, SHAPES, _inputs, _oracle,  # noqa: F401
                       _poison_allocator)
from moe_ops.launch.dispatch import dispatch_triton  # noqa: F401
from moe_ops.ops.samples import make_dispatch_inputs  # noqa: F401
from moe_ops.reference import dispatch_reference, route_reference  # noqa: F401
from moe_ops.reference.routing import selection_scores  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T", [1, 7, 128, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", list(SHAPES))
def test_parity_benchmark_shapes(name, dtype, T):
    args = _inputs(name, T, dtype, seed=T)
    _poison_allocator()
    out = torch.full((T, args[0].shape[1]), float("nan"), dtype=dtype, device="cuda")
    dispatch_triton(*args, out=out)
    assert rel_err(out, _oracle(*args)) <= GPU_RTOL[dtype]
    del args, out
    torch.cuda.empty_cache()


@pytest.mark.parametrize("T", [1, 8, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(SHAPES))
def test_parity_path_variants(name, dtype, T):
    """The heuristic's path switches both ways at T = 1, 8 (decode tiles) and 2048 (TMA weight
    tiles, the T == 1 direct rows and the combine folded into the down GEMM or done by its last
    program, programmatic dependent launch, half-height tail tiles, pipeline depth), ids < 0
    included, against float64."""
    from moe_ops.tuning.heuristics import heuristic_config, neighbours

    args = _inputs(name, T, dtype, routing="negative", seed=T + 3)
    H, I, E, K = SHAPES[name]
    ref = _oracle(*args)
    base = heuristic_config(T, E, K, H, I, "cuda", dtype)
    words = ("tma", "direct", "fused", "pdl", "s3", "s4", "half", "combine", "ws", "per tile")
    picked = {k: v for k, v in neighbours(base, dtype).items()
              if k == "heuristic" or any(w in k for w in words)}
    assert len(picked) >= 2
    for vname, cfg in picked.items():
        _poison_allocator()
        out = torch.full((T, H), float("nan"), dtype=dtype, device="cuda")
        dispatch_triton(*args, config=cfg, out=out)
        assert rel_err(out, ref) <= GPU_RTOL[dtype], vname


@pytest.mark.parametrize("name", ["deepseek_v3_routed", "qwen3_30b_a3b"])
def test_one_token_unused_expert_nan_weights(name):
    """T == 1, the fused down+combine kernel and the combine-last path, ids < 0 and >= E among
    the token's slots, NaN weights in expert 0, which no slot uses: the output is finite and
    matches float64 (a dropped id must read no weights); every id dropped gives zeros."""
    import dataclasses

    from moe_ops.tuning.heuristics import heuristic_config

    H, I, E, K = SHAPES[name]
    h, w13, w2, w, _ = _inputs(name, 1, torch.bfloat16, seed=23)
    w13[0].fill_(float("nan"))
    w2[0].fill_(float("nan"))
    base = heuristic_config(1, E, K, H, I, "cuda", torch.bfloat16)
    for ids in ([[5, -1, 9, E, 17, -3, 2, 40]], [[-1] * 4 + [E] * 4]):
        ids = torch.tensor(ids, dtype=torch.int32, device="cuda")
        ref = _oracle(h, w13, w2, w, ids)
        for fused in (True, False):
            cfg = dataclasses.replace(base, down_combine_fused=fused, combine_in_down=not fused)
            _poison_allocator()
            out = torch.full((1, H), float("nan"), dtype=torch.bfloat16, device="cuda")
            dispatch_triton(h, w13, w2, w, ids, config=cfg, out=out)
            assert out.isfinite().all(), (fused, nan_summary(out))
            assert rel_err(out, ref) <= GPU_RTOL[torch.bfloat16] or \
                torch.equal(out, torch.zeros_like(out)), fused
            if (ids < 0).logical_or(ids >= E).all():
                assert torch.equal(out, torch.zeros_like(out)), fused


@pytest.mark.parametrize("routing", ["skewed", "one_expert", "empty_experts", "negative"])
def test_parity_routings(routing):
    args = _inputs("qwen3_30b_a3b", 2048, torch.bfloat16, routing=routing, seed=11)
    out = torch.ops.moe.dispatch(*args)
    assert rel_err(out, _oracle(*args)) <= GPU_RTOL[torch.bfloat16]


def test_odd_sizes():
    g = torch.Generator(device="cuda").manual_seed(5)
    for T, H, I, E, K in [(1, 33, 17, 5, 2), (77, 1000, 333, 13, 3), (300, 129, 65, 3, 3)]:
        for dtype in (torch.bfloat16, torch.float32):
            args = make_dispatch_inputs(T, H, I, E, K, dtype=dtype, device="cuda", generator=g,
                                        routing="negative")
            out = torch.ops.moe.dispatch(*args)
            assert rel_err(out, _oracle(*args)) <= GPU_RTOL[dtype]


@pytest.mark.parametrize("T", [1, 8, 2048])
def test_expanded_weights(T):
    """Weights broadcast over the experts (stride 0 along E, e.g. tied experts): no tensor
    descriptor is made for a zero stride (the pointer path reads them); forward and every
    gradient equal to those of a contiguous copy (weight gradients: the copy's summed over E)
    and near float64."""
    H, I, E, K = 256, 128, 16, 4
    g = torch.Generator(device="cuda").manual_seed(T)
    h, w13, w2, w, ids = make_dispatch_inputs(T, H, I, E, K, dtype=torch.bfloat16, device="cuda",
                                              routing="negative", weight_std=0.05, generator=g)
    b13 = w13[:1].clone().requires_grad_()
    b2 = w2[:1].clone().requires_grad_()
    h.requires_grad_()
    w.requires_grad_()
    out = torch.ops.moe.dispatch(h, b13.expand(E, -1, -1), b2.expand(E, -1, -1), w, ids)
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (h, b13, b2, w), go)
    c13 = b13.detach().expand(E, -1, -1).contiguous().requires_grad_()
    c2 = b2.detach().expand(E, -1, -1).contiguous().requires_grad_()
    out_c = torch.ops.moe.dispatch(h, c13, c2, w, ids)
    gh, g13, g2, gw = torch.autograd.grad(out_c, (h, c13, c2, w), go)
    assert torch.equal(out, out_c)
    assert rel_err(out, _oracle(h.detach(), c13.detach(), c2.detach(), w.detach(), ids)) \
        <= GPU_RTOL[torch.bfloat16]
    assert torch.equal(grads[0], gh) and torch.equal(grads[3], gw)
    for got, want in ((grads[1], g13.float().sum(0, keepdim=True)),
                      (grads[2], g2.float().sum(0, keepdim=True))):
        assert rel_err(got.float(), want) <= 1e-2


def test_offsets_past_2_31():
    # T*K*H = 40000*8*7168 = 2.29e9 > 2^31: per-slot output offsets need 64-bit arithmetic.
    T, H, I, E, K = 40000, 7168, 256, 8, 8
    g = torch.Generator(device="cuda").manual_seed(6)
    args = make_dispatch_inputs(T, H, I, E, K, dtype=torch.bfloat16, device="cuda", generator=g,
                                weight_std=0.02)
    out = torch.ops.moe.dispatch(*args)
    ref = _oracle(*args)
    assert rel_err(out, ref) <= GPU_RTOL[torch.bfloat16]
    # the last tokens live past the 2^31 boundary of the slot buffer
    assert rel_err(out[-100:], ref[-100:]) <= GPU_RTOL[torch.bfloat16]


def test_deterministic_bitwise():
    args = _inputs("olmoe", 2048, torch.bfloat16, routing="skewed")
    first = torch.ops.moe.dispatch(*args)
    for _ in range(5):
        assert torch.equal(torch.ops.moe.dispatch(*args), first)

@pytest.mark.parametrize("T", [1, 8, 300])
def test_int64_ids_wrapping_in_int32_dropped(T):
    """int64 ids out of range whose low 32 bits name a valid expert are dropped like -1: the
    training forward and gradients (recompute mode: the alignment kernels route the slots) and,
    at T == 1 on the DeepSeek-V3 shape, the folded single-token down+combine kernel."""
    import moe_ops

    name = "deepseek_v3_routed" if T == 1 else "qwen3_30b_a3b"
    h, w13, w2, tw, ids = _inputs(name, T, torch.bfloat16, seed=T, num_experts=16)
    ids = ids.long()
    bad = ids.clone()
    bad.view(-1)[::3] = -(2**32) + 1
    bad.view(-1)[1::5] = 2**32 + 2
    dropped = bad.masked_fill((bad < 0) | (bad >= w2.shape[0]), -1)
    prev = moe_ops.set_recompute(True)
    try:
        got = []
        for i in (bad, dropped):
            params = [t.detach().clone().requires_grad_(True) for t in (h, w13, w2, tw)]
            out = torch.ops.moe.dispatch(*params, i)
            out.float().square().sum().backward()
            got.append([out] + [p.grad for p in params])
    finally:
        moe_ops.set_recompute(prev)
    for a, b in zip(*got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("T", [1, 8, 128, 4096])
def test_cuda_graph_capture_route_dispatch(T):
    """Route + dispatch captured in a CUDA graph and replayed on new inputs: bitwise the eager
    result. T=4096 (256 rows per expert) captures the warp-specialised down GEMM, whose
    in-kernel descriptors take scratch memory from the allocator moe_ops gives Triton."""
    H, I, E, K = SHAPES["qwen3_30b_a3b"]
    g = torch.Generator(device="cuda").manual_seed(T)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g).bfloat16() * 0.02
    w2 = torch.randn(E, H, I, device="cuda", generator=g).bfloat16() * 0.02
    x_static = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    l_static = torch.randn(T, E, device="cuda", generator=g)

    def step():
        w, ids = torch.ops.moe.route(l_static, K)
        return torch.ops.moe.dispatch(x_static, w13, w2, w, ids)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compile kernels before capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = step()
    for i in range(3):
        x_static.copy_(torch.randn(T, H, device="cuda", generator=g).bfloat16())
        l_static.copy_(torch.randn(T, E, device="cuda", generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_static, step())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ops_on_a_gpu_that_is_not_current():
    """Route, dispatch and its backward on cuda:1 while cuda:0 is current (as with a model split
    over GPUs): the kernels run on the tensors' GPU, results equal to running with cuda:1
    current, and cuda:0 stays current."""
    H, I, E, K = SHAPES["qwen3_30b_a3b"]
    T = 256
    g = torch.Generator(device="cuda:1").manual_seed(31)
    args = make_dispatch_inputs(T, H, I, E, K, dtype=torch.bfloat16, device="cuda:1",
                                weight_std=0.02, generator=g)
    logits = torch.randn(T, E, device="cuda:1", generator=g)
    go = torch.randn(T, H, device="cuda:1", dtype=torch.bfloat16, generator=g)

    def run():
        w, ids = torch.ops.moe.route(logits, K)
        leaves = [a.detach().requires_grad_(True) for a in args[:4]]
        out = torch.ops.moe.dispatch(*leaves, ids)
        out.backward(go)
        return [w, ids, out] + [a.grad for a in leaves]

    torch.cuda.set_device(0)
    got = run()
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    with torch.cuda.device(1):
        ref = run()
    for a, b in zip(got, ref):
        assert a.device == torch.device("cuda:1") and torch.equal(a, b)


def test_no_host_sync():
    args = _inputs("olmoe", 128, torch.bfloat16)
    logits = torch.randn(128, 64, device="cuda")
    torch.ops.moe.dispatch(*args)
    torch.ops.moe.route(logits, 8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w, ids = torch.ops.moe.route(logits, 8)
        torch.ops.moe.dispatch(args[0], args[1], args[2], w, ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)

@pytest.mark.parametrize("T", [1, 300])
def test_dispatch_train_z_zero_for_slots_without_an_expert(T):
    """The training forward's z: rows of ids < 0 and >= E are zero (gate_up never writes them;
    zero_dropped_z_kernel does), bitwise reproducible on poisoned memory, other rows as the
    reference's z."""
    args = list(_inputs("qwen3_30b_a3b", T, torch.bfloat16, seed=41))
    ids = args[4].clone()
    E = args[1].shape[0]
    ids[0, 1] = -1
    ids[-1, 0] = E if T > 1 else -5
    args[4] = ids
    zs = []
    for _ in range(2):
        _poison_allocator()
        zs.append(torch.ops.moe.dispatch_train(*args)[1])
    assert torch.equal(zs[0], zs[1])
    flat = ids.reshape(-1)
    dropped = (flat < 0) | (flat >= E)
    assert int(dropped.sum()) == 2 and not zs[0][dropped].any()
    _, z_ref = dispatch_reference(*args, return_z=True)
    assert rel_err(zs[0][~dropped], z_ref[~dropped]) <= 2e-2

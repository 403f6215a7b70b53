"""moe.dispatch backward on the GPU: parity on every benchmark shape, routings, large offsets,
bitwise reproducibility, the persistent weight gradients, exactness beside another GPU process."""
import os  # noqa: F401

import pytest
import torch
import triton  # noqa: F401
import triton.language as tl  # noqa: F401

from conftest import assert_same_selection, nan_summary, rel_err  # noqa: F401
from gpu_utils import (BWD_RTOL, GPU_RTOL, SHAPES, _inputs, _oracle,  # noqa: F401
                       _poison_allocator, deepseek_backward_experts, gpu_noise,
                       peak_beyond_allocated)
from moe_ops.launch.dispatch import dispatch_triton  # noqa: F401
from moe_ops.ops.samples import make_dispatch_inputs  # noqa: F401
from moe_ops.reference import dispatch_reference, route_reference  # noqa: F401
from moe_ops.reference.routing import selection_scores  # noqa: F401

pytestmark = pytest.mark.gpu


def test_backward_gpu_matches_float64():
    g = torch.Generator(device="cuda").manual_seed(12)
    args = make_dispatch_inputs(64, 256, 128, 8, 2, dtype=torch.float32, device="cuda",
                                generator=g, requires_grad=True, routing="negative")
    out = torch.ops.moe.dispatch(*args)
    go = torch.randn(out.shape, device="cuda", generator=g)
    out.backward(go)
    ref = [a.detach().double().requires_grad_(True) for a in args[:4]]
    dispatch_reference(*ref, args[4]).backward(go.double())
    for a, r in zip(args[:4], ref):
        assert rel_err(a.grad, r.grad) <= 1e-5


# -- backward (Triton kernels) ------------------------------------------------------------------
# float16 keeps 3 more mantissa bits than bfloat16: its gradients' rounding error is ~8x smaller;
# 1e-2 is the interpreter tests' float16 bound (tests/test_training_modes.py, GRAD_TOL).

def _backward(go, args, path):
    """The two Triton backwards: z recomputed (moe.dispatch_backward) or saved by the training
    forward (moe.dispatch_train + moe.dispatch_backward_saved, the default under autograd)."""
    if path == "recompute":
        return torch.ops.moe.dispatch_backward(go, *args)
    _, z = torch.ops.moe.dispatch_train(*args)
    return torch.ops.moe.dispatch_backward_saved(go, z, *args)


@pytest.mark.parametrize("path", ["saved", "recompute"])
@pytest.mark.parametrize("T", [128, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", list(SHAPES))
def test_backward_parity_benchmark_shapes(name, dtype, T, path):
    from moe_ops.reference import dispatch_backward_reference

    # DeepSeek-V3 at full E: weights + our grads + the reference's float32 grads (and float32
    # per-expert temporaries) ran out of the H200's 139 GiB (2026-11-29), in the oracle, not in
    # moe_ops. Its H and I are kept; E is cut (gpu_utils.deepseek_backward_experts).
    E = deepseek_backward_experts() if name == "deepseek_v3_routed" else None
    args = _inputs(name, T, dtype, seed=T + 1, num_experts=E)
    go = torch.randn(T, args[0].shape[1], device="cuda", dtype=dtype)
    _poison_allocator()
    got = _backward(go, args, path)
    ref = dispatch_backward_reference(go, *args)   # float32 expert by expert
    for label, a, r in zip(("hidden", "w13", "w2", "topk_weights"), got, ref):
        assert rel_err(a, r) <= BWD_RTOL[dtype], (label, rel_err(a, r))
    del got, ref, args
    torch.cuda.empty_cache()


@pytest.mark.parametrize("path", ["saved", "recompute"])
@pytest.mark.parametrize("routing", ["skewed", "one_expert", "empty_experts", "negative"])
def test_backward_parity_routings(routing, path):
    from moe_ops.reference import dispatch_backward_reference

    args = _inputs("olmoe", 2048, torch.bfloat16, routing=routing, seed=13)
    go = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    got = _backward(go, args, path)
    ref = dispatch_backward_reference(go, *args)
    for a, r in zip(got, ref):
        if r.norm() == 0:
            assert torch.equal(a, torch.zeros_like(a))
        else:
            assert rel_err(a, r) <= BWD_RTOL[torch.bfloat16]


def test_backward_large_offsets():
    # T*K*H = 2.29e9 > 2^31 in the per-slot dx buffer and the gathers
    from moe_ops.reference import dispatch_backward_reference

    T, H, I, E, K = 40000, 7168, 128, 8, 8
    g = torch.Generator(device="cuda").manual_seed(14)
    args = make_dispatch_inputs(T, H, I, E, K, dtype=torch.bfloat16, device="cuda", generator=g,
                                weight_std=0.02)
    go = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = dispatch_backward_reference(go, *args)
    for path in ("saved", "recompute"):
        got = _backward(go, args, path)
        for a, r in zip(got, ref):
            assert rel_err(a, r) <= BWD_RTOL[torch.bfloat16], path
        assert rel_err(got[0][-64:], ref[0][-64:]) <= BWD_RTOL[torch.bfloat16], path
        del got


def test_backward_bitwise_reproducible_and_no_host_sync():
    args = list(_inputs("qwen3_30b_a3b", 2048, torch.bfloat16, routing="skewed", seed=15))
    for a in args[:4]:
        a.requires_grad_(True)
    go = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    torch.ops.moe.dispatch(*args).backward(go)   # warm-up (kernel compilation)
    grads = []
    for _ in range(2):
        for a in args[:4]:
            a.grad = None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.ops.moe.dispatch(*args).backward(go)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        grads.append([a.grad.clone() for a in args[:4]])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("routing", ["uniform", "skewed", "empty_experts"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_weight_grad_persistent_matches_per_tile(name, routing):
    """The persistent weight-gradient kernel (one program per SM walking output tiles) sums the
    same rows in the same order with the same tile shape as the
    per-tile kernel: the weight gradients must be bitwise equal, and near the float32
    reference."""
    import dataclasses

    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.reference import dispatch_backward_reference
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    T = 2048
    E = deepseek_backward_experts() if name == "deepseek_v3_routed" else None
    hidden, w13, w2, tw, ids = _inputs(name, T, torch.bfloat16, routing=routing, seed=21,
                                       num_experts=E)
    go = torch.randn(T, hidden.shape[1], device="cuda", dtype=torch.bfloat16)
    cfg = dispatch_config(T, w2.shape[0], ids.shape[1], w2.shape[1], w2.shape[2], "cuda",
                          torch.bfloat16)
    # the fixed deal unless a variant asks for LPT (the heuristics' default)
    bc = backward_config(cfg, "cuda", torch.bfloat16)

    def wg(**kw):
        return dataclasses.replace(bc, weight_grad=dataclasses.replace(
            bc.weight_grad, **{"block_n": 256, "lpt_schedule": False, **kw}))

    variants = {"per tile": wg(persistent=False),
                "persistent": wg(persistent=True, persistent_num_stages=3),
                "small chunks": wg(persistent=True, persistent_num_stages=3, persistent_chunk=4),
                "lpt": wg(persistent=True, persistent_num_stages=3, lpt_schedule=True),
                "lpt small chunks": wg(persistent=True, persistent_num_stages=3,
                                       lpt_schedule=True, persistent_chunk=4)}
    got = {}
    for vname, v in variants.items():
        _poison_allocator()
        got[vname] = dispatch_backward_triton(go, hidden, w13, w2, tw, ids, config=cfg,
                                              bwd_config=v)
    ref = dispatch_backward_reference(go, hidden, w13, w2, tw, ids)
    for i, label in ((1, "w13"), (2, "w2")):
        for vname in ("persistent", "small chunks", "lpt", "lpt small chunks"):
            assert torch.equal(got[vname][i], got["per tile"][i]), (vname, label)
        assert rel_err(got["persistent"][i], ref[i]) <= BWD_RTOL[torch.bfloat16], label
    del got, ref
    torch.cuda.empty_cache()

def test_backward_default_kernels_exact_beside_another_gpu_process():
    """Triton 3.6's warp-specialised kernels wrote NaN and stale values whenever another
    process used the GPU (every run of this case with one other process running matmuls); the
    default kernels must stay exact there. Ten runs of the training
    forward and backward (default configs) on poisoned memory beside a process running
    matmuls: no NaN, and every run bitwise equal to the first."""
    T, H, I, E, K = 40000, 7168, 128, 8, 8   # the large-offsets case, where it was reproduced
    g = torch.Generator(device="cuda").manual_seed(31)
    args = make_dispatch_inputs(T, H, I, E, K, dtype=torch.bfloat16, device="cuda", generator=g,
                                weight_std=0.02)
    go = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    with gpu_noise() as noise:
        first = None
        for _ in range(10):
            _poison_allocator()
            got = _backward(go, args, "saved")
            assert noise.poll() is None, "the noise process ended early"
            for label, t in zip(("hidden", "w13", "w2", "topk_weights"), got):
                assert not torch.isnan(t).any(), f"{label}: {nan_summary(t)}"
            if first is None:
                first = got
            else:
                for a, b in zip(got, first):
                    assert torch.equal(a, b)


def _backward_buffer_bytes(T, K, E, H, I):
    """Bytes of the backward's transient bf16 buffers (dA float32) at the largest aligned row
    count (at most block_m - 1 = 127 padding rows per expert): x or dO gathered, dz, s*a, dA,
    and dx's per-slot buffer."""
    slots, rows = T * K, T * K + E * 128
    return dict(gathered=rows * H * 2, dz=rows * 2 * I * 2, sa=rows * I * 2, dA=slots * I * 4,
                dxs=slots * H * 2, z=slots * 2 * I * 2)


@pytest.mark.parametrize("path", ["saved", "recompute"])
def test_backward_peak_memory_follows_the_order_of_use(path):
    """The backward's transient peak beyond its inputs is its largest stage, not the sum of its
    buffers: the activation gradient (dO gathered, dz, s*a, dA and, recomputing, z) comes before
    the weight gradients are allocated, and x is gathered for dW13 only once dO and s*a are
    freed (Qwen3-30B-A3B, T=8192: the bound is ~0.3 GiB under the weight gradients plus the
    activation-gradient stage)."""
    T, name = 8192, "qwen3_30b_a3b"
    args = _inputs(name, T, torch.bfloat16, seed=16)
    hidden, w13, w2 = args[0], args[1], args[2]
    E, I, H = w2.shape[0], w2.shape[2], hidden.shape[1]
    K = args[4].shape[1]
    go = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    z = torch.ops.moe.dispatch_train(*args)[1] if path == "saved" else None
    run = (lambda: torch.ops.moe.dispatch_backward_saved(go, z, *args)) if z is not None else (
        lambda: torch.ops.moe.dispatch_backward(go, *args))
    grads, peak = peak_beyond_allocated(run)
    b = _backward_buffer_bytes(T, K, E, H, I)
    nbytes = [g.numel() * g.element_size() for g in grads[:4]]   # dx, dw13, dw2, dweights
    act_grad = b["gathered"] + b["dz"] + b["sa"] + b["dA"] + (b["z"] if z is None else 0)
    dw2_stage = nbytes[2] + b["gathered"] + b["dz"] + b["sa"]
    dw13_stage = nbytes[2] + nbytes[1] + b["dz"] + max(b["gathered"], b["dxs"])
    bound = nbytes[0] + nbytes[3] + max(act_grad, dw2_stage, dw13_stage) + (16 << 20)
    assert peak <= bound, (peak / 2**30, bound / 2**30)
    assert bound < nbytes[1] + nbytes[2] + act_grad   # the order of use is what the bound tests


def test_x_chunks_bit_equal_and_lower_peak():
    """BackwardConfig.x_chunks = 0 (the default, automatic: 2 chunks at Qwen3-30B-A3B) and 4
    against one chunk, T=8192: the same gradients bit for bit (each element the same sum, the
    same tiles), and the peak beyond the inputs bounded by the chunked stages (dW13's holds
    x gathered / chunks, dx's per-slot buffer is gone by then) and below one chunk's."""
    import dataclasses

    from moe_ops.launch.dispatch_backward import dispatch_backward_triton, x_chunks
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    T, name = 8192, "qwen3_30b_a3b"
    args = _inputs(name, T, torch.bfloat16, seed=17)
    hidden, w2 = args[0], args[2]
    E, I, H = w2.shape[0], w2.shape[2], hidden.shape[1]
    K = args[4].shape[1]
    go = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    z = torch.ops.moe.dispatch_train(*args)[1]
    cfg = dispatch_config(T, E, K, H, I, "cuda", torch.bfloat16)
    bc = backward_config(cfg, "cuda", torch.bfloat16, rows_per_expert=T * K / E, inter_size=I)
    assert bc.x_chunks == 0
    auto, bc = bc, dataclasses.replace(bc, x_chunks=1)
    b = _backward_buffer_bytes(T, K, E, H, I)
    assert x_chunks(auto, H, b["gathered"], b["dz"]) == 2
    grads = {}
    for label, bwd in (("one", bc), ("auto", auto),
                       ("four", dataclasses.replace(bc, x_chunks=4))):
        grads[label], grads[label + "_peak"] = peak_beyond_allocated(
            lambda bwd=bwd: dispatch_backward_triton(go, *args, z=z, config=cfg, bwd_config=bwd))
    nbytes = [g.numel() * g.element_size() for g in grads["one"][:4]]   # dx, dw13, dw2, dweights
    for label, n in (("auto", 2), ("four", 4)):
        for x, y in zip(grads[label], grads["one"]):
            assert torch.equal(x, y), label
        stages = (b["gathered"] + b["dz"] + b["sa"] + b["dA"],
                  nbytes[2] + b["gathered"] + b["dz"] + b["sa"], nbytes[2] + b["dz"] + b["dxs"],
                  nbytes[2] + nbytes[1] + b["dz"] + b["gathered"] // n)
        bound = nbytes[0] + nbytes[3] + max(stages) + (16 << 20)
        peak = grads[label + "_peak"]
        assert peak <= bound, (label, peak / 2**30, bound / 2**30)
        assert peak < grads["one_peak"], (label, peak, grads["one_peak"])

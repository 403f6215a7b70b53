"""moe_ops.launch.fast on the GPU: the verify mode and repeated or misaligned calls."""
import pytest
import torch
import triton
import triton.language as tl
from conftest import rel_err
from gpu_utils import GPU_RTOL, _oracle, misaligned_copy

from moe_ops.launch.dispatch import dispatch_triton
from moe_ops.ops.samples import make_dispatch_inputs

pytestmark = pytest.mark.gpu


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


def test_fast_launch_verify_catches_a_key_that_misses_alignment(monkeypatch):
    """The safety net of moe_ops.launch.fast: with MOE_OPS_VERIFY_LAUNCH=1, a key reused for
    arguments that Triton specialises differently (a pointer off 16-byte alignment) raises."""
    from moe_ops.launch.fast import FastLaunch

    monkeypatch.setenv("MOE_OPS_VERIFY_LAUNCH", "1")
    x = torch.arange(65, dtype=torch.float32, device="cuda")
    y = torch.full((64,), float("nan"), device="cuda")
    FastLaunch(_copy_kernel, "same")[(1,)](x, y, 64, BLOCK=64)   # through the JIT
    y.fill_(float("nan"))
    FastLaunch(_copy_kernel, "same")[(1,)](x, y, 64, BLOCK=64)   # direct, verified
    assert torch.equal(y, x[:64])
    with pytest.raises(RuntimeError, match="would not pick"):
        FastLaunch(_copy_kernel, "same")[(1,)](x[1:], y, 64, BLOCK=64)


@pytest.mark.parametrize("T", [1, 8, 300])
def test_fast_launch_repeated_and_misaligned_calls(T, monkeypatch):
    """Repeated calls of one shape take the fast launch (each checked against the kernel Triton's
    JIT would pick); a hidden / topk_weights view off 16-byte alignment, same shapes, gets its own
    key and the right answer."""
    monkeypatch.setenv("MOE_OPS_VERIFY_LAUNCH", "1")
    H, I, E, K = 256, 128, 64, 8
    g = torch.Generator(device="cuda").manual_seed(T)
    args = make_dispatch_inputs(T, H, I, E, K, dtype=torch.bfloat16, device="cuda",
                                weight_std=0.02, generator=g)
    ref = _oracle(*args)
    outs = [dispatch_triton(*args) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert rel_err(outs[0], ref) <= GPU_RTOL[torch.bfloat16]
    hidden, tw = misaligned_copy(args[0]), misaligned_copy(args[3])
    for _ in range(2):
        out = dispatch_triton(hidden, args[1], args[2], tw, args[4])
        assert rel_err(out, ref) <= GPU_RTOL[torch.bfloat16]
    logits = torch.randn(T, E, device="cuda", generator=g)
    first = torch.ops.moe.route(logits, K)
    for _ in range(2):
        again = torch.ops.moe.route(logits, K)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])

"""Shared inputs and helpers of the GPU tests (tests/test_*_gpu.py; skipped without CUDA)."""

import torch

from moe_ops.ops.samples import make_dispatch_inputs
from moe_ops.reference import dispatch_reference
# the GPU tests import these from here
from moe_ops.tools._timing import gpu_noise  # noqa: F401
from moe_ops.tools._timing import poison_cuda_allocator as _poison_allocator  # noqa: F401
from moe_ops.tuning.shapes import SHAPES  # name: (H, I, E, K)

# float32 runs full-precision products; bf16/fp16 store the [rows, I] activation in the input
# dtype, so their error is a few units of its rounding (2^-8 bf16, 2^-11 fp16).
GPU_RTOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def _oracle(hidden, w13, w2, w, ids):
    """float64 reference on the GPU: float64 activations make the reference compute in float64,
    casting one expert's weights at a time."""
    return dispatch_reference(hidden.double(), w13, w2, w.double(), ids)


def peak_beyond_allocated(run):
    """run()'s result and its peak memory beyond what was allocated before it, measured on a
    second call (the first compiles the kernels and warms the allocator)."""
    run()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def misaligned_copy(t):
    """A copy of `t` as a view one element past its buffer's start (off 16-byte alignment for
    2- and 4-byte dtypes): the launch path must specialise it apart from aligned arguments."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    return view


def _inputs(name, T, dtype, routing="uniform", seed=0, num_experts=None):
    H, I, E, K = SHAPES[name]
    E = num_experts or E
    g = torch.Generator(device="cuda").manual_seed(seed)
    return make_dispatch_inputs(T, H, I, E, K, dtype=dtype, device="cuda", routing=routing,
                                weight_std=0.02, generator=g)


BWD_RTOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def deepseek_backward_experts() -> int:
    """Experts of the DeepSeek-V3 backward tests (its H and I kept, E cut): 64 where the GPU has
    100 GiB or more (H200: the float32 oracle ran out at the full 256), 32 below (H100's 80 GB:
    64 ran out of memory in float32 at T = 2048 and in the persistent weight-gradient test)."""
    total = torch.cuda.get_device_properties(0).total_memory
    return 64 if total >= 100 * 2**30 else 32

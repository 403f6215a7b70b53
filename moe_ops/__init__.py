"""moe_ops: fused Mixture-of-Experts operators for PyTorch (torch.ops.moe.*), Triton on CUDA.

`import moe_ops` registers torch.ops.moe.route and torch.ops.moe.dispatch, and the transformers
experts implementation "moe_ops" when transformers is installed."""
from moe_ops._runtime import set_recompute
from moe_ops.mxfp4_layout import swizzle_mxfp4, unswizzle_mxfp4
from moe_ops.ops.dispatch import dispatch
from moe_ops.ops.routing import route

__version__ = "0.1.0"
__all__ = ["dispatch", "route", "set_recompute", "swizzle_mxfp4", "unswizzle_mxfp4",
           "__version__"]


def _register_integrations():
    try:
        import transformers  # noqa: F401
    except ImportError:
        return
    from moe_ops.integrations.hf_quant import register_fp8_experts_interface
    from moe_ops.integrations.huggingface import register_experts_interface

    register_experts_interface()
    register_fp8_experts_interface()   # FineGrainedFP8 experts (DeepSeek-V3, Qwen3-MoE FP8)


_register_integrations()


def _decorate_kernels():
    """Import every launcher (so every @triton.jit kernel is decorated) now. Triton decides
    compiled-or-interpreted when the decorator runs: imported lazily, at a process's first
    dispatch, the kernels would stay interpreted for its CUDA tensors too if it had set
    TRITON_INTERPRET=1 in between (moe_ops picks the interpreter per call, for CPU tensors)."""
    try:
        import triton  # noqa: F401
    except ImportError:   # the PyTorch reference still runs on CPU
        return
    from moe_ops.launch import alignment, dispatch, dispatch_backward, quant, routing  # noqa: F401


_decorate_kernels()

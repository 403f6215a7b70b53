"""@triton.jit code only; host-side launch code lives in moe_ops.launch."""

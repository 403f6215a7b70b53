"""What every launcher shares: the launchable form of a kernel (compiled, fast-launched or
interpreted), the Hopper feature checks (programmatic dependent launch, tensor memory access),
dot precision, host tensor descriptors and the persistent kernels' program count."""
from __future__ import annotations

import functools
import os
import sys

import torch

from moe_ops import _env
from moe_ops._features import host_tensor_descriptors
from moe_ops._compat import Interpreted, ensure_triton_allocator, tensor_descriptor  # noqa: F401
from moe_ops.launch.fast import FastLaunch

SMEM_LIMIT = 232448   # bytes of shared memory a program may use on sm_90


_launchers: dict = {}

# Compile options every moe_ops kernel launches with. Fused multiply-adds on: the float32
# arithmetic of the kernels (the FP8 promotion's multiply-add, the combine's sums, the
# activations) and the bit-for-bit properties measured on it (batch invariance, equality between
# paths, docs/design.md) assume them. Triton 3.6-3.9 fuse by default; 3.9 warns that its default
# turns off in 3.10, so moe_ops asks for it explicitly.
COMPILE_OPTIONS = {"enable_fp_fusion": True}


class _Compiled:
    """kernel_for's CUDA launcher without a fast-launch key: kernel[grid](...) with
    COMPILE_OPTIONS (a call's own keyword wins)."""

    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **{**COMPILE_OPTIONS, **kwargs})


def kernel_for(kernel, device: torch.device, key=None):
    """The launchable form of a @triton.jit kernel for tensors on `device`: the kernel itself on
    CUDA, its interpreted form on CPU. With a `key` (hashable; it must determine Triton's
    specialisation of the launch: moe_ops.launch.fast), CUDA launches after the first with that
    key skip Triton's argument binding (MOE_OPS_FAST_LAUNCH=0 turns that off)."""
    if device.type != "cpu":
        if key is None or not _env.fast_launch():
            return _Compiled(kernel)
        return FastLaunch(kernel, key, COMPILE_OPTIONS)
    launcher = _launchers.get(kernel.fn)
    if launcher is None:
        require_interpreter()
        launcher = _launchers[kernel.fn] = Interpreted(kernel.fn)
    return launcher


def interpreted_launcher(kernel):
    """The interpreted form of a @triton.jit kernel, without the interpreter check (the check's
    own probe kernel uses it)."""
    return Interpreted(kernel.fn)


_interpreter_ok: bool | None = None


def interpreter_works() -> bool:
    """Whether this Triton's interpreter can run our kernels. Triton 3.6's interpreter with
    numpy 2.4 (seen here) cannot run a loop bounded by a runtime scalar (int() of a 1-element array
    raises), and a failed interpreted launch there leaves Triton unable to compile GPU kernels
    for the rest of the process; triton 3.9 works. So the probe (a one-program kernel with such
    a loop) runs once, in a child process."""
    global _interpreter_ok
    if _interpreter_ok is None:
        import subprocess

        code = (
            "import torch, triton, triton.language as tl\n"
            "from moe_ops.launch._common import interpreted_launcher\n"
            "@triton.jit\n"
            "def _probe(x_ptr, n, B: tl.constexpr):\n"
            "    acc = tl.zeros((B,), tl.float32)\n"
            "    for i in range(0, n, B):\n"
            "        acc += tl.load(x_ptr + i + tl.arange(0, B))\n"
            "    tl.store(x_ptr + tl.arange(0, B), acc)\n"
            "x = torch.ones(8)\n"
            "interpreted_launcher(_probe)[(1,)](x, 8, B=4)\n"
            "assert torch.equal(x[:4], torch.full((4,), 2.0))\n")
        env = _env.child_env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
        try:
            r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                               timeout=300)
            _interpreter_ok = r.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _interpreter_ok = False
    return _interpreter_ok


def require_interpreter():
    if not interpreter_works():
        import triton

        try:
            import numpy
        except ImportError:
            raise RuntimeError(
                "TRITON_INTERPRET=1 is set but numpy is not installed: Triton's interpreter needs "
                "it (pip install numpy), or unset TRITON_INTERPRET to run the PyTorch reference "
                "on CPU") from None
        raise RuntimeError(
            f"TRITON_INTERPRET=1 is set but the Triton interpreter of triton {triton.__version__} "
            f"with numpy {numpy.__version__} cannot run moe_ops' kernels (loops bounded by runtime "
            "scalars fail); use triton >= 3.9, or unset TRITON_INTERPRET to run the PyTorch "
            "reference on CPU")


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get full-precision products (tf32 would cost ~3e-4 relative error).
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_args(pdl: bool, device: torch.device) -> dict:
    """Launch options of a kernel with programmatic dependent launch (Hopper and later; off in the
    interpreter, which cannot run the grid-dependency instructions)."""
    if not pdl or device.type != "cuda" or not sm90(device):
        return {}
    return dict(USE_PDL=True, launch_pdl=True)


@functools.lru_cache(maxsize=None)
def num_programs(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM on CUDA, three in the interpreter (several
    tiles each)."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_layout_ok(t, strides=None) -> bool:
    """Whether tensor memory access can address `t` (or the view of its storage with
    `strides`): a GPU with a tensor memory accelerator (sm_90+; the interpreter too), a
    contiguous last dimension, a 16-byte aligned base and 16-byte multiples as other strides,
    none of them 0 (an expanded tensor, e.g. one expert's weights broadcast over E: the pointer
    path reads it as it is)."""
    if (t.is_cuda and not sm90(t.device)) or not host_tensor_descriptors():
        return False
    strides = t.stride() if strides is None else strides
    es = t.element_size()
    return (strides[-1] == 1 and t.data_ptr() % 16 == 0
            and all(st > 0 and st * es % 16 == 0 for st in strides[:-1]))


def weight_desc(w, block_shape, shape=None, strides=None):
    """A tensor-memory-access descriptor of `w` (an [E, ., .] weight; the backward's weight
    gradients also pass row-ordered activations and gradients), or of the view of its storage
    given by `shape` and `strides`, with `block_shape`, or None when the layout does not
    allow one (TMA needs a contiguous last dimension and 16-byte aligned base and strides) or
    the GPU has no tensor memory accelerator (before sm_90: the pointer path). The interpreter
    takes descriptors (its tests cover the TMA path on CPU)."""
    if not tma_layout_ok(w, strides):
        return None
    shape = list(w.shape) if shape is None else list(shape)
    strides = list(w.stride()) if strides is None else list(strides)
    return tensor_descriptor(w, shape, strides, block_shape)

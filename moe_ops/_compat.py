"""Every private torch and Triton API moe_ops uses, in one module, so that an upgrade touches one
file. tests/test_compat.py exercises each entry point on the installed versions (torch 2.11 and
2.13, Triton 3.6 to 3.9); the launcher entry points are covered on the GPU by the fast-launch
tests.

torch: the dispatcher's keysets (the autograd kernels re-dispatch below Autograd), schema
lookup, functorch's transform state, torch.distributed's functional collective ops.
Triton: the compiled kernel's launcher (fast launch), the active driver's device and stream,
the launch hooks, the JIT's kernel choice without a launch (verify mode), host tensor
descriptors built without re-validation, the global-scratch allocator, and the interpreter
run per call."""
from __future__ import annotations

import inspect

import torch

# --------------------------------------------------------------------------------------------
# torch.distributed
# --------------------------------------------------------------------------------------------


def c10d_functional():
    """torch.distributed's functional collectives as ops (all_to_all_single, all_reduce,
    wait_tensor): traceable by torch.compile, with autograd registered for wait_tensor
    (moe_ops.distributed)."""
    return torch.ops._c10d_functional


# --------------------------------------------------------------------------------------------
# torch dispatcher
# --------------------------------------------------------------------------------------------


def below_autograd():
    """A context in which ops dispatch below the Autograd keys (an autograd kernel calling the
    plain op's kernels)."""
    return torch._C._AutoDispatchBelowAutograd()


def after_autograd(keyset):
    """The part of a dispatch keyset below Autograd (for op.redispatch)."""
    return keyset & torch._C._after_autograd_keyset


def any_requires_grad(*tensors) -> bool:
    return torch._C._any_requires_grad(*tensors)


def has_schema(qualified_name: str) -> bool:
    """Whether the dispatcher knows an operator `ns::name` (registered from Python or C++)."""
    try:
        torch._C._dispatch_find_schema_or_throw(qualified_name, "")
    except RuntimeError:
        return False
    return True


def functorch_active() -> bool:
    return torch._C._are_functorch_transforms_active()


def forward_ad_level() -> int:
    """The innermost forward-AD dual level (-1 outside any `dual_level`)."""
    from torch.autograd import forward_ad

    return forward_ad._current_level


# --------------------------------------------------------------------------------------------
# Triton launches
# --------------------------------------------------------------------------------------------


def current_device():
    """The device Triton's JIT launches on (the current CUDA device)."""
    from triton.runtime import driver

    return driver.active.get_current_device()


def current_stream(device):
    from triton.runtime import driver

    return driver.active.get_current_stream(device)


def launch_hooks():
    """(enter, exit): Triton's launch hooks (profilers set them), each None when unset."""
    from triton import knobs

    runtime = knobs.runtime
    return runtime.launch_enter_hook, runtime.launch_exit_hook


def run_compiled(ck, grid, stream, values, enter, exit_hook) -> None:
    """Launch a compiled kernel `ck` (what kernel[grid](...) returned) with all its parameters
    `values` in order, as Triton's JIT does after binding."""
    meta = None if enter is None else ck.launch_metadata(grid, stream, *values)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    ck.run(grid[0], g1, g2, stream, ck.function, ck.packed_metadata, meta, enter, exit_hook,
           *values)


def jit_pick(kernel, grid, args, kwargs):
    """The compiled kernel Triton's JIT would launch for these arguments (nothing launched)."""
    return kernel.run(*args, grid=grid, warmup=True, **kwargs)


# --------------------------------------------------------------------------------------------
# Triton host tensor descriptors
# --------------------------------------------------------------------------------------------

_desc_fields: dict = {}   # (rank, block shape) -> a validated descriptor's block-only fields


def tensor_descriptor(t, shape, strides, block_shape):
    """triton.tools.tensor_descriptor.TensorDescriptor(t, shape, strides, block_shape). Its
    constructor's checks cost ~5 us of host time per descriptor (two per forward); after the
    first with a given rank and block shape, the block-only fields are copied instead (the
    caller has checked base alignment, strides and shape: moe_ops.launch._common.tma_layout_ok)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    key = (len(shape), tuple(block_shape))
    fields = _desc_fields.get(key)
    if fields is None or min(shape) <= 0:
        d = TensorDescriptor(t, list(shape), list(strides), list(block_shape))
        _desc_fields[key] = {k: v for k, v in vars(d).items()
                             if k not in ("base", "shape", "strides")}
        return d
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(fields)
    d.base, d.shape, d.strides = t, list(shape), list(strides)
    return d


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_triton_allocator() -> None:
    """Kernels that make tensor descriptors on the device need Triton's global-scratch
    allocator (128 bytes per descriptor and program). If the caller has not set one (Triton's
    default raises), set one that allocates through torch's caching allocator: stream-ordered,
    and inside CUDA-graph capture from the graph's pool. An allocator the caller set is kept."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


# --------------------------------------------------------------------------------------------
# Triton's interpreter, chosen per call
# --------------------------------------------------------------------------------------------

_interpreted: dict = {}


class Interpreted:
    """Launches a kernel through Triton's interpreter even when triton was imported without
    TRITON_INTERPRET=1 (Triton decides interpret-or-compile when each @triton.jit decorator runs,
    triton.language's own @jit helpers such as tl.zeros included; moe_ops decides per call).
    While the launch runs, a call of any @triton.jit function is routed to its interpreted
    form."""

    def __init__(self, fn):
        from triton.runtime.interpreter import InterpretedFunction

        self._kernel = InterpretedFunction(fn)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction

            saved = JITFunction.__call__

            def call(self, *a, **kw):
                wrapped = _interpreted.get(self.fn)
                if wrapped is None:
                    wrapped = _interpreted[self.fn] = InterpretedFunction(self.fn)
                return wrapped(*a, **kw)

            JITFunction.__call__ = call
            patched = _lang_snapshot()
            try:
                kwargs.pop("num_warps", None)
                kwargs.pop("num_stages", None)
                return self._kernel[grid](*args, **kwargs)
            finally:
                JITFunction.__call__ = saved
                _lang_restore(patched)

        return launch


def _lang_snapshot() -> list:
    """The attributes of triton.language, triton.language.core and triton.language.tensor. The
    interpreter patches them while it runs a kernel; its calls of nested @triton.jit functions
    patch them again and never restore them, so after an interpreted launch that calls a helper,
    kernels compiled later in the process built their IR through the interpreter's semantic
    ("'value' object has no attribute 'dtype'", triton 3.9)."""
    import triton.language as tl
    import triton.language.core as core

    return [(obj, dict(vars(obj))) for obj in (tl, core, tl.tensor)]


def _lang_restore(snapshot: list) -> None:
    for obj, attrs in snapshot:
        now = vars(obj)
        # (a submodule imported meanwhile, e.g. triton.language.semantic, stays)
        for name in [k for k, v in now.items() if k not in attrs and not inspect.ismodule(v)]:
            delattr(obj, name)
        for name, value in attrs.items():
            if now.get(name, _MISSING) is not value:
                setattr(obj, name, value)


_MISSING = object()

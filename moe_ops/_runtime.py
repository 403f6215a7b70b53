"""Where a call runs: Triton on CUDA, the Triton interpreter on CPU (TRITON_INTERPRET=1), or the
plain-torch reference on CPU. Read at call time so tests can flip the interpreter per test."""
from __future__ import annotations

import contextlib
import inspect
import os

import torch


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b). (triton.cdiv and triton.next_power_of_2 are constexpr_function
    wrappers that cost microseconds of host time per call, and a launch path calls them ~10
    times.)"""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Host-side smallest power of 2 >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


_TRUE_WORDS = ("1", "true", "yes", "on", "y")


def env_flag(name: str, default: bool = False) -> bool:
    """A boolean environment switch read as Triton reads its own (TRITON_INTERPRET): on for
    1 / true / yes / on / y (any case), off for anything else ("0", "false", "no", "off", "");
    `default` when the variable is unset."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in _TRUE_WORDS


def interpret_enabled() -> bool:
    return env_flag("TRITON_INTERPRET")


def checks_enabled() -> bool:
    """MOE_OPS_CHECK=1 turns on data-dependent checks (id range); they cost a host sync."""
    return env_flag("MOE_OPS_CHECK")


_recompute: bool | None = None


def recompute_enabled() -> bool:
    """Training memory mode of moe.dispatch (set_recompute / MOE_OPS_RECOMPUTE=1)."""
    if _recompute is None:
        return env_flag("MOE_OPS_RECOMPUTE")
    return _recompute


def set_recompute(enabled: bool | None) -> bool:
    """Whether the backward of moe.dispatch recomputes the SwiGLU pre-activation z = W13_e x
    (no activation memory, one extra gate+up GEMM: +2/3 of the forward's flops) instead of
    saving it in the forward (T*K*2I elements of the input dtype per MoE layer). Default: save;
    None restores the default (MOE_OPS_RECOMPUTE). Read when the forward runs (under
    torch.compile: when it is traced). Returns the previous setting."""
    global _recompute
    if enabled is not None and not isinstance(enabled, (bool, int)):
        # bool("no") is True: a string would silently turn the recompute on
        raise TypeError(f"set_recompute(enabled) takes True, False or None, got {enabled!r}")
    previous = recompute_enabled()
    _recompute = None if enabled is None else bool(enabled)
    return previous


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_triton_allocator() -> None:
    """Kernels that make tensor descriptors on the device need Triton's global-scratch
    allocator (128 bytes per descriptor and program). If the caller has not set one (Triton's
    default raises), set one that allocates through torch's caching allocator: stream-ordered,
    and inside CUDA-graph capture from the graph's pool. An allocator the caller set is kept.
    Triton keeps it in a context variable, so it is checked on every launch that needs it."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


_NO_GUARD = contextlib.nullcontext()


def on_device(t: torch.Tensor):
    """A context in which `t`'s CUDA device is the current device. Triton launches on the
    current device and its stream, and kernels registered from Python get no device guard from
    the dispatcher: tensors on cuda:1 with cuda:0 current would be read by a kernel on the
    wrong GPU. Free (a shared no-op context) when the device already is the current one."""
    if t.device.type != "cuda" or t.device.index is None \
            or t.device.index == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(t.device.index)


def use_triton(t: torch.Tensor) -> bool:
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and interpret_enabled()


_interpreted: dict = {}


class _Interpreted:
    """Launches a kernel through Triton's interpreter even when triton was imported without
    TRITON_INTERPRET=1 (Triton decides interpret-or-compile when each @triton.jit decorator runs,
    triton.language's own @jit helpers such as tl.zeros included; we decide per call). While the
    launch runs, a call of any @triton.jit function is routed to its interpreted form."""

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
    (InterpretedFunction.__call__) patch them again and never restore them, so after an
    interpreted launch that calls a helper, kernels compiled later in the process (compile_check,
    a CUDA launch) built their IR through the interpreter's semantic: "'value' object has no
    attribute 'dtype'" (triton 3.9; seen when tests/test_compile_sm90.py ran after the
    interpreted alignment tests with an empty Triton cache)."""
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


_launchers: dict = {}


def kernel_for(kernel, device: torch.device, key=None):
    """The launchable form of a @triton.jit kernel for tensors on `device`: the kernel itself on
    CUDA, its interpreted form on CPU. With a `key` (hashable; it must determine Triton's
    specialisation of the launch: moe_ops.launch.fast), CUDA launches after the first with that
    key skip Triton's argument binding (MOE_OPS_FAST_LAUNCH=0 turns that off)."""
    if device.type != "cpu":
        if key is None or not env_flag("MOE_OPS_FAST_LAUNCH", True):
            return kernel
        from moe_ops.launch.fast import FastLaunch

        return FastLaunch(kernel, key)
    if kernel.fn not in _launchers and kernel.fn.__name__ != "_probe":
        require_interpreter()
    if kernel.fn not in _launchers:
        _launchers[kernel.fn] = _Interpreted(kernel.fn)
    return _launchers[kernel.fn]


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
        import sys

        code = (
            "import torch, triton, triton.language as tl\n"
            "from moe_ops._runtime import kernel_for\n"
            "@triton.jit\n"
            "def _probe(x_ptr, n, B: tl.constexpr):\n"
            "    acc = tl.zeros((B,), tl.float32)\n"
            "    for i in range(0, n, B):\n"
            "        acc += tl.load(x_ptr + i + tl.arange(0, B))\n"
            "    tl.store(x_ptr + tl.arange(0, B), acc)\n"
            "x = torch.ones(8)\n"
            "kernel_for(_probe, torch.device('cpu'))[(1,)](x, 8, B=4)\n"
            "assert torch.equal(x[:4], torch.full((4,), 2.0))\n")
        env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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

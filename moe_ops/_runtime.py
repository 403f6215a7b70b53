"""Where a call runs: Triton on CUDA, the Triton interpreter on CPU (TRITON_INTERPRET=1), or the
plain-torch reference on CPU. Read at call time so tests can flip the interpreter per test."""
from __future__ import annotations

import os

import torch


def interpret_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def checks_enabled() -> bool:
    """MOE_OPS_CHECK=1 turns on data-dependent checks (id range); they cost a host sync."""
    return os.environ.get("MOE_OPS_CHECK", "0") not in ("", "0")


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
            try:
                kwargs.pop("num_warps", None)
                kwargs.pop("num_stages", None)
                return self._kernel[grid](*args, **kwargs)
            finally:
                JITFunction.__call__ = saved

        return launch


_launchers: dict = {}


def kernel_for(kernel, device: torch.device):
    """The launchable form of a @triton.jit kernel for tensors on `device`: the kernel itself on
    CUDA, its interpreted form on CPU."""
    if device.type != "cpu":
        return kernel
    if kernel.fn not in _launchers:
        _launchers[kernel.fn] = _Interpreted(kernel.fn)
    return _launchers[kernel.fn]

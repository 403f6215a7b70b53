"""Where a call runs: Triton on CUDA, the Triton interpreter on CPU (TRITON_INTERPRET=1), or the
plain-torch reference on CPU. Read at call time so tests can flip the interpreter per test."""
from __future__ import annotations

import contextlib

import torch

from moe_ops import _env


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b). (triton.cdiv and triton.next_power_of_2 are constexpr_function
    wrappers that cost microseconds of host time per call, and a launch path calls them ~10
    times.)"""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Host-side smallest power of 2 >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def interpret_enabled() -> bool:
    return _env.interpret()


def checks_enabled() -> bool:
    """MOE_OPS_CHECK=1 turns on data-dependent checks (id range); they cost a host sync."""
    return _env.check()


_recompute: bool | None = None


def recompute_enabled() -> bool:
    """Training memory mode of moe.dispatch (set_recompute / MOE_OPS_RECOMPUTE=1)."""
    if _recompute is None:
        return _env.recompute()
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
